"""pytest plugin for running vLLM's own tests against our pool ("plugin on").

Load it explicitly, before collection::

    python -m pytest --noconftest -p blockpool.integrations.vllm.pytest_plugin tests/v1/core/...

With ``--noconftest`` nothing calls vLLM's plugin loader, and vLLM's test
modules bind ``BlockPool`` when they are imported; so this module calls
:func:`blockpool.integrations.vllm.register` when pytest imports it (``-p``
plugins are imported before any test module) and checks in
``pytest_configure`` that both ``vllm.v1.core.block_pool.BlockPool`` and the
coordinator's binding are ours.

It then makes vLLM build
:class:`~blockpool.integrations.vllm.parity.ParityBlockPool` instead
(:func:`blockpool.integrations.vllm.parity.install`): our pool plus the
handling of blocks of no pool that vLLM's unit tests make by hand.

After each test it runs the core's invariant check
(:meth:`~blockpool.HazardAwareBlockPool.check`) on every pool the test
built; a broken invariant does not fail the test (the pass sets of the two
runs must stay comparable) but is reported. At the end of the session it
reports what the core served (:data:`blockpool.integrations.vllm.served.SERVED`)
and the invariant results: in the terminal summary and, when
``BLOCKPOOL_VLLM_SERVED`` names a file, as JSON there (the parity script
asserts the allocation count is non-zero).

It also counts, per test file, the connector transfers the core fenced
(``SERVED.transfers_fenced``) and how many of those fences were non-empty
(``SERVED.fences_nonempty``), as the difference of those process-wide
counters around each test, summed over the file's tests; files that fenced
nothing are listed with zeros, so a wired connector that never reaches our
pool shows up. In the JSON: ``"fenced_by_file": {path: {"transfers": n,
"nonempty": m}}`` (paths as in the node ids). Work done in other processes
(spawned workers) is not counted.

``BLOCKPOOL_VLLM_PLUGIN`` is ignored here: loading this plugin is the
request to install the pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from typing import Any

import pytest

from blockpool.integrations import vllm as _plugin

ENV_SERVED = "BLOCKPOOL_VLLM_SERVED"
"""Path of the JSON file the session's counts are written to (optional)."""

os.environ[_plugin.ENV_PLUGIN] = "1"
_plugin.register()

from blockpool.integrations.vllm import parity as _parity
from blockpool.integrations.vllm.served import SERVED

_parity.install()

_CHECKS: dict[str, Any] = {"pools_checked": 0, "tests_checked": 0, "broken": {}}
_FENCED: dict[str, dict[str, int]] = {}
"""Per test file: connector transfers fenced and non-empty fences."""


def _fence_counts() -> tuple[int, int]:
    return SERVED.transfers_fenced, SERVED.fences_nonempty


def _report() -> dict[str, Any]:
    state = _plugin.install_state()
    return {
        "installed": _plugin.is_installed(),
        "hazards": state.hazards,
        "modules": state.modules,
        **SERVED.as_dict(),
        "loose_blocks_ignored": _parity.LOOSE_BLOCKS["ignored"],
        "invariants": {
            "pools_checked": _CHECKS["pools_checked"],
            "tests_checked": _CHECKS["tests_checked"],
            "broken": dict(sorted(_CHECKS["broken"].items())),
        },
        "fenced_by_file": {path: dict(c) for path, c in sorted(_FENCED.items())},
    }


def pytest_configure(config: pytest.Config) -> None:
    if not _plugin.is_installed():
        raise pytest.UsageError("blockpool: register() did not install the pool into vLLM")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, None]:
    fenced0, nonempty0 = _fence_counts()
    _parity.track_new_pools(True)
    try:
        yield
    finally:
        fenced1, nonempty1 = _fence_counts()
        per_file = _FENCED.setdefault(item.nodeid.split("::", 1)[0], {"transfers": 0, "nonempty": 0})
        per_file["transfers"] += fenced1 - fenced0
        per_file["nonempty"] += nonempty1 - nonempty0
        pools = _parity.track_new_pools(False)
        if pools:
            _CHECKS["tests_checked"] += 1
        for core in pools:
            _CHECKS["pools_checked"] += 1
            try:
                core.check()
            except AssertionError as exc:  # InvariantError is an AssertionError
                _CHECKS["broken"].setdefault(item.nodeid, str(exc))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(ENV_SERVED)
    if path:
        with open(path, "w") as f:
            json.dump(_report(), f, indent=1, sort_keys=True)
            f.write("\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    r = _report()
    inv = r["invariants"]
    write = terminalreporter.write_line
    write(
        f"blockpool: HazardAwareBlockPool served {r['allocations']} allocations "
        f"({r['blocks_allocated']} blocks), {r['frees']} frees, {r['cache_hits']} prefix hits "
        f"in {r['pools']} pools; vLLM's BlockPool rebound in {len(r['modules'])} modules"
    )
    write(
        f"blockpool: scheduler wiring issued {r['steps_issued']} step tokens, ended {r['steps_ended']}, "
        f"saw {r['steps_untokened']} steps without tokens (no stream but compute), "
        f"began {r['copy_batches']} copy batches; ignored {r['loose_blocks_ignored']} blocks of no pool"
    )
    write(
        f"blockpool: invariants checked on {inv['pools_checked']} pools after {inv['tests_checked']} tests; "
        f"broken after {len(inv['broken'])} tests"
    )
    for nodeid, msg in inv["broken"].items():
        write(f"  {nodeid}: {msg}")
    fenced = r["fenced_by_file"]
    write(
        f"blockpool: {r['transfers_fenced']} connector transfers fenced ({r['fences_nonempty']} non-empty fences), "
        f"in {sum(1 for c in fenced.values() if c['transfers'])} of {len(fenced)} test files"
    )
