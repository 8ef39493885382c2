"""Blocks whose content is bad, and device writes outside the transfers
the pool sees, on vLLM's real ``Scheduler`` with the wired connectors: a
connector's ``invalid_block_ids`` reach vLLM's recovery as reported and
mark exactly those blocks bad in the pool, so each
``kv_load_failure_policy`` serves what stock vLLM serves; a GET into
blocks the step zeroes waits for the zeroing; and in a
``MultiConnector([NixlConnector, MooncakeStoreConnector])`` a PUT of the
blocks NIXL received waits for the first step issued after the report,
whose forward runs after NIXL's post-receive kernels (its worker
enqueues them on the compute stream when it reports the read: block-size
and layout conversion, the zeroing of sub-blocks the read did not cover,
the heterogeneous-attention packing, the copy from a host buffer), as
vLLM's own after-forward event does.

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
from tests.test_vllm_connectors import (
    lookup,
    make_request,
    make_scheduler,
    model_output,
    remote_prefill,
    worker,
    wrapper,
)

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
def test_vllm_recovers_exactly_the_blocks_the_connector_reported_and_the_pool_marks_only_those(
    registered: bool,
) -> None:
    scheduler, out, load = loading()
    assert load is not None
    first, second, last = load.block_ids
    output = model_output(out, invalid_block_ids={last}, finished_recving={"B"})
    scheduler.update_from_output(out, output)
    # vLLM reads the report as the connector made it and keeps the valid prefix.
    assert output.kv_connector_output.invalid_block_ids == {last}
    assert scheduler.requests["B"].num_computed_tokens == 2 * tc.BS
    core = scheduler.kv_cache_manager.block_pool.core
    assert core.invalid_block_ids() == [last]
    assert core.token_status(load.token).value == "completed"
    assert scheduler.kv_cache_manager.block_pool.hazards.loads_failed_in_part == 1
    assert first < second < last


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_with_hazards_off_vllm_recovers_the_blocks_the_connector_reported(registered: bool) -> None:
    scheduler, out, _ = loading()
    last = loaded_blocks(scheduler)[-1]
    output = model_output(out, invalid_block_ids={last}, finished_recving={"B"})
    scheduler.update_from_output(out, output)
    assert output.kv_connector_output.invalid_block_ids == {last}
    assert scheduler.requests["B"].num_computed_tokens == 2 * tc.BS


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_invalid_blocks_no_pending_load_wrote_are_left_to_vllm_as_reported(
    registered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, out, load = loading()
    assert load is not None
    output = model_output(out, invalid_block_ids={load.block_ids[-1], 60}, finished_recving={"B"})
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.blockpool"):
        scheduler.update_from_output(out, output)
    assert output.kv_connector_output.invalid_block_ids == {load.block_ids[-1], 60}
    assert scheduler.kv_cache_manager.block_pool.core.invalid_block_ids() == [load.block_ids[-1]]
    assert not [r for r in caplog.records if "invalid block" in r.getMessage()]


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_report_naming_every_block_of_a_load_fails_the_load_whole(registered: bool) -> None:
    scheduler, out, load = loading()
    assert load is not None
    output = model_output(out, invalid_block_ids=set(load.block_ids), finished_recving={"B"})
    scheduler.update_from_output(out, output)
    core = scheduler.kv_cache_manager.block_pool.core
    assert output.kv_connector_output.invalid_block_ids == set(load.block_ids)
    assert core.invalid_block_ids() == list(load.block_ids)
    assert core.token_status(load.token).value == "failed"
    assert scheduler.kv_cache_manager.block_pool.hazards.loads_failed_in_part == 0
    assert scheduler.requests["B"].num_computed_tokens == 0


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
# kv_load_failure_policy: what stock vLLM serves, the plugin serves
# ----------------------------------------------------------------------


def step_until_gone(
    scheduler: Any, req_id: str, report: Any, steps: int = 12
) -> tuple[int, list[int], dict[str, Any]]:
    """Step vLLM's scheduler until ``req_id`` leaves it (or ``steps``
    steps). ``report(out)`` gives the connector's output for a step and
    whether the step planned a load of ``req_id``. Returns the loads
    planned, ``req_id``'s computed tokens after each step it was still
    there, and each finished request's finish reason."""
    loads = 0
    computed: list[int] = []
    finished: dict[str, Any] = {}
    for _ in range(steps):
        out = scheduler.schedule()
        connector, planned = report(out)
        loads += planned
        engine_outputs = scheduler.update_from_output(out, model_output(out, **connector))
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason
        request = scheduler.requests.get(req_id)
        if request is None:
            break
        computed.append(request.num_computed_tokens)
    return loads, computed, finished


def serve_a_get_failing_in_block(bad: int, *, recompute: bool) -> tuple[int, list[int], dict[str, Any]]:
    """MooncakeStore holds 64 of request B's 80 tokens (four blocks); each
    GET of B reports it done with B's block ``bad`` invalid (a key that
    keeps failing), as MooncakeStore's receive thread reports a batch with
    one failed key. :func:`step_until_gone` for B."""
    scheduler = make_scheduler("MooncakeStoreConnector", {"load_async": True})
    scheduler.recompute_kv_load_failures = recompute
    scheduler.connector.connector_scheduler.client.lookup.return_value = lookup(64)
    scheduler.add_request(make_request("B", list(range(500, 580)), max_tokens=3))

    def report(out: Any) -> tuple[dict[str, Any], bool]:
        gets = [
            rm
            for rm in out.kv_connector_metadata.requests
            if rm.load_spec is not None and rm.load_spec.can_load
        ]
        if not gets:
            return {}, False
        (table,) = scheduler.kv_cache_manager.get_block_ids("B")
        return {"finished_recving": {"B"}, "invalid_block_ids": {table[bad]}}, True

    return step_until_gone(scheduler, "B", report)


@pytest.mark.parametrize("registered", [True, False], indirect=True)
def test_under_recompute_a_get_failing_in_one_block_keeps_the_valid_prefix_and_finishes_after_one_get(
    registered: bool,
) -> None:
    from vllm.v1.engine import FinishReason

    gets, computed, finished = serve_a_get_failing_in_block(2, recompute=True)
    assert gets == 1
    # After the report: the tokens of the blocks before the first invalid one.
    assert computed[0] == 2 * tc.BS
    assert finished == {"B": FinishReason.LENGTH}
    assert len(computed) == 3  # the fourth step finishes B


@pytest.mark.parametrize("registered", [True, False], indirect=True)
def test_under_fail_a_get_failing_in_one_block_fails_its_request(registered: bool) -> None:
    from vllm.v1.engine import FinishReason

    gets, computed, finished = serve_a_get_failing_in_block(2, recompute=False)
    assert (gets, computed, finished) == (1, [], {"B": FinishReason.ERROR})


@pytest.mark.parametrize("registered", [True, False], indirect=True)
def test_under_fail_a_request_sharing_only_the_valid_prefix_of_a_failed_load_is_served(
    registered: bool,
) -> None:
    """A's synchronous GET writes its four blocks; C, scheduled in the same
    step, hits A's first two (vLLM publishes a synchronous load's keys when
    it allocates the blocks). The GET reports A's last block invalid: vLLM
    fails A, whose computed tokens cover it, and serves C, whose do not."""
    from vllm.v1.engine import FinishReason

    scheduler = make_scheduler("MooncakeStoreConnector", {"load_async": False})
    scheduler.recompute_kv_load_failures = False
    cs = scheduler.connector.connector_scheduler
    cs.client.lookup.side_effect = lambda req_id, *args, **kwargs: lookup(64 if req_id == "A" else 0)
    scheduler.add_request(make_request("A", list(range(500, 580)), max_tokens=3))
    scheduler.add_request(make_request("C", list(range(500, 532)) + list(range(900, 920)), max_tokens=3))

    def report(out: Any) -> tuple[dict[str, Any], bool]:
        if "A" not in out.num_scheduled_tokens or out.num_scheduled_tokens.get("C") != 20:
            return {}, False
        (a,), (c,) = (
            scheduler.kv_cache_manager.get_block_ids("A"),
            scheduler.kv_cache_manager.get_block_ids("C"),
        )
        assert c[:2] == a[:2]  # C shares A's first two loaded blocks
        return {"invalid_block_ids": {a[3]}}, True

    gets, _, finished = step_until_gone(scheduler, "C", report)
    assert gets == 1
    assert finished == {"A": FinishReason.ERROR, "C": FinishReason.LENGTH}


def simple_cpu_offload_scheduler(num_blocks: int = 32) -> Any:
    """vLLM's Scheduler with SimpleCPUOffload (CPU room for 16 blocks)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=tc.BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    page = spec.page_size_bytes
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks, layers=["layer"], layer_stride=page * num_blocks, block_stride=page
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return make_scheduler(
        "SimpleCPUOffloadConnector", {"cpu_bytes_to_use": page * 16}, kv=kv, num_blocks=num_blocks
    )


def simple_cpu_stores_done(out: Any) -> dict[str, Any]:
    """The workers' report of the step's store, done on the one worker."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    event = out.kv_connector_metadata.store_event
    if event < 0:
        return {}
    return {"kv_connector_worker_meta": SimpleCPUOffloadWorkerMetadata(completed_store_events={event: 1})}


@pytest.mark.parametrize("registered", [True, False], indirect=True)
def test_under_recompute_a_simple_cpu_offload_load_failing_in_one_block_keeps_the_valid_prefix(
    registered: bool,
) -> None:
    """P's four full blocks are offloaded to the CPU and dropped from the
    GPU prefix cache; C, with P's prompt and 8 more tokens, loads them,
    and the load reports C's third block invalid."""
    from vllm.v1.engine import FinishReason

    scheduler = simple_cpu_offload_scheduler()
    scheduler.recompute_kv_load_failures = True
    prompt = list(range(1, 73))
    scheduler.add_request(make_request("P", prompt, max_tokens=3))
    step_until_gone(scheduler, "P", lambda out: (simple_cpu_stores_done(out), False))
    for _ in range(2):  # the stores of P's blocks vLLM flushes after P finished
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(out, **simple_cpu_stores_done(out)))
    assert scheduler.kv_cache_manager.reset_prefix_cache()
    scheduler.add_request(make_request("C", [*prompt, *[9] * 8], max_tokens=3))

    def report(out: Any) -> tuple[dict[str, Any], bool]:
        meta = out.kv_connector_metadata
        connector = simple_cpu_stores_done(out)
        if "C" not in meta.load_event_to_reqs.get(meta.load_event, ()):
            return connector, False
        (table,) = scheduler.kv_cache_manager.get_block_ids("C")
        return {**connector, "finished_recving": {"C"}, "invalid_block_ids": {table[2]}}, True

    loads, computed, finished = step_until_gone(scheduler, "C", report)
    assert loads == 1
    assert computed[0] == 2 * tc.BS
    assert finished == {"C": FinishReason.LENGTH}


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


# ----------------------------------------------------------------------
# NIXL's post-receive rewrites
# ----------------------------------------------------------------------


NIXL_THEN_MOONCAKE = {
    "connectors": [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
    ]
}


def decode_with_store(async_scheduling: bool = False) -> Any:
    """A decode instance: NIXL reads request B's prompt (40 tokens, not
    block-aligned) from a prefill engine, MooncakeStore holds nothing of
    it and stores what B computes."""
    scheduler = make_scheduler(
        "MultiConnector", NIXL_THEN_MOONCAKE, num_blocks=32, async_scheduling=async_scheduling
    )
    scheduler.connector._connectors[1].connector_scheduler.client.lookup.return_value = lookup(0)
    scheduler.add_request(make_request("B", list(range(200, 240)), transfer=remote_prefill(3), max_tokens=4))
    return scheduler


def nixl_read(out: Any) -> Transfer:
    nixl_meta, _ = out.kv_connector_metadata.metadata
    return Transfer.from_wire(getattr(nixl_meta.reqs_to_recv["B"], vc.META_LOAD))


def mooncake_put(out: Any) -> Transfer | None:
    _, mooncake_meta = out.kv_connector_metadata.metadata
    puts = [
        getattr(rm, vc.META_STORE, None) for rm in mooncake_meta.requests if rm.req_id == "B" and rm.can_save
    ]
    return Transfer.from_wire(puts[0]) if puts and puts[0] is not None else None


def step_record(out: Any) -> StepRecord:
    return StepRecord.from_wire(getattr(vw.step_of(out.kv_connector_metadata), vc.META_STEP)[0])


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_mooncake_put_of_blocks_nixl_received_waits_for_the_step_after_the_receive(
    registered: bool,
) -> None:
    scheduler = decode_with_store()
    out0 = scheduler.schedule()  # B waits for its remote KV: no token scheduled
    read = nixl_read(out0)
    scheduler.update_from_output(out0, model_output(out0, finished_recving={"B"}))
    out1 = scheduler.schedule()
    put = mooncake_put(out1)
    assert put is not None
    assert set(put.block_ids) < set(read.block_ids)  # the two full blocks NIXL wrote
    assert put.fence.tokens == (step_record(out1).forward,)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_with_async_scheduling_the_put_waits_for_the_first_step_issued_after_the_receive(
    registered: bool,
) -> None:
    """vLLM's AsyncScheduler schedules step 1 before it reads step 0's
    output: the blocks are written by the first step issued after the
    report (step 2). Every rank runs the steps in order, so the kernels
    step 0 enqueued run before step 1's forward already: the fence is
    later than it must be, never early."""
    scheduler = decode_with_store(async_scheduling=True)
    scheduler.add_request(make_request("A", list(range(600, 640)), max_tokens=8))  # keeps the engine stepping
    out0 = scheduler.schedule()
    read = nixl_read(out0)
    out1 = scheduler.schedule()  # issued before step 0's output is read
    scheduler.update_from_output(out0, model_output(out0, finished_recving={"B"}))
    scheduler.update_from_output(out1, model_output(out1))
    out2 = scheduler.schedule()
    put = mooncake_put(out2)
    assert put is not None and set(put.block_ids) < set(read.block_ids)
    assert step_record(out1).forward.seq < step_record(out2).forward.seq
    assert put.fence.tokens == (step_record(out2).forward,)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_on_stand_ins_the_put_reads_the_blocks_after_nixls_post_receive_kernels(registered: bool) -> None:
    """The worker half on stand-in streams, in vLLM's order: step 0's
    ``get_finished`` reports B's read and enqueues NIXL's post-receive
    kernels on the compute stream; step 1 binds its metadata, runs its
    forward and records its token; MooncakeStore's send thread waits on
    the PUT's fence (the ``current_event`` the plugin's ``wait_for_save``
    gives it), then reads the blocks."""
    scheduler = decode_with_store()
    out0 = scheduler.schedule()
    scheduler.update_from_output(out0, model_output(out0, finished_recving={"B"}))
    out1 = scheduler.schedule()
    put = mooncake_put(out1)
    assert put is not None
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        kv = dict.fromkeys(put.block_ids, "prefill's block size")  # NIXL's READ landed
        compute.enqueue(
            lambda: kv.update(dict.fromkeys(put.block_ids, "decode's block size")), "post-receive"
        )
        carrier = vw.step_of(out1.kv_connector_metadata)
        wh.on_bind(carrier)
        compute.enqueue(lambda: None, "step 1 forward")
        wh.forward_done(carrier)
        vw.FenceWait(wh, put).synchronize()  # the send thread, before it reads
        assert set(kv.values()) == {"decode's block size"}
    finally:
        vw.install(None)
