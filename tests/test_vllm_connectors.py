"""vLLM's own connectors wait on exact fences: vLLM's real ``Scheduler``
with its real MooncakeStore and Offloading connectors, our pool bound in
it, the worker half on CPU stand-in streams and events, judged by the race
oracle. Needs vLLM (skipped otherwise; the parity script runs these in its
venv) and the shape-only model configs of ``../shared/vllm-parity/hf``
(the root ``conftest.py`` points ``HF_HOME`` at a copy of them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock, patch

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
torch = pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from blockpool.checking.race_oracle import RaceOracle
from blockpool.core.errors import InvalidArgumentError
from blockpool.core.hazards import EMPTY_FENCE, AccessKind, Fence, StreamKind, Token
from blockpool.integrations import vllm as plugin
from blockpool.integrations.vllm import connectors as vc
from blockpool.integrations.vllm import worker as vw
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.worker.standins import StandInDevice
from blockpool.worker.torch_events import EventLedger

BS = 16
MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"


@pytest.fixture
def registered(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The plugin installed in this process, hazards on or off
    (``request.param``), undone afterwards."""
    hazards = getattr(request, "param", True)
    plugin.unregister()
    env = {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "1" if hazards else "0"}
    with patch.dict(os.environ, env):
        plugin.register()
    try:
        yield hazards
    finally:
        plugin.unregister()


def make_scheduler(
    connector: str | None,
    extra: dict[str, Any] | None = None,
    num_blocks: int = 64,
    role: str = "kv_both",
    kv: Any = None,
    *,
    block_size: int = BS,
    dcp: int = 1,
    pcp: int = 1,
    max_num_batched_tokens: int = 256,
    async_scheduling: bool = False,
) -> Any:
    """vLLM's real Scheduler for a tiny model shape, with ``connector``
    (``None``: no KV connector):
    ``block_size`` is the KV cache spec's (the scheduler's is ``block_size
    * dcp``, as vLLM's engine resolves it); ``async_scheduling`` builds
    vLLM's ``AsyncScheduler``."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    with _triton_gate_passed():
        return _build_scheduler(
            connector,
            extra,
            num_blocks,
            role,
            kv,
            block_size,
            dcp,
            pcp,
            max_num_batched_tokens,
            async_scheduling,
        )


@contextmanager
def _triton_gate_passed() -> Iterator[None]:
    """Test-only: vLLM 0.34's venv resolves the CPU platform, which refuses
    to build a config on an x86 CPU without triton-cpu
    (``CpuPlatform.check_and_update_config``; not on the package index).
    These tests run no model, so that one check sees Triton as present
    while the scheduler is built, as on a machine with triton-cpu."""
    try:
        import vllm.triton_utils as tu
    except ImportError:  # pragma: no cover
        yield
        return
    with patch.object(tu, "HAS_TRITON", True):
        yield


def _build_scheduler(
    connector: str | None,
    extra: dict[str, Any] | None,
    num_blocks: int,
    role: str,
    kv: Any,
    block_size: int,
    dcp: int,
    pcp: int,
    max_num_batched_tokens: int,
    async_scheduling: bool,
) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(model="facebook/opt-125m", trust_remote_code=True, dtype="float16", seed=42)
    sched = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"
    transfer = (
        None
        if connector is None
        else KVTransferConfig(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra or {})
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    # Set after validation, which wants a TP size above the model's KV heads
    # for DCP; the scheduler reads only these two.
    config.parallel_config.decode_context_parallel_size = dcp
    config.parallel_config.prefill_context_parallel_size = pcp
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if kv is None:
        kv = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
        )
    config.cache_config.num_gpu_blocks = num_blocks
    cls: Any = Scheduler
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cls = AsyncScheduler
    with set_current_vllm_config(config), patch(f"{MOONCAKE}.scheduler.LookupKeyClient"):
        return cls(
            vllm_config=config,
            kv_cache_config=kv,
            log_stats=False,
            structured_output_manager=MagicMock(),
            block_size=block_size * dcp,
        )


def make_request(
    rid: str, tokens: list[int], max_tokens: int = 64, transfer: dict[str, Any] | None = None
) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, 50256)
    req = Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    req.kv_transfer_params = transfer
    return req


def model_output(scheduler_output: Any, **connector: Any) -> Any:
    import dataclasses

    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    extra: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # 0.32, 0.33
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=[[7] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(**connector) if connector else None,
        **extra,
    )


def lookup(hit_tokens: int) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult

    return MooncakeLookupResult(hit_length=hit_tokens)


def inject_partial_hit_cow(scheduler: Any, req_id: str, idx: int, cached_block: Any) -> None:
    """When ``req_id``'s blocks are allocated, redirect its block ``idx`` to
    a private copy of ``cached_block`` through vLLM's own ``_apply_cow`` --
    what vLLM's allocation does on a partial prefix-cache hit (a hit ending
    inside ``cached_block``), which this single-group test model cannot
    produce by itself (partial hits need a hybrid model). The copy
    ``cached_block -> the request's block idx`` then runs on the compute
    stream before the step, as vLLM ships it in ``kv_cache_block_copies``."""
    manager = scheduler.kv_cache_manager
    single = manager.coordinator.single_type_managers[0]
    allocate = manager.allocate_slots

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        out = allocate(request, *args, **kwargs)
        if request.request_id == req_id and out is not None:
            blocks = single.req_to_blocks[req_id]
            own = blocks[idx]
            manager.block_pool.touch([cached_block])  # the hit's reference
            blocks[idx] = cached_block
            single._apply_cow(req_id, idx, cached_block, own)
        return out

    manager.allocate_slots = allocate_slots


def worker(dev: StandInDevice, compute: Any) -> vw.WorkerHazards:
    ledger = EventLedger(dev.new_event, streams={"compute": compute})
    wh = vw.WorkerHazards(ledger, lambda: compute, timeout=5.0)
    vw.install(wh)
    return wh


def wrapper(installer: Any, owner_name: str, attr: str, orig: Any) -> Any:
    """The plugin's wrapper of ``owner_name.attr`` applied to ``orig``."""
    made = {}

    def capture(owner: Any, a: str, make: Any) -> None:
        made[(owner.__name__, a)] = make

    installer(capture)
    return made[(owner_name, attr)](orig)


# ----------------------------------------------------------------------
# MooncakeStore: the seed scenario
# ----------------------------------------------------------------------


def run_seed_scenario(scheduler: Any) -> tuple[Any, Any, list[int], int]:
    """Request A fills blocks; request B shares A's first 40 tokens (a
    partial hit ending inside A's third block: vLLM copies that block into
    B's own block ``d``) and MooncakeStore has B's first 64 tokens: its GET
    writes B's blocks from index 2 -- ``d`` among them. Returns step 2's
    scheduler output, B's ReqMeta and B's block table."""
    cs = scheduler.connector.connector_scheduler
    cs.client.lookup.return_value = lookup(0)
    a = make_request("A", list(range(1, 41)))
    scheduler.add_request(a)
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, model_output(out1))
    a_third = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["A"][2]
    b = make_request("B", list(range(1, 41)) + list(range(100, 140)))
    inject_partial_hit_cow(scheduler, "B", 2, a_third)
    cs.client.lookup.return_value = lookup(64)
    scheduler.add_request(b)
    out2 = scheduler.schedule()
    (meta,) = [rm for rm in out2.kv_connector_metadata.requests if rm.req_id == "B"]
    table = [
        blk.block_id
        for blk in scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["B"]
    ]
    return out2, meta, table, a_third.block_id


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_mooncake_get_into_a_cow_destination_waits_for_exactly_the_copy(registered: bool) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    out2, meta, table, src = run_seed_scenario(scheduler)
    d = table[2]
    assert [(c.src_block_id, c.dst_block_id) for c in out2.kv_cache_block_copies] == [(src, d)]
    step = StepRecord.from_wire(getattr(out2.kv_connector_metadata, vc.META_STEP)[0])
    assert step.copies is not None and (step.copies.stream, step.copies.kind) == (
        "compute",
        StreamKind.DEVICE,
    )
    load = Transfer.from_wire(getattr(meta, vc.META_LOAD))
    assert load.block_ids == (d, table[3])
    assert load.token.stream == "mooncake_store" and load.token.kind is StreamKind.HOST
    assert load.fence.tokens == (step.copies,)


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_hazards_off_leaves_mooncake_metadata_as_vllm_builds_it(registered: bool) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    out2, meta, _, _ = run_seed_scenario(scheduler)
    assert not hasattr(meta, vc.META_LOAD)
    assert not hasattr(out2.kv_connector_metadata, vc.META_STEP)


def replay_get_on_worker(
    out2: Any, meta: Any, table: list[int], fenced: bool
) -> tuple[dict[int, str], list[str]]:
    """The worker half on stand-ins: the step's CoW copy is enqueued on the
    compute stream (it has not run yet), the step's metadata is bound, then
    MooncakeStore's receive thread handles B's GET through the plugin's
    wrapper. Returns block ``d``'s final content and the race oracle's
    reports."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as mw

    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    oracle = RaceOracle({"compute": StreamKind.DEVICE, "mooncake_store": StreamKind.HOST})
    kv = {b: "" for b in table}
    races: list[str] = []
    (copy,) = out2.kv_cache_block_copies
    step = getattr(out2.kv_connector_metadata, vc.META_STEP, None)
    copy_token = StepRecord.from_wire(step[0]).copies if step else Token("compute", 1)
    load = Transfer.from_wire(getattr(meta, vc.META_LOAD)) if fenced else None
    get_token = load.token if load else Token("mooncake_store", 1, StreamKind.HOST)

    compute.enqueue(lambda: kv.__setitem__(copy.dst_block_id, "copied prefix"), "cow copy")
    oracle.record(copy_token)
    races += map(str, oracle.tag(copy_token, [copy.dst_block_id], AccessKind.WRITE, "cow copy"))
    mw.KVCacheStoreSendingThread  # noqa: B018  (imported: the wrapper targets it)
    if step is not None:
        wh.on_bind(out2.kv_connector_metadata)
    waited: list[Token] = []

    def get(thread: Any, req_meta: Any) -> None:  # the real GET writes every destination block
        # Ordered after exactly the tokens the device has finished by now.
        wh.ledger.poll()
        waited.extend(t for t in (copy_token,) if wh.ledger.is_complete(t))
        oracle.record(get_token, after=waited)
        races.extend(
            map(
                str,
                oracle.tag(
                    get_token, list(load.block_ids) if load else table[2:4], AccessKind.WRITE, "mooncake GET"
                ),
            )
        )
        for b in load.block_ids if load else table[2:4]:
            kv[b] = "remote KV"

    handle = wrapper(vw._wire_mooncake, "KVCacheStoreRecvingThread", "_handle_request", get)
    thread = SimpleNamespace(done_task_lock=threading.Lock(), _failed_requests=set())
    t = threading.Thread(target=handle, args=(thread, meta))
    t.start()
    t.join(10)
    dev.run()  # the device catches up
    vw.install(None)
    return kv, races


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_seed_scenario_on_stand_ins_is_race_free_with_the_fence(registered: bool) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    out2, meta, table, _ = run_seed_scenario(scheduler)
    kv, races = replay_get_on_worker(out2, meta, table, fenced=True)
    assert races == []
    assert kv[table[2]] == "remote KV"


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_seed_scenario_races_without_the_fence(registered: bool) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    out2, meta, table, _ = run_seed_scenario(scheduler)
    kv, races = replay_get_on_worker(out2, meta, table, fenced=False)
    assert len(races) == 1 and races[0].startswith(f"WAW race on block {table[2]}")
    assert kv[table[2]] == "copied prefix"  # the copy ran after the GET: the remote KV is lost


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_mooncake_store_waits_on_the_step_that_wrote_its_blocks_not_the_whole_forward(
    registered: bool,
) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    cs = scheduler.connector.connector_scheduler
    cs.client.lookup.return_value = lookup(0)
    a = make_request("A", list(range(1, 41)))
    scheduler.add_request(a)
    out1 = scheduler.schedule()
    step1 = StepRecord.from_wire(getattr(out1.kv_connector_metadata, vc.META_STEP)[0])
    (store_meta,) = [rm for rm in out1.kv_connector_metadata.requests if rm.can_save]
    store = Transfer.from_wire(getattr(store_meta, vc.META_STORE))
    a_blocks = [
        b.block_id for b in scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["A"]
    ]
    # The send thread reads the two full blocks (32 of 40 tokens), after step 1 wrote them.
    assert store.block_ids == tuple(a_blocks[:2])
    assert store.fence.tokens == (step1.forward,)
    # Step 2 appends to A's third block: the forward waits on nothing (the
    # PUT does not read that block), and step 1's store is not in its way.
    scheduler.update_from_output(out1, model_output(out1))
    out2 = scheduler.schedule()
    assert Fence.from_wire(getattr(out2.kv_connector_metadata, vc.META_STEP)[1]) == EMPTY_FENCE


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_mooncake_send_thread_synchronizes_on_the_stores_own_fence(registered: bool) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    scheduler.connector.connector_scheduler.client.lookup.return_value = lookup(0)
    scheduler.add_request(make_request("A", list(range(1, 41))))
    out1 = scheduler.schedule()
    meta = out1.kv_connector_metadata
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        wh.on_bind(meta)
        compute.enqueue(lambda: None, "step 1 forward")
        sent: list[Any] = []
        store_worker = SimpleNamespace(
            _capacity_only=False, can_put=True, kv_send_thread=SimpleNamespace(add_request=sent.append)
        )
        wait_for_save = wrapper(vw._wire_mooncake, "MooncakeStoreWorker", "wait_for_save", None)
        vllm_event = SimpleNamespace(record=lambda: None, synchronize=lambda: None, query=lambda: True)
        with patch.object(
            vw.torch.cuda, "Event", lambda: vllm_event
        ):  # recorded as vLLM does, kept as fallback
            wait_for_save(store_worker, meta)
        (req,) = sent
        assert isinstance(req.current_event, vw.FenceWait)
        assert req.current_event.stock is vllm_event and not req.current_event.keep_stock
        assert not wh.ledger.is_complete(StepRecord.from_wire(getattr(meta, vc.META_STEP)[0]).forward)
        req.current_event.synchronize()  # what the send thread calls before reading the blocks
        assert [op for op in dev.log if op[0] == "synchronize"] == [("synchronize", "MainThread", "ev0")]
        assert wh.tokens_waited == 1
    finally:
        vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_mooncake_load_into_untouched_blocks_has_an_empty_fence(registered: bool) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    cs = scheduler.connector.connector_scheduler
    cs.client.lookup.return_value = lookup(48)
    scheduler.add_request(make_request("B", list(range(1, 81))))
    out = scheduler.schedule()
    (meta,) = [rm for rm in out.kv_connector_metadata.requests if rm.req_id == "B"]
    load = Transfer.from_wire(getattr(meta, vc.META_LOAD))
    assert len(load.block_ids) == 3
    assert load.fence.tokens == ()


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_mooncake_completions_end_the_transfers_in_the_pool(registered: bool) -> None:
    scheduler = make_scheduler("MooncakeStoreConnector")
    out2, meta, _, _ = run_seed_scenario(scheduler)
    load = Transfer.from_wire(getattr(meta, vc.META_LOAD))
    core = scheduler.kv_cache_manager.block_pool.core
    assert not core.is_ended(load.token)
    scheduler.update_from_output(out2, model_output(out2, finished_recving={"B"}))
    assert core.is_ended(load.token)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_scheduler_binding_an_unwired_connector_logs_one_line(
    registered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    vc._LOGGED.discard("ExampleConnector")
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.blockpool"):
        make_scheduler("ExampleConnector", {"shared_storage_path": "/tmp/blockpool-test-example"})
        make_scheduler("ExampleConnector", {"shared_storage_path": "/tmp/blockpool-test-example"})
    lines = [r.getMessage() for r in caplog.records if "not wired" in r.getMessage()]
    assert lines == [lines[0]] and "ExampleConnector" in lines[0]


def test_unwired_env_leaves_a_connector_as_vllm_built_it() -> None:
    plugin.unregister()
    env = {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "1", vc.ENV_UNWIRED: "mooncake_store"}
    with patch.dict(os.environ, env):
        plugin.register()
    try:
        assert "mooncake_store" not in plugin.install_state().connectors
        scheduler = make_scheduler("MooncakeStoreConnector")
        assert vc.wiring_of(scheduler.connector.connector_scheduler) is None
    finally:
        plugin.unregister()


def _register_with_unwired(value: str) -> tuple[Any, list[tuple[str, str]]]:
    """``register()`` with ``BLOCKPOOL_VLLM_UNWIRED=value``: the install
    state and the plugin's log records ``(level, message)`` of that call."""
    import logging

    got: list[tuple[str, str]] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append((record.levelname, record.getMessage()))

    lg, h = logging.getLogger("vllm.plugins.blockpool"), H(logging.DEBUG)
    level = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    plugin.unregister()
    env = {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "1", vc.ENV_UNWIRED: value}
    try:
        with patch.dict(os.environ, env):
            plugin.register()
    finally:
        lg.removeHandler(h)
        lg.setLevel(level)
    return plugin.install_state(), got


def test_an_unknown_name_in_the_unwired_setting_leaves_every_connector_unwired_with_one_error_line() -> None:
    """``mooncake`` for ``mooncake_store``: the operator meant a connector
    off. Every connector is left as vLLM built it (its own waits), the pool
    still installs, and one ERROR line names the unknown name and the valid
    ones."""
    try:
        state, log = _register_with_unwired("mooncake")
        assert plugin.is_installed() and state.hazards
        assert state.connectors == []
        assert {"mooncake_store", "offloading", "simple_cpu_offload", "nixl"} <= set(state.unwired)
        assert all("BLOCKPOOL_VLLM_UNWIRED" in why for why in state.unwired.values())
        errors = [m for lvl, m in log if lvl == "ERROR"]
        assert len(errors) == 1
        assert "'mooncake'" in errors[0]
        assert all(name in errors[0] for name in vc.CONNECTORS)
        assert [m for lvl, m in log if "left unwired by" in m] == []  # the error line says it once
        scheduler = make_scheduler("MooncakeStoreConnector")
        assert vc.wiring_of(scheduler.connector.connector_scheduler) is None
    finally:
        plugin.unregister()


def test_every_unknown_name_of_the_unwired_setting_is_named_and_a_known_one_is_not() -> None:
    with (
        patch.dict(os.environ, {vc.ENV_UNWIRED: " nixl, mooncake ,lmcache-mp,nixl"}),
        pytest.raises(InvalidArgumentError) as info,
    ):
        vc._unwired_by_env()
    message = str(info.value)
    assert "'mooncake', 'lmcache-mp'" in message
    assert "'nixl'" not in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", set()),
        (" nixl , offloading ,", {"nixl", "offloading"}),
        ("all", set(vc.CONNECTORS)),
        ("lmcache_mp,all", set(vc.CONNECTORS)),
    ],
)
def test_the_unwired_setting_takes_connector_names_or_all(value: str, expected: set[str]) -> None:
    with patch.dict(os.environ, {vc.ENV_UNWIRED: value}):
        assert vc._unwired_by_env() == expected


def test_known_names_in_the_unwired_setting_wire_the_others_without_an_error() -> None:
    try:
        state, log = _register_with_unwired("mooncake_store,nixl")
        assert "mooncake_store" not in state.connectors and "nixl" not in state.connectors
        assert "offloading" in state.connectors
        assert [m for lvl, m in log if lvl == "ERROR"] == []
    finally:
        plugin.unregister()


# ----------------------------------------------------------------------
# Offloading (CPU offload on CUDA copy streams)
# ----------------------------------------------------------------------

OFFLOAD = {"cpu_bytes_to_use": 1 << 24, "block_size": BS}


def offload_step(scheduler: Any, out: Any, completed: dict[int, int] | None = None) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    meta = OffloadingWorkerMetadata(completed_jobs=completed) if completed else None
    scheduler.update_from_output(
        out, model_output(out, kv_connector_worker_meta=meta) if meta else model_output(out)
    )


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_offload_store_waits_on_the_step_that_wrote_its_blocks(registered: bool) -> None:
    scheduler = make_scheduler("OffloadingConnector", OFFLOAD)
    scheduler.add_request(make_request("A", list(range(1, 41))))
    out1 = scheduler.schedule()
    step1 = StepRecord.from_wire(getattr(out1.kv_connector_metadata, vc.META_STEP)[0])
    ((job_id, job),) = out1.kv_connector_metadata.store_jobs.items()
    store = Transfer.from_wire(getattr(job, vc.META_STORE))
    a_blocks = [
        b.block_id for b in scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["A"]
    ]
    assert store.block_ids == tuple(a_blocks[:2])
    assert (store.token.stream, store.token.kind) == ("offload_d2h", StreamKind.DEVICE)
    assert store.fence.tokens == (step1.forward,)
    core = scheduler.kv_cache_manager.block_pool.core
    offload_step(scheduler, out1)
    assert not core.is_ended(store.token)
    out2 = scheduler.schedule()
    offload_step(scheduler, out2, completed={job_id: 1})  # every worker (one here) reported the job
    assert core.is_ended(store.token)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_offload_load_into_untouched_blocks_has_an_empty_fence(registered: bool) -> None:
    scheduler = make_scheduler("OffloadingConnector", OFFLOAD)
    scheduler.add_request(make_request("A", list(range(1, 41)), max_tokens=1))
    out1 = scheduler.schedule()
    ((job_id, _),) = out1.kv_connector_metadata.store_jobs.items()
    offload_step(scheduler, out1)
    out2 = scheduler.schedule()
    offload_step(scheduler, out2, completed={job_id: 1})
    assert scheduler.kv_cache_manager.reset_prefix_cache()  # the GPU copy is gone, the CPU one stays
    scheduler.add_request(make_request("B", list(range(1, 41)) + [9] * 8))
    out3 = scheduler.schedule()
    loads = out3.kv_connector_metadata.load_jobs
    assert len(loads) == 1
    (job,) = loads.values()
    load = Transfer.from_wire(getattr(job, vc.META_LOAD))
    assert load.token.stream in ("offload_h2d", "offload_h2d_sync")
    assert len(load.block_ids) == 2
    assert load.fence.tokens == ()


def offload_load_of_a_stored_prefix(scheduler: Any) -> tuple[Any, int, Transfer]:
    """Store A's 40-token prompt to the CPU tier, drop it from the GPU
    prefix cache, then schedule B with the same prefix: B waits for the
    asynchronous load of its two full blocks. Returns that step's output,
    the load's job id and its transfer."""
    scheduler.add_request(make_request("A", list(range(1, 41)), max_tokens=1))
    out1 = scheduler.schedule()
    ((store_job, _),) = out1.kv_connector_metadata.store_jobs.items()
    offload_step(scheduler, out1)
    out2 = scheduler.schedule()
    offload_step(scheduler, out2, completed={store_job: 1})
    assert scheduler.kv_cache_manager.reset_prefix_cache()
    scheduler.add_request(make_request("B", list(range(1, 41)) + [9] * 8))
    out3 = scheduler.schedule()
    ((job_id, job),) = out3.kv_connector_metadata.load_jobs.items()
    assert not getattr(job, "sync", False)
    return out3, job_id, Transfer.from_wire(getattr(job, vc.META_LOAD))


@pytest.mark.parametrize("registered", [True], indirect=True)
@pytest.mark.parametrize("failed", [True, False], ids=["failed", "completed"])
def test_a_failed_offload_copy_fails_its_token_and_its_blocks_are_not_published(
    registered: bool, failed: bool
) -> None:
    """vLLM 0.34's Offloading workers name a copy that did not run to its
    end in ``failed_jobs`` (with the job's completion count, and the
    request in ``failed_recving``): the load's token fails, so its blocks
    lose their keys and are never published; a load reported without a
    failure completes and its blocks are published as vLLM caches them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    from blockpool.core.hazards import TokenStatus
    from blockpool.integrations.vllm.surface import active

    if not active().offloading_failed_jobs:
        pytest.skip("this vLLM's Offloading connector reports no failed copies (no failed_jobs)")
    scheduler = make_scheduler("OffloadingConnector", OFFLOAD)
    out3, job_id, load = offload_load_of_a_stored_prefix(scheduler)
    core = scheduler.kv_cache_manager.block_pool.core
    assert core.token_status(load.token) is TokenStatus.PENDING
    worker_meta = OffloadingWorkerMetadata()
    worker_meta.mark_completed(job_id, success=not failed)  # what the worker's get_finished reports
    failed_recving = {"B"} if failed else set()
    scheduler.update_from_output(
        out3,
        model_output(
            out3, finished_recving={"B"}, failed_recving=failed_recving, kv_connector_worker_meta=worker_meta
        ),
    )
    assert core.token_status(load.token) is (TokenStatus.FAILED if failed else TokenStatus.COMPLETED)
    scheduler.schedule()  # B resumes: vLLM caches what its load brought (or frees its blocks)
    hashed = {bid for bid in load.block_ids if core.blocks[bid].block_hash is not None}
    assert hashed == (set() if failed else set(load.block_ids))
    cs = scheduler.connector.connector_scheduler
    assert job_id not in cs._jobs  # vLLM's own bookkeeping ended the job too
    assert (
        vc.wiring_of(cs).failed_reports == set() and (vc.OFFLOADING, job_id) not in vc.wiring_of(cs).pending
    )


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_an_offload_job_one_rank_reports_failed_fails_only_once_every_rank_reported(registered: bool) -> None:
    """With two workers, a job one of them reported failed is still running
    on the other: its token stays pending (its blocks held) until the other
    reports, then fails, whatever the other rank said."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    from blockpool.core.hazards import TokenStatus
    from blockpool.integrations.vllm.surface import active

    if not active().offloading_failed_jobs:
        pytest.skip("this vLLM's Offloading connector reports no failed copies (no failed_jobs)")
    scheduler = make_scheduler("OffloadingConnector", OFFLOAD)
    cs = scheduler.connector.connector_scheduler
    _out3, job_id, load = offload_load_of_a_stored_prefix(scheduler)
    core = scheduler.kv_cache_manager.block_pool.core
    w = vc.wiring_of(cs)
    cs.config = cs.config._replace(num_workers=2)  # as vLLM sizes it for two ranks
    cs._jobs[job_id].pending_count = 2
    first = OffloadingWorkerMetadata()
    first.mark_completed(job_id, success=False)
    cs.update_connector_output(SimpleNamespace(kv_connector_worker_meta=first))
    assert core.token_status(load.token) is TokenStatus.PENDING
    second = OffloadingWorkerMetadata()
    second.mark_completed(job_id)
    cs.update_connector_output(SimpleNamespace(kv_connector_worker_meta=second))
    assert core.token_status(load.token) is TokenStatus.FAILED
    assert w.failed_reports == set() and w.pending == set()


# ----------------------------------------------------------------------
# NIXL (remote reads into decode blocks) and SimpleCPUOffload
# ----------------------------------------------------------------------


def remote_prefill(num_blocks: int) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "prefill-B",
        "remote_block_ids": list(range(num_blocks)),
        "remote_host": "127.0.0.1",
        "remote_port": 1234,
        "tp_size": 1,
    }


@pytest.mark.parametrize("registered", [True], indirect=True)
@pytest.mark.parametrize("outcome", ["finished_recving", "failed_recving"])
def test_nixl_remote_read_begins_on_the_pool_and_ends_with_the_connectors_report(
    registered: bool, outcome: str
) -> None:
    scheduler = make_scheduler("NixlConnector", role="kv_consumer", num_blocks=16)
    scheduler.add_request(make_request("B", list(range(200, 240)), transfer=remote_prefill(3)))
    out = scheduler.schedule()
    rm = out.kv_connector_metadata.reqs_to_recv["B"]
    load = Transfer.from_wire(getattr(rm, vc.META_LOAD))
    assert list(load.block_ids) == [b for group in rm.local_block_ids for b in group]
    assert (load.token.stream, load.token.kind) == ("nixl", StreamKind.HOST)
    assert load.fence.tokens == ()  # blocks nobody touched
    core = scheduler.kv_cache_manager.block_pool.core
    failed_before = core.stats().failed_tokens
    scheduler.update_from_output(out, model_output(out, **{outcome: {"B"}}))
    core.poll()
    assert core.is_ended(load.token)
    assert core.stats().failed_tokens - failed_before == (outcome == "failed_recving")


def nixl_worker_wrappers() -> tuple[Any, Any]:
    """The plugin's wrappers of NIXL's pull worker, around stand-ins that log."""
    made: dict[str, Any] = {}
    vw._wire_nixl(lambda owner, attr, make: made.__setitem__(attr, make))
    posted: list[str] = []

    class PullWorker:  # the two methods the wrappers wrap
        def __init__(self) -> None:
            self._recv_failures: set[str] = set()
            self.transport_failures = 0

        def _handle_failed_transfer(  # vLLM's signature (0.32 to 0.34)
            self,
            req_id: str,
            handle: Any,
            failed_req_ids: set[str] | None = None,
            record_failed_transfer: bool = True,
        ) -> bool:
            posted.append(f"failed {req_id}")
            self.transport_failures += record_failed_transfer
            if failed_req_ids is not None:
                failed_req_ids.add(req_id)
            return handle is None

    PullWorker._read_blocks_for_req = made["_read_blocks_for_req"](
        lambda self, r, m: posted.append(f"READ {r}")
    )
    PullWorker.start_load_kv = made["start_load_kv"](lambda self, *a: posted.append("start_load_kv"))
    return PullWorker(), posted


def test_nixl_read_whose_fence_runs_is_deferred_not_waited_for_on_the_main_thread() -> None:
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    try:
        e1 = Token("compute", 1)
        compute.enqueue(lambda: None, "step 1 still reads the blocks")
        wh.record(e1)
        meta = SimpleNamespace()
        load = Transfer("B", "load", Token("nixl", 1, StreamKind.HOST), Fence([e1]), (3, 4))
        setattr(meta, vc.META_LOAD, load.to_wire())
        pull, posted = nixl_worker_wrappers()
        pull._read_blocks_for_req("B", meta)  # from vLLM's start_load_kv, on the main thread
        assert posted == [] and not any(op[0] == "synchronize" for op in dev.log)
        pull.start_load_kv(None)  # next step: step 1 still runs
        assert posted == ["start_load_kv"]
        dev.run()  # step 1 ends
        pull.start_load_kv(None)
        assert posted == ["start_load_kv", "READ B", "start_load_kv"]
        assert wh.deferred == 1
    finally:
        vw.install(None)


def test_nixl_read_with_an_ended_fence_is_posted_at_once() -> None:
    dev = StandInDevice()
    wh = worker(dev, dev.new_stream("compute"))
    try:
        meta = SimpleNamespace()
        setattr(
            meta,
            vc.META_LOAD,
            Transfer("B", "load", Token("nixl", 1, StreamKind.HOST), Fence(), (3,)).to_wire(),
        )
        pull, posted = nixl_worker_wrappers()
        pull._read_blocks_for_req("B", meta)
        assert posted == ["READ B"] and wh.deferred == 0
    finally:
        vw.install(None)


def test_nixl_read_whose_fence_never_ends_is_failed_never_posted() -> None:
    """A deferred read whose fence has not ended by the wiring's deadline is
    waited for once more, then reported failed as vLLM reports a read it
    declines (the request lands in ``_recv_failures``, so the scheduler fails
    its token and the request recomputes), never posted into blocks an
    earlier access may still write, and not counted against the remote
    engine as a transport failure."""
    import time

    dev = StandInDevice()
    wh = worker(dev, dev.new_stream("compute"))
    wh.timeout = 0.05
    try:
        earlier = Token("nixl", 1, StreamKind.HOST)  # an earlier read still writing the blocks
        meta = SimpleNamespace()
        load = Transfer("B", "load", Token("nixl", 2, StreamKind.HOST), Fence([earlier]), (3, 4))
        setattr(meta, vc.META_LOAD, load.to_wire())
        pull, posted = nixl_worker_wrappers()
        pull._read_blocks_for_req("B", meta)
        assert posted == [] and wh.deferred == 1
        time.sleep(0.06)  # past the deadline
        pull.start_load_kv(None)
        assert posted == ["failed B", "start_load_kv"]
        assert pull._recv_failures == {"B"} and pull.transport_failures == 0
        pull.start_load_kv(None)
        assert posted == ["failed B", "start_load_kv", "start_load_kv"]  # not retried
    finally:
        vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_deferred_frees_are_not_tagged_with_a_later_step_so_a_nixl_read_does_not_wait(
    registered: bool,
) -> None:
    """vLLM's consumer with overlapping batches (defer_block_free) returns a
    request's blocks only after every step that could touch them ended; the
    step still running then never touched them (the reviewer's case: the
    read's fence named it, and a NIXL-only worker blocked on it)."""
    from vllm.v1.request import RequestStatus

    s = make_scheduler("NixlConnector", role="kv_consumer", num_blocks=16)
    s.defer_block_free = True  # vLLM sets it for a consumer with max_concurrent_batches > 1
    s.add_request(make_request("A", list(range(1, 193))))  # 12 blocks
    out1 = s.schedule()
    s.add_request(make_request("C", list(range(500, 520))))
    out2 = s.schedule()  # step 2 in flight
    s.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # deferred: step 2 may still touch A
    s.update_from_output(out1, model_output(out1))
    s.add_request(make_request("D", list(range(700, 710))))
    out3 = s.schedule()  # step 3 in flight: it never touches A's blocks
    s.update_from_output(out2, model_output(out2))  # step 2 done: vLLM returns A's blocks now
    s.add_request(make_request("B", list(range(200, 240)), transfer=remote_prefill(3)))
    out4 = s.schedule()
    load = Transfer.from_wire(getattr(out4.kv_connector_metadata.reqs_to_recv["B"], vc.META_LOAD))
    assert load.fence.tokens == ()
    s.update_from_output(out3, model_output(out3))


V1_RUNNER = "vllm.v1.worker.kv_connector_model_runner_mixin"
NO_V1_RUNNER = "this vLLM has no Model Runner V1 (0.34 removed it): V2's hooks are tested for it"


def test_the_step_token_is_recorded_after_the_forward_before_the_async_loads() -> None:
    pytest.importorskip(V1_RUNNER, reason=NO_V1_RUNNER)
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    order: list[str] = []
    try:

        @contextmanager
        def vllm_lifecycle(scheduler_output: Any, defer_finalize: bool = False) -> Iterator[None]:
            order.append("bind")
            yield None
            order.append("start_load_kv")  # async loads: NIXL posts its READs here
            order.append("wait_for_save")

        lifecycle = wrapper(
            vw._wire_runner, "KVConnectorModelRunnerMixin", "_get_kv_connector_output", vllm_lifecycle
        )
        step = StepRecord(1, Token("compute", 1))
        meta = SimpleNamespace()
        setattr(meta, vc.META_STEP, (step.to_wire(), Fence().to_wire()))
        multi = SimpleNamespace(metadata=(SimpleNamespace(), meta))  # MultiConnector's metadata
        with lifecycle.__func__(SimpleNamespace(kv_connector_metadata=multi)):
            order.append("forward")
            assert wh.ledger.event_of(step.forward) is None
        assert order == ["bind", "forward", "start_load_kv", "wait_for_save"]
        assert wh.ledger.event_of(step.forward) is not None
    finally:
        vw.install(None)


def test_model_runner_v2_records_the_step_token_after_the_forward_before_the_async_loads() -> None:
    """Model Runner V2 (the only runner of vLLM 0.34) starts the async loads
    in ``ActiveKVConnector.post_forward``, after the forward was launched:
    eN is recorded on the compute stream before they start (a load may wait
    on it), and before ``wait_for_save``."""
    v2 = pytest.importorskip("vllm.v1.worker.gpu.kv_connector")
    dev = StandInDevice()
    compute = dev.new_stream("compute")
    wh = worker(dev, compute)
    step = StepRecord(1, Token("compute", 1))
    meta = SimpleNamespace()
    setattr(meta, vc.META_STEP, (step.to_wire(), Fence().to_wire()))
    order: list[tuple[str, bool]] = []

    def seen(what: str) -> None:
        order.append((what, wh.ledger.event_of(step.forward) is not None))

    connector = MagicMock()
    connector._connector_metadata = SimpleNamespace(metadata=(SimpleNamespace(), meta))  # MultiConnector's
    connector.wait_for_save.side_effect = lambda: seen("wait_for_save")
    runner = object.__new__(v2.ActiveKVConnector)  # vLLM's own post_forward, on a stand-in connector
    runner.kv_connector = connector
    runner._disabled = False
    runner._pending_load_kwargs = {}
    runner._start_load_kv = lambda: seen("start_load_kv")
    post_forward = wrapper(
        vw._wire_runner, "ActiveKVConnector", "post_forward", v2.ActiveKVConnector.post_forward
    )
    try:
        post_forward(runner, set())
        assert order == [("start_load_kv", True), ("wait_for_save", True)]
        assert wh.unrecorded({"compute": 1}) == {}
    finally:
        vw.install(None)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_offload_jobs_a_cache_reset_forgets_end_only_when_every_worker_reported(registered: bool) -> None:
    scheduler = make_scheduler("OffloadingConnector", OFFLOAD)
    scheduler.add_request(make_request("A", list(range(1, 41))))
    out1 = scheduler.schedule()
    ((job_id, job),) = out1.kv_connector_metadata.store_jobs.items()
    store = Transfer.from_wire(getattr(job, vc.META_STORE))
    core = scheduler.kv_cache_manager.block_pool.core
    offload_step(scheduler, out1)
    scheduler.connector.connector_scheduler.reset_cache()  # vLLM forgets the job; the worker still runs it
    out2 = scheduler.schedule()
    offload_step(scheduler, out2)
    assert not core.is_ended(store.token)
    out3 = scheduler.schedule()
    offload_step(scheduler, out3, completed={job_id: 1})
    assert core.is_ended(store.token)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_simple_cpu_offload_store_begins_on_the_pool_and_ends_when_every_worker_reported(
    registered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    page = spec.page_size_bytes
    kv = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[
            KVCacheTensor(size=page * 16, layers=["layer"], layer_stride=page * 16, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    scheduler = make_scheduler("SimpleCPUOffloadConnector", {"cpu_bytes_to_use": page * 8}, kv=kv)
    assert not any("SimpleCPUOffloadConnector is not wired" in r.getMessage() for r in caplog.records)
    scheduler.add_request(make_request("A", list(range(1, 41)), max_tokens=3))
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, model_output(out1))
    out2 = scheduler.schedule()  # the store of step 1's full blocks is planned now
    meta = out2.kv_connector_metadata
    store = Transfer.from_wire(getattr(meta, vc.META_STORE))
    assert list(store.block_ids) == meta.store_gpu_blocks and len(store.block_ids) == 2
    assert (store.token.stream, store.token.kind) == ("simple_cpu_d2h", StreamKind.DEVICE)
    assert store.fence.tokens == ()  # step 1 wrote them and has ended
    core = scheduler.kv_cache_manager.block_pool.core
    done = SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})
    scheduler.update_from_output(out2, model_output(out2, kv_connector_worker_meta=done))
    assert core.is_ended(store.token)


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_simple_cpu_offload_lazy_store_ends_before_its_blocks_return_to_the_eviction_end(
    registered: bool,
) -> None:
    """vLLM 0.34's SimpleCPUOffload in lazy mode stores cached blocks near
    the eviction end of the free queue and, once every worker reported the
    store, frees them back there (``free_blocks(..., evict_first=True)``):
    the store's token has ended by then (the wiring ends it before vLLM's
    code frees), so the blocks are handed out first, as in stock vLLM, and
    a later write into them is not fenced on the store."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    from blockpool.core.hazards import TokenStatus
    from blockpool.integrations.vllm.surface import active

    if not active().evict_first:
        pytest.skip("this vLLM's free_blocks has no evict_first (lazy stores are freed to the tail)")
    n = 16
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    page = spec.page_size_bytes
    kv = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[
            KVCacheTensor(size=page * n, layers=["layer"], layer_stride=page * n, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    s = make_scheduler("SimpleCPUOffloadConnector", {"cpu_bytes_to_use": page * 8, "lazy_offload": True}, kv=kv,
                       num_blocks=n)  # fmt: skip
    pool = s.kv_cache_manager.block_pool
    core = pool.core
    s.add_request(make_request("A", list(range(1, 41)), max_tokens=1))
    out1 = s.schedule()
    s.update_from_output(out1, model_output(out1))  # A finished: its two full blocks are cached and free
    out2 = s.schedule()  # the lazy store walks the free queue from its eviction end
    meta = out2.kv_connector_metadata
    store = Transfer.from_wire(getattr(meta, vc.META_STORE))
    stored = list(meta.store_gpu_blocks)
    assert len(stored) == 2 and list(store.block_ids) == stored
    assert all(pool.blocks[b].ref_cnt == 1 for b in stored)  # vLLM holds them while they are copied
    s.update_from_output(out2, model_output(out2))
    out3 = s.schedule()
    done = SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})
    s.update_from_output(out3, model_output(out3, kv_connector_worker_meta=done))
    assert core.token_status(store.token) is TokenStatus.COMPLETED
    head = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()][:2]
    assert sorted(head) == sorted(stored)  # returned to the eviction end
    assert all(pool.blocks[b].block_hash is not None for b in stored)  # still cached
    assert {b.block_id for b in pool.get_new_blocks(2)} == set(stored)  # handed out first, not held back


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_scheduler_without_connectors_sees_its_steps_without_issuing_tokens(registered: bool) -> None:
    """With the compute stream alone every access is ordered by it and every
    fence is empty: the wiring counts each step and issues, tags and ends
    no token (the cost of one a step in a real engine: docs/performance.md)."""
    from vllm.v1.request import RequestStatus

    from blockpool.integrations.vllm.served import SERVED

    s = make_scheduler(None, num_blocks=16)
    hz = s.kv_cache_manager.block_pool.hazards
    assert hz is not None and not hz.step_tokens and not hz.has_other_streams()
    issued, untokened = SERVED.steps_issued, SERVED.steps_untokened
    s.add_request(make_request("A", list(range(1, 40))))
    out1 = s.schedule()
    s.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # freed while step 1 runs
    # With a token, the frees would carry step 1's (still running) as a read.
    assert all(b.writer is None and not b.readers for b in hz.pool.blocks)
    s.update_from_output(out1, model_output(out1))
    assert (SERVED.steps_issued - issued, SERVED.steps_untokened - untokened) == (0, 1)
    assert hz.steps_untokened == 1 and hz.steps_issued == 0 and hz.pool.last_token("compute") is None


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_scheduler_with_a_wired_connector_issues_step_tokens(registered: bool) -> None:
    from vllm.v1.request import RequestStatus

    s = make_scheduler("NixlConnector", role="kv_consumer", num_blocks=16)
    hz = s.kv_cache_manager.block_pool.hazards
    assert hz.step_tokens and hz.has_other_streams()
    s.add_request(make_request("A", list(range(1, 40))))
    out1 = s.schedule()
    s.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # freed while step 1 runs
    e1 = hz.step_record(out1).forward
    # Step 1's forward wrote A's blocks (tag_step_writes) and its read tags the frees.
    assert [b.block_id for b in hz.pool.blocks if b.writer == e1] != []
    s.update_from_output(out1, model_output(out1))
    assert hz.steps_untokened == 0 and hz.steps_issued == 1


def test_a_stream_added_later_turns_step_tokens_on_and_warns_of_outstanding_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from blockpool import HazardAwareBlockPool
    from blockpool.integrations.vllm.hazards import StepHazards

    hz = StepHazards(HazardAwareBlockPool(8))
    hz.step_tokens = False
    out = SimpleNamespace(total_num_scheduled_tokens=8, new_block_ids_to_zero=None)
    assert hz.skip_step(out) and not hz.skip_step(
        SimpleNamespace(total_num_scheduled_tokens=0, new_block_ids_to_zero=None)
    )
    hz.add_stream("compute", StreamKind.DEVICE)  # its own stream: nothing changes
    assert not hz.step_tokens
    with caplog.at_level("WARNING", logger="vllm.plugins.blockpool"):
        hz.add_stream("nixl", StreamKind.HOST)
    assert hz.step_tokens and "1 steps scheduled without step tokens" in caplog.text
    assert (
        str(hz.step_record(SimpleNamespace(total_num_scheduled_tokens=8, new_block_ids_to_zero=None)).forward)
        == "compute:1"
    )
    # A step ended before the stream came: nothing outstanding, no warning.
    hz2 = StepHazards(HazardAwareBlockPool(8))
    hz2.step_tokens = False
    hz2.skip_step(out)
    assert hz2.end_step(out) is None
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm.plugins.blockpool"):
        hz2.add_stream("nixl", StreamKind.HOST)
    assert hz2.step_tokens and caplog.text == ""


def test_a_step_seen_without_tokens_keeps_no_reference_to_its_output() -> None:
    import gc
    import weakref

    from blockpool import HazardAwareBlockPool
    from blockpool.integrations.vllm.hazards import StepHazards

    class Output:  # a SimpleNamespace takes no weak reference
        total_num_scheduled_tokens = 8

    hz = StepHazards(HazardAwareBlockPool(8))
    hz.step_tokens = False
    out = Output()
    ref = weakref.ref(out)
    assert hz.skip_step(out) and hz.steps_untokened == 1
    del out
    gc.collect()
    assert ref() is None and hz.outstanding_steps() == [] and not hz._steps  # no entry per untokened step


def test_an_output_the_untokened_wiring_never_saw_does_not_offset_the_outstanding_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM's unit tests build outputs by hand and pass them to
    # update_from_output: end_step must not count those as ended, or a
    # stream added later would hide (or report a negative number of) the
    # steps still running without tokens.
    from blockpool import HazardAwareBlockPool
    from blockpool.integrations.vllm.hazards import StepHazards

    hz = StepHazards(HazardAwareBlockPool(8))
    hz.step_tokens = False
    assert (
        hz.end_step(SimpleNamespace(total_num_scheduled_tokens=8, new_block_ids_to_zero=None)) is None
    )  # never scheduled here
    hz.skip_step(SimpleNamespace(total_num_scheduled_tokens=8, new_block_ids_to_zero=None))  # still running
    with caplog.at_level("WARNING", logger="vllm.plugins.blockpool"):
        hz.add_stream("nixl", StreamKind.HOST)
    assert "1 steps scheduled without step tokens" in caplog.text


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_step_writes_are_read_from_the_live_tables_and_match_the_block_ids(
    registered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from blockpool.integrations.vllm import hazards as vh

    seen: list[tuple[list[int], list[int], list[int]]] = []  # (tagged, by ids, last blocks) per step
    tail_blocks = vh.StepHazards._tail_blocks

    def spy(self: Any, computed: Any, scheduled: Any, req_ids: Any, tables: Any, sizes: Any) -> Any:
        computed = dict(computed)
        got = tail_blocks(self, computed.items(), scheduled, req_ids, tables, sizes)
        manager = scheduler.kv_cache_manager  # the block state's resolver is its get_block_ids
        live = tuple(m.req_to_blocks for m in manager.coordinator.single_type_managers)
        assert len(tables) == len(live) and all(t is m for t, m in zip(tables, live))
        assert set(computed) == set(scheduled)
        ids = [i for r in computed for i in manager.get_block_ids(r)[0][computed[r] // BS :]]
        last = [manager.coordinator.get_blocks(r)[0][-1].block_id for r in scheduled]
        seen.append(([b.block_id for b in got], [b.block_id for b in self.blocks_of(ids)], last))
        return got

    monkeypatch.setattr(vh.StepHazards, "_tail_blocks", spy)
    scheduler = make_scheduler("OffloadingConnector", OFFLOAD)
    scheduler.add_request(make_request("A", list(range(1, 41))))
    scheduler.add_request(make_request("B", list(range(101, 131))))
    for _ in range(3):  # a prefill, then decodes
        out = scheduler.schedule()
        offload_step(scheduler, out)
    assert len(seen) == 3
    for tagged, by_ids, _ in seen:
        assert tagged == by_ids
    assert seen[1][0] == seen[1][2]  # a decode writes only each request's last block
    # a state whose resolver is not vLLM's own manager method is read by ids
    assert vh._live_tables(SimpleNamespace(req_ids={"A"}, resolve_block_ids=lambda r: ())) is None
