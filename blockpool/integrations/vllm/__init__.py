"""The vLLM general plugin: make vLLM build :class:`VllmBlockPool` (a
:class:`~blockpool.HazardAwareBlockPool`) wherever it builds its ``BlockPool``.

Entry point (``pyproject.toml``)::

    [project.entry-points."vllm.general_plugins"]
    blockpool = "blockpool.integrations.vllm:register"

vLLM's ``load_general_plugins()`` calls :func:`register` in every vLLM
process (API server, engine core, workers). The pool lives in the engine
core's scheduler: ``KVCacheCoordinator.__init__`` builds it from the
module-level name ``BlockPool`` of ``vllm.v1.core.kv_cache_coordinator``.
:func:`register` rebinds that name, the defining module's
``vllm.v1.core.block_pool.BlockPool`` (so modules imported later bind ours),
and the name in every other vLLM module already imported that binds vLLM's
class (vLLM 0.33: ``single_type_kv_cache_manager``, ``hisparse.coordinator``,
``hisparse.block_pool``; classes already derived from vLLM's pool, e.g.
``SharedEventQueueBlockPool``, the HiSparse host pool, stay vLLM's). With
hazards on it also wires :class:`~blockpool.integrations.vllm.hazards.StepHazards`
into ``Scheduler.schedule``, ``Scheduler.update_from_output`` and
``KVCacheManager.take_kv_cache_block_copies``; those wrappers do nothing
for a scheduler whose pool is not ours.

Turning it off:

- ``VLLM_PLUGINS`` (vLLM's allowlist of plugin names): leave ``blockpool``
  out, e.g. ``VLLM_PLUGINS=""``, and vLLM never calls :func:`register`;
- ``BLOCKPOOL_VLLM_PLUGIN=0`` (also ``false``, ``off``, ``no``):
  :func:`register` logs one line and changes nothing;
- ``BLOCKPOOL_VLLM_HAZARDS=0``: our pool, without hazard tracking or
  scheduler wiring (a plain vLLM-compatible pool).

:func:`register` is idempotent and logs exactly one line per process, on the
``vllm.plugins.blockpool`` logger (so it appears in vLLM's log).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Any

import attrs

__all__ = [
    "ENV_HAZARDS",
    "ENV_PLUGIN",
    "InstallState",
    "install_state",
    "is_installed",
    "register",
    "unregister",
]

ENV_PLUGIN = "BLOCKPOOL_VLLM_PLUGIN"
"""Set to ``0`` / ``false`` / ``off`` / ``no`` to keep vLLM's own pool."""
ENV_HAZARDS = "BLOCKPOOL_VLLM_HAZARDS"
"""Set to ``0`` / ``false`` / ``off`` / ``no`` for our pool without hazard tracking."""

logger = logging.getLogger("vllm.plugins.blockpool")

_BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"
_COORDINATOR_MODULE = "vllm.v1.core.kv_cache_coordinator"
_ORIGINAL_ATTR = "_blockpool_vllm_BlockPool"
_FALSY = {"0", "false", "off", "no"}


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _FALSY


@attrs.define
class InstallState:
    """What :func:`register` did in this process.

    Attributes:
        installed: Our pool is bound in vLLM.
        disabled: :data:`ENV_PLUGIN` turned the plugin off.
        hazards: Hazard tracking and scheduler wiring are on.
        modules: The modules whose ``BlockPool`` name was rebound.
        original: vLLM's ``BlockPool`` class.
        patched: ``(owner, attribute, original function)`` of each wrapper
            (``None``: the attribute was inherited and is deleted on undo).
        connectors: Names of the KV connectors wired
            (:mod:`~blockpool.integrations.vllm.connectors`).
    """

    installed: bool = False
    disabled: bool = False
    hazards: bool = False
    modules: list[str] = attrs.field(factory=list)
    original: Any = None
    patched: list[tuple[Any, str, Any]] = attrs.field(factory=list)
    connectors: list[str] = attrs.field(factory=list)


_STATE = InstallState()
_LOCK = threading.Lock()


def install_state() -> InstallState:
    """The process's :class:`InstallState` (live object; read only)."""
    return _STATE


def is_installed() -> bool:
    """True when vLLM's coordinator and ``vllm.v1.core.block_pool`` both
    bind our pool (:class:`VllmBlockPool` or a subclass: the parity
    harness's). O(1)."""
    bp = sys.modules.get(_BLOCK_POOL_MODULE)
    co = sys.modules.get(_COORDINATOR_MODULE)
    if bp is None or co is None or not _STATE.installed:
        return False
    return _ours(bp.BlockPool) and _ours(co.BlockPool)


def _ours(cls: Any) -> bool:
    from blockpool.integrations.vllm.pool import VllmBlockPool

    return isinstance(cls, type) and issubclass(cls, VllmBlockPool)


def register() -> None:
    """vLLM's general-plugin entry point: install our pool (see the module
    docstring). Idempotent and thread-safe; logs one line the first time.
    O(modules loaded) for the scan of already-imported vLLM modules.

    A vLLM whose ``v1`` core cannot be imported or lacks the names rebound
    here is left alone, with one error line in the log (the engine keeps
    running on vLLM's pool). Written against vLLM 0.33.
    """
    with _LOCK:
        if _STATE.installed or _STATE.disabled:
            return
        if not _env_on(ENV_PLUGIN):
            _STATE.disabled = True
            logger.info(
                "blockpool: plugin disabled by %s=%s; vLLM keeps its own BlockPool",
                ENV_PLUGIN,
                os.environ.get(ENV_PLUGIN),
            )
            return
        try:
            _install(hazards=_env_on(ENV_HAZARDS))
        except (ImportError, AttributeError) as exc:
            # A vLLM without the v1 core this adapter targets: keep vLLM running.
            _STATE.disabled = True
            logger.error("blockpool: cannot install into this vLLM (%r); vLLM keeps its own BlockPool", exc)
            return
        logger.info(
            "blockpool %s: vLLM %s's BlockPool is now %s (HazardAwareBlockPool core; hazard tracking %s) "
            "in %d modules; KV connectors wired: %s; set %s=0 or leave 'blockpool' out of VLLM_PLUGINS "
            "to turn it off",
            _version(),
            _vllm_version(),
            "blockpool.integrations.vllm.pool.VllmBlockPool",
            "on" if _STATE.hazards else f"off by {ENV_HAZARDS}",
            len(_STATE.modules),
            ", ".join(_STATE.connectors) or "none",
            ENV_PLUGIN,
        )


def _version() -> str:
    import blockpool

    return blockpool.__version__


def _vllm_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("vllm")
    except Exception:  # noqa: BLE001  (version is only printed)
        return "?"


def _install(hazards: bool) -> None:
    import importlib

    # Import the coordinator first: it imports every module that derives a
    # class from vLLM's pool at import time, so those keep vLLM's base.
    bp = importlib.import_module(_BLOCK_POOL_MODULE)
    importlib.import_module(_COORDINATOR_MODULE)
    from blockpool.integrations.vllm.pool import VllmBlockPool

    original = getattr(bp, _ORIGINAL_ATTR, None) or bp.BlockPool
    setattr(bp, _ORIGINAL_ATTR, original)
    VllmBlockPool.default_track_hazards = hazards
    modules = []
    for name, mod in list(sys.modules.items()):
        if (name == "vllm" or name.startswith("vllm.")) and getattr(mod, "BlockPool", None) is original:
            mod.BlockPool = VllmBlockPool  # type: ignore[attr-defined]
            modules.append(name)
    _STATE.modules = sorted(modules)
    _STATE.original = original
    _STATE.hazards = hazards
    if hazards:
        _wire_scheduler()
        _wire_connectors()
    _STATE.installed = True


def unregister() -> None:
    """Undo :func:`register` (tests): rebind vLLM's class where ours was
    bound, remove the scheduler wrappers, forget the disabled flag. Pools
    already built stay what they are. O(modules loaded)."""
    with _LOCK:
        from blockpool.integrations.vllm.pool import VllmBlockPool

        original = _STATE.original
        if original is not None:
            for name, mod in list(sys.modules.items()):
                if (name == "vllm" or name.startswith("vllm.")) and _ours(getattr(mod, "BlockPool", None)):
                    mod.BlockPool = original  # type: ignore[attr-defined]
        for owner, attr, fn in reversed(_STATE.patched):
            if fn is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)
        from blockpool.integrations.vllm import connectors as vllm_connectors

        vllm_connectors.unwire()
        VllmBlockPool.default_track_hazards = True
        _STATE.__init__()  # type: ignore[misc]


# ----------------------------------------------------------------------
# scheduler wiring (hazards on)
# ----------------------------------------------------------------------


def _hazards_of_pool(pool: Any) -> Any:
    from blockpool.integrations.vllm.pool import VllmBlockPool

    return pool.hazards if isinstance(pool, VllmBlockPool) else None


def _hazards_of_scheduler(scheduler: Any) -> Any:
    manager = getattr(scheduler, "kv_cache_manager", None)
    return _hazards_of_pool(getattr(manager, "block_pool", None))


def _served() -> Any:
    from blockpool.integrations.vllm.served import SERVED

    return SERVED


def _patch(owner: Any, attr: str, make: Any) -> None:
    """Replace ``owner.attr`` by ``make(original)``, once; recorded for
    :func:`unregister`. An inherited attribute is wrapped on ``owner`` and
    deleted again on undo."""
    original = getattr(owner, attr)
    if getattr(original, "__blockpool_wrapped__", False) and attr in owner.__dict__:
        return
    own = owner.__dict__.get(attr)
    wrapper = make(original)
    wrapper.__blockpool_wrapped__ = True
    setattr(owner, attr, wrapper)
    _STATE.patched.append((owner, attr, own))


def _wire_scheduler() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def wrap_schedule(orig: Any) -> Any:
        @functools.wraps(orig)
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, *args, **kwargs)
            hz = _hazards_of_scheduler(self)
            if hz is not None and hz.step_record(out) is not None:
                _served().steps_issued += 1
            return out

        return schedule

    def wrap_update(orig: Any) -> Any:
        @functools.wraps(orig)
        def update_from_output(
            self: Any, scheduler_output: Any, model_runner_output: Any, *a: Any, **k: Any
        ) -> Any:
            hz = _hazards_of_scheduler(self)
            if hz is not None:
                if hz.end_step(scheduler_output) is not None:
                    _served().steps_ended += 1
                hz.on_connector_output(getattr(model_runner_output, "kv_connector_output", None))
            return orig(self, scheduler_output, model_runner_output, *a, **k)

        return update_from_output

    def wrap_take_copies(orig: Any) -> Any:
        @functools.wraps(orig)
        def take_kv_cache_block_copies(self: Any, *a: Any, **k: Any) -> Any:
            copies, retained = orig(self, *a, **k)
            hz = _hazards_of_pool(getattr(self, "block_pool", None))
            if hz is not None and retained and hz.begin_copies(list(zip(retained[0::2], retained[1::2]))):
                _served().copy_batches += 1
            return copies, retained

        return take_kv_cache_block_copies

    def wrap_init(orig: Any) -> Any:
        @functools.wraps(orig)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            connector = getattr(self, "connector", None)
            if connector is not None and _hazards_of_scheduler(self) is not None:
                from blockpool.integrations.vllm.connectors import report_unwired

                report_unwired(connector)

        return __init__

    def wrap_drain(orig: Any) -> Any:
        @functools.wraps(orig)
        def _drain_deferred_frees(self: Any) -> Any:
            hz = _hazards_of_scheduler(self)
            if hz is None:
                return orig(self)
            with hz.frees_after_their_steps():
                return orig(self)

        return _drain_deferred_frees

    _patch(Scheduler, "__init__", wrap_init)
    if "_drain_deferred_frees" in Scheduler.__dict__:
        _patch(Scheduler, "_drain_deferred_frees", wrap_drain)
    _patch(Scheduler, "schedule", wrap_schedule)
    _patch(Scheduler, "update_from_output", wrap_update)
    _patch(KVCacheManager, "take_kv_cache_block_copies", wrap_take_copies)


def _wire_connectors() -> None:
    """Scheduler half (:mod:`~blockpool.integrations.vllm.connectors`) and,
    where torch imports, worker half (:mod:`~blockpool.integrations.vllm.worker`)
    of the connector wiring."""
    from blockpool.integrations.vllm import connectors as vllm_connectors

    _STATE.connectors = vllm_connectors.wire(_patch)
    try:
        from blockpool.integrations.vllm import worker as vllm_worker
    except ImportError as exc:  # no torch: a scheduler-only process
        logger.debug("blockpool: worker-side connector wiring unavailable (%r)", exc)
        return
    vllm_worker.wire(_patch, _STATE.connectors)


def __getattr__(name: str) -> Any:
    # ``from blockpool.integrations.vllm import VllmBlockPool`` without
    # importing vLLM when only register() is wanted.
    if name == "VllmBlockPool":
        from blockpool.integrations.vllm.pool import VllmBlockPool

        return VllmBlockPool
    if name == "SERVED":  # no vLLM import
        from blockpool.integrations.vllm.served import SERVED

        return SERVED
    raise AttributeError(name)
