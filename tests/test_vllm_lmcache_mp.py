"""LMCache's multi-process connector waits on exact fences: vLLM's real
``Scheduler`` with LMCache's own ``LMCacheMPConnector`` (the class vLLM's
``lmcache_mp_connector`` module resolves to), our pool bound in it, the
worker half on CPU stand-in streams.

LMCache's connector runs here with its IPC boundary stubbed, as LMCache's
own MP connector tests stub it: the scheduler adapter (lookups against the
LMCache server) is a fake answering from a table, and the worker adapter's
transfer context (the IPC event and the server's copies) is a fake whose
``create_recorded_event`` records a stand-in event on the current stream
and whose ``submit_retrieve`` / ``submit_store`` enqueue the server's copy
on a stand-in "server" stream after a wait on that event, returning a
future the test completes. Everything else -- LMCache's request trackers,
``LMCacheMPRequestMetadata`` and ``LoadStoreOp``, its worker adapter's
futures, failed-load records and ``get_finished`` -- is LMCache's real
code. Where LMCache's compute backend cannot import (its wheel's
``device_ops`` needs numba), it is stood in for while the connector
imports, and only for LMCache's modules.

Needs vLLM and LMCache (skipped otherwise) and the shape-only model
configs of ``../shared/vllm-parity/hf``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock, patch

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
torch = pytest.importorskip("torch")
if importlib.util.find_spec("lmcache") is None:
    # Not an environment gap of vLLM's venv: LMCache has its own
    # (scripts/lmcache_parity.sh builds .venv-lmcache, where CI runs these).
    pytest.skip("this vLLM venv has no LMCache: run in .venv-lmcache", allow_module_level=True)

from blockpool.core.hazards import EMPTY_FENCE, Token, TokenStatus
from blockpool.integrations.vllm import connectors as vc
from blockpool.integrations.vllm import lmcache_mp as mp
from blockpool.integrations.vllm import worker as vw
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.worker.standins import StandInDevice
from tests.test_vllm_connectors import make_request, make_scheduler, model_output, worker
from tests.test_vllm_lmcache import (
    _resumed_req_ids,  # noqa: F401  (autouse: LMCache reads resumed_req_ids)
    import_with_stand_ins,
)

connector_mod = import_with_stand_ins(mp.MODULE, "LMCache's MP connector")
adapter_mod = importlib.import_module("lmcache.integration.vllm.vllm_multi_process_adapter")

BS = 16
CHUNK = 32  # LMCache chunk: 2 blocks
CONNECTOR = "LMCacheMPConnector"


@pytest.fixture(autouse=True)
def _lmcaches_own_class() -> Iterator[None]:
    """vLLM's module resolves ``LMCacheMPConnector`` when it first imports;
    in a process where LMCache's module did not import then, it holds
    vLLM's builtin copy. These tests run LMCache's class, as vLLM does
    wherever LMCache is installed."""
    vmod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector")
    with patch.object(vmod, "LMCacheMPConnector", connector_mod.LMCacheMPConnector):
        yield


@pytest.fixture
def registered(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The plugin installed in this process, hazards on or off
    (``request.param``), undone afterwards."""
    import os

    from blockpool.integrations import vllm as plugin

    hazards = getattr(request, "param", True)
    plugin.unregister()
    with patch.dict(os.environ, {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "1" if hazards else "0"}):
        plugin.register()
    try:
        yield hazards
    finally:
        plugin.unregister()


class Future:
    """The server's answer to one submitted transfer (LMCache's
    ``MessagingFuture``): done once the test says so."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = False
        self.ok = True

    def query(self) -> bool:
        return self.done

    def result(self, timeout: float | None = None) -> bool:
        assert self.done
        return self.ok


class FakeTransfer:
    """The worker adapter's transfer context: the IPC event is a stand-in
    event recorded on the current stream; the server's copy runs on the
    ``server`` stand-in stream after a wait on it."""

    def __init__(self, dev: StandInDevice) -> None:
        self.server = dev.new_stream("server")
        self.log: list[str] = []
        self.futures: list[Future] = []

    def register(self, *a: Any, **k: Any) -> None:
        pass

    def flush_inflight_stores(self, *a: Any, **k: Any) -> None:
        pass

    def unregister(self, *a: Any, **k: Any) -> None:
        pass

    def close(self, *a: Any, **k: Any) -> None:
        pass

    def create_recorded_event(self) -> Any:
        return vw.current().current_stream().record_event()

    def _submit(self, what: str, request_id: str, event: Any) -> Future:
        if event is not None:
            self.server.wait_event(event)
        self.server.enqueue(lambda: self.log.append(f"{what} {request_id}"), f"{what} {request_id}")
        f = Future(f"{what} {request_id}")
        self.futures.append(f)
        return f

    def submit_retrieve(
        self, request_id: str, key: Any, kv: Any, block_ids: Any, event: Any, *a: Any, **k: Any
    ) -> Future:
        return self._submit("retrieve", request_id, event)

    def submit_store(
        self, request_id: str, key: Any, kv: Any, block_ids: Any, event: Any, *a: Any, **k: Any
    ) -> Future:
        return self._submit("store", request_id, event)


@contextmanager
def lmcache_io(dev: StandInDevice | None = None) -> Iterator[SimpleNamespace]:
    """LMCache's IPC boundary stubbed (as LMCache's own MP connector tests
    stub it): ``hits[request_id]`` tokens are in LMCache; the worker's
    transfers go to a :class:`FakeTransfer`."""
    hits: dict[str, int] = {}
    sched = MagicMock(lmcache_tokens_per_chunk=CHUNK)
    sched.check_lookup_result.side_effect = lambda req_id: hits.get(req_id, 0)
    transfer = FakeTransfer(dev or StandInDevice())
    with (
        patch.object(connector_mod, "LMCacheMPSchedulerAdapter", lambda **kw: sched),
        patch.object(connector_mod, "print_banner_once", MagicMock()),
        patch.object(connector_mod, "vllm_layout_hints", lambda config: {}),
        patch.object(adapter_mod.RequestClientFactory, "create", MagicMock()),
        patch.object(adapter_mod, "get_lmcache_chunk_size", lambda *a, **kw: CHUNK),
        patch.object(adapter_mod, "get_experimental", lambda *a, **kw: set()),
        patch.object(adapter_mod, "HeartbeatThread", MagicMock()),
        patch.object(adapter_mod, "set_ipc_policy", MagicMock()),
        patch.object(adapter_mod, "create_transfer_context", lambda *a, **kw: transfer),
        patch.object(adapter_mod.RequestTelemetryFactory, "create", lambda **kw: MagicMock()),
    ):
        yield SimpleNamespace(hits=hits, scheduler_adapter=sched, transfer=transfer)


def table(scheduler: Any, req_id: str) -> list[int]:
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[req_id]
    return [b.block_id for b in blocks]


def metas(out: Any, req_id: str, direction: str) -> list[Any]:
    return [
        rm
        for rm in out.kv_connector_metadata.requests
        if rm.request_id == req_id and rm.direction == direction
    ]


def transfer_of(rm: Any, attr: str) -> Transfer:
    return Transfer.from_wire(getattr(rm, attr))


def step_of(out: Any) -> StepRecord:
    return StepRecord.from_wire(getattr(out.kv_connector_metadata, vc.META_STEP)[0])


def hazards(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool.hazards


def core(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool.core


def abort(scheduler: Any, req_id: str) -> None:
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)


def worker_connector(scheduler: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    conn = connector_mod.LMCacheMPConnector(
        scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config
    )
    conn.register_kv_caches({"layer": torch.zeros(2, 8, BS, 1, 1)})
    return conn


# ----------------------------------------------------------------------
# loads
# ----------------------------------------------------------------------


def load_into_blocks_a_running_step_reads(scheduler: Any, io: SimpleNamespace) -> tuple[Any, Any]:
    """Request A prefills (step 1, ended), then decodes (step 2, its output
    not back yet) and is aborted: its 4 blocks are freed while step 2 still
    reads them (a ``kv_consumer`` stores nothing, so LMCache does not delay
    the free). Request B (80 tokens, LMCache holds its first 64) gets the
    pool's 5 blocks, A's among them; step 3 retrieves B's first 64 tokens
    into its first 4 (an asynchronous load). Returns steps 2 and 3's
    outputs."""
    scheduler.add_request(make_request("A", list(range(1, 51))))
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, model_output(out1))
    out2 = scheduler.schedule()
    abort(scheduler, "A")
    io.hits["B"] = 64
    scheduler.add_request(make_request("B", list(range(500, 580))))
    out3 = scheduler.schedule()
    return out2, out3


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_retrieve_into_blocks_a_previous_step_reads_waits_on_exactly_that_step(registered: bool) -> None:
    with lmcache_io() as io:
        scheduler = make_scheduler(CONNECTOR, num_blocks=6, role="kv_consumer")
        out2, out3 = load_into_blocks_a_running_step_reads(scheduler, io)
    (rm,) = metas(out3, "B", "RETRIEVE")
    load = transfer_of(rm, vc.META_LOAD)
    assert load.block_ids == tuple(table(scheduler, "B")[:4])  # tokens [0, 64): 4 blocks of 16
    assert (load.token.stream, load.kind) == (mp.LOAD_STREAM, "load")
    # e2: A's decode, still running
    assert load.fence.tokens == (step_of(out2).forward,) == (Token("compute", 2),)


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_hazards_off_leaves_lmcaches_metadata_as_it_builds_it(registered: bool) -> None:
    with lmcache_io() as io:
        scheduler = make_scheduler(CONNECTOR, num_blocks=6, role="kv_consumer")
        _, out3 = load_into_blocks_a_running_step_reads(scheduler, io)
    (rm,) = metas(out3, "B", "RETRIEVE")
    assert not hasattr(rm, vc.META_LOAD) and not hasattr(out3.kv_connector_metadata, vc.META_STEP)


@contextmanager
def _uninstalled_after() -> Iterator[None]:
    """The worker hazards installed in this thread are removed on leaving."""
    try:
        yield
    finally:
        vw.install(None)


def shared_prefix_steps(scheduler: Any, io: SimpleNamespace) -> Any:
    """A (48 tokens, still running) and B share their first 48 tokens: B's
    prefix hit is A's 3 blocks; LMCache holds B's first 96 tokens, so B
    retrieves the chunks ``[32, 96)``, whose first 16 tokens (A's block 2)
    the server skips. Returns step 2's output (B's retrieve)."""
    prompt = list(range(1, 49))
    scheduler.add_request(make_request("A", prompt))
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, model_output(out1))
    io.hits["B"] = 96
    scheduler.add_request(make_request("B", prompt + list(range(600, 660))))
    return scheduler.schedule()


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_retrieve_writes_from_the_first_token_the_server_does_not_skip(registered: bool) -> None:
    with lmcache_io() as io:
        scheduler = make_scheduler(CONNECTOR, role="kv_consumer")
        (rm,) = metas(shared_prefix_steps(scheduler, io), "B", "RETRIEVE")
    b = table(scheduler, "B")
    assert (rm.op.start, rm.op.end, rm.op.skip_first_n_tokens) == (32, 96, 16)
    assert rm.op.block_ids == [b[2:6]]  # the op names the shared block 2 ...
    assert transfer_of(rm, vc.META_LOAD).block_ids == tuple(b[3:6])  # ... which the load does not write


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_refused_retrieve_runs_with_lmcaches_own_ordering_and_the_request_keeps_its_loaded_tokens(
    registered: bool,
) -> None:
    """A server that rewrites whole chunks (no ``skip_first_n_tokens``)
    would write A's block 2, which A computed and still holds: the pool
    refuses the retrieve. It runs as LMCache runs it without the plugin
    (submitted to the server, which consumes the lookup's locks, ordered
    by LMCache's own event), so under ``kv_load_failure_policy="fail"`` B
    finishes its load and keeps the tokens it loaded, as in stock."""
    from blockpool.integrations.vllm import lmcache as lw

    get = connector_mod.LMCacheMPRequestMetadata.GetRetrieveMetadata

    def whole_chunks(*a: Any, **k: Any) -> Any:
        rm = get(*a, **k)
        rm.op.skip_first_n_tokens = 0
        return rm

    refused = (mp.LMCACHE_MP, "load refused by the pool")
    before = lw.FALLBACKS.get(refused, 0)
    dev = StandInDevice()
    worker(dev, dev.new_stream("compute"))
    with (
        _uninstalled_after(),
        lmcache_io(dev) as io,
        patch.object(
            connector_mod.LMCacheMPRequestMetadata, "GetRetrieveMetadata", staticmethod(whole_chunks)
        ),
    ):
        scheduler = make_scheduler(CONNECTOR, role="kv_consumer")
        assert not scheduler.recompute_kv_load_failures  # kv_load_failure_policy="fail"
        out2 = shared_prefix_steps(scheduler, io)
        b = table(scheduler, "B")
        assert b[2] == table(scheduler, "A")[2]  # the shared prefix hit
        (rm,) = metas(out2, "B", "RETRIEVE")  # left in the step as LMCache planned it ...
        assert not hasattr(rm, vc.META_LOAD)  # ... not begun on the pool
        assert lw.FALLBACKS[refused] == before + 1
        assert hazards(scheduler).pending_transfers() == []

        conn = worker_connector(scheduler)
        conn.bind_connector_metadata(out2.kv_connector_metadata)
        conn.start_load_kv(SimpleNamespace())
        (future,) = io.transfer.futures  # submitted to the server
        assert future.name == "retrieve B"
        future.done = True
        _, recving = conn.get_finished(set())
        invalid = conn.get_block_ids_with_load_errors()
        assert (recving, invalid) == ({"B"}, set())
        scheduler.update_from_output(
            out2, model_output(out2, finished_recving=recving, invalid_block_ids=invalid)
        )
        assert scheduler.requests["B"].num_computed_tokens == 96  # loaded, not recomputed
        out3 = scheduler.schedule()
    assert out3.num_scheduled_tokens["B"] == 108 - 96


# ----------------------------------------------------------------------
# the worker's fence wait
# ----------------------------------------------------------------------


@contextmanager
def load_on_worker(audit: Any = None) -> Iterator[tuple[Any, Any, Any, SimpleNamespace]]:
    """The load scenario (:func:`load_into_blocks_a_running_step_reads`) on
    the worker, stand-ins: step 2's forward (it reads A's blocks) is
    enqueued on the compute stream, not run, and ``e2`` recorded after it;
    then LMCache's ``start_load_kv`` submits step 3's retrieve through the
    plugin's wrapper. Yields ``(worker hazards, the worker connector, the
    compute stream, the stubbed IPC boundary)``."""
    from blockpool.worker.torch_events import EventLedger

    dev = StandInDevice()
    with lmcache_io(dev) as io:
        scheduler = make_scheduler(CONNECTOR, num_blocks=6, role="kv_consumer")
        out2, out3 = load_into_blocks_a_running_step_reads(scheduler, io)
        compute = dev.new_stream("compute")
        ledger = EventLedger(dev.new_event, streams={"compute": compute})
        wh = vw.WorkerHazards(ledger, lambda: compute, timeout=5.0, audit=audit)
        vw.install(wh)
        try:
            conn = worker_connector(scheduler)
            wh.record(Token("compute", 1))
            compute.enqueue(lambda: io.transfer.log.append("step 2 reads A's blocks"), "forward 2")
            wh.record(step_of(out2).forward)  # e2 after step 2's forward
            conn.bind_connector_metadata(out3.kv_connector_metadata)
            conn.start_load_kv(SimpleNamespace())
            yield wh, conn, compute, io
        finally:
            vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_servers_retrieve_waits_on_an_event_recorded_after_the_fence_on_a_side_stream(
    registered: bool,
) -> None:
    with load_on_worker() as (wh, conn, compute, io):
        server = io.transfer.server
        assert server.run() == 0 and io.transfer.log == []  # held at its wait on the IPC event
        assert wh.waits == 1 and wh.stock_fallbacks == 0  # the fence (e2) was waited on ...
        assert conn._blockpool_side_stream.run() == 0  # ... by the side stream the event is recorded on
        compute.run()
        conn._blockpool_side_stream.run()
        server.run()
        assert io.transfer.log == ["step 2 reads A's blocks", "retrieve B"]


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_fenced_event_that_cannot_be_made_leaves_lmcaches_own_event_and_raises_nothing(
    registered: bool,
) -> None:
    def refuse(*a: Any, **k: Any) -> None:
        raise RuntimeError("no side stream on this device")

    with patch.object(mp, "_side_stream", refuse), load_on_worker() as (wh, _, compute, io):
        assert [f.name for f in io.transfer.futures] == ["retrieve B"]  # submitted, as stock
        assert wh.stock_fallbacks == 1
        server = io.transfer.server
        assert server.run() == 0  # LMCache's own event, on the compute stream
        compute.run()
        server.run()
        assert io.transfer.log == ["step 2 reads A's blocks", "retrieve B"]


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_audit_mode_counts_a_retrieve_and_adds_no_wait(registered: bool) -> None:
    """LMCache's own event is recorded on the compute stream, after e2: the
    retrieve is fenced, and ordered by LMCache's own wait (not a race)."""
    from blockpool.integrations.vllm.audit import Audit

    audit = Audit()
    with load_on_worker(audit) as (wh, conn, _, _):
        counts = audit.to_json()["by_connector_and_kind"][f"{mp.LMCACHE_MP}/load"]
        assert (counts["started"], counts["fenced"], counts["raced"]) == (1, 1, 0)
        assert wh.waits == 0 and "_blockpool_side_stream" not in conn.__dict__


# ----------------------------------------------------------------------
# stores
# ----------------------------------------------------------------------


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_store_waits_on_the_step_that_wrote_its_blocks(registered: bool) -> None:
    with lmcache_io():
        scheduler = make_scheduler(CONNECTOR)
        scheduler.add_request(make_request("C", list(range(1, 65))))
        out1 = scheduler.schedule()
    (rm,) = metas(out1, "C", "STORE")
    store = transfer_of(rm, vc.META_STORE)
    assert (store.token.stream, store.kind) == (mp.STORE_STREAM, "store")
    assert store.block_ids == tuple(table(scheduler, "C")[:4])  # tokens [0, 64): two 32-token chunks
    assert store.fence.tokens == (step_of(out1).forward,)  # e1 wrote them


def run_step_on_worker(wh: Any, conn: Any, compute: Any, out: Any) -> None:
    """One step on the worker: bind its metadata, its forward (recorded as
    ``eN``), then ``wait_for_save`` submits its stores."""
    conn.bind_connector_metadata(out.kv_connector_metadata)
    compute.enqueue(lambda: None, "forward")
    wh.record(step_of(out).forward)
    conn.wait_for_save()
    conn.clear_connector_metadata()


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_two_store_ops_of_one_request_end_each_when_its_own_copy_ended(registered: bool) -> None:
    """LMCache keeps one store future per request (the second op's replaces
    the first's); each op still ends by its own."""
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        with lmcache_io(dev) as io:
            scheduler = make_scheduler(CONNECTOR, max_num_batched_tokens=32)
            scheduler.add_request(make_request("C", list(range(1, 65))))
            conn = worker_connector(scheduler)
            out1 = scheduler.schedule()  # tokens [0, 32): one chunk
            run_step_on_worker(wh, conn, compute, out1)
            scheduler.update_from_output(out1, model_output(out1))
            out2 = scheduler.schedule()  # tokens [32, 64)
            run_step_on_worker(wh, conn, compute, out2)
            (op1,) = metas(out1, "C", "STORE")
            (op2,) = metas(out2, "C", "STORE")
            t1, t2 = transfer_of(op1, vc.META_STORE), transfer_of(op2, vc.META_STORE)
            f1, f2 = io.transfer.futures
            assert conn.worker_adapter.store_futures["C"] is f2

            f1.done = True  # the first op's copy ended, not the second's
            meta = conn.build_connector_worker_meta()
            assert isinstance(meta, mp.MPWorkerMeta) and meta.inner is None
            output = model_output(out2, kv_connector_worker_meta=meta)
            scheduler.update_from_output(out2, output)
            assert output.kv_connector_output.kv_connector_worker_meta is None  # LMCache saw its own
            pool = core(scheduler)
            assert (pool.token_status(t1.token), pool.token_status(t2.token)) == (
                TokenStatus.COMPLETED,
                TokenStatus.PENDING,
            )

            f2.done = True
            out3 = scheduler.schedule()
            scheduler.update_from_output(
                out3, model_output(out3, kv_connector_worker_meta=conn.build_connector_worker_meta())
            )
            assert pool.token_status(t2.token) is TokenStatus.COMPLETED
            assert hazards(scheduler).pending_transfers() == []
    finally:
        vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_preempted_requests_store_holds_its_blocks_until_every_rank_reported_it(registered: bool) -> None:
    """C's store op runs on two ranks; C is preempted (its blocks freed)
    while the copies run: its blocks are held back, not handed out, until
    both ranks reported the op, and come back then."""
    from vllm.v1.outputs import KVConnectorOutput

    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        with lmcache_io(dev) as io:
            scheduler = make_scheduler(CONNECTOR)
            scheduler.vllm_config.parallel_config.world_size = 2
            c = make_request("C", list(range(1, 65)))
            scheduler.add_request(c)
            conn = worker_connector(scheduler)
            out1 = scheduler.schedule()
            run_step_on_worker(wh, conn, compute, out1)
            (op,) = metas(out1, "C", "STORE")
            store = transfer_of(op, vc.META_STORE)
            scheduler._preempt_request(c, 0.0)
            scheduler.update_from_output(out1, model_output(out1))
            hz, pool = hazards(scheduler), core(scheduler)
            assert hz.blocks_on_their_way() == 4  # held back: the server still reads them

            (future,) = io.transfer.futures
            future.done = True
            rank_report = conn.build_connector_worker_meta()  # this rank: its copy ended
            # What vLLM's update_from_output hands the connector (C, preempted, is not scheduled).
            scheduler.connector.update_connector_output(
                KVConnectorOutput(kv_connector_worker_meta=rank_report)
            )
            assert hz.blocks_on_their_way() == 4 and pool.token_status(store.token) is TokenStatus.PENDING

            other_rank = mp.MPWorkerMeta(None, dict(rank_report.done))
            scheduler.connector.update_connector_output(
                KVConnectorOutput(kv_connector_worker_meta=other_rank)
            )
            assert hz.blocks_on_their_way() == 0 and pool.token_status(store.token) is TokenStatus.COMPLETED
    finally:
        vw.install(None)


def test_the_ranks_reports_sum_per_op_around_lmcaches_own_metadata() -> None:
    lmc = connector_mod.LMCacheMPWorkerMetadata
    a = mp.MPWorkerMeta(lmc({"C": 1}), {(1, "C"): 1})
    b = mp.MPWorkerMeta(None, {(1, "C"): 1, (2, "C"): 1})
    merged = a.aggregate(b).aggregate(lmc({"C": 1}))  # a rank whose wiring reported nothing
    assert merged.done == {(1, "C"): 2, (2, "C"): 1}
    assert merged.inner.completed_store_requests == {"C": 2}


def test_lmcache_mp_is_among_the_wired_connectors_with_its_host_engines() -> None:
    from blockpool.core.hazards import StreamKind

    assert vc.CONNECTORS[mp.LMCACHE_MP].module == mp.MODULE
    assert vc.CONNECTORS[mp.LMCACHE_MP].streams == {
        mp.LOAD_STREAM: StreamKind.HOST,
        mp.STORE_STREAM: StreamKind.HOST,
    }


def test_the_declared_lmcache_names_match_the_installed_lmcache() -> None:
    from blockpool.integrations.vllm import surface

    names = [n for n in surface.active().all_names() if n.connector == mp.LMCACHE_MP]
    drifts = [d for d in surface.check(surface.active(), names) if d.status != "ok"]
    assert len(names) == 23 and drifts == []


def test_the_registration_line_names_lmcache_mp_among_the_wired_connectors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging
    import os

    from blockpool.integrations import vllm as plugin

    plugin.unregister()
    try:
        with (
            patch.dict(os.environ, {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "1"}),
            caplog.at_level(logging.INFO, logger="vllm.plugins.blockpool"),
        ):
            plugin.register()
        (line,) = [r.getMessage() for r in caplog.records if "KV connectors wired:" in r.getMessage()]
        assert mp.LMCACHE_MP in line.split("KV connectors wired: ")[1].split(";")[0].split(", ")
    finally:
        plugin.unregister()


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_store_the_server_never_answers_ends_once_lmcache_marks_the_server_unhealthy(
    registered: bool,
) -> None:
    """LMCache drops its futures when its heartbeat marks the server
    unhealthy; the wiring reports the op then, so a preempted request's
    blocks are not held forever."""
    from vllm.v1.outputs import KVConnectorOutput

    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        with lmcache_io(dev):
            scheduler = make_scheduler(CONNECTOR)
            c = make_request("C", list(range(1, 65)))
            scheduler.add_request(c)
            conn = worker_connector(scheduler)
            out1 = scheduler.schedule()
            run_step_on_worker(wh, conn, compute, out1)
            scheduler._preempt_request(c, 0.0)
            scheduler.update_from_output(out1, model_output(out1))
            hz = hazards(scheduler)
            assert (
                conn.build_connector_worker_meta() is None and hz.blocks_on_their_way() == 4
            )  # no answer yet
            conn.worker_adapter._health_event.clear()  # the heartbeat found the server gone
            report = conn.build_connector_worker_meta()
            scheduler.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
            assert hz.blocks_on_their_way() == 0 and hz.pending_transfers() == []
    finally:
        vw.install(None)


# ----------------------------------------------------------------------
# worker metadata across ranks
# ----------------------------------------------------------------------


def rank_worker_meta(lmcache_meta: Any, done_ops: dict[tuple[int, str], Any]) -> Any:
    """What the wired ``build_connector_worker_meta`` returns on a rank
    where LMCache's own returns ``lmcache_meta`` and the wiring holds the
    store ops ``done_ops`` (each with a future whose copy ended)."""
    from tests.test_vllm_connectors import wrapper

    fut = Future("store")
    fut.done = True
    rank = SimpleNamespace(
        worker_adapter=SimpleNamespace(is_healthy=True),
        _blockpool_store_ops={key: (t, fut) for key, t in done_ops.items()},
    )
    build = wrapper(
        mp.wire_worker, "LMCacheMPConnector", "build_connector_worker_meta", lambda self: lmcache_meta
    )
    return build(rank)


@pytest.mark.parametrize("first", [0, 1])
def test_ranks_reporting_lmcaches_metadata_and_the_wirings_aggregate_in_any_order(first: int) -> None:
    """One rank has only LMCache's own report (a store LMCache completed),
    the other only the wiring's (a store op whose copy ended): vLLM's
    ``KVOutputAggregator`` merges them in either order, without LMCache's
    ``aggregate`` meeting a metadata of another type."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    lmc = connector_mod.LMCacheMPWorkerMetadata
    store = Transfer("C", "store", Token(mp.STORE_STREAM, 1), EMPTY_FENCE, (4,))
    ranks = [rank_worker_meta(lmc({"C": 1}), {}), rank_worker_meta(None, {(1, "C"): store})]
    ordered = [ranks[first], ranks[1 - first]]
    outputs = [
        ModelRunnerOutput(
            req_ids=[],
            sampled_token_ids=[],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=m),
        )
        for m in ordered
    ]
    merged = KVOutputAggregator(2).aggregate(outputs).kv_connector_output.kv_connector_worker_meta
    assert all(isinstance(m, mp.MPWorkerMeta) for m in ranks)  # one type on every rank
    assert isinstance(merged, mp.MPWorkerMeta)
    assert merged.done == {(1, "C"): 1}
    assert merged.inner.completed_store_requests == {"C": 1}


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_servers_transfers_are_given_up_at_lmcaches_own_mq_timeout(registered: bool) -> None:
    """A retrieve or store the server never answers holds its blocks at
    most as long as LMCache itself waits for its server (``mq_timeout``)."""
    with lmcache_io() as io:
        io.scheduler_adapter._mq_timeout = 7.5
        scheduler = make_scheduler(CONNECTOR)
    hz = hazards(scheduler)
    assert (hz.give_up_time(mp.LOAD_STREAM), hz.give_up_time(mp.STORE_STREAM)) == (7.5, 7.5)


def test_a_store_future_that_cannot_be_read_leaves_its_op_pending_and_raises_nothing_into_vllm() -> None:
    """A future whose ``query`` raises (a server connection LMCache lost
    half-way, say) is read as not ended: that op stays pending (its lease
    ends it at LMCache's ``mq_timeout``), the other ops are reported, and
    vLLM's output path sees no exception."""
    from tests.test_vllm_connectors import wrapper

    class Broken(Future):
        def query(self) -> bool:
            raise OSError("connection reset")

    done, broken = Future("store"), Broken("store")
    done.done = True
    t1, t2 = (Transfer("C", "store", Token(mp.STORE_STREAM, n), EMPTY_FENCE, (4,)) for n in (1, 2))
    rank = SimpleNamespace(
        worker_adapter=SimpleNamespace(is_healthy=True),
        _blockpool_store_ops={(1, "C"): (t1, broken), (2, "C"): (t2, done)},
    )
    build = wrapper(mp.wire_worker, "LMCacheMPConnector", "build_connector_worker_meta", lambda self: None)
    meta = build(rank)
    assert isinstance(meta, mp.MPWorkerMeta) and meta.done == {(2, "C"): 1}
    assert list(rank._blockpool_store_ops) == [(1, "C")]
