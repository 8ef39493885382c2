"""The vLLM wiring under the pool's refusals: a load or
store the pool refuses (``UnsafeTransferError``) is not begun, leaves the
pool unchanged, is logged, and gets no wire form, so the worker keeps vLLM's
own path for it (its own waits, as stock); no exception reaches vLLM's
scheduler. Needs neither vLLM nor torch (the scheduler half of the wiring
imports neither)."""

from __future__ import annotations

import logging

import pytest

from blockpool import AccessKind, HazardAwareBlockPool, StreamKind
from blockpool.integrations.vllm.connectors import MOONCAKE, OFFLOAD_D2H, ConnectorWiring
from blockpool.integrations.vllm.hazards import StepHazards


@pytest.fixture
def wired() -> tuple[HazardAwareBlockPool, ConnectorWiring]:
    pool = HazardAwareBlockPool(16, streams={"compute": StreamKind.DEVICE})
    hz = StepHazards(pool)
    hz.add_stream(MOONCAKE, StreamKind.HOST)
    hz.add_stream(OFFLOAD_D2H, StreamKind.DEVICE)
    return pool, ConnectorWiring("mooncake_store", hz, (16,))


def _unchanged(pool: HazardAwareBlockPool, call) -> object:  # type: ignore[no-untyped-def]
    pool.poll()
    before = pool.snapshot()
    out = call()
    assert pool.snapshot() == before
    return out


def test_a_refused_load_into_a_shared_block_is_not_begun_and_keeps_vllms_own_path(
    wired: tuple[HazardAwareBlockPool, ConnectorWiring], caplog: pytest.LogCaptureFixture
) -> None:
    pool, w = wired
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["p0", "p1"], 0, 2, 16)
    pool.tag(a, pool.issue("compute"), AccessKind.WRITE)  # the first request's step wrote them
    pool.touch(a)  # a second request's prefix hit: ref count 2
    ids = [b.block_id for b in a]
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.blockpool"):
        assert _unchanged(pool, lambda: w.load("req-2", ids, MOONCAKE, key=("job", 1))) is None
    assert w.pending == set()  # nothing for the connector's completion to end
    assert w.hazards.transfers_begun == 0
    assert "load of request 'req-2' not fenced, left to vLLM's own path" in caplog.text
    assert "SharedBlockError" not in caplog.text and "ref count 2" in caplog.text


def test_a_refused_store_of_a_failed_load_is_not_begun_and_keeps_vllms_own_path(
    wired: tuple[HazardAwareBlockPool, ConnectorWiring], caplog: pytest.LogCaptureFixture
) -> None:
    pool, w = wired
    blocks = pool.get_new_blocks(2)
    ids = [b.block_id for b in blocks]
    assert w.load("req-1", ids, MOONCAKE) is not None
    w.finish("req-1", failed=True)  # the connector reported the load failed
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.blockpool"):
        assert _unchanged(pool, lambda: w.store("req-1", ids, OFFLOAD_D2H, key=("job", 2))) is None
    assert "store of request 'req-1' not fenced" in caplog.text and "no valid content" in caplog.text
    assert w.pending == set()
    step = pool.issue("compute")  # recomputed by a step: written again
    pool.tag(blocks, step, AccessKind.WRITE)
    assert w.store("req-1", ids, OFFLOAD_D2H, key=("job", 3)) is not None  # now fenced as usual
    assert w.pending == {("job", 3)}


def test_an_accepted_transfer_is_unchanged_by_the_refusal_checks(
    wired: tuple[HazardAwareBlockPool, ConnectorWiring],
) -> None:
    pool, w = wired
    ids = [b.block_id for b in pool.get_new_blocks(2)]
    wire = w.load("req-3", ids, MOONCAKE, key=("job", 4))
    assert wire is not None and w.pending == {("job", 4)} and w.hazards.transfers_begun == 1
