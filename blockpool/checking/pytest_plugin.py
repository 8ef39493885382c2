"""pytest plugin: fixtures that check block-pool code for races.

Registered as the ``pytest11`` entry point ``blockpool``, so it loads in every
pytest run where blockpool is installed; it imports nothing but pytest at
load time (the pool and the oracle are imported when a fixture is first
used). Switch it off with ``pytest -p no:blockpool``.

Fixtures (override any of them in a ``conftest.py`` to change the setup):

- ``blockpool_streams``: ``{name: StreamKind}``; default compute, h2d, d2h
  (``DEVICE``) and rdma (``HOST``).
- ``blockpool_num_gpu_blocks``: pool size, null block included; default 64.
- ``blockpool_pool``: a debug :class:`~blockpool.HazardAwareBlockPool` on them.
- ``blockpool_oracle``: a :class:`~blockpool.checking.race_oracle.RaceOracle` on the same streams.
- ``blockpool_harness``: a :class:`~blockpool.checking.harness.RaceHarness` driving
  both. A test that used it fails when the oracle found a race, with every
  race in the message, unless it called ``harness.expect_races()`` or carries
  the ``blockpool_expect_races`` marker. Races found during teardown make a
  teardown error; races found in a test that failed anyway are added to its
  report as the section "blockpool races".

See ``docs/pytest-plugin.md``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from blockpool.checking.harness import RaceHarness
    from blockpool.checking.race_oracle import RaceOracle
    from blockpool.core.hazards import StreamKind
    from blockpool.core.pool import HazardAwareBlockPool

_HARNESS = "blockpool_harness"
_MARKER = "blockpool_expect_races"


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker. O(1)."""
    config.addinivalue_line(
        "markers", f"{_MARKER}: the test provokes races on purpose; blockpool_harness does not fail it"
    )


def _harness(item: pytest.Item) -> RaceHarness | None:
    funcargs = getattr(item, "funcargs", None)
    return funcargs.get(_HARNESS) if funcargs else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """After a test body that passed: fail it if its harness found races."""
    __tracebackhide__ = True
    harness = _harness(item)
    if harness is not None:
        harness.check_new_races()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A test that failed for another reason still shows its races."""
    outcome = yield
    report = outcome.get_result()
    harness = _harness(item)
    if harness is not None and report.when == "call" and report.failed:
        new = harness.take_unreported()
        if new:
            # the violations and where they were made, without the summary line
            body = harness.explain(new).split("\n", 1)[1]
            report.sections.append(("blockpool races", textwrap.dedent(body)))


@pytest.fixture
def blockpool_streams() -> dict[str, StreamKind]:
    """The streams of the pool and oracle: compute, h2d, d2h (DEVICE), rdma (HOST)."""
    from blockpool.checking.harness import DEFAULT_STREAMS

    return dict(DEFAULT_STREAMS)


@pytest.fixture
def blockpool_num_gpu_blocks() -> int:
    """Blocks in ``blockpool_pool``, null block included."""
    return 64


@pytest.fixture
def blockpool_pool(
    blockpool_num_gpu_blocks: int, blockpool_streams: dict[str, StreamKind]
) -> HazardAwareBlockPool:
    """A debug HazardAwareBlockPool (fences carry reasons) on ``blockpool_streams``."""
    from blockpool.core.pool import HazardAwareBlockPool

    return HazardAwareBlockPool(blockpool_num_gpu_blocks, streams=blockpool_streams, debug=True)


@pytest.fixture
def blockpool_oracle(blockpool_pool: HazardAwareBlockPool) -> RaceOracle:
    """A RaceOracle on the streams of ``blockpool_pool``."""
    from blockpool.checking.race_oracle import RaceOracle

    return RaceOracle(blockpool_pool.streams)


@pytest.fixture
def blockpool_harness(
    request: pytest.FixtureRequest, blockpool_pool: HazardAwareBlockPool, blockpool_oracle: RaceOracle
) -> Iterator[RaceHarness]:
    """A RaceHarness over ``blockpool_pool`` and ``blockpool_oracle``; the
    test fails if the oracle finds a race (see the module docstring)."""
    from blockpool.checking.harness import RaceHarness

    harness = RaceHarness(blockpool_pool, blockpool_oracle)
    if request.node.get_closest_marker(_MARKER) is not None:
        harness.expect_races()
    yield harness
    __tracebackhide__ = True
    harness.check_new_races()
