"""Scheduler-side wiring of vLLM's KV connectors: every load and store they
start begins on our pool, and its fence rides to the workers in the
connector's own metadata.

:func:`wire` (called by :func:`blockpool.integrations.vllm.register` when
hazards are on) wraps a few methods of each connector it knows; the
wrappers act only for a connector instance bound to a
:class:`~blockpool.integrations.vllm.pool.VllmBlockPool` with hazard
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
   Offloading's ``completed_jobs``) once every rank reported a job; from
   vLLM 0.34 Offloading also names the jobs a worker reported failed
   (``failed_jobs``): such a job's transfers end failed (a failed load's
   blocks lose their keys, never published).

Wired connectors (vLLM 0.32 to 0.34), their stream or engine and its kind:

============================  =========================================  ======
connector                     stream / engine                            kind
============================  =========================================  ======
``MooncakeStoreConnector``    ``mooncake_store`` (send and recv threads)  HOST
``OffloadingConnector``       ``offload_h2d``, ``offload_h2d_sync``,      DEVICE
                              ``offload_d2h`` (CUDA copy streams)
``SimpleCPUOffloadConnector`` ``simple_cpu_h2d``, ``simple_cpu_d2h``      DEVICE
                              (scheduler side only)
``NixlConnector`` (pull/push) ``nixl`` (remote reads into decode blocks)  HOST
``LMCacheConnectorV1``        ``lmcache_load``, ``lmcache_store``         DEVICE
                              (LMCache's copy streams; see
                              :mod:`~blockpool.integrations.vllm.lmcache`)
``LMCacheMPConnector``        ``lmcache_mp_load``, ``lmcache_mp_store``   HOST
(LMCache's own class)         (the LMCache server's copies; see
                              :mod:`~blockpool.integrations.vllm.lmcache_mp`)
============================  =========================================  ======

Any other connector logs one line when a scheduler binds it to our pool:
its transfers are not fenced. ``BLOCKPOOL_VLLM_UNWIRED`` (a comma-separated
list of names from :data:`CONNECTORS`, or ``all``) leaves connectors
unwired, restoring vLLM's behaviour for them; a name not in
:data:`CONNECTORS` leaves every connector unwired, with one error line.

This module imports vLLM lazily (inside :func:`wire`) and never torch; the
worker half is :mod:`blockpool.integrations.vllm.worker`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from blockpool.core.hazards import StreamKind
from blockpool.integrations.vllm import lmcache as _lmcache
from blockpool.integrations.vllm import lmcache_mp as _lmcache_mp
from blockpool.integrations.vllm.hazards import StepHazards, Transfer, engine_give_up

__all__ = [
    "CONNECTORS",
    "ENV_UNWIRED",
    "META_LOAD",
    "META_STEP",
    "META_STOCK",
    "META_STORE",
    "ConnectorSpec",
    "ConnectorWiring",
    "attach",
    "group_block_sizes",
    "leaf_connectors",
    "load_block_ids",
    "on_scheduler_built",
    "report_unwired",
    "scheduler_block_sizes",
    "stock_waits_reason",
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
META_STOCK = "blockpool_stock_waits"
"""Attribute of a wired connector's metadata, ``True`` when the scheduler's
configuration is one whose fences the wiring cannot show exact
(:func:`stock_waits_reason`): the worker keeps vLLM's own wait for every
transfer (MooncakeStore's ``current_event``) and adds the fence on top."""

_ATTR = "_blockpool_wiring"


@attrs.define
class ConnectorWiring:
    """One connector instance's link to a pool's :class:`StepHazards`.

    Attributes:
        name: The connector's name in :data:`CONNECTORS`.
        hazards: The scheduler's step and transfer wiring.
        block_sizes: Block size (tokens) of each KV cache group, in the
            order of the scheduler's block tables: the size the group's
            manager allocates by (``kv_cache_spec.block_size`` times the
            decode context parallel size for a DCP-sharded group), set from
            the scheduler's managers once it is built
            (:func:`on_scheduler_built`).
        pending: Keys of transfers begun and not ended (job-keyed connectors).
        reports: Completion reports counted so far per job key.
        failed_reports: Job keys some worker reported failed, until every
            rank reported them (:meth:`report`).
        stock_waits: The wiring cannot show this scheduler's fences exact
            (:func:`stock_waits_reason`), so the workers keep vLLM's own
            waits and add the fences on top (:data:`META_STOCK` on every
            step's metadata). True until :func:`on_scheduler_built` read the
            block sizes from the scheduler's managers and found nothing else
            in the way.
        faults: Steps whose fence planning raised (logged once): those
            steps shipped :data:`META_STOCK`, and vLLM's scheduler never saw
            the exception.
    """

    name: str
    hazards: StepHazards
    block_sizes: tuple[int, ...]
    pending: set[Hashable] = attrs.field(factory=set)
    reports: dict[Hashable, int] = attrs.field(factory=dict)
    failed_reports: set[Hashable] = attrs.field(factory=set)
    stock_waits: bool = True
    faults: int = 0

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
        self.failed_reports.discard(key)
        return self.hazards.finish(key, failed=failed)

    def report(self, key: Hashable, count: int, needed: int, *, failed: bool = False) -> int:
        """Count ``count`` workers' completion reports of the job under
        ``key``; once ``needed`` (every rank) reported, end its transfers:
        failed when any report said the job failed (``failed``, on this
        call or an earlier one), else completed. Never before every rank
        reported: a rank whose copy still runs may still touch the blocks.
        Counted here, not read from the connector's own job table (which a
        cache reset clears while the jobs still run). Returns the number of
        transfers ended. O(1)."""
        if key not in self.pending:
            return 0
        if failed:
            self.failed_reports.add(key)
        n = self.reports.get(key, 0) + count
        if n < needed:
            self.reports[key] = n
            return 0
        return self.finish(key, failed=key in self.failed_reports)

    def _begin(
        self,
        begin: Callable[..., Transfer],
        request_id: str,
        block_ids: Iterable[int],
        stream: str,
        key: Hashable,
    ) -> Any:
        from blockpool.core.errors import UnsafeTransferError

        blocks = self.hazards.blocks_of(block_ids)
        if not blocks:
            return None
        try:
            t = begin(request_id, blocks, stream, key=key)
        except UnsafeTransferError as exc:
            # The pool refused it (a load into a block another request still
            # reads, a store of content a failed load left bad): not begun in
            # the pool, nothing changed there, and no exception out of vLLM's
            # scheduler. Without a wire form the worker keeps vLLM's own path
            # for it (vLLM's own waits, as stock: never weaker).
            logger.warning(
                "blockpool: %s: %s of request %r not fenced, left to vLLM's own path: %s",
                self.name, begin.__name__.removeprefix("begin_"), request_id, exc,
            )  # fmt: skip
            return None
        if key is not None:
            self.pending.add(key)
        from blockpool.integrations.vllm.served import SERVED

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
    from blockpool.integrations.vllm.pool import VllmBlockPool

    hz = pool.hazards if isinstance(pool, VllmBlockPool) else None
    if hz is None or name not in _WIRED:
        if getattr(obj, _ATTR, None) is not None:
            setattr(obj, _ATTR, None)
        return None
    for stream, kind in CONNECTORS[name].streams.items():
        hz.add_stream(stream, kind)
        if kind is StreamKind.HOST:  # its transfers' leases end at the connector's own give-up time
            hz.give_up_after(stream, engine_give_up(name, obj))
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
    patch: Callable[[Any, Any], None]


Patcher = Callable[[Any, str, Callable[[Any], Any]], None]

MOONCAKE = "mooncake_store"
OFFLOADING = "offloading"
OFFLOAD_H2D = "offload_h2d"
OFFLOAD_H2D_SYNC = "offload_h2d_sync"
OFFLOAD_D2H = "offload_d2h"
SIMPLE = "simple_cpu_offload"
SIMPLE_H2D = "simple_cpu_h2d"
SIMPLE_D2H = "simple_cpu_d2h"
NIXL = "nixl"

# ----------------------------------------------------------------------
# the three wrappers every connector gets, parameterised
# ----------------------------------------------------------------------


def _binder(name: str, inner: str | None, config_attr: str, default_size: Callable[[Any], int]) -> Any:
    """Wrap ``bind_gpu_block_pool``: after vLLM's code, attach the wiring to
    the connector (``inner=None``) or to its scheduler half ``getattr(self,
    inner)``, with the block sizes of ``getattr(self, config_attr)``."""

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> None:
            orig(self, gpu_block_pool)
            target = self if inner is None else getattr(self, inner, None)
            if target is not None:
                sizes = group_block_sizes(getattr(self, config_attr, None), default_size(self))
                attach(target, gpu_block_pool, name, sizes)

        return bind_gpu_block_pool

    return make


def _planner(
    plan: Callable[[Any, ConnectorWiring, Any, Any], None], before: Callable[[Any], Any] | None = None
) -> Any:
    """Wrap ``build_connector_meta``: issue the step's tokens and tag its
    writes, run vLLM's code, then ``plan(self, wiring, meta, before(self))``
    begins the transfers vLLM planned; the step's record goes on the
    metadata. A connector without wiring runs vLLM's code alone."""

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
            w = wiring_of(self)
            if w is None:
                return orig(self, scheduler_output)
            failed: BaseException | None = None
            step = ctx = None
            try:
                step = w.begin_step(scheduler_output)
                ctx = before(self) if before is not None else None
            except Exception as exc:  # noqa: BLE001  (never out of vLLM's scheduler)
                failed = exc
            meta = orig(self, scheduler_output)
            if failed is None:
                try:
                    plan(self, w, meta, ctx)
                except Exception as exc:  # noqa: BLE001
                    failed = exc
            if step is not None:
                setattr(meta, META_STEP, step)
            if failed is not None:
                # A wiring fault (a vLLM whose objects differ, a pool error):
                # what was begun keeps its fence; the rest of the step keeps
                # vLLM's own waits, and so does everything fenced, on top.
                w.faults += 1
                if w.faults == 1:
                    logger.error(
                        "blockpool: %s: planning the step's fences failed (%r); this step keeps vLLM's own "
                        "waits (further faults are counted in the wiring, not logged)",
                        w.name,
                        failed,
                    )
            if w.stock_waits or failed is not None:
                setattr(meta, META_STOCK, True)
            return meta

        return build_connector_meta

    return make


def _reporter(field: str, on_reports: Callable[[Any, ConnectorWiring, dict[Any, int], Any], None]) -> Any:
    """Wrap ``update_connector_output``: before vLLM's code (which may free
    or release a finished job's blocks: a block freed with its transfer
    still pending would be held back), hand the per-job completion counts
    of ``kv_connector_worker_meta.<field>`` to ``on_reports(self, wiring,
    counts, worker_meta)`` (the whole ``kv_connector_worker_meta``, for
    the failures it reports). A wiring fault is counted in the wiring and
    logged once, never raised into vLLM's scheduler."""

    def make(orig: Any) -> Any:
        @functools.wraps(orig)
        def update_connector_output(self: Any, connector_output: Any) -> None:
            w = wiring_of(self)
            worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            counts = getattr(worker_meta, field, None)
            if w is not None and counts:
                try:
                    on_reports(self, w, counts, worker_meta)
                except Exception as exc:  # noqa: BLE001  (never out of vLLM's scheduler)
                    w.faults += 1
                    if w.faults == 1:
                        logger.error(
                            "blockpool: %s: ending the reported jobs' transfers failed (%r); they stay "
                            "pending in the pool (further faults are counted in the wiring, not logged)",
                            w.name,
                            exc,
                        )
            return orig(self, connector_output)

        return update_connector_output

    return make


def _put(item: Any, attr: str, wire_form: Any) -> None:
    if wire_form is not None:
        setattr(item, attr, wire_form)


def _cache_block_size(connector: Any) -> int:
    cache_config = getattr(getattr(connector, "_vllm_config", None), "cache_config", None)
    return int(getattr(cache_config, "block_size", 0) or 16)


# ----------------------------------------------------------------------
# MooncakeStore
# ----------------------------------------------------------------------


def _plan_mooncake(sched: Any, w: ConnectorWiring, meta: Any, pinned_before: set[int]) -> None:
    sizes = _store_group_sizes(sched, w)
    for rm in meta.requests:
        ls = rm.load_spec
        if ls is not None and ls.can_load:
            ids = load_block_ids(rm.block_ids, ls.vllm_cached_tokens, ls.kvpool_cached_tokens, sizes)
            _put(rm, META_LOAD, w.load(rm.req_id, ids, MOONCAKE))
        job = rm.store_job_id
        if rm.can_save and job is not None and job not in pinned_before and job in sched._pinned_saves:
            reads = _mooncake_store_reads(sched, rm, sizes)
            _put(rm, META_STORE, w.store(rm.req_id, reads, MOONCAKE, key=(MOONCAKE, job)))


def _mooncake_saves_done(sched: Any, w: ConnectorWiring, saves: dict[int, int], _: Any) -> None:
    for job, count in saves.items():
        pinned = sched._pinned_saves.get(job)
        if pinned is not None and pinned[1] - count <= 0:
            w.finish((MOONCAKE, job))


def _patch_mooncake_store(mod: Any, patch: Patcher) -> None:
    cls = mod.MooncakeStoreScheduler
    patch(
        cls, "bind_gpu_block_pool", _binder(MOONCAKE, None, "kv_cache_config", lambda s: s._block_size or 16)
    )
    patch(cls, "build_connector_meta", _planner(_plan_mooncake, lambda s: set(s._pinned_saves)))
    patch(cls, "update_connector_output", _reporter("completed_saves", _mooncake_saves_done))


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
    ids = (
        load_block_ids(groups, 0, end, [sizes[i] if i < len(sizes) else bs for i in keep]) if end > 0 else []
    )
    ids.extend(p.block_id for p in rm.boundary_puts or ())
    return list(dict.fromkeys(ids))


# ----------------------------------------------------------------------
# Offloading (CPU offload on CUDA copy streams)
# ----------------------------------------------------------------------


def _plan_offloading(sched: Any, w: ConnectorWiring, meta: Any, _: Any) -> None:
    for job_id, job in meta.load_jobs.items():
        stream = OFFLOAD_H2D_SYNC if getattr(job, "sync", False) else OFFLOAD_H2D
        _put(
            job,
            META_LOAD,
            w.load(job.req_id, _spec_block_ids(job.dst_spec), stream, key=(OFFLOADING, job_id)),
        )
    # Tokens of one stream are issued in the order its worker submits the
    # jobs: store jobs this step flushes go first (the worker submits them
    # at once), the others at the next step's start.
    flush = meta.jobs_to_flush or ()
    for job_id, job in sorted(meta.store_jobs.items(), key=lambda item: item[0] not in flush):
        _put(
            job,
            META_STORE,
            w.store(job.req_id, _spec_block_ids(job.src_spec), OFFLOAD_D2H, key=(OFFLOADING, job_id)),
        )


def _offload_jobs_done(sched: Any, w: ConnectorWiring, jobs: dict[int, int], worker_meta: Any) -> None:
    # Counted by the wiring: a cache reset clears vLLM's own job table while
    # the jobs still run on the workers. A job any worker reported failed
    # (vLLM 0.34's failed_jobs: a copy that did not run to its end) fails
    # its token once every worker reported it: a failed load's blocks lose
    # their keys and are never published; a failed store ends as a failed
    # read of its blocks.
    from blockpool.integrations.vllm.surface import active

    failed = (getattr(worker_meta, "failed_jobs", None) or ()) if active().offloading_failed_jobs else ()
    for job_id, count in jobs.items():
        w.report((OFFLOADING, job_id), count, sched.config.num_workers, failed=job_id in failed)


def _patch_offloading(mod: Any, patch: Patcher) -> None:
    cls = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
    ).OffloadingConnectorScheduler
    bind = _binder(OFFLOADING, "connector_scheduler", "_kv_cache_config", _cache_block_size)
    patch(mod.OffloadingConnector, "bind_gpu_block_pool", bind)
    patch(cls, "build_connector_meta", _planner(_plan_offloading))
    patch(cls, "update_connector_output", _reporter("completed_jobs", _offload_jobs_done))


def _spec_block_ids(spec: Any) -> list[int]:
    ids = getattr(spec, "block_ids", None)
    return [] if ids is None else [int(b) for b in ids]


# ----------------------------------------------------------------------
# SimpleCPUOffload (scheduler side)
# ----------------------------------------------------------------------


def _plan_simple(sched: Any, w: ConnectorWiring, meta: Any, _: Any) -> None:
    loads = {}
    for req_id in meta.load_event_to_reqs.get(meta.load_event, ()):
        transfer = getattr(sched._reqs_to_load.get(req_id), "transfer_meta", None)
        if transfer is not None:
            wire_load = w.load(req_id, transfer.gpu_block_ids, SIMPLE_H2D)
            if wire_load is not None:
                loads[req_id] = wire_load
    setattr(meta, META_LOAD, loads)
    if meta.store_event >= 0:
        _put(meta, META_STORE, w.store("", meta.store_gpu_blocks, SIMPLE_D2H, key=(SIMPLE, meta.store_event)))


def _simple_stores_done(sched: Any, w: ConnectorWiring, events: dict[int, int], _: Any) -> None:
    for event, count in events.items():
        if sched._store_event_pending_counts.get(event, 0) + count >= sched._expected_worker_count:
            w.finish((SIMPLE, event))


def _patch_simple_cpu_offload(mod: Any, patch: Patcher) -> None:
    cls = mod.SimpleCPUOffloadScheduler
    patch(cls, "bind_gpu_block_pool", _binder(SIMPLE, None, "kv_cache_config", lambda s: s.block_size or 16))
    patch(cls, "build_connector_meta", _planner(_plan_simple))
    patch(cls, "update_connector_output", _reporter("completed_store_events", _simple_stores_done))


# ----------------------------------------------------------------------
# NIXL (remote reads into decode blocks)
# ----------------------------------------------------------------------


def _plan_nixl(sched: Any, w: ConnectorWiring, meta: Any, _: Any) -> None:
    for req_id, rm in meta.reqs_to_recv.items():
        # Only a read the scheduler awaits is reported back
        # (finished_recving / failed_recving / invalid_block_ids).
        if rm.awaiting_kvs:
            ids = [b for group in rm.local_block_ids for b in group]
            _put(rm, META_LOAD, w.load(req_id, ids, NIXL))


def _nixl_binder(orig: Any) -> Any:
    """:func:`_binder` for NIXL, which also declares the ``nixl`` engine one
    whose workers rewrite the blocks they received
    (:meth:`StepHazards.rewrites_on_receive`): NIXL's worker enqueues its
    post-receive kernels on the compute stream when it reports a read
    finished, so those blocks count as written by the next step."""
    bound = _binder(NIXL, "connector_scheduler", "_kv_cache_config", _cache_block_size)(orig)

    @functools.wraps(orig)
    def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> None:
        bound(self, gpu_block_pool)
        w = wiring_of(getattr(self, "connector_scheduler", None))
        if w is not None:
            w.hazards.rewrites_on_receive(NIXL)

    return bind_gpu_block_pool


def _patch_nixl(mod: Any, patch: Patcher) -> None:
    conn = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector")
    patch(conn.NixlBaseConnector, "bind_gpu_block_pool", _nixl_binder)
    patch(mod.NixlBaseConnectorScheduler, "build_connector_meta", _planner(_plan_nixl))


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
    _lmcache.LMCACHE: ConnectorSpec(_lmcache.MODULE, _lmcache.STREAMS, _lmcache.patch_scheduler),
    _lmcache_mp.LMCACHE_MP: ConnectorSpec(
        _lmcache_mp.MODULE, _lmcache_mp.STREAMS, _lmcache_mp.patch_scheduler
    ),
}
"""Every connector this module can wire, by name."""

_WIRED: set[str] = set()


def wired_names() -> frozenset[str]:
    """Names of the connectors wired in this process. O(1)."""
    return frozenset(_WIRED)


def _unwired_by_env() -> set[str]:
    """The connector names :data:`ENV_UNWIRED` leaves unwired: its
    comma-separated names (blanks around them ignored), every name of
    :data:`CONNECTORS` for ``all``, none when it is unset or empty.
    O(len of the setting).

    Raises:
        InvalidArgumentError: it names something that is neither a name of
            :data:`CONNECTORS` nor ``all`` (a one-line message naming each
            such name and the valid ones); nothing is read as unwired then.
    """
    from blockpool.core.errors import InvalidArgumentError

    raw = os.environ.get(ENV_UNWIRED, "")
    names = list(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n != "all" and n not in CONNECTORS]
    if unknown:
        raise InvalidArgumentError(
            f"{ENV_UNWIRED} names no known KV connector: {', '.join(map(repr, unknown))} "
            f"(valid: {', '.join(CONNECTORS)}, or all)"
        )
    return set(CONNECTORS) if "all" in names else set(names)


def wire(patch: Patcher, errors: dict[str, str] | None = None, skip: Iterable[str] = ()) -> list[str]:
    """Install the wrappers of every connector in :data:`CONNECTORS` that
    imports here and is not named in :data:`ENV_UNWIRED`, through
    ``patch(owner, attribute, make_wrapper)`` (the plugin's patcher, which
    records what to undo and returns a function undoing that one wrapper).

    Each connector is wired all or nothing: when one of its wrappers fails
    (a name vLLM renamed or removed), the wrappers it got before are undone
    and it runs as vLLM built it, with one warning (its transfers are not
    fenced); the error goes into ``errors`` under its name. A connector
    whose module does not import for want of an optional third-party
    dependency cannot run here and is skipped with one debug line. Returns
    the names wired. Connectors named in ``skip`` are left as vLLM built
    them (the caller has said why). A :data:`ENV_UNWIRED` that names an
    unknown connector (:func:`_unwired_by_env` raises) leaves every
    connector as vLLM built it, with one ERROR line naming the unknown and
    the valid names; each connector's entry in ``errors`` says so.
    O(connectors).
    """
    from blockpool.core.errors import InvalidArgumentError

    try:
        off = _unwired_by_env()
        refused = None
    except InvalidArgumentError as exc:
        # The operator meant some connector off and named it wrong: every
        # connector is left as vLLM built it (its own waits), the safe side
        # of whatever was meant; the pool itself still installs.
        off, refused = set(CONNECTORS), f"{exc}; every KV connector is left as vLLM built it"
        logger.error("blockpool: %s (its own waits, not fenced) until the setting is corrected", refused)
    skipped = set(skip)
    done = []
    for name, spec in CONNECTORS.items():
        if name in skipped:
            continue
        if name in off:
            if refused is not None:
                if errors is not None:
                    errors[name] = refused
            else:
                logger.info(
                    "blockpool: %s left unwired by %s: its transfers are not fenced", name, ENV_UNWIRED
                )
            continue
        undo: list[Callable[[], None]] = []

        def recording(
            owner: Any, attr: str, make: Callable[[Any], Any], _undo: list[Callable[[], None]] = undo
        ) -> None:
            u = patch(owner, attr, make)
            if u is not None:
                _undo.append(u)

        try:
            mod = importlib.import_module(spec.module)
            spec.patch(mod, recording)
        except Exception as exc:  # noqa: BLE001  (vLLM's code differs: leave the connector as it is)
            for u in reversed(undo):
                u()
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            if missing is not None and missing.split(".")[0] != "vllm":
                logger.debug("blockpool: %s not available in this environment (%r)", name, exc)
                continue
            if errors is not None:
                errors[name] = repr(exc)
            logger.warning(
                "blockpool: cannot wire KV connector %s in this vLLM (%r): it runs as vLLM built it, "
                "its transfers are not fenced",
                name,
                exc,
            )
            continue
        _WIRED.add(name)
        _UNDO[name] = undo
        done.append(name)
    return done


_UNDO: dict[str, list[Callable[[], None]]] = {}


def unwire(names: Iterable[str] | None = None) -> None:
    """Without ``names``: forget which connectors are wired (the plugin's
    ``unregister`` undoes the wrappers). With ``names``: undo those
    connectors' scheduler-side wrappers (newest first) and forget them, so
    they run as vLLM built them. O(wrappers undone)."""
    if names is None:
        _WIRED.clear()
        _UNDO.clear()
        return
    for name in names:
        for u in reversed(_UNDO.pop(name, ())):
            u()
        _WIRED.discard(name)


_LOGGED: set[str] = set()


def leaf_connectors(connector: object) -> list[object]:
    """``connector`` itself, or the connectors a ``MultiConnector`` holds
    (recursively). O(connectors)."""
    subs = getattr(connector, "_connectors", None)
    if isinstance(subs, (list, tuple)):
        return [leaf for c in subs for leaf in leaf_connectors(c)]
    return [connector]


def _wirings_under(connector: object) -> Iterator[tuple[object, ConnectorWiring | None]]:
    """``(leaf connector, its wiring or None)`` for each connector under
    ``connector``; the wiring sits on the connector or on its scheduler half."""
    for c in leaf_connectors(connector):
        inner = [c, getattr(c, "connector_scheduler", None), getattr(c, "scheduler_manager", None)]
        found = [w for w in (wiring_of(x) for x in inner if x is not None) if w is not None]
        yield c, found[0] if found else None


def scheduler_block_sizes(scheduler: object) -> tuple[int, ...] | None:
    """The block size (tokens) each KV cache group of ``scheduler`` allocates
    by, in block-table order: its ``SingleTypeKVCacheManager.block_size``
    (vLLM 0.32 and 0.33: ``kv_cache_spec.block_size * dcp_world_size`` for a
    DCP-sharded group, the spec's size otherwise). This, not the spec's
    size, maps a token index to a block-table index. ``None`` when the
    scheduler has no such managers. O(groups)."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    managers = getattr(getattr(manager, "coordinator", None), "single_type_managers", None)
    if not managers:
        return None
    sizes = tuple(getattr(m, "block_size", 0) for m in managers)
    return sizes if all(type(b) is int and b > 0 for b in sizes) else None


def stock_waits_reason(vllm_config: object, block_sizes: tuple[int, ...] | None) -> str | None:
    """Why the wiring cannot show the fences of a scheduler with this
    configuration exact (so its workers keep vLLM's own waits as well), or
    ``None`` when it can:

    - ``block_sizes`` unknown (no managers to read them from);
    - speculative decoding: the draft model writes KV after the target
      forward; ``eN`` is recorded after the draft (``finalize_kv_connector``),
      but that path is not run on a real engine here;
    - prefill context parallelism (PCP > 1): the worker's placement of a
      block's tokens across PCP ranks is not modelled.

    O(1)."""
    if block_sizes is None:
        return "the KV cache groups' block sizes could not be read from the scheduler"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is on"
    pcp = getattr(getattr(vllm_config, "parallel_config", None), "prefill_context_parallel_size", 1)
    if isinstance(pcp, int) and pcp > 1:
        return f"prefill context parallelism is on (size {pcp})"
    return None


def on_scheduler_built(scheduler: object) -> list[str]:
    """Called by the plugin once a ``Scheduler`` whose pool is ours is built
    (its connectors are bound by then): give every wired connector the
    block sizes the scheduler's managers allocate by
    (:func:`scheduler_block_sizes`), turn on :attr:`ConnectorWiring.stock_waits`
    where :func:`stock_waits_reason` says so (one INFO line per connector),
    and report the connectors left unwired (:func:`report_unwired`).
    Returns the unwired class names reported. O(connectors + groups)."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return []
    sizes = scheduler_block_sizes(scheduler)
    reason = stock_waits_reason(getattr(scheduler, "vllm_config", None), sizes)
    for c, w in _wirings_under(connector):
        if w is None:
            continue
        if sizes is not None:
            w.block_sizes = sizes
        w.stock_waits = reason is not None
        if reason is not None:
            logger.info(
                "blockpool: %s keeps vLLM's own waits and adds its fences on top: %s",
                type(c).__name__,
                reason,
            )
    return report_unwired(connector)


def report_unwired(connector: object) -> list[str]:
    """Log one line per connector class (once per process) for each
    connector under ``connector`` that no wiring is attached to: its
    transfers are not fenced. Returns the class names reported this call.
    O(connectors)."""
    out = []
    for c, w in _wirings_under(connector):
        if w is not None:
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
