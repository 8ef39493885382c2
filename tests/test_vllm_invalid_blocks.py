"""Blocks whose content is bad, on vLLM's real ``Scheduler`` with the
wired MooncakeStore connector: vLLM's recovery recomputes every block a
failed load left bad in the pool, and a GET into blocks the step zeroes
waits for the zeroing.

Needs vLLM (skipped otherwise) and the shape-only model configs of
``../shared/vllm-parity/hf``, like ``test_vllm_connectors.py``.
"""

from __future__ import annotations

import logging
import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
torch = pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from blockpool.integrations.vllm import connectors as vc
from blockpool.integrations.vllm import worker as vw
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.worker.standins import StandInDevice
from tests import test_vllm_connectors as tc
from tests.test_vllm_connectors import lookup, make_request, make_scheduler, model_output, worker, wrapper

registered = tc.registered  # the plugin installed, hazards on or off (request.param)


def zeroing_kv_cache() -> Any:
    """One full-attention group of 64 blocks whose new blocks vLLM zeroes
    (as it resolves ``needs_kv_cache_zeroing`` for a model with Mamba
    layers or a mixed-precision KV cache: a field on vLLM 0.34, a property
    of the layers on 0.32 and 0.33)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=tc.BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    derived = isinstance(getattr(KVCacheConfig, "needs_kv_cache_zeroing", None), property)
    cls = (
        type("ZeroingKVCacheConfig", (KVCacheConfig,), {"needs_kv_cache_zeroing": True})
        if derived
        else KVCacheConfig
    )
    kv = cls(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    if not derived:
        kv.needs_kv_cache_zeroing = True
    return kv


def loading(load_async: bool = True) -> tuple[Any, Any, Transfer | None]:
    """MooncakeStore has the first 48 of request B's 80 tokens: B's GET
    writes its first three blocks. Returns the scheduler, the step's output
    and the GET's transfer (``None`` with hazards off). ``load_async=False``: the scheduler plans the
    GET to run within the step that computes B's other tokens."""
    scheduler = make_scheduler("MooncakeStoreConnector", {"load_async": load_async}, kv=zeroing_kv_cache())
    scheduler.recompute_kv_load_failures = True  # kv_load_failure_policy="recompute"
    scheduler.connector.connector_scheduler.client.lookup.return_value = lookup(48)
    scheduler.add_request(make_request("B", list(range(500, 580))))
    out = scheduler.schedule()
    (meta,) = [rm for rm in out.kv_connector_metadata.requests if rm.req_id == "B"]
    wire = getattr(meta, vc.META_LOAD, None)
    return scheduler, out, None if wire is None else Transfer.from_wire(wire)


def loaded_blocks(scheduler: Any) -> list[int]:
    """The three blocks B's GET writes, from vLLM's own block table."""
    return [
        b.block_id
        for b in scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["B"][:3]
    ]


# ----------------------------------------------------------------------
# vLLM's invalid_block_ids recovery
# ----------------------------------------------------------------------


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_vllm_recomputes_every_block_a_failed_load_left_bad(registered: bool) -> None:
    scheduler, out, load = loading()
    assert load is not None
    first, _, last = load.block_ids
    # The connector reports only the GET's last block invalid; the load
    # failed as one transfer, and the pool holds all three blocks bad.
    output = model_output(out, invalid_block_ids={last}, finished_recving={"B"})
    scheduler.update_from_output(out, output)
    assert output.kv_connector_output.invalid_block_ids == set(load.block_ids)
    assert scheduler.kv_cache_manager.block_pool.core.invalid_block_ids() == list(load.block_ids)
    # vLLM truncated B's computed tokens at its first bad block: none stay.
    assert scheduler.requests["B"].num_computed_tokens == 0
    assert scheduler.kv_cache_manager.block_pool.hazards.invalid_blocks_added == 2
    assert first < last


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_with_hazards_off_vllm_recovers_the_blocks_the_connector_reported(registered: bool) -> None:
    scheduler, out, _ = loading()
    last = loaded_blocks(scheduler)[-1]
    output = model_output(out, invalid_block_ids={last}, finished_recving={"B"})
    scheduler.update_from_output(out, output)
    assert output.kv_connector_output.invalid_block_ids == {last}
    assert scheduler.requests["B"].num_computed_tokens == 2 * tc.BS


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_disagreement_is_warned_once_with_its_counts(
    registered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, out, load = loading()
    assert load is not None
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.blockpool"):
        scheduler.update_from_output(out, model_output(out, invalid_block_ids={load.block_ids[-1], 60}))
    hz = scheduler.kv_cache_manager.block_pool.hazards
    lines = [r.getMessage() for r in caplog.records if "invalid block" in r.getMessage()]
    expected = (
        "blockpool: the connector reported 2 invalid block(s); the 1 failed load(s) they belong to left 3 "
        "block(s) bad in the pool: 2 only the pool knew were added to vLLM's recovery (recomputed), 1 only "
        "the connector reported were left to it as reported (further disagreements are counted in "
        "invalid_reports_disagreeing)"
    )
    assert lines == [expected]
    assert (hz.invalid_reports_disagreeing, hz.invalid_blocks_added) == (1, 2)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_when_the_sets_agree_nothing_is_added_or_logged(
    registered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, out, load = loading()
    assert load is not None
    output = model_output(out, invalid_block_ids=set(load.block_ids), finished_recving={"B"})
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.blockpool"):
        scheduler.update_from_output(out, output)
    hz = scheduler.kv_cache_manager.block_pool.hazards
    assert output.kv_connector_output.invalid_block_ids == set(load.block_ids)
    assert (hz.invalid_reports_disagreeing, hz.invalid_blocks_added) == (0, 0)
    assert not [r for r in caplog.records if "invalid block" in r.getMessage()]


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_failed_request_without_invalid_blocks_gets_no_block_level_report(registered: bool) -> None:
    scheduler, out, load = loading()
    assert load is not None
    output = model_output(out, failed_recving={"B"})
    scheduler.update_from_output(out, output)
    # The pool knows the blocks are bad; vLLM recovers the whole request
    # (failed_recving), and a block-level report is not made up for it.
    assert scheduler.kv_cache_manager.block_pool.core.invalid_block_ids() == list(load.block_ids)
    assert output.kv_connector_output.invalid_block_ids == set()


# ----------------------------------------------------------------------
# the zeroing of new blocks
# ----------------------------------------------------------------------


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_get_into_blocks_the_step_zeroes_waits_for_the_zeroing(registered: bool) -> None:
    _, out, load = loading(load_async=False)
    assert load is not None and set(load.block_ids) <= set(out.new_block_ids_to_zero)
    step = StepRecord.from_wire(getattr(out.kv_connector_metadata, vc.META_STEP)[0])
    # The zeroing runs on compute before the forward: its own token, which
    # the worker records when the connector binds the step.
    assert step.copies is not None and step.copies.seq < step.forward.seq
    assert load.fence.tokens == (step.copies,) and load.fence.needs_host_wait


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_zeroing_rewrites_the_blocks_a_failed_load_left_bad(registered: bool) -> None:
    scheduler, out, load = loading(load_async=False)
    assert load is not None
    core = scheduler.kv_cache_manager.block_pool.core
    core.fail(load.token)
    assert core.invalid_block_ids() == list(load.block_ids)
    # vLLM zeroes them again before recomputing them (record_blocks_for_zeroing).
    scheduler.kv_cache_manager.record_blocks_for_zeroing("B", 0)
    scheduler.update_from_output(out, model_output(out))
    again = scheduler.schedule()
    assert set(load.block_ids) <= set(again.new_block_ids_to_zero)
    assert core.invalid_block_ids() == []


def replay_zeroing_and_get(out: Any, targets: tuple[int, ...]) -> dict[int, str]:
    """The worker half on stand-ins: vLLM's runner enqueues the zeroing of
    the step's new blocks on the compute stream (not run yet), the step's
    metadata is bound, then MooncakeStore's receive thread runs B's GET
    into ``targets`` through the plugin's wrapper. Returns their final
    content."""
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    kv: dict[int, str] = {}
    zero = list(out.new_block_ids_to_zero)
    compute.enqueue(lambda: kv.update(dict.fromkeys(zero, "zeros")), "zero new blocks")
    if getattr(out.kv_connector_metadata, vc.META_STEP, None) is not None:
        wh.on_bind(out.kv_connector_metadata)
    (meta,) = [rm for rm in out.kv_connector_metadata.requests if rm.req_id == "B"]

    def get(thread: Any, req_meta: Any) -> None:
        kv.update(dict.fromkeys(targets, "remote KV"))

    handle = wrapper(vw._wire_mooncake, "KVCacheStoreRecvingThread", "_handle_request", get)
    t = threading.Thread(
        target=handle, args=(SimpleNamespace(done_task_lock=threading.Lock(), _failed_requests=set()), meta)
    )
    t.start()
    t.join(10)
    dev.run()  # the device catches up
    vw.install(None)
    return {b: kv[b] for b in targets}


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_on_stand_in_streams_the_get_lands_after_the_zeroing(registered: bool) -> None:
    scheduler, out, load = loading(load_async=False)
    assert load is not None and load.block_ids == tuple(loaded_blocks(scheduler))
    assert set(replay_zeroing_and_get(out, load.block_ids).values()) == {"remote KV"}


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_on_stand_in_streams_an_unfenced_get_is_overwritten_by_the_zeroing(registered: bool) -> None:
    scheduler, out, _ = loading(load_async=False)
    assert set(replay_zeroing_and_get(out, tuple(loaded_blocks(scheduler))).values()) == {"zeros"}
