"""Simulated workers for the seeded fault harness (:mod:`tests.vllm_faults`):
LMCache's vLLM connectors, in-process (``LMCacheConnectorV1`` over
LMCache's adapter) and multi-process (LMCache's ``LMCacheMPConnector``).

Importing this module where LMCache is installed registers two
:class:`~tests.vllm_faults.ConnectorSim` classes in
:data:`~tests.vllm_faults.SIMS` (nothing where it is not):

- ``lmcache`` (:class:`LMCacheSim`): LMCache's scheduler half is its real
  adapter (request trackers, ``ReqMeta``, load and save specs) with its
  lookup client answered by the simulated LMCache store: the longest run
  of whole :data:`CHUNK`-token chunks of the request's tokens a finished
  store saved. LMCache runs a step's loads and stores inside that step (its
  ``get_finished`` reports nothing): a load's failure comes back in that
  step's ``invalid_block_ids`` (``fail``: every block it wrote;
  ``fail_partial``: the later half), a store is saved once the step's
  output came back. No other fault applies to it.
- ``lmcache_mp`` (:class:`LMCacheMPSim`): LMCache's scheduler adapter (the
  lookups against the LMCache server) answered by the simulated store, and
  one real ``LMCacheMPConnector`` worker per rank, LMCache's own code,
  whose transfer context (the IPC boundary) is simulated: each retrieve or
  store it submits gets a future the fault schedule completes (ok, failed,
  late, never, skewed between ranks, out of order). What each rank reports
  (``finished_recving``, ``invalid_block_ids``, the worker metadata of its
  stores) is what LMCache's worker code and, with the plugin on, its
  worker wrappers build from those futures; the ranks' outputs are joined
  by vLLM's ``KVOutputAggregator`` in either order (``reversed_ranks``).

LMCache's services (its engine, lookup server, IPC and heartbeat) are
stood in for while a schedule builds and serves its scheduler: started by
the sim's :meth:`scheduler_kwargs`, which the harness calls right before it
builds the scheduler, and stopped by :meth:`settle_never`, which it calls
once the run ends (a run whose build failed stops them at the next one, or
with :func:`stand_ins_off`).

Replay one schedule (from the repository root, in LMCache's venv)::

    python -m tests.vllm_faults_lmcache --connector lmcache_mp --seed 17 --schedules 1 -v
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import random
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock, patch

from tests import vllm_faults as vf
from tests.vllm_faults_nixl import holds_blocks_for_a_transfer

CHUNK = 32
"""Tokens per LMCache chunk in every schedule (two blocks)."""

AVAILABLE = importlib.util.find_spec("lmcache") is not None
"""LMCache is installed here (its sims are registered only then)."""

DRAIN_STEPS = 8
"""Steps an LMCache MP run goes on while a finished request waits for
LMCache's worker to report its stores."""

_STACK: list[contextlib.ExitStack] = []


def stand_ins_off() -> None:
    """Stop the stand-ins a run started, if any. O(1)."""
    while _STACK:
        _STACK.pop().close()


def _stand_ins_on(managers: list[Any]) -> None:
    stand_ins_off()
    stack = contextlib.ExitStack()
    try:
        for m in managers:
            stack.enter_context(m)
    except BaseException:
        stack.close()
        raise
    _STACK.append(stack)


@contextlib.contextmanager
def _resumed_req_ids() -> Iterator[None]:
    """LMCache 0.5.6's ``build_connector_meta`` reads
    ``CachedRequestData.resumed_req_ids``, which vLLM 0.34 dropped (a
    resumed request comes back whole, as a new one): an empty set there."""
    from vllm.v1.core.sched.output import CachedRequestData

    if "resumed_req_ids" in getattr(CachedRequestData, "__dataclass_fields__", {}):
        yield
        return
    with patch.object(CachedRequestData, "resumed_req_ids", frozenset(), create=True):
        yield


class ChunkStore:
    """The simulated LMCache store: token prefixes of whole chunks saved."""

    def __init__(self) -> None:
        self.saved: set[int] = set()  # hash of each saved chunk-aligned prefix

    def save(self, token_ids: Any) -> None:
        """Save every whole chunk of ``token_ids``. O(tokens)."""
        tokens = tuple(int(t) for t in token_ids)
        for end in range(CHUNK, len(tokens) + 1, CHUNK):
            self.saved.add(hash(tokens[:end]))

    def hit(self, token_ids: Any) -> int:
        """Tokens of the longest saved chunk-aligned prefix of ``token_ids``.
        O(tokens)."""
        tokens = tuple(int(t) for t in token_ids)
        n = 0
        for end in range(CHUNK, len(tokens) + 1, CHUNK):
            if hash(tokens[:end]) not in self.saved:
                break
            n = end
        return n


def _table(scheduler: Any, req_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def _blocks(table: list[int], start: int, end: int) -> list[int]:
    return table[start // vf.BS : -(-end // vf.BS)] if end > start else []


# ----------------------------------------------------------------------
# LMCache in-process
# ----------------------------------------------------------------------


class LMCacheSim(vf.ConnectorSim):
    """LMCache's in-process connector (module docstring)."""

    name = "lmcache"
    connector = "LMCacheConnectorV1"
    fault_kinds = ("fail", "fail_partial")
    transfer_kinds = ("load",)
    # Not drawn: with vLLM's AsyncScheduler and a failed load under
    # "recompute", stock itself leaves the request unfinished (seed 23).
    async_scheduling = False

    @classmethod
    def kinds_for(cls, transfer_kind: str) -> tuple[str, ...]:
        return cls.fault_kinds if transfer_kind == "load" else ()

    @classmethod
    def stand_ins(cls) -> list[Any]:
        from tests.test_vllm_lmcache import lmcache_built

        return [_resumed_req_ids(), lmcache_built(layerwise=False)]

    @classmethod
    def scheduler_kwargs(cls, schedule: vf.Schedule) -> dict[str, Any]:
        _stand_ins_on(cls.stand_ins())
        return {}

    def settle_never(self) -> None:
        super().settle_never()
        stand_ins_off()

    def prepare(self) -> None:
        self.store = ChunkStore()
        self.saves: dict[Any, list[int]] = {}  # store job -> token ids it saves
        self.scheduler.connector._lmcache_engine._manager.lookup_client = self

    # LMCache's lookup client, answered by the simulated store.
    def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
        return self.store.hit(token_ids)

    def lookup_cache(self, lookup_id: str) -> int:
        return -1

    def clear_lookup_status(self, lookup_id: str) -> None:
        pass

    def plan(self, step: int, out: Any) -> None:
        for rm in out.kv_connector_metadata.requests:
            table = _table(self.scheduler, rm.req_id)
            ls = rm.load_spec
            if ls is not None and ls.can_load:
                blocks = _blocks(table, ls.vllm_cached_tokens, ls.lmcache_cached_tokens)
                self.begin(rm.req_id, "load", ("load", rm.req_id, step), blocks, step, 0)
            ss = rm.save_spec
            if ss is not None and ss.can_save and len(rm.token_ids):
                start = ss.skip_leading_tokens // CHUNK * CHUNK
                t = self.begin(rm.req_id, "store", ("store", rm.req_id, step), _blocks(table, start, len(rm.token_ids)),
                               step, 0, faultable=False)  # fmt: skip
                self.saves[t.job] = list(rm.token_ids)

    def encode(
        self, step: int, due: list[list[vf.SimTransfer]], twice: list[list[vf.SimTransfer]]
    ) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput

        outs = []
        for rank in range(self.ranks):
            invalid: set[int] = set()
            for t in due[rank]:
                if t.kind == "load" and t.failed:
                    invalid.update(t.failed_blocks or t.block_ids)
                elif t.kind == "store" and rank == 0:
                    self.store.save(self.saves.pop(t.job, ()))
            outs.append(KVConnectorOutput(invalid_block_ids=invalid) if invalid else None)
        return outs


# ----------------------------------------------------------------------
# LMCache MP
# ----------------------------------------------------------------------


class SimTransferContext:
    """One rank's transfer context (the IPC boundary of LMCache's worker
    adapter): every submitted retrieve or store gets a future (LMCache's
    ``MessagingFuture`` as the LMCache MP tests stand it in: done once the
    fault schedule says so), kept in :attr:`submitted` in submission
    order."""

    def __init__(self) -> None:
        self.submitted: list[Any] = []

    def _nothing(self, *a: Any, **k: Any) -> None:
        """Registering, flushing and closing: nothing to do in the simulation."""

    register = flush_inflight_stores = unregister = close = _nothing

    def create_recorded_event(self) -> Any:
        return SimpleNamespace(synchronize=lambda: None)

    def _submit(self, what: str, request_id: str) -> Any:
        from tests.test_vllm_lmcache_mp import Future

        f = Future(f"{what} {request_id}")
        f.what, f.request_id = what, request_id
        self.submitted.append(f)
        return f

    def submit_retrieve(self, request_id: str, *a: Any, **k: Any) -> Any:
        return self._submit("retrieve", request_id)

    def submit_store(self, request_id: str, *a: Any, **k: Any) -> Any:
        return self._submit("store", request_id)


def _mp_modules() -> tuple[Any, Any]:
    from blockpool.integrations.vllm import lmcache_mp as mp
    from tests.test_vllm_lmcache import import_with_stand_ins

    connector_mod = import_with_stand_ins(mp.MODULE, "LMCache's MP connector")
    return connector_mod, importlib.import_module("lmcache.integration.vllm.vllm_multi_process_adapter")


class LMCacheMPSim(vf.ConnectorSim):
    """LMCache's multi-process connector with one real worker per rank
    (module docstring)."""

    name = "lmcache_mp"
    connector = "LMCacheMPConnector"
    fault_kinds = ("fail", "late", "never", "reorder", "skew")

    @classmethod
    def kinds_for(cls, transfer_kind: str) -> tuple[str, ...]:
        # A store LMCache cannot fail in vLLM's view (nothing to recompute).
        return (
            cls.fault_kinds if transfer_kind == "load" else tuple(k for k in cls.fault_kinds if k != "fail")
        )

    @classmethod
    def draw_options(cls, rng: random.Random, schedule: vf.Schedule) -> dict[str, Any]:
        return {
            "delay": rng.choice((0, 1, 1, 2)),
            "reversed_ranks": rng.random() < 0.5,
            "lazy_offload": rng.random() < 0.5,
        }

    @classmethod
    def stand_ins(cls) -> list[Any]:
        connector_mod, adapter_mod = _mp_modules()
        vmod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector")
        scheduler_adapter = MagicMock(lmcache_tokens_per_chunk=CHUNK)
        scheduler_adapter.check_lookup_result.side_effect = lambda req_id: _LOOKUP[0](req_id)
        cls.contexts: list[SimTransferContext] = []

        def transfer_context(*a: Any, **k: Any) -> SimTransferContext:
            ctx = SimTransferContext()
            cls.contexts.append(ctx)
            return ctx

        from tests.test_vllm_lmcache_mp import lmcache_io

        # LMCache MP's own tests' stand-ins, with the lookups and the transfer
        # contexts (one per rank) replaced by the simulation's.
        return [
            _resumed_req_ids(),
            patch.object(vmod, "LMCacheMPConnector", connector_mod.LMCacheMPConnector),
            lmcache_io(),
            patch.object(connector_mod, "LMCacheMPSchedulerAdapter", lambda **kw: scheduler_adapter),
            patch.object(adapter_mod, "create_transfer_context", transfer_context),
        ]

    @classmethod
    def scheduler_kwargs(cls, schedule: vf.Schedule) -> dict[str, Any]:
        _stand_ins_on(cls.stand_ins())
        return {"extra": {"lmcache.mp.lazy_offload": True}} if schedule.options.get("lazy_offload") else {}

    def settle_never(self) -> None:
        super().settle_never()
        stand_ins_off()

    def prepare(self) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        connector_mod, _ = _mp_modules()
        self.store = ChunkStore()
        _LOOKUP[0] = self.lookup
        s = self.scheduler
        s.vllm_config.parallel_config.world_size = self.ranks
        type(self).contexts = []
        self.workers = []
        for _ in range(self.ranks):
            conn = connector_mod.LMCacheMPConnector(s.vllm_config, KVConnectorRole.WORKER, s.kv_cache_config)
            conn.register_kv_caches({"layer": torch.zeros(2, s.kv_cache_config.num_blocks, vf.BS, 1, 1)})
            self.workers.append(conn)
        self.contexts = list(type(self).contexts)
        self.saves: dict[Any, list[int]] = {}
        self._out: Any = None
        self._finished_since: dict[str, int] = {}

    def lookup(self, req_id: str) -> int:
        req = self.scheduler.requests.get(req_id)
        return 0 if req is None else self.store.hit(req.all_token_ids)

    def plan(self, step: int, out: Any) -> None:
        meta = out.kv_connector_metadata
        self._out = out
        before = [len(c.submitted) for c in self.contexts]
        for conn in self.workers:
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(SimpleNamespace())
            conn.wait_for_save()
        planned = []
        for rm in meta.requests:
            op = rm.op
            groups = [list(g) for g in op.block_ids]
            if rm.direction == "RETRIEVE":
                # The server leaves the first skip_first_n_tokens alone (vLLM's prefix-cache blocks).
                skip = (op.start + op.skip_first_n_tokens) // vf.BS - op.start // vf.BS
                blocks = [b for g in groups for b in g[skip:]]
                t = self.begin(rm.request_id, "load", ("load", rm.request_id, step), blocks, step,
                               self.schedule.options["delay"])  # fmt: skip
            else:
                t = self.begin(rm.request_id, "store", ("store", rm.request_id, step, len(planned)),
                               [b for g in groups for b in g], step, self.schedule.options["delay"])  # fmt: skip
                req = self.scheduler.requests.get(rm.request_id)
                self.saves[t.job] = list(req.all_token_ids[: op.end]) if req is not None else []
            planned.append(t)
        for rank, (ctx, n) in enumerate(zip(self.contexts, before)):
            new = ctx.submitted[n:]
            for t in planned:
                what = "retrieve" if t.kind == "load" else "store"
                match = next((f for f in new if f.what == what and f.request_id == t.req_id), None)
                if match is not None:
                    new.remove(match)
                t.futures = getattr(t, "futures", [None] * self.ranks)
                t.futures[rank] = match
        for conn in self.workers:
            conn.clear_connector_metadata()

    def encode(
        self, step: int, due: list[list[vf.SimTransfer]], twice: list[list[vf.SimTransfer]]
    ) -> list[Any]:
        finished = set(getattr(self._out, "finished_req_ids", ()) or ())
        outs = []
        for rank, conn in enumerate(self.workers):
            for t in due[rank]:
                f = getattr(t, "futures", [None] * self.ranks)[rank]
                if f is not None:
                    f.done, f.ok = True, not t.failed
                if t.kind == "store" and not t.failed and all(t.reported):
                    self.store.save(self.saves.pop(t.job, ()))
            outs.append(_worker_output(conn, finished))
        return outs

    def may_reset(self) -> bool:
        # vLLM refuses a reset while a finished request's blocks wait for
        # its stores (eager offload), a lazy store pins its blocks, or a
        # retrieve's request waits for its blocks (RuntimeError), plugin or
        # not; an eager store of a running request does not stop stock's.
        lazy = bool(self.schedule.options.get("lazy_offload"))
        live = any(t.live and (lazy or t.kind == "load") for t in self.transfers)
        return not live and not holds_blocks_for_a_transfer(self.scheduler)

    def busy(self) -> bool:
        """A transfer will still be reported, or a finished request's blocks
        wait for LMCache's worker to report its store (``finished_sending``)
        and have waited fewer than :data:`DRAIN_STEPS` steps: an engine that
        goes on stepping delivers it."""
        if super().busy():
            return True
        held = False
        for r in self.scheduler.requests.values():
            if r.is_finished():
                since = self._finished_since.setdefault(r.request_id, self.step)
                held = held or self.step < since + DRAIN_STEPS
        return held

    def report(self, step: int) -> list[Any]:
        outs = super().report(step)
        if self.ranks > 1 and self.schedule.options["reversed_ranks"]:
            # vLLM joins rank 0's output with the others'; the reversed order
            # puts a rank that reported nothing first.
            return list(reversed(outs))
        return outs


_LOOKUP: list[Any] = [lambda req_id: 0]


def _worker_output(conn: Any, finished_req_ids: set[str]) -> Any:
    """What vLLM's model runner reports for ``conn`` after a step
    (``ActiveKVConnector.post_forward``)."""
    from vllm.v1.outputs import KVConnectorOutput

    results = conn.get_transfer_results(finished_req_ids)
    return KVConnectorOutput(
        finished_sending=results.finished_sending or None,
        finished_recving=results.finished_recving or None,
        failed_recving=results.failed_recving,
        invalid_block_ids=conn.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=conn.build_connector_worker_meta(),
    )


if AVAILABLE:
    vf.register_sim(LMCacheSim)
    vf.register_sim(LMCacheMPSim)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, os.getcwd())
    import conftest  # noqa: F401  (the shape-only model configs, offline)

    vf._quiet_logs()
    sys.exit(vf.main())
