"""Never weaker than stock vLLM: the configurations in which the wiring once
replaced vLLM's own wait with a fence that missed a write (decode context
parallelism, speculative decoding, loads planned in an empty step, a load
into blocks an in-flight step still reads under async scheduling), each on
vLLM's real ``Scheduler`` and the plugin's real worker wrappers over CPU
stand-in streams and events. Needs vLLM (skipped otherwise; the parity
script runs these in its venv).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
torch = pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from blockpool.core.hazards import Fence, StreamKind, Token
from blockpool.integrations.vllm import connectors as vc
from blockpool.integrations.vllm import worker as vw
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.worker.standins import StandInDevice
from blockpool.worker.torch_events import EventLedger
from tests.test_vllm_connectors import (
    NO_V1_RUNNER,
    OFFLOAD,
    V1_RUNNER,
    lookup,
    make_request,
    make_scheduler,
    model_output,
    offload_step,
    registered,
    wrapper,
)

__all__ = ["registered"]  # the fixture, imported for its tests

STEP = vc.META_STEP


def step_of(out: Any) -> StepRecord:
    return StepRecord.from_wire(getattr(out.kv_connector_metadata, STEP)[0])


def table_of(scheduler: Any, req_id: str) -> list[int]:
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return [b.block_id for b in manager.req_to_blocks[req_id]]


class Rank:
    """One worker rank on stand-ins: a compute stream, a copy stream, the
    plugin's :class:`WorkerHazards` over them (installed while in use), and
    the current stream a handler switches to."""

    def __init__(self) -> None:
        self.dev = StandInDevice()
        self.compute = self.dev.new_stream("compute")
        self.copy = self.dev.new_stream("copy")
        self.current = self.compute
        ledger = EventLedger(self.dev.new_event, streams={"compute": self.compute})
        self.wh = vw.WorkerHazards(ledger, lambda: self.current, timeout=5.0)

    def __enter__(self) -> Rank:  # noqa: PYI034  (a test helper, never subclassed)
        vw.install(self.wh)
        return self

    def __exit__(self, *exc: object) -> None:
        vw.install(None)

    def run_steps(self, *outs: Any) -> None:
        """Replay the worker's side of scheduled steps: bind each step's
        metadata, enqueue its forward on compute, record ``eN``."""
        for out in outs:
            meta = out.kv_connector_metadata
            self.wh.on_bind(meta)
            self.compute.enqueue(lambda: None, "forward")
            self.wh.forward_done(meta)

    @staticmethod
    def issued(scheduler: Any) -> dict[str, int]:
        """The newest DEVICE token the scheduler's pool issued, per stream."""
        core = scheduler.kv_cache_manager.block_pool.core
        last = {}
        for stream, kind in core.streams.items():
            t = core.last_token(stream)
            if kind is StreamKind.DEVICE and t is not None:
                last[stream] = t.seq
        return last

    def unrecorded(self, scheduler: Any, since: dict[str, int]) -> dict[str, list[int]]:
        """DEVICE tokens the scheduler's pool issued after ``since``
        (:meth:`issued` before this rank ran any step) that this rank never
        recorded."""
        out = self.wh.unrecorded(self.issued(scheduler))
        return {k: v for k, v in ((k, [q for q in v if q > since.get(k, 0)]) for k, v in out.items()) if v}


# ----------------------------------------------------------------------
# decode context parallelism: a block spans spec block size * DCP tokens
# ----------------------------------------------------------------------


@pytest.mark.parametrize("registered", [True], indirect=True)
@pytest.mark.parametrize(("dcp", "spec_block_size"), [(1, 32), (2, 16)])
def test_mooncake_put_of_blocks_a_step_writes_waits_on_that_step_at_any_dcp_size(
    registered: bool, dcp: int, spec_block_size: int
) -> None:
    """Both configurations have 32-token blocks in the scheduler's block
    table; with DCP 2 the wiring once mapped tokens to blocks by the spec's
    16 and the PUT of step 2's blocks had an empty fence."""
    s = make_scheduler(
        "MooncakeStoreConnector", block_size=spec_block_size, dcp=dcp, max_num_batched_tokens=128
    )
    assert vc.wiring_of(s.connector.connector_scheduler).block_sizes == (32,)
    s.connector.connector_scheduler.client.lookup.return_value = lookup(0)
    s.add_request(make_request("A", list(range(1, 201))))
    out1 = s.schedule()  # tokens 0..128: blocks 0..3
    s.update_from_output(out1, model_output(out1))
    out2 = s.schedule()  # tokens 128..200: blocks 4..6 (6 partial), step 1 ended
    e2 = step_of(out2).forward
    table = table_of(s, "A")
    stores = [
        Transfer.from_wire(getattr(rm, vc.META_STORE))
        for rm in out2.kv_connector_metadata.requests
        if getattr(rm, vc.META_STORE, None) is not None
    ]
    assert len(stores) == 1
    (store,) = stores
    assert set(table[4:6]) <= set(store.block_ids) <= set(table)
    assert store.fence.tokens == (e2,)
    assert not getattr(out2.kv_connector_metadata, vc.META_STOCK, False)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_step_writes_are_tagged_by_the_managers_block_size_under_dcp(registered: bool) -> None:
    """The forward's writes (tag_step_writes) use 32-token blocks at DCP 2:
    an offload store of step 2's blocks waits on step 2."""
    s = make_scheduler(
        "OffloadingConnector", {**OFFLOAD, "block_size": 32}, block_size=16, dcp=2, max_num_batched_tokens=128
    )
    s.add_request(make_request("A", list(range(1, 201))))
    out1 = s.schedule()
    offload_step(s, out1)
    out2 = s.schedule()
    e2 = step_of(out2).forward
    table = table_of(s, "A")
    (job,) = out2.kv_connector_metadata.store_jobs.values()
    store = Transfer.from_wire(getattr(job, vc.META_STORE))
    assert set(store.block_ids) <= set(table[4:])
    assert store.fence.tokens == (e2,)


def test_stock_waits_are_kept_where_the_fences_are_not_shown_exact() -> None:
    ns = SimpleNamespace
    plain = ns(speculative_config=None, parallel_config=ns(prefill_context_parallel_size=1))
    assert vc.stock_waits_reason(plain, (32,)) is None
    assert (
        vc.stock_waits_reason(plain, None)
        == "the KV cache groups' block sizes could not be read from the scheduler"
    )
    spec = ns(speculative_config=object(), parallel_config=ns(prefill_context_parallel_size=1))
    assert vc.stock_waits_reason(spec, (32,)) == "speculative decoding is on"
    pcp = ns(speculative_config=None, parallel_config=ns(prefill_context_parallel_size=2))
    assert vc.stock_waits_reason(pcp, (32,)) == "prefill context parallelism is on (size 2)"


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_pcp_scheduler_ships_the_stock_waits_flag_with_every_step(registered: bool) -> None:
    s = make_scheduler("MooncakeStoreConnector", pcp=2)
    s.connector.connector_scheduler.client.lookup.return_value = lookup(0)
    assert vc.wiring_of(s.connector.connector_scheduler).stock_waits
    s.add_request(make_request("A", list(range(1, 41))))
    out = s.schedule()
    assert getattr(out.kv_connector_metadata, vc.META_STOCK) is True


class StockEvent:
    """Stands in for ``torch.cuda.Event`` in MooncakeStore's ``wait_for_save``
    (records on the rank's current stream)."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self.event = rank.dev.new_event()

    def record(self) -> None:
        self.event.record(self.rank.current)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_mooncake_store_keeps_vllms_event_on_top_of_its_fence_when_flagged(registered: bool) -> None:
    s = make_scheduler("MooncakeStoreConnector", pcp=2)
    s.connector.connector_scheduler.client.lookup.return_value = lookup(0)
    s.add_request(make_request("A", list(range(1, 41))))
    meta = s.schedule().kv_connector_metadata
    with Rank() as rank, patch.object(vw.torch.cuda, "Event", lambda: StockEvent(rank)):
        rank.wh.on_bind(meta)
        rank.compute.enqueue(lambda: None, "step 1 forward")
        sent: list[Any] = []
        store_worker = SimpleNamespace(
            _capacity_only=False, can_put=True, kv_send_thread=SimpleNamespace(add_request=sent.append)
        )
        wrapper(vw._wire_mooncake, "MooncakeStoreWorker", "wait_for_save", None)(store_worker, meta)
        (req,) = sent
        assert isinstance(req.current_event, vw.FenceWait)
        assert isinstance(req.current_event.stock, StockEvent) and req.current_event.keep_stock
        rank.compute.enqueue(lambda: None, "later work on compute")
        assert not req.current_event.query()
        req.current_event.synchronize()
        syncs = [op for op in rank.dev.log if op[0] == "synchronize"]
        assert len(syncs) == 2  # the fence's event, then vLLM's own


# ----------------------------------------------------------------------
# speculative decoding: eN after the draft model's KV writes
# ----------------------------------------------------------------------


def step_meta(seq: int) -> tuple[StepRecord, Any]:
    record = StepRecord(seq, Token("compute", seq))
    meta = SimpleNamespace()
    setattr(meta, STEP, (record.to_wire(), Fence().to_wire()))
    return record, meta


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_with_spec_decode_the_step_token_is_recorded_after_the_draft_model(registered: bool) -> None:
    """vLLM's V1 runner with a speculative config defers ``wait_for_save``
    to ``finalize_kv_connector`` (after the draft model, whose KV is saved
    too); eN must be recorded there, not when the target forward ends."""
    mixin = pytest.importorskip(V1_RUNNER, reason=NO_V1_RUNNER)
    order: list[str] = []

    @contextmanager
    def vllm_lifecycle(scheduler_output: Any, defer_finalize: bool = False) -> Iterator[None]:
        order.append("bind")
        yield None
        order.append("start_load_kv")
        if not defer_finalize:
            order.append("wait_for_save")

    record, meta = step_meta(1)
    connector = SimpleNamespace(
        _connector_metadata=meta,
        wait_for_save=lambda: order.append("wait_for_save"),
        clear_connector_metadata=lambda: order.append("clear"),
    )
    lifecycle = wrapper(
        vw._wire_runner, "KVConnectorModelRunnerMixin", "_get_kv_connector_output", vllm_lifecycle
    )
    finalize = mixin.KVConnectorModelRunnerMixin.finalize_kv_connector  # the plugin's wrapper of vLLM's own
    assert getattr(finalize, "__blockpool_wrapped__", False)
    with (
        Rank() as rank,
        patch.object(mixin, "has_kv_transfer_group", lambda: True),
        patch.object(mixin, "get_kv_transfer_group", lambda: connector),
    ):
        with lifecycle.__func__(SimpleNamespace(kv_connector_metadata=meta), defer_finalize=True):
            rank.compute.enqueue(lambda: order.append("target KV writes"), "target forward")
        assert rank.wh.ledger.event_of(record.forward) is None
        rank.compute.enqueue(lambda: order.append("draft KV writes"), "draft forward")
        finalize()
        event = rank.wh.ledger.event_of(record.forward)
        assert event is not None
        rank.compute.run(max_ops=1)
        assert order[-1] == "target KV writes" and not event.query()  # eN still waits for the draft
        rank.compute.run()
        assert event.query()
    assert order == ["bind", "start_load_kv", "wait_for_save", "clear", "target KV writes", "draft KV writes"]


def test_model_runner_v2_records_the_step_token_at_finalize_step_when_deferred() -> None:
    v2 = pytest.importorskip("vllm.v1.worker.gpu.kv_connector")
    if not hasattr(v2.ActiveKVConnector, "finalize_step"):
        pytest.skip("this vLLM's Model Runner V2 never defers wait_for_save")
    record, meta = step_meta(1)
    made: dict[str, Any] = {}
    vw._wire_runner(lambda owner, attr, make: made.__setitem__(attr, make))
    post = made["post_forward"](lambda self, finished, defer_finalize=False: None)
    finalize_step = made["finalize_step"](lambda self: None)
    runner = SimpleNamespace(_disabled=False, kv_connector=SimpleNamespace(_connector_metadata=meta))
    with Rank() as rank:
        post(runner, set(), defer_finalize=True)
        assert rank.wh.ledger.event_of(record.forward) is None
        finalize_step(runner)
        assert rank.wh.ledger.event_of(record.forward) is not None
    _, meta2 = step_meta(2)
    runner.kv_connector._connector_metadata = meta2
    with Rank() as rank:
        post(runner, set())  # not deferred: recorded after the forward, as before
        assert rank.wh.ledger.event_of(Token("compute", 2)) is not None


# ----------------------------------------------------------------------
# an Offloading load planned in an empty step, into blocks a step still reads
# ----------------------------------------------------------------------


def offload_prefix_to_cpu(s: Any, tokens: list[int]) -> None:
    """Store ``tokens``' full blocks to the CPU tier and drop them from the
    GPU prefix cache (the GPU copy is gone, the CPU one stays)."""
    s.add_request(make_request("P", tokens, max_tokens=1))
    out1 = s.schedule()
    ((job_id, _),) = out1.kv_connector_metadata.store_jobs.items()
    offload_step(s, out1)
    out2 = s.schedule()
    offload_step(s, out2, completed={job_id: 1})
    assert s.kv_cache_manager.reset_prefix_cache()


class CopyHandler:
    """The part of vLLM's ``SingleDirectionOffloadingHandler`` the plugin's
    ``transfer_async`` wrapper uses: the copy kernels run with the copy
    stream current, and the job's transfer is appended with that stream."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank
        self._transfers: list[Any] = []

    def _swap_blocks_batch(self, *args: Any) -> None:
        self.rank.copy.enqueue(lambda: None, "h2d copy")

    def transfer_async(self, job_id: int, spec: Any = None) -> bool:
        self.rank.current = self.rank.copy
        try:
            self._swap_blocks_batch()
        finally:
            self.rank.current = self.rank.compute
        self._transfers.append(SimpleNamespace(stream=self.rank.copy))
        return True


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_offload_load_planned_in_an_empty_step_waits_on_its_fence_and_records_its_token(
    registered: bool,
) -> None:
    s = make_scheduler("OffloadingConnector", OFFLOAD, num_blocks=5, role="kv_producer")  # no deferred frees
    offload_prefix_to_cpu(s, list(range(1, 41)))
    since = Rank.issued(s)  # the steps before are not replayed on the rank
    a_ids = add_short_requests(s, 3)
    out_a = s.schedule()
    e_a = step_of(out_a).forward
    from vllm.v1.request import RequestStatus

    s.finish_requests(a_ids, RequestStatus.FINISHED_ABORTED)  # their blocks, freed while their step runs
    s.add_request(make_request("B", list(range(1, 41)) + [9] * 8))
    out_b = s.schedule()
    meta = out_b.kv_connector_metadata
    assert out_b.total_num_scheduled_tokens == 0 and getattr(meta, STEP, None) is None
    ((job_id, job),) = meta.load_jobs.items()
    load = Transfer.from_wire(getattr(job, vc.META_LOAD))
    assert set(table_of_blocks(out_a)) & set(load.block_ids)  # B reuses their blocks
    assert load.fence.tokens == (e_a,)
    with Rank() as rank:
        rank.run_steps(out_a)  # their forward, still reading
        # vLLM's kv_connector_no_forward for the empty step: start_load_kv
        # collects the jobs, then each handler submits its copy.
        wrapper(vw._wire_offloading, "OffloadingConnectorWorker", "start_kv_transfers", lambda self, m: None)(
            SimpleNamespace(_is_store_writer=True), meta
        )
        handler = CopyHandler(rank)
        assert vw.offload_transfer_async(CopyHandler.transfer_async)(handler, job_id) is True
        waits = [op for op in rank.dev.log if op[0] == "wait_event"]
        assert waits == [("wait_event", "copy", rank.wh.ledger.event_of(e_a).name)]
        assert rank.wh.ledger.event_of(load.token) is not None
        assert rank.unrecorded(s, since) == {}


# ----------------------------------------------------------------------
# async scheduling, producer role: a load into blocks step N+1 still reads
# ----------------------------------------------------------------------


def add_short_requests(s: Any, n: int) -> list[str]:
    """``n`` requests of one partial block each (nothing for a connector to
    store), filling the pool so that the next request reuses their blocks."""
    ids = [f"A{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        s.add_request(make_request(rid, list(range(300 + 10 * i, 310 + 10 * i))))
    return ids


def abort_during_next_step(s: Any) -> tuple[Any, Any, Token]:
    """AsyncScheduler: requests A0..A2 run step N, step N+1 is scheduled,
    they are aborted (their blocks freed while N+1 may still read them),
    then step N's output comes back. Returns (step N output, step N+1
    output, eN+1)."""
    from vllm.v1.request import RequestStatus

    assert not s.defer_block_free  # a producer: vLLM's deferred frees do not apply
    a_ids = add_short_requests(s, 3)
    out_n = s.schedule()
    out_n1 = s.schedule()
    e_n1 = step_of(out_n1).forward
    s.finish_requests(a_ids, RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out_n, model_output(out_n))
    return out_n, out_n1, e_n1


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_async_offload_load_into_an_aborted_requests_blocks_waits_for_exactly_the_step_in_flight(
    registered: bool,
) -> None:
    s = make_scheduler(
        "OffloadingConnector", OFFLOAD, num_blocks=5, role="kv_producer", async_scheduling=True
    )
    offload_prefix_to_cpu(s, list(range(1, 41)))
    since = Rank.issued(s)  # the steps before are not replayed on the rank
    out_n, out_n1, e_n1 = abort_during_next_step(s)
    s.add_request(make_request("C", list(range(1, 41)) + [9] * 8))
    out_c = s.schedule()
    ((job_id, job),) = out_c.kv_connector_metadata.load_jobs.items()
    load = Transfer.from_wire(getattr(job, vc.META_LOAD))
    a_table = set(table_of_blocks(out_n))
    assert a_table & set(load.block_ids)  # C reuses A's blocks
    assert load.fence.tokens == (e_n1,)
    with Rank() as rank:
        rank.run_steps(out_n, out_n1)
        wrapper(vw._wire_offloading, "OffloadingConnectorWorker", "start_kv_transfers", lambda self, m: None)(
            SimpleNamespace(_is_store_writer=True), out_c.kv_connector_metadata
        )
        vw.offload_transfer_async(CopyHandler.transfer_async)(CopyHandler(rank), job_id)
        waits = [op for op in rank.dev.log if op[0] == "wait_event"]
        assert waits == [("wait_event", "copy", rank.wh.ledger.event_of(e_n1).name)]
        rank.wh.forward_done(out_c.kv_connector_metadata)
        assert rank.unrecorded(s, since) == {}


def table_of_blocks(out: Any) -> list[int]:
    """The block ids step ``out`` gave its new requests."""
    return [b for r in out.scheduled_new_reqs for group in r.block_ids for b in group]


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_async_mooncake_get_into_an_aborted_requests_blocks_waits_for_exactly_the_step_in_flight(
    registered: bool,
) -> None:
    s = make_scheduler("MooncakeStoreConnector", num_blocks=5, role="kv_producer", async_scheduling=True)
    cs = s.connector.connector_scheduler
    cs.client.lookup.return_value = lookup(0)
    out_n, out_n1, e_n1 = abort_during_next_step(s)
    cs.client.lookup.return_value = lookup(32)
    s.add_request(make_request("C", list(range(1, 49))))
    out_c = s.schedule()
    metas = [rm for rm in out_c.kv_connector_metadata.requests if getattr(rm, vc.META_LOAD, None) is not None]
    if not metas:
        pytest.skip("MooncakeStore plans no load in a producer role in this vLLM")
    (rm,) = metas
    load = Transfer.from_wire(getattr(rm, vc.META_LOAD))
    assert set(table_of_blocks(out_n)) & set(load.block_ids)
    assert load.fence.tokens == (e_n1,)
    # The receive thread waits for step N+1 on the host before its GETs.
    with Rank() as rank:
        rank.run_steps(out_n, out_n1)
        got: list[bool] = []
        event = rank.wh.ledger.event_of(e_n1)

        def get(thread: Any, req_meta: Any) -> None:
            got.append(event.query())  # step N+1 has ended when the GET runs

        handle = wrapper(vw._wire_mooncake, "KVCacheStoreRecvingThread", "_handle_request", get)
        t = threading.Thread(
            target=handle, args=(SimpleNamespace(done_task_lock=threading.Lock(), _failed_requests=set()), rm)
        )
        t.start()
        t.join(10)
        assert got == [True]
        assert rank.wh.waits == 1 and rank.wh.tokens_waited == 1


def test_a_device_token_the_rank_never_records_is_reported_not_left_to_a_timeout() -> None:
    with Rank() as rank:
        rank.wh.record(Token("compute", 1))
        rank.wh.record(Token("compute", 3))  # compute:2 was lost
        assert rank.wh.skipped == {"compute": [2]}
        assert rank.wh.unrecorded({"compute": 5, "offload_h2d": 1}) == {
            "compute": [2, 4, 5],
            "offload_h2d": [1],
        }


def test_a_worker_leaves_scheduler_only_streams_to_vllms_own_waits() -> None:
    """SimpleCPUOffload is wired on the scheduler only: no worker records
    its tokens, so a forward fence naming one must not fail the bind (as a
    wait on an unrecorded event would) -- vLLM's own copy-thread waits order
    that transfer, as in stock vLLM."""
    assert vw.SCHEDULER_ONLY_STREAMS == {vc.SIMPLE_H2D, vc.SIMPLE_D2H}
    record, meta = step_meta(1)
    store = Token(vc.SIMPLE_D2H, 1)
    setattr(meta, STEP, (record.to_wire(), Fence([store]).to_wire()))
    with Rank() as rank:
        assert rank.wh.on_bind(meta) == record
        assert not [op for op in rank.dev.log if op[0] == "wait_event"]
        assert rank.wh.waitable(Fence([store, Token("compute", 3)])) == (Token("compute", 3),)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_connector_bound_outside_a_scheduler_keeps_stock_waits(registered: bool) -> None:
    s = make_scheduler("MooncakeStoreConnector")
    w = vc.wiring_of(s.connector.connector_scheduler)
    assert w.stock_waits is False  # the scheduler's managers gave the block sizes
    # vLLM's own connector unit tests bind a pool by hand, with no scheduler:
    fresh = vc.attach(SimpleNamespace(), s.kv_cache_manager.block_pool, "mooncake_store", (16,))
    assert fresh is not None and fresh.stock_waits is True


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_async_simple_cpu_offload_load_into_an_aborted_requests_blocks_names_exactly_the_step_in_flight(
    registered: bool,
) -> None:
    """SimpleCPUOffload is wired on the scheduler side: the load's fence is
    exact (its worker keeps vLLM's own copy-thread wait)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    n = 6
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    page = spec.page_size_bytes
    kv = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[
            KVCacheTensor(size=page * n, layers=["layer"], layer_stride=page * n, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    s = make_scheduler(
        "SimpleCPUOffloadConnector",
        {"cpu_bytes_to_use": page * 8},
        kv=kv,
        num_blocks=n,
        role="kv_producer",
        async_scheduling=True,
    )
    s.add_request(make_request("P", list(range(1, 41)), max_tokens=3))
    out1 = s.schedule()
    s.update_from_output(out1, model_output(out1))
    out2 = s.schedule()  # P's two full blocks are stored
    done = SimpleCPUOffloadWorkerMetadata(completed_store_events={out2.kv_connector_metadata.store_event: 1})
    s.update_from_output(out2, model_output(out2, kv_connector_worker_meta=done))
    while "P" in s.requests:
        out = s.schedule()
        s.update_from_output(out, model_output(out))
    assert s.kv_cache_manager.reset_prefix_cache()
    out_n, _, e_n1 = abort_during_next_step(s)
    s.add_request(make_request("C", list(range(1, 41)) + [9] * 8))
    meta = s.schedule().kv_connector_metadata
    load = Transfer.from_wire(getattr(meta, vc.META_LOAD)["C"])
    assert set(load.block_ids) <= set(table_of_blocks(out_n))  # C's blocks are the aborted requests'
    assert load.fence.tokens == (e_n1,)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_cow_copy_in_a_step_with_no_scheduled_token_is_recorded_so_the_get_into_it_runs(
    registered: bool,
) -> None:
    """The seed scenario when nothing else runs: the step that ships B's
    copy schedules no token (B waits for its GET), but vLLM's runner still
    enqueues the copy before it returns early; the step needs a record, or
    nothing records the copy token and the GET times out and fails.
    (Found by review.)"""
    from tests.test_vllm_connectors import inject_partial_hit_cow

    s = make_scheduler("MooncakeStoreConnector")
    cs = s.connector.connector_scheduler
    cs.client.lookup.return_value = lookup(0)
    s.add_request(make_request("A", list(range(1, 49)), max_tokens=1))
    out1 = s.schedule()
    a_third = s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["A"][2]
    s.update_from_output(out1, model_output(out1))
    assert "A" not in s.requests  # nothing else runs
    inject_partial_hit_cow(s, "B", 2, a_third)
    cs.client.lookup.return_value = lookup(64)
    s.add_request(make_request("B", list(range(1, 41)) + list(range(100, 140))))
    out2 = s.schedule()
    assert out2.total_num_scheduled_tokens == 0 and out2.kv_cache_block_copies
    step = step_of(out2)
    (rm,) = [r for r in out2.kv_connector_metadata.requests if r.req_id == "B"]
    load = Transfer.from_wire(getattr(rm, vc.META_LOAD))
    assert step.copies is not None and load.fence.tokens == (step.copies,)
    since = {"compute": step_of(out1).forward.seq}
    with Rank() as rank:
        rank.wh.timeout = 2.0
        rank.compute.enqueue(lambda: None, "cow copy")  # vLLM's _update_states, before the empty-step return
        rank.wh.on_bind(out2.kv_connector_metadata)  # kv_connector_no_forward
        rank.wh.forward_done(out2.kv_connector_metadata)
        got: list[bool] = []
        handle = wrapper(
            vw._wire_mooncake,
            "KVCacheStoreRecvingThread",
            "_handle_request",
            lambda thread, m: got.append(True),
        )
        t = threading.Thread(
            target=handle, args=(SimpleNamespace(done_task_lock=threading.Lock(), _failed_requests=set()), rm)
        )
        t.start()
        t.join(10)
        assert got == [True]
        assert rank.unrecorded(s, since) == {}
    s.update_from_output(out2, model_output(out2))
    assert s.kv_cache_manager.block_pool.core.is_ended(step.forward)


def test_a_non_writer_rank_records_the_store_jobs_vllm_flushes_and_completes_at_once() -> None:
    """On an Offloading non-writer rank (replicated layout, rank > 0),
    vLLM's real ``handle_preemptions`` pops this step's flushed store jobs
    and completes them before ``prepare_store_kv`` sees them: their tokens
    are recorded there, or a later load fenced on one could not wait.
    (Found by review.)"""
    from unittest.mock import MagicMock

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import worker as ow
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    e1, s1 = Token("compute", 1), Token("offload_d2h", 1)
    job = SimpleNamespace(req_id="A", src_spec=MagicMock(), dst_spec=MagicMock())
    setattr(job, vc.META_STORE, Transfer("A", "store", s1, Fence([e1]), (3,)).to_wire())
    meta = SimpleNamespace(load_jobs={}, store_jobs={1: job}, jobs_to_flush={1})
    setattr(meta, STEP, (StepRecord(1, e1).to_wire(), Fence().to_wire()))
    me = SimpleNamespace(
        _is_store_writer=False,
        _connector_worker_meta=OffloadingWorkerMetadata(),
        _unsubmitted_store_jobs=[],
        worker=MagicMock(),
    )
    handle_preemptions = wrapper(
        vw._wire_offloading,
        "OffloadingConnectorWorker",
        "handle_preemptions",
        ow.OffloadingConnectorWorker.handle_preemptions,
    )
    prepare_store_kv = wrapper(
        vw._wire_offloading,
        "OffloadingConnectorWorker",
        "prepare_store_kv",
        ow.OffloadingConnectorWorker.prepare_store_kv,
    )
    with Rank() as rank:
        handle_preemptions(me, meta)
        assert me._connector_worker_meta.completed_jobs == {1: 1}  # vLLM completed it on this rank
        rank.wh.on_bind(meta)
        rank.compute.enqueue(lambda: None, "forward")
        prepare_store_kv(me, meta)
        assert rank.wh.unrecorded({"offload_d2h": 1, "compute": 1}) == {}
        assert rank.wh.out_of_order == 0


def test_a_fence_the_rank_cannot_wait_on_leaves_the_job_to_vllms_own_waits_never_raising_into_vllm() -> None:
    """A fence token never recorded on this rank (a wiring path that lost a
    record): the offload job runs after vLLM's own ``wait_stream`` only --
    stock vLLM -- with one warning and a count, instead of an exception
    out of vLLM's ``transfer_async``. (Found by review.)"""
    with Rank() as rank:
        lost = Token("offload_d2h", 5)
        rank.wh.jobs[("offloading", 9)] = Transfer("B", "load", Token("offload_h2d", 1), Fence([lost]), (3,))
        assert vw.offload_transfer_async(CopyHandler.transfer_async)(CopyHandler(rank), 9) is True
        assert rank.wh.stock_fallbacks == 1 and rank.wh.waits == 0
        assert rank.wh.ledger.event_of(Token("offload_h2d", 1)) is not None  # its own token still recorded


def test_an_offload_job_with_no_copy_kernels_is_still_ordered_after_its_fence() -> None:
    """A job vLLM submits without a copy (nothing for this rank to copy)
    still records its token: it must be ordered after the job's fence, or
    later fences that name only it would lose the fence's tokens."""

    class NoCopyHandler(CopyHandler):
        def transfer_async(self, job_id: int, spec: Any = None) -> bool:
            self._transfers.append(SimpleNamespace(stream=self.rank.copy))
            return True

    with Rank() as rank:
        rank.compute.enqueue(lambda: None, "forward")
        rank.wh.record(E := Token("compute", 1))
        rank.wh.jobs[("offloading", 3)] = Transfer("B", "load", Token("offload_h2d", 1), Fence([E]), (3,))
        assert vw.offload_transfer_async(NoCopyHandler.transfer_async)(NoCopyHandler(rank), 3) is True
        waits = [op for op in rank.dev.log if op[0] == "wait_event"]
        assert waits == [("wait_event", "copy", rank.wh.ledger.event_of(E).name)]


def vllm_copy_handler(rank: Rank, swap: Any) -> tuple[Any, Any]:
    """vLLM 0.34's own ``SingleDirectionOffloadingHandler`` (CPU to GPU, one
    group, a block per chunk) on the rank's stand-ins: its copy stream is
    ``rank.copy``, ``current_platform``'s current stream and stream context
    are the rank's, and ``swap`` stands for the copy kernels. Returns the
    handler and the patch of the module's platform (a context manager)."""
    from collections import deque

    gmod = pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker")

    @contextmanager
    def stream_ctx(stream: Any) -> Iterator[None]:
        saved, rank.current = rank.current, stream
        try:
            yield
        finally:
            rank.current = saved

    platform = SimpleNamespace(
        current_stream=lambda: rank.current,
        stream=stream_ctx,
        Stream=rank.dev.new_stream,
        is_xpu=lambda: False,
    )
    h = object.__new__(gmod.SingleDirectionOffloadingHandler)
    h.gpu_to_cpu, h.blocks_per_chunk, h.layer_refs_per_group = False, 1, [[None]]
    h._canonical_copy_plans = None
    h._fill_group_ops = lambda g_idx, **k: (k["op_idx"] + k["group_size"], 64 * k["group_size"])
    h._swap_blocks_batch = swap
    h._transfer_events, h._transfers, h._buffer_pool = {}, deque(), []
    h._stream_pool, h._event_pool = [rank.copy], [rank.dev.new_event(), rank.dev.new_event()]
    # No pinned host memory without an accelerator: the descriptor buffers
    # vLLM allocates are plain CPU tensors here.
    return h, patch.multiple(
        gmod, current_platform=platform, _clear_pending_device_error=lambda: None, PIN_MEMORY=False
    )


def device_ptrs(n: int) -> Any:
    import numpy as np
    from vllm.v1.kv_offload.base import DevicePointers

    return DevicePointers(np.zeros(n, np.uint64), np.full(n, 64, np.uint64), (n,), (1,), (0,))


@pytest.mark.parametrize("copy_fails", [False, True], ids=["copied", "copy-failed"])
def test_vllm_034_offload_copy_waits_on_exactly_its_fence_before_its_kernels(copy_fails: bool) -> None:
    """vLLM 0.34's ``transfer_async(job_id, device_ptrs, cpu_spec)``, its
    own body: the job's copy stream waits on the job's fence (a store still
    reading the destination) after vLLM's own ``wait_stream(compute)`` and
    before the copy kernels, and the job's token is recorded after them. A
    copy that raises (vLLM marks the job failed and reports it in
    ``failed_jobs``) still records the token, after the fence: nothing of
    ours raises into vLLM, and waits on the token end."""
    import inspect

    import numpy as np

    gmod = pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker")
    if (
        "device_ptrs"
        not in inspect.signature(gmod.SingleDirectionOffloadingHandler.transfer_async).parameters
    ):
        pytest.skip(
            "this vLLM's transfer_async takes GPU and CPU specs (before 0.34): stand-in handlers cover it"
        )
    ran: list[str] = []
    with Rank() as rank:
        d2h = rank.dev.new_stream("d2h")
        store = Token("offload_d2h", 1)
        d2h.enqueue(lambda: ran.append("store reads"), "store")
        rank.wh.record(store, d2h)
        load = Token("offload_h2d", 1)
        rank.wh.jobs[("offloading", 4)] = Transfer("B", "load", load, Fence([store]), (3, 4))

        def swap(*args: Any, **kwargs: Any) -> None:
            assert rank.current is rank.copy  # vLLM runs the kernels with the copy stream current
            if copy_fails:
                raise RuntimeError("copy failed")
            rank.copy.enqueue(lambda: ran.append("load writes"), "h2d copy")

        handler, platform = vllm_copy_handler(rank, swap)
        with platform:
            ok = vw.offload_transfer_async(gmod.SingleDirectionOffloadingHandler.transfer_async)(
                handler, 4, device_ptrs(2), SimpleNamespace(block_ids=np.array([7, 8]))
            )
        assert ok is True and handler._transfers[-1].failed is copy_fails
        ops = [op for op in rank.dev.log if op[1] == "copy"]
        fence_wait = ("wait_event", "copy", rank.wh.ledger.event_of(store).name)
        assert fence_wait in ops and ops.index(fence_wait) > 0  # after vLLM's own wait_stream(compute)
        assert rank.wh.ledger.event_of(load) is not None and rank.wh.stock_fallbacks == 0
        assert ("offloading", 4) not in rank.wh.jobs
        rank.copy.run()
        assert ran == []  # the copy stream waits for the store
        rank.dev.run()
        assert ran == (["store reads"] if copy_fails else ["store reads", "load writes"])


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_fault_in_fence_planning_never_reaches_vllms_scheduler(registered: bool) -> None:
    """Whatever goes wrong while the wiring plans a step's fences, vLLM's
    ``schedule()`` returns its metadata, and the step keeps vLLM's own
    waits (``META_STOCK``); one ERROR line."""
    s = make_scheduler("OffloadingConnector", OFFLOAD)
    w = vc.wiring_of(s.connector.connector_scheduler)
    s.add_request(make_request("A", list(range(1, 41))))
    with patch.object(w.hazards, "begin_store", side_effect=RuntimeError("boom")):
        out = s.schedule()
    meta = out.kv_connector_metadata
    assert len(meta.store_jobs) == 1 and getattr(meta, vc.META_STOCK) is True
    assert getattr(meta, STEP, None) is not None and w.faults == 1
    offload_step(s, out)
    out2 = s.schedule()  # the next step plans normally again
    assert not getattr(out2.kv_connector_metadata, vc.META_STOCK, False)


def test_with_pipeline_parallelism_a_rank_that_does_not_draft_records_the_step_token_at_the_forward() -> None:
    """With spec decode, vLLM's V1 runner defers ``wait_for_save`` on every
    rank, but only the last pipeline stage drafts and finalizes; the others
    must record eN when the forward ends, or it is never recorded."""
    pytest.importorskip(V1_RUNNER, reason=NO_V1_RUNNER)  # the module wrapped

    @contextmanager
    def vllm_lifecycle(scheduler_output: Any, defer_finalize: bool = False) -> Iterator[None]:
        yield None

    record, meta = step_meta(1)
    lifecycle = wrapper(
        vw._wire_runner, "KVConnectorModelRunnerMixin", "_get_kv_connector_output", vllm_lifecycle
    )
    for last_rank, recorded in ((False, True), (True, False)):
        group = SimpleNamespace(is_last_rank=last_rank)
        with Rank() as rank, patch("vllm.distributed.parallel_state.get_pp_group", lambda g=group: g):
            with lifecycle.__func__(SimpleNamespace(kv_connector_metadata=meta), defer_finalize=True):
                rank.compute.enqueue(lambda: None, "target forward")
            assert (rank.wh.ledger.event_of(record.forward) is not None) is recorded


def test_a_copy_fence_no_wait_can_order_is_counted_not_waited_on() -> None:
    """vLLM enqueues a step's block copies before the connector binds the
    step: a copy fence that names a running access cannot be waited on
    there; it is counted and logged once, and the bind adds no wait."""
    d2h = Token("offload_d2h", 1)
    record = StepRecord(1, Token("compute", 2), Token("compute", 1), Fence([d2h]))
    meta = SimpleNamespace()
    setattr(meta, STEP, (record.to_wire(), Fence().to_wire()))
    with Rank() as rank:
        assert rank.wh.on_bind(meta) == record
        assert rank.wh.copy_fences_unwaited == 1
        assert not [op for op in rank.dev.log if op[0] == "wait_event"]
        assert rank.wh.ledger.event_of(record.copies) is not None


def test_a_put_whose_fence_the_rank_cannot_wait_on_waits_on_vllms_event_and_raises_nothing() -> None:
    """MooncakeStore's send thread must never see an exception of ours: a
    fence naming a token this rank never records falls back to vLLM's own
    event (recorded where vLLM records it), as stock."""
    with Rank() as rank:
        rank.wh.timeout = 0.2
        rank.compute.enqueue(lambda: None, "forward")
        stock = StockEvent(rank)
        stock.record()
        t = Transfer(
            "A", "store", Token("mooncake_store", 1, StreamKind.HOST), Fence([Token("compute", 9)]), (1,)
        )
        vw.FenceWait(rank.wh, t, stock).synchronize()
        assert rank.wh.stock_fallbacks == 1
        assert [op[2] for op in rank.dev.log if op[0] == "synchronize"] == [stock.event.name]
