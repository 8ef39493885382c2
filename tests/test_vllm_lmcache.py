"""LMCache's in-process connector waits on exact fences: vLLM's real
``Scheduler`` with vLLM's ``LMCacheConnectorV1`` over LMCache's own adapter
(``lmcache.integration.vllm.vllm_v1_adapter``), our pool bound in it, the
worker half on CPU stand-in streams.

LMCache's adapter runs here with its engine, lookup client and GPU
connector replaced by fakes (as LMCache's own adapter tests run it): the
scheduler half is LMCache's real code (its request trackers, ``ReqMeta``,
load and save specs); the worker half is LMCache's real ``start_load_kv``
and ``wait_for_save`` calling a fake engine whose ``retrieve`` and
``store`` enqueue on stand-in load and store streams. Where LMCache's
compute backend cannot import (its wheel's ``device_ops`` needs numba; its
storage backends need aiofile, cryptography, uvicorn), those modules are
stood in for while the adapter imports, and only for LMCache's modules.

Needs vLLM and LMCache (skipped otherwise) and the shape-only model
configs of ``../shared/vllm-parity/hf``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
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

from blockpool.core.hazards import Token, TokenStatus
from blockpool.integrations.vllm import connectors as vc
from blockpool.integrations.vllm import lmcache as lw
from blockpool.integrations.vllm import worker as vw
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.worker.standins import StandInDevice
from tests.test_vllm_connectors import make_request, make_scheduler, model_output, worker

# Modules LMCache imports that need a compiled package absent here; none
# of them runs in these tests.
_STOOD_IN = ("numba", "cryptography", "aiofile", "uvicorn")


def import_with_stand_ins(module: str, what: str) -> Any:
    """LMCache's ``module`` (``what``: its name in a skip reason), imported
    with :data:`_STOOD_IN` stood in for while it imports (then removed from
    ``sys.modules``); the calling test module is skipped when it does not
    import for another reason."""
    import lmcache

    if not hasattr(lmcache, "device_ops"):  # its compute backend did not load (no numba)
        lmcache.device_ops = MagicMock(name="lmcache.device_ops")
    added: list[str] = []
    try:
        for _ in range(32):
            try:
                return importlib.import_module(module)
            except ModuleNotFoundError as exc:
                name = exc.name or ""
                if name.split(".")[0] not in _STOOD_IN:
                    pytest.skip(f"{what} does not import here ({exc})", allow_module_level=True)
                sys.modules[name] = MagicMock(name=name)
                added.append(name)
        pytest.skip(f"{what} does not import here", allow_module_level=True)
    finally:
        for name in added:
            sys.modules.pop(name, None)


adapter = import_with_stand_ins(lw.ADAPTER, "LMCache's adapter")


@pytest.fixture(autouse=True)
def _resumed_req_ids() -> Iterator[None]:
    """LMCache 0.5.6's ``build_connector_meta`` reads
    ``CachedRequestData.resumed_req_ids`` (vLLM 0.32, 0.33) and raises
    without it; vLLM 0.34 dropped the field (a resumed request comes back
    whole, as a new one), so there no running request is a resumed one:
    the class gets an empty set while these tests run."""
    from vllm.v1.core.sched.output import CachedRequestData

    if "resumed_req_ids" in {f for f in getattr(CachedRequestData, "__dataclass_fields__", {})}:
        yield
        return
    with patch.object(CachedRequestData, "resumed_req_ids", frozenset(), create=True):
        yield


BS = 16
CHUNK = 32
CONNECTOR = "LMCacheConnectorV1"


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


class FakeLookup:
    """LMCache's lookup client: ``hits[request_id]`` tokens are in LMCache."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}

    def lookup_cache(self, lookup_id: str) -> int:
        return -1

    def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
        return self.hits.get(lookup_id, 0)

    def clear_lookup_status(self, lookup_id: str) -> None:
        pass


@contextmanager
def lmcache_built(
    lookup: FakeLookup | None = None, engine: Any = None, layerwise: bool = False
) -> Iterator[None]:
    """LMCache's adapter built without its services: its real state
    (``_init_connector_state``) around a fake lookup client and engine."""
    from lmcache.v1.config import LMCacheEngineConfig

    def init(self: Any, vllm_config: Any, role: Any, parent: Any) -> None:
        self._parent = parent
        self._vllm_config = vllm_config
        self._role = role
        self.device = "cpu"
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        self.worker_count = 1
        self.config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, use_layerwise=layerwise)
        self._manager = SimpleNamespace(lookup_client=lookup, lmcache_engine=engine)
        self._init_connector_state(role, vllm_config, self.config)

    with patch.object(adapter.LMCacheConnectorV1Impl, "__init__", init):
        yield


def lmcache_scheduler(lookup: FakeLookup, *, num_blocks: int = 64, layerwise: bool = False, **kw: Any) -> Any:
    with lmcache_built(lookup, layerwise=layerwise):
        return make_scheduler(CONNECTOR, num_blocks=num_blocks, **kw)


def table(scheduler: Any, req_id: str) -> list[int]:
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[req_id]
    return [b.block_id for b in blocks]


def req_meta(out: Any, req_id: str) -> Any:
    (rm,) = [rm for rm in out.kv_connector_metadata.requests if rm.req_id == req_id]
    return rm


def step_of(out: Any) -> StepRecord:
    return StepRecord.from_wire(getattr(out.kv_connector_metadata, vc.META_STEP)[0])


def hazards(scheduler: Any) -> Any:
    return scheduler.kv_cache_manager.block_pool.hazards


def abort(scheduler: Any, req_id: str) -> None:
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)


# ----------------------------------------------------------------------
# loads
# ----------------------------------------------------------------------


def load_into_blocks_a_running_step_reads(scheduler: Any, lookup: FakeLookup) -> tuple[Any, Any]:
    """Request A prefills (step 1, ended), then decodes (step 2, its output
    not back yet: asynchronous scheduling) and is aborted: its 4 blocks
    are freed while step 2 still reads them. Request B (LMCache holds its
    first 48 tokens) gets those blocks; step 3 loads into 3 of them.
    Returns steps 2 and 3's outputs."""
    scheduler.add_request(make_request("A", list(range(1, 51))))
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, model_output(out1))
    out2 = scheduler.schedule()
    abort(scheduler, "A")
    lookup.hits["B"] = 48
    scheduler.add_request(make_request("B", list(range(500, 564))))
    out3 = scheduler.schedule()
    return out2, out3


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_load_into_blocks_a_previous_step_reads_waits_on_exactly_that_step(registered: bool) -> None:
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup, num_blocks=5)
    out2, out3 = load_into_blocks_a_running_step_reads(scheduler, lookup)
    rm = req_meta(out3, "B")
    load = Transfer.from_wire(getattr(rm, vc.META_LOAD))
    assert load.block_ids == tuple(table(scheduler, "B")[:3])  # tokens [0, 48): 3 blocks of 16
    assert (load.token.stream, load.kind) == (lw.LOAD_STREAM, "load")
    assert load.fence.tokens == (step_of(out2).forward,)  # e2: A's decode, still running
    assert step_of(out2).forward == Token("compute", 2)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_load_begins_at_the_first_token_vllm_does_not_hold(registered: bool) -> None:
    """LMCache's paged copy skips the tokens vLLM's prefix cache holds
    (``skip_prefix_n_tokens``): the load writes from ``vllm_cached_tokens``
    on, not from the start of its first chunk."""
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup)
    _, rm = whole_chunk_load_over_a_shared_prefix(scheduler, lookup)  # the same two requests, paged here
    assert (rm.load_spec.vllm_cached_tokens, rm.load_spec.lmcache_cached_tokens) == (48, 96)
    load = Transfer.from_wire(getattr(rm, vc.META_LOAD))
    assert load.block_ids == tuple(table(scheduler, "B")[3:6])  # tokens [48, 96), not the shared block 2


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_hazards_off_leaves_lmcaches_metadata_as_it_builds_it(registered: bool) -> None:
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup, num_blocks=5)
    _, out3 = load_into_blocks_a_running_step_reads(scheduler, lookup)
    rm = req_meta(out3, "B")
    assert rm.load_spec.can_load
    assert not hasattr(rm, vc.META_LOAD) and not hasattr(out3.kv_connector_metadata, vc.META_STEP)


# ----------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------


def whole_chunk_load_over_a_shared_prefix(scheduler: Any, lookup: FakeLookup) -> tuple[Any, Any]:
    """Layerwise LMCache rewrites whole chunks: B's load from token 32
    (its 48-token prefix hit rounded down to a 32-token chunk) would write
    block 2, which A (still running) shares with B. Returns step 2's
    output and B's ReqMeta."""
    prompt = list(range(1, 49))
    scheduler.add_request(make_request("A", prompt))
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, model_output(out1))
    lookup.hits["B"] = 96
    scheduler.add_request(make_request("B", prompt + list(range(600, 660))))
    out2 = scheduler.schedule()
    return out2, req_meta(out2, "B")


REFUSED = (lw.LMCACHE, "load refused by the pool")


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_refused_load_runs_as_lmcache_plans_it_and_the_request_keeps_its_loaded_tokens(
    registered: bool,
) -> None:
    """B's whole-chunk layerwise load would rewrite block 2, which A
    computed and still holds: the pool refuses it. It runs as LMCache runs
    it without the plugin (no fence of ours, nothing reported failed), so
    under ``kv_load_failure_policy="fail"`` B keeps the tokens it loaded,
    as in stock; the step's forward token becomes the writer of the load's
    blocks, so a later fence of them is not met before the load ran."""
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup, layerwise=True)
    assert not scheduler.recompute_kv_load_failures  # kv_load_failure_policy="fail"
    before = lw.FALLBACKS.get(REFUSED, 0)
    out2, rm = whole_chunk_load_over_a_shared_prefix(scheduler, lookup)
    b = table(scheduler, "B")
    assert b[2] == table(scheduler, "A")[2]  # the shared prefix hit
    assert not hasattr(rm, vc.META_LOAD)  # not begun on the pool ...
    assert rm.load_spec.can_load  # ... and run as LMCache planned it
    assert lw.FALLBACKS[REFUSED] == before + 1
    assert hazards(scheduler).pending_transfers() == []
    e2 = step_of(out2).forward
    assert [blk.writer for blk in hazards(scheduler).blocks_of(b[2:6])] == [e2] * 4  # tokens [32, 96)

    engine = FakeEngine(StandInDevice())
    conn = worker_connector(scheduler, engine, layerwise=True)
    invalid = layerwise_step(conn, engine, out2)
    engine.gpu_connector.load_stream.run()
    assert invalid == set() and engine.log.count("load layer 0") == 1  # run, nothing reported failed
    scheduler.update_from_output(out2, model_output(out2, invalid_block_ids=invalid))
    assert scheduler.requests["B"].num_computed_tokens == 108  # 96 loaded, 12 computed


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_refused_loads_block_another_engine_still_reads_keeps_its_record(registered: bool) -> None:
    """The same refusal while A's store of its prompt (LMCache's store
    stream) still reads block 2: ``eN`` is not ordered after that store, so
    block 2 keeps its writer and its reader; B's own blocks get ``eN``."""
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup, layerwise=True)
    prefix = list(range(1, 49))
    scheduler.add_request(make_request("A", prefix + list(range(700, 722))))
    out1 = scheduler.schedule()  # A's prefill; its output (and so its store's end) not back yet
    store = Transfer.from_wire(getattr(req_meta(out1, "A"), vc.META_STORE))
    assert table(scheduler, "A")[2] in store.block_ids  # the store of A's chunks [0, 64) reads block 2
    lookup.hits["B"] = 96
    scheduler.add_request(make_request("B", prefix + list(range(600, 660))))
    out2 = scheduler.schedule()
    rm = req_meta(out2, "B")
    assert rm.load_spec.can_load and not hasattr(rm, vc.META_LOAD)  # refused, run as LMCache runs it
    b = table(scheduler, "B")
    assert b[2] == table(scheduler, "A")[2]
    shared, *own = hazards(scheduler).blocks_of(b[2:6])
    assert shared.writer == step_of(out1).forward and store.token in shared.readers
    assert [blk.writer for blk in own] == [step_of(out2).forward] * 3


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_load_after_the_prefix_is_not_refused(registered: bool) -> None:
    """The same request with LMCache's paged (non-layerwise) copy, which
    skips the shared prefix: begun, nothing refused."""
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup)
    _, rm = whole_chunk_load_over_a_shared_prefix(scheduler, lookup)
    assert rm.load_spec.can_load and hasattr(rm, vc.META_LOAD)
    assert Transfer.from_wire(getattr(rm, vc.META_LOAD)).block_ids == tuple(table(scheduler, "B")[3:6])


# ----------------------------------------------------------------------
# stores
# ----------------------------------------------------------------------


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_store_waits_on_the_step_that_wrote_its_blocks(registered: bool) -> None:
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup)
    scheduler.add_request(make_request("C", list(range(1, 65))))
    out1 = scheduler.schedule()
    rm = req_meta(out1, "C")
    store = Transfer.from_wire(getattr(rm, vc.META_STORE))
    assert (store.token.stream, store.kind) == (lw.STORE_STREAM, "store")
    assert store.block_ids == tuple(table(scheduler, "C")[:4])  # tokens [0, 64): two 32-token chunks
    assert store.fence.tokens == (step_of(out1).forward,)  # e1 wrote them


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_steps_transfers_end_with_its_output(registered: bool) -> None:
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup)
    scheduler.add_request(make_request("C", list(range(1, 65))))
    out1 = scheduler.schedule()
    (store,) = hazards(scheduler).pending_transfers()
    pool = scheduler.kv_cache_manager.block_pool.core
    assert pool.token_status(store.token) is TokenStatus.PENDING
    scheduler.update_from_output(out1, model_output(out1))
    assert hazards(scheduler).pending_transfers() == []
    assert pool.token_status(store.token) is TokenStatus.COMPLETED


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_preempted_requests_store_holds_its_blocks_until_its_step_came_back_from_every_rank(
    registered: bool,
) -> None:
    """C's store runs in step 1; C is preempted (its blocks freed) before
    step 1's output is back. A write into those blocks waits on the store
    until step 1's output -- which vLLM returns once every rank ran the
    step, stores included -- comes back; then on nothing of it."""
    from blockpool.core.hazards import AccessKind

    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup)
    c = make_request("C", list(range(1, 65)))
    scheduler.add_request(c)
    out1 = scheduler.schedule()
    store = Transfer.from_wire(getattr(req_meta(out1, "C"), vc.META_STORE))
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["C"][:4]
    scheduler._preempt_request(c, 0.0)
    pool = scheduler.kv_cache_manager.block_pool.core
    assert all(b.ref_cnt == 0 for b in blocks)
    fence = pool.fence_for(blocks, lw.LOAD_STREAM, AccessKind.WRITE)
    assert store.token in fence.tokens
    scheduler.update_from_output(out1, model_output(out1))
    assert store.token not in pool.fence_for(blocks, lw.LOAD_STREAM, AccessKind.WRITE).tokens
    assert pool.token_status(store.token) is TokenStatus.COMPLETED


# ----------------------------------------------------------------------
# the worker half
# ----------------------------------------------------------------------


class FakeEngine:
    """LMCache's engine: ``retrieve`` and ``store`` enqueue their copies on
    the GPU connector's load and store streams (stand-ins)."""

    def __init__(self, dev: StandInDevice) -> None:
        self.gpu_connector = SimpleNamespace(
            load_stream=dev.new_stream("load"), store_stream=dev.new_stream("store")
        )
        self.kv: dict[str, str] = {}
        self.log: list[str] = []
        self.num_layers = 1
        self.retrieve_layer_kwargs: list[dict[str, Any]] = []

    def retrieve(self, tokens: Any, mask: Any = None, **kwargs: Any) -> Any:
        req = kwargs["req_id"]
        self.gpu_connector.load_stream.enqueue(lambda: self.log.append(f"load {req}"), f"load {req}")
        return torch.ones(len(tokens), dtype=torch.bool)

    def retrieve_layer(self, tokens: Any, mask: Any = None, **kwargs: Any) -> Iterator[Any]:
        """As LMCache's: called without the request's id; the first call of
        the generator prepares, each later one enqueues one layer's copy on
        the load stream, the last returns the retrieved tokens' mask."""
        self.retrieve_layer_kwargs.append(kwargs)

        def layers() -> Iterator[Any]:
            yield None
            for layer in range(self.num_layers):
                self.gpu_connector.load_stream.enqueue(
                    lambda layer=layer: self.log.append(f"load layer {layer}"), f"load layer {layer}"
                )
                yield None
            yield torch.ones(len(tokens), dtype=torch.bool)

        return layers()

    def store(
        self, tokens: Any, hashes: Any = None, offsets: Any = None, mask: Any = None, **kwargs: Any
    ) -> None:
        req = kwargs["req_id"]
        self.gpu_connector.store_stream.enqueue(lambda: self.log.append(f"store {req}"), f"store {req}")

    def store_layer(self, tokens: Any, mask: Any = None, **kwargs: Any) -> Iterator[None]:
        req = kwargs["req_id"]

        def layers() -> Iterator[None]:
            for layer in range(2):
                self.gpu_connector.store_stream.enqueue(
                    lambda layer=layer: self.log.append(f"store {req} layer {layer}"), f"store {req}"
                )
                yield

        return layers()

    def lookup_unpin(self, req_id: str) -> None:
        pass


def worker_connector(scheduler: Any, engine: FakeEngine, layerwise: bool = False) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    with lmcache_built(engine=engine, layerwise=layerwise):
        conn = LMCacheConnectorV1(scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config)
    conn._lmcache_engine.kv_caches = {"layer": torch.zeros(1)}
    engine.num_layers = conn._lmcache_engine.num_layers
    return conn


def layerwise_step(conn: Any, engine: FakeEngine, out: Any, between: Any = None) -> set[int]:
    """One step of a layerwise LMCache on the worker: ``start_load_kv``,
    the forward's ``wait_for_layer_load`` of every layer (``between()``
    runs after the first), ``wait_for_save``. Returns the blocks LMCache
    reports failed."""
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(SimpleNamespace(attn_metadata=object()))
    for layer in range(engine.num_layers):
        conn.wait_for_layer_load(f"layer{layer}")
        if layer == 0 and between is not None:
            between()
    conn.wait_for_save()
    invalid = conn.get_block_ids_with_load_errors()
    conn.clear_connector_metadata()
    return invalid


@contextmanager
def load_on_worker(audit: Any = None) -> Iterator[tuple[Any, Any, Any, FakeEngine]]:
    """The load scenario (:func:`load_into_blocks_a_running_step_reads`)
    on the worker, stand-ins: step 2's forward (it reads A's blocks) is
    enqueued on the compute stream, not run, and ``e2`` recorded after it;
    then LMCache's ``start_load_kv`` runs step 3's load through the
    plugin's wrapper. Yields ``(worker hazards, step 3's output, the
    compute stream, the engine)``."""
    from blockpool.worker.torch_events import EventLedger

    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup, num_blocks=5)
    out2, out3 = load_into_blocks_a_running_step_reads(scheduler, lookup)
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    ledger = EventLedger(dev.new_event, streams={"compute": compute})
    wh = vw.WorkerHazards(ledger, lambda: compute, timeout=5.0, audit=audit)
    vw.install(wh)
    try:
        engine = FakeEngine(dev)
        conn = worker_connector(scheduler, engine)
        wh.record(Token("compute", 1))
        compute.enqueue(lambda: engine.log.append("step 2 reads A's blocks"), "forward 2")
        wh.record(step_of(out2).forward)  # e2 after step 2's forward
        conn.bind_connector_metadata(out3.kv_connector_metadata)
        conn.start_load_kv(SimpleNamespace(attn_metadata=object()))
        yield wh, out3, compute, engine
    finally:
        vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_load_stream_waits_on_the_loads_fence_before_lmcache_copies(registered: bool) -> None:
    with load_on_worker() as (wh, out3, compute, engine):
        load = engine.gpu_connector.load_stream
        assert load.run() == 0 and engine.log == []  # held at its wait on e2
        compute.run()
        load.run()
        assert engine.log == ["step 2 reads A's blocks", "load B"]
        assert wh.waits == 1 and wh.stock_fallbacks == 0
        assert wh.was_recorded(Transfer.from_wire(getattr(req_meta(out3, "B"), vc.META_LOAD)).token)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_audit_mode_counts_a_load_that_starts_while_its_fence_runs_and_adds_no_wait(registered: bool) -> None:
    from blockpool.integrations.vllm.audit import Audit

    audit = Audit()
    with load_on_worker(audit) as (wh, _, _, engine):
        assert engine.gpu_connector.load_stream.run() == 1  # no wait added: LMCache's copy runs as stock
        assert engine.log == ["load B"]
        assert audit.to_json()["by_connector_and_kind"]["lmcache/load"]["raced"] == 1
        (example,) = audit.examples
        assert example.running == (Token("compute", 2),) and wh.waits == 0


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_store_stream_waits_on_the_stores_fence_before_lmcache_copies(registered: bool) -> None:
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup)
    scheduler.add_request(make_request("C", list(range(1, 65))))
    out1 = scheduler.schedule()
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        engine = FakeEngine(dev)
        conn = worker_connector(scheduler, engine)
        conn.bind_connector_metadata(out1.kv_connector_metadata)
        compute.enqueue(lambda: engine.log.append("forward 1 writes C"), "forward 1")
        wh.record(step_of(out1).forward)
        # vLLM calls save_kv_layer for every layer; LMCache's paged (not
        # layerwise) store runs in wait_for_save and waits on its fence there.
        conn.save_kv_layer("layer", torch.zeros(1), object())
        with patch.object(adapter, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True)):
            conn.wait_for_save()
        store = engine.gpu_connector.store_stream
        assert store.run() == 0 and engine.log == []  # held at its wait on e1
        compute.run()
        store.run()
        assert engine.log == ["forward 1 writes C", "store C"]
        token = Transfer.from_wire(getattr(req_meta(out1, "C"), vc.META_STORE)).token
        assert wh.was_recorded(token) and wh.stock_fallbacks == 0
    finally:
        vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_layerwise_store_waits_at_its_first_layer_and_is_recorded_after_its_last(registered: bool) -> None:
    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup, layerwise=True)
    scheduler.add_request(make_request("C", list(range(1, 65))))
    out1 = scheduler.schedule()
    token = Transfer.from_wire(getattr(req_meta(out1, "C"), vc.META_STORE)).token
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        engine = FakeEngine(dev)
        conn = worker_connector(scheduler, engine, layerwise=True)
        conn.bind_connector_metadata(out1.kv_connector_metadata)
        compute.enqueue(lambda: engine.log.append("forward 1 writes C"), "forward 1")
        wh.record(step_of(out1).forward)
        conn.save_kv_layer("layer", torch.zeros(1), object())  # the first layer creates the storer
        assert not wh.was_recorded(token)  # its copies run layer by layer
        conn.wait_for_save()  # the last layer
        assert wh.was_recorded(token) and wh.waits == 1
        store = engine.gpu_connector.store_stream
        assert store.run() == 0  # held at its wait on e1
        compute.run()
        store.run()
        assert engine.log == ["forward 1 writes C", "store C layer 0", "store C layer 1"]
    finally:
        vw.install(None)


def test_lmcache_is_among_the_wired_connectors_with_its_streams() -> None:
    assert vc.CONNECTORS[lw.LMCACHE].module == lw.MODULE
    assert set(vc.CONNECTORS[lw.LMCACHE].streams) == {lw.LOAD_STREAM, lw.STORE_STREAM}


# ----------------------------------------------------------------------
# never worse than stock: a refusal runs the load as LMCache would
# ----------------------------------------------------------------------


def serve(scheduler: Any, engine: FakeEngine, max_steps: int = 12) -> dict[str, Any]:
    """Run the scheduler's steps to the end through the worker half
    (LMCache's ``start_load_kv``, ``wait_for_save`` and failed-load record,
    stand-in streams run after each step), ``kv_load_failure_policy`` as
    the scheduler has it. Returns the finished requests' statuses by id."""
    from vllm.v1.request import RequestStatus

    dev = StandInDevice()
    compute = dev.new_stream("compute")
    worker(dev, compute)
    statuses: dict[str, Any] = {}
    seen = dict(scheduler.requests)
    try:
        conn = worker_connector(scheduler, engine)
        for _ in range(max_steps):
            if not scheduler.has_requests():
                break
            out = scheduler.schedule()
            conn.bind_connector_metadata(out.kv_connector_metadata)
            conn.start_load_kv(SimpleNamespace(attn_metadata=object()))
            with patch.object(adapter, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True)):
                conn.wait_for_save()
            invalid = conn.get_block_ids_with_load_errors()
            conn.clear_connector_metadata()
            for s in (compute, engine.gpu_connector.load_stream, engine.gpu_connector.store_stream):
                s.run()
            scheduler.update_from_output(out, model_output(out, invalid_block_ids=invalid))
        for rid, req in seen.items():
            statuses[rid] = req.status
    finally:
        vw.install(None)
    assert not scheduler.has_requests()
    assert all(RequestStatus.is_finished(s) for s in statuses.values())
    return statuses


def fill_shared_in_one_step(scheduler: Any, lookup: FakeLookup) -> None:
    """Requests A and B share a 64-token prefix that LMCache holds and vLLM
    does not, and arrive together: vLLM allocates A's blocks for the load
    and publishes their keys at once, and B hits them in the same
    ``schedule()``."""
    prefix = list(range(1, 65))
    lookup.hits.update(A=64, B=64)
    scheduler.add_request(make_request("A", prefix + [901, 902], max_tokens=2))
    scheduler.add_request(make_request("B", prefix + [903, 904], max_tokens=2))


@pytest.mark.parametrize("registered", [True, False], indirect=True)
def test_two_requests_filling_one_shared_prefix_in_one_step_both_finish_under_the_fail_policy(
    registered: bool,
) -> None:
    from vllm.v1.request import RequestStatus

    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup)
    assert not scheduler.recompute_kv_load_failures  # kv_load_failure_policy="fail"
    fill_shared_in_one_step(scheduler, lookup)
    engine = FakeEngine(StandInDevice())
    refused = lw.FALLBACKS.get(REFUSED, 0)
    statuses = serve(scheduler, engine)
    assert statuses == {"A": RequestStatus.FINISHED_LENGTH_CAPPED, "B": RequestStatus.FINISHED_LENGTH_CAPPED}
    assert "load A" in engine.log  # A's load ran; B read what it wrote
    assert lw.FALLBACKS.get(REFUSED, 0) == refused  # the fill was accepted, not run on the fallback


# ----------------------------------------------------------------------
# layerwise loads
# ----------------------------------------------------------------------


@contextmanager
def layerwise_load_on_worker(audit: Any = None) -> Iterator[tuple[Any, Any, Any, Any, FakeEngine, Any]]:
    """The load scenario (:func:`load_into_blocks_a_running_step_reads`)
    with LMCache's layerwise path, on the worker, stand-ins: step 2's
    forward (it reads A's blocks) is enqueued on the compute stream, not
    run, and ``e2`` recorded after it. Yields ``(worker hazards, step 2's
    and step 3's outputs, the device, the engine, the connector)``."""
    from blockpool.worker.torch_events import EventLedger

    lookup = FakeLookup()
    scheduler = lmcache_scheduler(lookup, num_blocks=5, layerwise=True)
    out2, out3 = load_into_blocks_a_running_step_reads(scheduler, lookup)
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    ledger = EventLedger(dev.new_event, streams={"compute": compute})
    wh = vw.WorkerHazards(ledger, lambda: compute, timeout=5.0, audit=audit)
    vw.install(wh)
    try:
        engine = FakeEngine(dev)
        conn = worker_connector(scheduler, engine, layerwise=True)
        wh.record(Token("compute", 1))
        compute.enqueue(lambda: engine.log.append("step 2 reads A's blocks"), "forward 2")
        wh.record(step_of(out2).forward)
        yield wh, out2, out3, dev, engine, conn
    finally:
        vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_audit_mode_counts_a_layerwise_load_that_starts_while_its_fence_runs_and_adds_no_wait(
    registered: bool,
) -> None:
    from blockpool.integrations.vllm.audit import Audit

    audit = Audit()
    with layerwise_load_on_worker(audit) as (wh, _, out3, _, engine, conn):
        layerwise_step(conn, engine, out3)
        assert engine.gpu_connector.load_stream.run() == engine.num_layers  # no wait added: as stock
        assert audit.to_json()["by_connector_and_kind"]["lmcache/load"]["raced"] == 1
        assert wh.waits == 0


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_layerwise_load_waits_on_its_fence_and_its_token_is_met_only_after_its_last_layer(
    registered: bool,
) -> None:
    """LMCache's layerwise load copies layer by layer during the forward
    (``retrieve_layer``, called without the request's id). Its copies wait
    on its fence (A's running decode), and a transfer that waits on its
    token (a store of those blocks by another connector, say) runs only
    after the last layer's copy, never at the point ``start_load_kv``
    returned."""
    with layerwise_load_on_worker() as (wh, out2, out3, dev, engine, conn):
        load = Transfer.from_wire(getattr(req_meta(out3, "B"), vc.META_LOAD))
        assert load.fence.tokens == (step_of(out2).forward,)
        assert engine.num_layers >= 2
        early: list[bool] = []
        layerwise_step(conn, engine, out3, between=lambda: early.append(wh.was_recorded(load.token)))
        assert engine.retrieve_layer_kwargs and "req_id" not in engine.retrieve_layer_kwargs[0]
        assert early == [False] and wh.was_recorded(load.token)
        put = dev.new_stream("put")
        assert wh.wait_device_or_stock([load.token], put, "a store of B's blocks")
        put.enqueue(lambda: engine.log.append("store of B's blocks"), "put")
        assert engine.gpu_connector.load_stream.run() == 0 and put.run() == 0  # held at e2, at the load
        dev.run()
        layers = [f"load layer {i}" for i in range(engine.num_layers)]
        assert engine.log == ["step 2 reads A's blocks", *layers, "store of B's blocks"]
        assert wh.stock_fallbacks == 0


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_layerwise_load_whose_token_cannot_be_recorded_raises_nothing_into_vllm(registered: bool) -> None:
    """A failure while recording the layerwise loads' tokens stays in the
    wiring: counted and logged once; a wait on such a token is not met, so
    whatever waits on it keeps vLLM's own wait."""
    with layerwise_load_on_worker() as (wh, _, out3, _, engine, conn):
        load = Transfer.from_wire(getattr(req_meta(out3, "B"), vc.META_LOAD))

        def refuse(*a: Any, **k: Any) -> None:
            raise RuntimeError("no side stream on this device")

        from blockpool.integrations.vllm import lmcache_mp

        with patch.object(lmcache_mp, "_side_stream", refuse):
            layerwise_step(conn, engine, out3)
        assert not wh.was_recorded(load.token) and wh.stock_fallbacks == 1
