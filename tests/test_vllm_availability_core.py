"""Blocks held back for a host transfer do not make the plugin less
available than stock vLLM: ``reset_prefix_cache(reset_running_requests=True)``
(vLLM's path from ``pause_generation(clear_cache=True)`` and
``release_kv_cache_memory``) preempts every running request, and the pool's
reset then succeeds while a store still reads their blocks (ref count 0,
held): the held blocks lose their keys and come back once the store ends.
vLLM's real ``Scheduler``; needs vLLM (skipped otherwise) and the shape-only
model configs of ``../shared/vllm-parity/hf``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from blockpool.core.hazards import TokenStatus
from blockpool.integrations.vllm import connectors as vc
from tests.test_vllm_connectors import lookup, make_request, make_scheduler, model_output, registered

__all__ = ["registered"]  # the fixture, imported for its tests

N = 16  # blocks: 15 usable


def _running_request_with_a_host_store(scheduler: Any, blocks_stored: int = 2) -> tuple[Any, Any, list[int]]:
    """Request A ran one step; a host engine's store (a PUT that pins
    nothing, as LMCache MP's server copies) still reads its first full
    blocks. Returns the pool adapter, the store's transfer and A's blocks."""
    scheduler.connector.connector_scheduler.client.lookup.return_value = lookup(0)
    scheduler.add_request(make_request("A", list(range(1, 41))))
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, model_output(out1))
    pool = scheduler.kv_cache_manager.block_pool
    table = [
        b.block_id for b in scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["A"]
    ]
    hz = pool.hazards
    store = hz.begin_store("A", hz.blocks_of(table[:blocks_stored]), vc.MOONCAKE, key=("put", 1))
    return pool, store, table


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_reset_with_running_requests_succeeds_while_a_host_store_holds_their_blocks(
    registered: bool,
) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector", num_blocks=N, role="kv_consumer")
    pool, store, table = _running_request_with_a_host_store(scheduler)
    assert all(pool.blocks[b].block_hash is not None for b in table[:2])
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True  # stock vLLM resets too
    assert not scheduler.running and [r.request_id for r in scheduler.waiting] == ["A"]
    assert pool.core.held_block_ids() == sorted(table[:2])  # the store may still read them
    assert all(pool.blocks[b].block_hash is None for b in table)  # their keys are gone
    assert pool.get_num_free_blocks() == N - 1 - 2
    pool.hazards.finish(("put", 1))  # the PUT ended
    assert pool.core.token_status(store.token) is TokenStatus.COMPLETED
    assert pool.core.held_block_ids() == [] and pool.get_num_free_blocks() == N - 1  # every block came back
    pool.core.check()


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_pool_adapters_reset_succeeds_with_only_held_blocks_busy_and_fails_with_one_in_use(
    registered: bool,
) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector", num_blocks=N, role="kv_consumer")
    pool, _, table = _running_request_with_a_host_store(scheduler)
    assert pool.reset_prefix_cache() is False  # A still holds its blocks (ref count 1), as stock
    assert pool.blocks[table[0]].block_hash is not None
    scheduler.finish_requests(["A"], _aborted())
    assert pool.core.held_block_ids() == sorted(table[:2])
    assert pool.reset_prefix_cache() is True
    assert pool.core.held_block_ids() == sorted(table[:2])
    assert all(pool.blocks[b].block_hash is None for b in table)
    pool.core.check()


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_blocks_vllm_frees_with_evict_first_while_a_host_store_reads_them_are_evicted_first_when_it_ends(
    registered: bool,
) -> None:
    from blockpool.integrations.vllm.surface import active

    if not active().evict_first:
        pytest.skip("this vLLM's free_blocks has no evict_first")
    scheduler = make_scheduler("MooncakeStoreConnector", num_blocks=N, role="kv_consumer")
    pool, _, table = _running_request_with_a_host_store(scheduler)
    stored = [pool.blocks[b] for b in table[:2]]
    pool.touch(stored)  # a second holder: an offload's pin, say
    scheduler.finish_requests(["A"], _aborted())  # A's own references go
    assert pool.core.held_block_ids() == []
    pool.free_blocks(stored, evict_first=True)  # the last references, while the store still reads them
    assert pool.core.held_block_ids() == sorted(table[:2])
    pool.hazards.finish(("put", 1))
    assert pool.get_num_free_blocks() == N - 1  # applies the completion: the hold ends
    head = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()][:2]
    assert head == table[:2]  # at the eviction end, as vLLM asked
    pool.core.check()


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="no LMCache: run in .venv-lmcache")
@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_reset_succeeds_while_an_lmcache_mp_store_op_is_not_yet_reported(registered: bool) -> None:
    """A reset while LMCache MP's store op of request C is not yet
    reported; ``reset_prefix_cache(reset_running_requests=True)`` preempts C
    and resets (stock does); C's blocks stay held until the op is
    reported, then come back."""
    from vllm.v1.outputs import KVConnectorOutput

    from blockpool.integrations.vllm import worker as vw
    from blockpool.worker.standins import StandInDevice
    from tests.test_vllm_connectors import worker
    from tests.test_vllm_lmcache_mp import (
        CONNECTOR,
        core,
        hazards,
        lmcache_io,
        metas,
        run_step_on_worker,
        transfer_of,
        worker_connector,
    )

    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        with lmcache_io(dev) as io, _lmcache_class():
            scheduler = make_scheduler(CONNECTOR, num_blocks=N)
            scheduler.add_request(make_request("C", list(range(1, 65))))
            conn = worker_connector(scheduler)
            out1 = scheduler.schedule()
            run_step_on_worker(wh, conn, compute, out1)
            (op,) = metas(out1, "C", "STORE")
            store = transfer_of(op, vc.META_STORE)
            scheduler.update_from_output(out1, model_output(out1))
            assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
            hz, pool = hazards(scheduler), core(scheduler)
            assert hz.blocks_on_their_way() == 4 and pool.token_status(store.token) is TokenStatus.PENDING
            (future,) = io.transfer.futures
            future.done = True
            scheduler.connector.update_connector_output(
                KVConnectorOutput(kv_connector_worker_meta=conn.build_connector_worker_meta())
            )
            assert hz.blocks_on_their_way() == 0 and pool.get_num_free_blocks() == N - 1
            pool.check()
    finally:
        vw.install(None)


def _lmcache_class() -> Any:
    """LMCache's own connector class in vLLM's module, as the LMCache MP
    tests run it (their autouse fixture, as a context manager)."""
    from contextlib import contextmanager
    from unittest.mock import patch

    from tests.test_vllm_lmcache_mp import connector_mod

    @contextmanager
    def swapped() -> Any:
        vmod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector")
        with patch.object(vmod, "LMCacheMPConnector", connector_mod.LMCacheMPConnector):
            yield

    return swapped()
