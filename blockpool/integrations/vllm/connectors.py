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

This module holds the scheduler halves of vLLM's own connectors
(MooncakeStore, Offloading, SimpleCPUOffload, NIXL) and registers them at
import (:func:`~blockpool.integrations.vllm.wiring.register_connector`);
what every connector module shares (the wiring object, the metadata names,
the wrappers, the registry and :func:`wire`) is
:mod:`~blockpool.integrations.vllm.wiring`'s, re-exported here. It imports
vLLM lazily (inside :func:`wire`) and never torch; the worker halves are
:mod:`blockpool.integrations.vllm.worker`'s.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from blockpool.core.hazards import StreamKind
from blockpool.integrations.vllm.wiring import (
    _WIRED,
    CONNECTORS,
    ENV_UNWIRED,
    META_LOAD,
    META_STEP,
    META_STOCK,
    META_STORE,
    ConnectorSpec,
    ConnectorWiring,
    Patcher,
    _binder,
    _planner,
    _put,
    _reporter,
    _unwired_by_env,  # noqa: F401  (re-exported: tests read it here)
    attach,
    config_block_size,
    group_block_sizes,
    load_block_ids,
    register_connector,
    unwire,
    wire,
    wired_names,
    wiring_of,
)

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
    ids = sched._store_group_ids or range(len(sizes))
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
    coord = sched._store_coord  # None where no store group needs one (0.33 and 0.34)
    lcm = (bs if coord is None else coord.lcm_block_size) or bs
    end = (rm.token_len_chunk or 0) // lcm * lcm
    skip = sched._boundary_state_group_ids
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
    from blockpool.integrations.vllm.surface import active

    sync_loads = active().offloading_sync_loads  # TransferJob.sync: 0.33 and later
    for job_id, job in meta.load_jobs.items():
        stream = OFFLOAD_H2D_SYNC if sync_loads and job.sync else OFFLOAD_H2D
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

    failed = worker_meta.failed_jobs if active().offloading_failed_jobs else ()
    for job_id, count in jobs.items():
        w.report((OFFLOADING, job_id), count, sched.config.num_workers, failed=job_id in failed)


def _patch_offloading(mod: Any, patch: Patcher) -> None:
    cls = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
    ).OffloadingConnectorScheduler
    bind = _binder(OFFLOADING, "connector_scheduler", "_kv_cache_config", config_block_size)
    patch(mod.OffloadingConnector, "bind_gpu_block_pool", bind)
    patch(cls, "build_connector_meta", _planner(_plan_offloading))
    patch(cls, "update_connector_output", _reporter("completed_jobs", _offload_jobs_done))


def _spec_block_ids(spec: Any) -> list[int]:
    return [int(b) for b in spec.block_ids]


# ----------------------------------------------------------------------
# SimpleCPUOffload (scheduler side)
# ----------------------------------------------------------------------


def _plan_simple(sched: Any, w: ConnectorWiring, meta: Any, _: Any) -> None:
    loads = {}
    for req_id in meta.load_event_to_reqs.get(meta.load_event, ()):
        state = sched._reqs_to_load.get(req_id)
        transfer = None if state is None else state.transfer_meta
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
    bound = _binder(NIXL, "connector_scheduler", "_kv_cache_config", config_block_size)(orig)

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


register_connector(
    MOONCAKE,
    ConnectorSpec(
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler",
        {MOONCAKE: StreamKind.HOST},
        _patch_mooncake_store,
    ),
)
register_connector(
    OFFLOADING,
    ConnectorSpec(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
        {OFFLOAD_H2D: StreamKind.DEVICE, OFFLOAD_H2D_SYNC: StreamKind.DEVICE, OFFLOAD_D2H: StreamKind.DEVICE},
        _patch_offloading,
    ),
)
register_connector(
    SIMPLE,
    ConnectorSpec(
        "vllm.v1.simple_kv_offload.manager",
        {SIMPLE_H2D: StreamKind.DEVICE, SIMPLE_D2H: StreamKind.DEVICE},
        _patch_simple_cpu_offload,
    ),
)
register_connector(
    NIXL,
    ConnectorSpec(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
        {NIXL: StreamKind.HOST},
        _patch_nixl,
    ),
)


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


def scheduler_block_sizes(scheduler: Any) -> tuple[int, ...] | None:
    """The block size (tokens) each KV cache group of ``scheduler`` allocates
    by, in block-table order: its ``SingleTypeKVCacheManager.block_size``
    (vLLM 0.32 and 0.33: ``kv_cache_spec.block_size * dcp_world_size`` for a
    DCP-sharded group, the spec's size otherwise). This, not the spec's
    size, maps a token index to a block-table index. ``None`` when the
    scheduler has no such managers. O(groups)."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    if not managers:
        return None
    sizes = tuple(m.block_size for m in managers)
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
    if vllm_config.speculative_config is not None:
        return "speculative decoding is on"
    pcp = vllm_config.parallel_config.prefill_context_parallel_size
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
    connector = scheduler.connector
    if connector is None:
        return []
    sizes = scheduler_block_sizes(scheduler)
    reason = stock_waits_reason(scheduler.vllm_config, sizes)
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
