"""Scheduler-side wiring of vLLM's KV connectors: every load and store they
start begins on our pool, and its fence rides to the workers in the
connector's own metadata.

:func:`wire` (called by :func:`blockpool.integrations.vllm.register` when
hazards are on) wraps a few methods of each connector it knows; the
wrappers act only for a connector instance bound to a
:class:`~blockpool.integrations.vllm_pool.VllmBlockPool` with hazard
tracking (:func:`attach`), so a connector built around vLLM's own pool, or
one left unwired, behaves exactly as in vLLM.

What a wired connector does on the scheduler, each step:

1. the step's record is issued (:meth:`StepHazards.step_record`: the CoW
   copy token, then the forward token ``eN``) and the blocks the step
   writes are tagged with ``eN`` (:meth:`StepHazards.tag_step_writes`),
   before the connector plans its transfers;
2. vLLM's ``build_connector_meta`` runs unchanged;
3. each load and store it planned begins on the pool (a write of the
   destination blocks, a read of the source blocks), on the connector's
   stream or engine, and the :class:`Transfer`'s wire form is set on the
   item the worker reads (:data:`META_LOAD`, :data:`META_STORE`); the
   step's record and the forward's fence go on the metadata
   (:data:`META_STEP`);
4. completions and failures come back through the connector's existing
   reports: ``finished_recving`` / ``failed_recving`` /
   ``invalid_block_ids`` (by request id, through
   :meth:`StepHazards.on_connector_output`), and the job-completion counts
   in ``kv_connector_worker_meta`` (MooncakeStore's ``completed_saves``,
   Offloading's ``completed_jobs``) once every rank reported a job.

Wired connectors (vLLM 0.33), their stream or engine and its kind:

============================  =========================================  ======
connector                     stream / engine                            kind
============================  =========================================  ======
``MooncakeStoreConnector``    ``mooncake_store`` (send and recv threads)  HOST
``OffloadingConnector``       ``offload_h2d``, ``offload_h2d_sync``,      DEVICE
                              ``offload_d2h`` (CUDA copy streams)
``SimpleCPUOffloadConnector`` ``simple_cpu_h2d``, ``simple_cpu_d2h``      DEVICE
                              (scheduler side only)
``NixlConnector`` (pull/push) ``nixl`` (remote reads into decode blocks)  HOST
============================  =========================================  ======

Any other connector logs one line when a scheduler binds it to our pool:
its transfers are not fenced. ``BLOCKPOOL_VLLM_UNWIRED`` (a comma-separated
list of names from :data:`CONNECTORS`, or ``all``) leaves connectors
unwired, restoring vLLM's behaviour for them.

This module imports vLLM lazily (inside :func:`wire`) and never torch; the
worker half is :mod:`blockpool.integrations.vllm_worker`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import attrs

from blockpool.hazards import StreamKind
from blockpool.integrations.vllm_hazards import StepHazards, Transfer

__all__ = [
    "CONNECTORS",
    "ENV_UNWIRED",
    "META_LOAD",
    "META_STEP",
    "META_STORE",
    "ConnectorSpec",
    "ConnectorWiring",
    "attach",
    "group_block_sizes",
    "leaf_connectors",
    "load_block_ids",
    "report_unwired",
    "unwire",
    "wire",
    "wired_names",
    "wiring_of",
]

logger = logging.getLogger("vllm.plugins.blockpool")

ENV_UNWIRED = "BLOCKPOOL_VLLM_UNWIRED"
"""Comma-separated connector names (see :data:`CONNECTORS`) to leave
unwired, or ``all``."""

META_STEP = "blockpool_step"
"""Attribute of a wired connector's metadata: ``(StepRecord wire, forward
fence wire)``, or absent for an empty step."""
META_LOAD = "blockpool_load"
"""Attribute of a per-request or per-job metadata item: the load's
:meth:`Transfer.to_wire`."""
META_STORE = "blockpool_store"
"""Attribute of a per-request or per-job metadata item: the store's
:meth:`Transfer.to_wire`."""

_ATTR = "_blockpool_wiring"


@attrs.define
class ConnectorWiring:
    """One connector instance's link to a pool's :class:`StepHazards`.

    Attributes:
        name: The connector's name in :data:`CONNECTORS`.
        hazards: The scheduler's step and transfer wiring.
        block_sizes: Block size (tokens) of each KV cache group, in the
            order of the scheduler's block tables.
        pending: Keys of transfers begun and not ended (job-keyed connectors).
        reports: Completion reports counted so far per job key.
    """

    name: str
    hazards: StepHazards
    block_sizes: tuple[int, ...]
    pending: set[Hashable] = attrs.field(factory=set)
    reports: dict[Hashable, int] = attrs.field(factory=dict)

    def begin_step(self, scheduler_output: object) -> tuple[Any, Any] | None:
        """Issue the step's tokens and tag its writes (idempotent per step);
        the wire form for :data:`META_STEP`, or ``None`` for an empty step."""
        hz = self.hazards
        record = hz.step_record(scheduler_output)
        if record is None:
            return None
        forward_fence = hz.tag_step_writes(scheduler_output, self.block_sizes)
        return record.to_wire(), forward_fence.to_wire()

    def load(self, request_id: str, block_ids: Iterable[int], stream: str, key: Hashable = None) -> Any:
        """Begin a load into ``block_ids`` (unusable ids skipped); its wire
        form, or ``None`` when no block is left."""
        return self._begin(self.hazards.begin_load, request_id, block_ids, stream, key)

    def store(self, request_id: str, block_ids: Iterable[int], stream: str, key: Hashable = None) -> Any:
        """Begin a store from ``block_ids`` (unusable ids skipped); its wire
        form, or ``None`` when no block is left."""
        return self._begin(self.hazards.begin_store, request_id, block_ids, stream, key)

    def finish(self, key: Hashable, *, failed: bool = False) -> int:
        """End the transfers begun under ``key``; see :meth:`StepHazards.finish`."""
        self.pending.discard(key)
        self.reports.pop(key, None)
        return self.hazards.finish(key, failed=failed)

    def report(self, key: Hashable, count: int, needed: int) -> int:
        """Count ``count`` workers' completion reports of the job under
        ``key``; once ``needed`` (every rank) reported, end its transfers.
        Counted here, not read from the connector's own job table (which a
        cache reset clears while the jobs still run). Returns the number of
        transfers ended. O(1)."""
        if key not in self.pending:
            return 0
        n = self.reports.get(key, 0) + count
        if n < needed:
            self.reports[key] = n
            return 0
        return self.finish(key)

    def _begin(
        self,
        begin: Callable[..., Transfer],
        request_id: str,
        block_ids: Iterable[int],
        stream: str,
        key: Hashable,
    ) -> Any:
        blocks = self.hazards.blocks_of(block_ids)
        if not blocks:
            return None
        t = begin(request_id, blocks, stream, key=key)
        if key is not None:
            self.pending.add(key)
        from blockpool.integrations.vllm_pool import SERVED

        SERVED.transfers_fenced += 1
        SERVED.fences_nonempty += bool(t.fence.tokens)
        return t.to_wire()


def wiring_of(obj: object) -> ConnectorWiring | None:
    """The wiring attached to a connector object, or ``None``. O(1)."""
    return getattr(obj, _ATTR, None)


def group_block_sizes(kv_cache_config: object, default: int) -> tuple[int, ...]:
    """``kv_cache_spec.block_size`` of each of ``kv_cache_config``'s groups,
    in order (``(default,)`` when it has none). O(groups)."""
    sizes = tuple(
        int(getattr(getattr(g, "kv_cache_spec", None), "block_size", 0) or default)
        for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ()
    )
    return sizes or (default,)


def attach(obj: object, pool: object, name: str, block_sizes: tuple[int, ...]) -> ConnectorWiring | None:
    """Attach a :class:`ConnectorWiring` to connector object ``obj`` when
    ``pool`` is a :class:`VllmBlockPool` with hazard tracking, registering
    the connector's streams; else detach. Returns the wiring or ``None``.
    O(streams)."""
    from blockpool.integrations.vllm_pool import VllmBlockPool

    hz = pool.hazards if type(pool) is VllmBlockPool else None
    if hz is None or name not in _WIRED:
        if getattr(obj, _ATTR, None) is not None:
            setattr(obj, _ATTR, None)
        return None
    for stream, kind in CONNECTORS[name].streams.items():
        hz.add_stream(stream, kind)
    w = ConnectorWiring(name, hz, block_sizes)
    setattr(obj, _ATTR, w)
    return w


def load_block_ids(
    groups: Sequence[Sequence[int]], first_token: int, end_token: int, block_sizes: int | Sequence[int]
) -> list[int]:
    """The block ids a transfer of tokens ``[first_token, end_token)``
    touches in each group of a block table: in group ``g``, indices
    ``first_token // size_g`` up to ``ceil(end_token / size_g)``, where
    ``block_sizes`` gives each group's block size (one int: every group).
    O(blocks).

    >>> load_block_ids(([5, 6, 7, 8],), 20, 40, 16)
    [6, 7]
    >>> load_block_ids(([5, 6, 7, 8], [9, 10]), 20, 40, (16, 32))
    [6, 7, 9, 10]
    """
    sizes = [block_sizes] * len(groups) if isinstance(block_sizes, int) else list(block_sizes)
    out: list[int] = []
    for g, bs in zip(groups, sizes):
        out.extend(g[first_token // bs : -(-end_token // bs)])
    return out


# ----------------------------------------------------------------------
# the connectors
# ----------------------------------------------------------------------


@attrs.frozen
class ConnectorSpec:
    """How one connector is wired.

    Attributes:
        module: Module holding the connector's classes.
        streams: Stream or engine names the wiring registers, with their kind.
        patch: ``patch(module, patcher)`` installs the wrappers.
    """

    module: str
    streams: dict[str, StreamKind]
    patch: Callable[[Any, Callable[[Any, str, Callable[[Any], Any]], None]], None]


MOONCAKE = "mooncake_store"
OFFLOAD_H2D = "offload_h2d"
OFFLOAD_H2D_SYNC = "offload_h2d_sync"
OFFLOAD_D2H = "offload_d2h"


def _patch_mooncake_store(mod: Any, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> None:
    cls = mod.MooncakeStoreScheduler

    def wrap_bind(orig: Any) -> Any:
        @functools.wraps(orig)
        def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> None:
            orig(self, gpu_block_pool)
            attach(
                self,
                gpu_block_pool,
                MOONCAKE,
                group_block_sizes(getattr(self, "kv_cache_config", None), getattr(self, "_block_size", 0) or 16),
            )

        return bind_gpu_block_pool

    def wrap_build(orig: Any) -> Any:
        @functools.wraps(orig)
        def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
            w = wiring_of(self)
            if w is None:
                return orig(self, scheduler_output)
            step = w.begin_step(scheduler_output)
            pinned_before = set(self._pinned_saves)
            meta = orig(self, scheduler_output)
            bs = _store_group_sizes(self, w)
            for rm in meta.requests:
                ls = rm.load_spec
                if ls is not None and ls.can_load:
                    ids = load_block_ids(rm.block_ids, ls.vllm_cached_tokens, ls.kvpool_cached_tokens, bs)
                    wire_load = w.load(rm.req_id, ids, MOONCAKE)
                    if wire_load is not None:
                        setattr(rm, META_LOAD, wire_load)
                job = rm.store_job_id
                if rm.can_save and job is not None and job not in pinned_before and job in self._pinned_saves:
                    wire_store = w.store(rm.req_id, _mooncake_store_reads(self, rm, bs), MOONCAKE, key=(MOONCAKE, job))
                    if wire_store is not None:
                        setattr(rm, META_STORE, wire_store)
            if step is not None:
                setattr(meta, META_STEP, step)
            return meta

        return build_connector_meta

    def wrap_update(orig: Any) -> Any:
        @functools.wraps(orig)
        def update_connector_output(self: Any, connector_output: Any) -> None:
            w = wiring_of(self)
            saves = getattr(getattr(connector_output, "kv_connector_worker_meta", None), "completed_saves", None)
            if w is not None and saves:
                # Before vLLM frees the job's pinned blocks: a block freed
                # with its store still pending would be held back.
                for job, count in saves.items():
                    pinned = self._pinned_saves.get(job)
                    if pinned is not None and pinned[1] - count <= 0:
                        w.finish((MOONCAKE, job))
            return orig(self, connector_output)

        return update_connector_output

    patch(cls, "bind_gpu_block_pool", wrap_bind)
    patch(cls, "build_connector_meta", wrap_build)
    patch(cls, "update_connector_output", wrap_update)


def _store_group_sizes(sched: Any, w: ConnectorWiring) -> list[int]:
    """Block size of each MooncakeStore store group (its projection of the
    KV cache groups, ``_store_group_ids``)."""
    sizes = w.block_sizes
    ids = getattr(sched, "_store_group_ids", None) or range(len(sizes))
    return [sizes[g] if g < len(sizes) else sched._block_size for g in ids]


def _mooncake_store_reads(sched: Any, rm: Any, sizes: Sequence[int]) -> list[int]:
    """The blocks a MooncakeStore store job reads: in every non-boundary-state
    store group, the positional chunks below its aligned token length
    (``token_len_chunk`` rounded down to the coordinator's
    ``lcm_block_size``, as the send thread does), and its boundary puts.
    vLLM pins more (every allocated block, for retries); a superset here
    would make the next step's forward wait for the PUT of a partial block
    it appends to."""
    bs = sched._block_size
    coord = getattr(sched, "_store_coord", None)
    lcm = getattr(coord, "lcm_block_size", bs) or bs
    end = (rm.token_len_chunk or 0) // lcm * lcm
    skip = getattr(sched, "_boundary_state_group_ids", frozenset())
    keep = [i for i in range(len(rm.block_ids)) if i not in skip]
    groups = [rm.block_ids[i] for i in keep]
    ids = load_block_ids(groups, 0, end, [sizes[i] if i < len(sizes) else bs for i in keep]) if end > 0 else []
    ids.extend(p.block_id for p in rm.boundary_puts or ())
    return list(dict.fromkeys(ids))


def _patch_offloading(mod: Any, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> None:
    sched_mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    outer = mod.OffloadingConnector
    cls = sched_mod.OffloadingConnectorScheduler

    def wrap_bind(orig: Any) -> Any:
        @functools.wraps(orig)
        def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> None:
            orig(self, gpu_block_pool)
            inner = getattr(self, "connector_scheduler", None)
            if inner is not None:
                attach(
                    inner,
                    gpu_block_pool,
                    OFFLOADING,
                    group_block_sizes(getattr(self, "_kv_cache_config", None), _cache_block_size(self)),
                )

        return bind_gpu_block_pool

    def wrap_build(orig: Any) -> Any:
        @functools.wraps(orig)
        def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
            w = wiring_of(self)
            if w is None:
                return orig(self, scheduler_output)
            step = w.begin_step(scheduler_output)
            meta = orig(self, scheduler_output)
            # Tokens of one stream are issued in the order its worker submits
            # the jobs: store jobs this step flushes go first (the worker
            # submits them at once), the others at the next step's start.
            flush = meta.jobs_to_flush or ()
            stores = sorted(meta.store_jobs.items(), key=lambda item: item[0] not in flush)
            for job_id, job in meta.load_jobs.items():
                stream = OFFLOAD_H2D_SYNC if getattr(job, "sync", False) else OFFLOAD_H2D
                wire_load = w.load(job.req_id, _spec_block_ids(job.dst_spec), stream, key=(OFFLOADING, job_id))
                if wire_load is not None:
                    setattr(job, META_LOAD, wire_load)
            for job_id, job in stores:
                wire_store = w.store(job.req_id, _spec_block_ids(job.src_spec), OFFLOAD_D2H, key=(OFFLOADING, job_id))
                if wire_store is not None:
                    setattr(job, META_STORE, wire_store)
            if step is not None:
                setattr(meta, META_STEP, step)
            return meta

        return build_connector_meta

    def wrap_update(orig: Any) -> Any:
        @functools.wraps(orig)
        def update_connector_output(self: Any, connector_output: Any) -> None:
            w = wiring_of(self)
            jobs = getattr(getattr(connector_output, "kv_connector_worker_meta", None), "completed_jobs", None)
            if w is not None and jobs:
                needed = self.config.num_workers
                for job_id, count in jobs.items():
                    w.report((OFFLOADING, job_id), count, needed)
            return orig(self, connector_output)

        return update_connector_output

    patch(outer, "bind_gpu_block_pool", wrap_bind)
    patch(cls, "build_connector_meta", wrap_build)
    patch(cls, "update_connector_output", wrap_update)


SIMPLE_H2D = "simple_cpu_h2d"
SIMPLE_D2H = "simple_cpu_d2h"
SIMPLE = "simple_cpu_offload"
NIXL = "nixl"


def _patch_simple_cpu_offload(mod: Any, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> None:
    cls = mod.SimpleCPUOffloadScheduler

    def wrap_bind(orig: Any) -> Any:
        @functools.wraps(orig)
        def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> None:
            orig(self, gpu_block_pool)
            attach(
                self,
                gpu_block_pool,
                SIMPLE,
                group_block_sizes(getattr(self, "kv_cache_config", None), getattr(self, "block_size", 0) or 16),
            )

        return bind_gpu_block_pool

    def wrap_build(orig: Any) -> Any:
        @functools.wraps(orig)
        def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
            w = wiring_of(self)
            if w is None:
                return orig(self, scheduler_output)
            step = w.begin_step(scheduler_output)
            meta = orig(self, scheduler_output)
            loads = {}
            for req_id in meta.load_event_to_reqs.get(meta.load_event, ()):
                state = self._reqs_to_load.get(req_id)
                transfer = getattr(state, "transfer_meta", None)
                if transfer is not None:
                    wire_load = w.load(req_id, transfer.gpu_block_ids, SIMPLE_H2D)
                    if wire_load is not None:
                        loads[req_id] = wire_load
            setattr(meta, META_LOAD, loads)
            if meta.store_event >= 0:
                wire_store = w.store("", meta.store_gpu_blocks, SIMPLE_D2H, key=(SIMPLE, meta.store_event))
                if wire_store is not None:
                    setattr(meta, META_STORE, wire_store)
            if step is not None:
                setattr(meta, META_STEP, step)
            return meta

        return build_connector_meta

    def wrap_update(orig: Any) -> Any:
        @functools.wraps(orig)
        def update_connector_output(self: Any, connector_output: Any) -> None:
            w = wiring_of(self)
            events = getattr(
                getattr(connector_output, "kv_connector_worker_meta", None), "completed_store_events", None
            )
            if w is not None and events:
                # Before vLLM releases the store's block references.
                for event, count in events.items():
                    if self._store_event_pending_counts.get(event, 0) + count >= self._expected_worker_count:
                        w.finish((SIMPLE, event))
            return orig(self, connector_output)

        return update_connector_output

    patch(cls, "bind_gpu_block_pool", wrap_bind)
    patch(cls, "build_connector_meta", wrap_build)
    patch(cls, "update_connector_output", wrap_update)


def _patch_nixl(mod: Any, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> None:
    conn = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector")
    base = mod.NixlBaseConnectorScheduler

    def wrap_bind(orig: Any) -> Any:
        @functools.wraps(orig)
        def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> None:
            orig(self, gpu_block_pool)
            inner = getattr(self, "connector_scheduler", None)
            if inner is not None:
                attach(
                    inner,
                    gpu_block_pool,
                    NIXL,
                    group_block_sizes(getattr(self, "_kv_cache_config", None), _cache_block_size(self)),
                )

        return bind_gpu_block_pool

    def wrap_build(orig: Any) -> Any:
        @functools.wraps(orig)
        def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
            w = wiring_of(self)
            if w is None:
                return orig(self, scheduler_output)
            step = w.begin_step(scheduler_output)
            meta = orig(self, scheduler_output)
            for req_id, rm in meta.reqs_to_recv.items():
                # Only a read the scheduler awaits is reported back
                # (finished_recving / failed_recving / invalid_block_ids).
                if not rm.awaiting_kvs:
                    continue
                ids = [b for group in rm.local_block_ids for b in group]
                wire_load = w.load(req_id, ids, NIXL)
                if wire_load is not None:
                    setattr(rm, META_LOAD, wire_load)
            if step is not None:
                setattr(meta, META_STEP, step)
            return meta

        return build_connector_meta

    patch(conn.NixlBaseConnector, "bind_gpu_block_pool", wrap_bind)
    patch(base, "build_connector_meta", wrap_build)


def _spec_block_ids(spec: Any) -> list[int]:
    ids = getattr(spec, "block_ids", None)
    if ids is None:
        return []
    return [int(b) for b in ids]


def _cache_block_size(connector: Any) -> int:
    cache_config = getattr(getattr(connector, "_vllm_config", None), "cache_config", None)
    return int(getattr(cache_config, "block_size", 0) or 16)


OFFLOADING = "offloading"

CONNECTORS: dict[str, ConnectorSpec] = {
    MOONCAKE: ConnectorSpec(
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler",
        {MOONCAKE: StreamKind.HOST},
        _patch_mooncake_store,
    ),
    OFFLOADING: ConnectorSpec(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
        {OFFLOAD_H2D: StreamKind.DEVICE, OFFLOAD_H2D_SYNC: StreamKind.DEVICE, OFFLOAD_D2H: StreamKind.DEVICE},
        _patch_offloading,
    ),
    SIMPLE: ConnectorSpec(
        "vllm.v1.simple_kv_offload.manager",
        {SIMPLE_H2D: StreamKind.DEVICE, SIMPLE_D2H: StreamKind.DEVICE},
        _patch_simple_cpu_offload,
    ),
    NIXL: ConnectorSpec(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
        {NIXL: StreamKind.HOST},
        _patch_nixl,
    ),
}
"""Every connector this module can wire, by name."""

_WIRED: set[str] = set()


def wired_names() -> frozenset[str]:
    """Names of the connectors wired in this process. O(1)."""
    return frozenset(_WIRED)


def _unwired_by_env() -> set[str]:
    raw = os.environ.get(ENV_UNWIRED, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return set(CONNECTORS) if "all" in names else names


def wire(patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> list[str]:
    """Install the wrappers of every connector in :data:`CONNECTORS` that
    imports here and is not named in :data:`ENV_UNWIRED`, through
    ``patch(owner, attribute, make_wrapper)`` (the plugin's patcher, which
    records what to undo). A connector whose module does not import (a
    missing optional dependency) is skipped with one debug line. Returns the
    names wired. O(connectors).
    """
    off = _unwired_by_env()
    done = []
    for name, spec in CONNECTORS.items():
        if name in off:
            logger.info("blockpool: %s left unwired by %s: its transfers are not fenced", name, ENV_UNWIRED)
            continue
        try:
            mod = importlib.import_module(spec.module)
            spec.patch(mod, patch)
        except (ImportError, AttributeError) as exc:
            logger.debug("blockpool: cannot wire %s in this vLLM (%r)", name, exc)
            continue
        _WIRED.add(name)
        done.append(name)
    return done


def unwire() -> None:
    """Forget which connectors are wired (the plugin's ``unregister`` undoes
    the wrappers). O(1)."""
    _WIRED.clear()


_LOGGED: set[str] = set()


def leaf_connectors(connector: object) -> list[object]:
    """``connector`` itself, or the connectors a ``MultiConnector`` holds
    (recursively). O(connectors)."""
    subs = getattr(connector, "_connectors", None)
    if isinstance(subs, (list, tuple)):
        return [leaf for c in subs for leaf in leaf_connectors(c)]
    return [connector]


def report_unwired(connector: object) -> list[str]:
    """Log one line per connector class (once per process) for each
    connector under ``connector`` that no wiring is attached to: its
    transfers are not fenced. Returns the class names reported this call.
    O(connectors)."""
    out = []
    for c in leaf_connectors(connector):
        inner = [c, getattr(c, "connector_scheduler", None), getattr(c, "scheduler_manager", None)]
        if any(wiring_of(x) is not None for x in inner if x is not None):
            continue
        name = type(c).__name__
        if name not in _LOGGED:
            _LOGGED.add(name)
            out.append(name)
            logger.warning(
                "blockpool: KV connector %s is not wired to the pool: its transfers are not fenced "
                "(wired: %s)",
                name,
                ", ".join(sorted(_WIRED)) or "none",
            )
    return out
