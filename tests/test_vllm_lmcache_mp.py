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

from blockpool.core.hazards import Token
from blockpool.integrations.vllm import connectors as vc
from blockpool.integrations.vllm import lmcache_mp as mp
from blockpool.integrations.vllm import worker as vw
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.worker.standins import StandInDevice
from tests.test_vllm_connectors import make_request, make_scheduler, model_output
from tests.test_vllm_lmcache import _resumed_req_ids  # noqa: F401  (autouse: LMCache reads resumed_req_ids)

_STOOD_IN = ("numba", "cryptography", "aiofile", "uvicorn")


def _import_connector() -> Any:
    """LMCache's MP connector module, importing it with :data:`_STOOD_IN`
    stood in for while it imports (then removed from ``sys.modules``)."""
    import lmcache

    if not hasattr(lmcache, "device_ops"):  # its compute backend did not load (no numba)
        lmcache.device_ops = MagicMock(name="lmcache.device_ops")
    added: list[str] = []
    try:
        for _ in range(32):
            try:
                return importlib.import_module(mp.MODULE)
            except ModuleNotFoundError as exc:
                name = exc.name or ""
                if name.split(".")[0] not in _STOOD_IN:
                    pytest.skip(
                        f"LMCache's MP connector does not import here ({exc})", allow_module_level=True
                    )
                sys.modules[name] = MagicMock(name=name)
                added.append(name)
        pytest.skip("LMCache's MP connector does not import here", allow_module_level=True)
    finally:
        for name in added:
            sys.modules.pop(name, None)


connector_mod = _import_connector()
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
    assert (
        load.fence.tokens == (step_of(out2).forward,) == (Token("compute", 2),)
    )  # A's decode, still running


@pytest.mark.parametrize("registered", [False], indirect=True)
def test_hazards_off_leaves_lmcaches_metadata_as_it_builds_it(registered: bool) -> None:
    with lmcache_io() as io:
        scheduler = make_scheduler(CONNECTOR, num_blocks=6, role="kv_consumer")
        _, out3 = load_into_blocks_a_running_step_reads(scheduler, io)
    (rm,) = metas(out3, "B", "RETRIEVE")
    assert not hasattr(rm, vc.META_LOAD) and not hasattr(out3.kv_connector_metadata, vc.META_STEP)


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
def test_a_refused_retrieve_is_not_run_and_comes_back_to_vllm_as_a_failed_load(registered: bool) -> None:
    """A server that rewrites whole chunks (no ``skip_first_n_tokens``)
    would write A's block 2, which A still reads: the pool refuses the
    retrieve; it leaves the step, the worker reports it failed through
    LMCache's own record, and vLLM recomputes B from that block."""
    get = connector_mod.LMCacheMPRequestMetadata.GetRetrieveMetadata

    def whole_chunks(*a: Any, **k: Any) -> Any:
        rm = get(*a, **k)
        rm.op.skip_first_n_tokens = 0
        return rm

    with (
        lmcache_io() as io,
        patch.object(
            connector_mod.LMCacheMPRequestMetadata, "GetRetrieveMetadata", staticmethod(whole_chunks)
        ),
    ):
        scheduler = make_scheduler(CONNECTOR, role="kv_consumer")
        scheduler.recompute_kv_load_failures = True  # kv_load_failure_policy="recompute" (else vLLM fails B)
        out2 = shared_prefix_steps(scheduler, io)
        b = table(scheduler, "B")
        assert b[2] == table(scheduler, "A")[2]  # the shared prefix hit
        assert metas(out2, "B", "RETRIEVE") == []  # not run
        assert getattr(out2.kv_connector_metadata, mp.META_REFUSED) == {"B": b[2:6]}
        assert hazards(scheduler).pending_transfers() == []

        conn = worker_connector(scheduler)
        conn.bind_connector_metadata(out2.kv_connector_metadata)
        conn.start_load_kv(SimpleNamespace())
        assert io.transfer.futures == []  # nothing submitted to the server
        _, recving = conn.get_finished(set())
        invalid = conn.get_block_ids_with_load_errors()
        assert (recving, invalid) == ({"B"}, set(b[2:6]))
        scheduler.update_from_output(
            out2, model_output(out2, finished_recving=recving, invalid_block_ids=invalid)
        )
        assert scheduler.requests["B"].num_computed_tokens == 32  # back to its first bad block
        out3 = scheduler.schedule()
    assert out3.num_scheduled_tokens["B"] == 108 - 32  # recomputed, not loaded
