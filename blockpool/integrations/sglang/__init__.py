"""The SGLang integration of :mod:`blockpool` (HiCache's load and write-back
fences): a general plugin SGLang loads itself.

Entry point (``pyproject.toml``)::

    [project.entry-points."sglang.srt.plugins"]
    blockpool = "blockpool.integrations.sglang:register"

SGLang's ``load_plugins()`` calls :func:`register` (in the scheduler
process among others; ``SGLANG_PLUGINS`` is its allowlist of plugin names),
then ``HookRegistry.apply_hooks()``. :func:`register` checks the running
SGLang against its declared surface
(:mod:`~blockpool.integrations.sglang.surface`; 0.5.23 only): another
version, or any drifted name, installs nothing and logs one line naming
each drifted name. Otherwise it registers AROUND hooks
(:mod:`~blockpool.integrations.sglang.hooks`,
:mod:`~blockpool.integrations.sglang.controllers`). The hooks stay inert
until the first one runs after ``apply_hooks()``: it checks that every
target was patched (``apply_hooks`` logs and skips a target that fails) and
arms them all, or none with one log line.

Modes (``BLOCKPOOL_SGLANG``): ``0`` (also ``off``, ``false``, ``no``)
installs nothing; ``audit`` (the default) computes every HiCache load's and
write-back's fence, keeps SGLang's ``wait_stream`` and counts
(:class:`~blockpool.integrations.sglang.hooks.Counters`); ``on`` makes the
transfer stream ``wait_event`` on the fence instead of ``wait_stream``
wherever the fence is known, and keeps ``wait_stream`` elsewhere. An
unknown value installs nothing (one warning).

- :mod:`blockpool.integrations.sglang.account`: the host-side page account
  beside SGLang's KV page allocator (no torch or SGLang import).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import Any

from blockpool.core.errors import InvalidArgumentError

logger = logging.getLogger("blockpool.integrations.sglang")

__all__ = ["counters", "register"]


def _hook_for(target: str) -> Callable[..., Any]:
    from blockpool.integrations.sglang import controllers as c
    from blockpool.integrations.sglang import hooks as h
    from blockpool.integrations.sglang import tree as t

    name = target.rsplit(".", 1)[1]
    table: dict[str, Callable[..., Any]] = {
        "_release_page_ids": h.hook_release,
        "alloc": h.hook_alloc,
        "alloc_extend": h.hook_alloc,
        "alloc_decode": h.hook_alloc,
        "merge_and_sort_free": h.hook_merge,
        "clear": h.hook_clear,
        "free": h.hook_token_free,
        "run_batch": h.hook_run_batch,
        "load": c.hook_load,
        "write": c.hook_write,
        "start_loading": c.hook_start_loading,
        "start_writing": c.hook_start_writing,
        "check_hicache_events": c.hook_check_events,
        "backup_kv_cache": c.hook_backup_kv_cache,
        "dec_lock_ref": t.hook_dec_lock_ref,
        "insert": t.hook_insert,
        "_evict_device_leaf": t.hook_evict_leaf,
        "_demote": t.hook_evict_leaf,
    }
    return table[name]


def _log_counters() -> None:
    data = counters()
    if data and (data["loads"] or data["writes"] or data["races"]):
        logger.info("blockpool: SGLang fence counters %s", data)


def register() -> bool:
    """SGLang's plugin entry point: check the surface, register the AROUND
    hooks (mode from ``BLOCKPOOL_SGLANG``). Returns whether hooks were
    registered; a second call in the same process does nothing and returns
    whether the first did. Never raises: SGLang's loader would only log it.
    O(size of the declared surface's source).
    """
    from blockpool.integrations.sglang import hooks as h
    from blockpool.integrations.sglang import surface as s

    if h.runtime() is not None:
        return True
    try:
        mode = h.read_mode()
    except InvalidArgumentError as exc:
        logger.warning("blockpool: %s; the SGLang plugin installs nothing", exc)
        return False
    if mode == "off":
        logger.info("blockpool: %s=0; the SGLang plugin installs nothing", h.ENV_MODE)
        return False
    version = s.installed_version()
    surface = s.surface_for(version)
    if surface is None:
        logger.warning(
            "blockpool: SGLang %s has no declared surface (declared: %s); the plugin installs nothing",
            version,
            ", ".join(sorted(s.SUPPORTED_SGLANG)),
        )
        return False
    drifts = s.check_surface(surface)
    if drifts:
        logger.warning(
            "blockpool: SGLang %s drifted from its declared surface: %s; the plugin installs nothing",
            version,
            "; ".join(str(d) for d in drifts),
        )
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    rt = h.Runtime(mode)
    targets = tuple(e.target for e in surface if e.role == "wrap" and s.present(e))
    rt.targets = targets
    rt.launch_hooked = any(t.endswith(".run_batch") for t in targets)
    for target in targets:
        HookRegistry.register(target, _hook_for(target), HookType.AROUND)
    h.set_runtime(rt)
    atexit.register(_log_counters)
    logger.info("blockpool: SGLang plugin registered %d hooks (%s mode)", len(targets), mode)
    return True


def counters() -> dict[str, int] | None:
    """The process's fence counters by name
    (:class:`~blockpool.integrations.sglang.hooks.Counters`, plus ``gain``),
    ``None`` when the plugin is not installed. O(1)."""
    from blockpool.integrations.sglang import hooks as h

    rt = h.runtime()
    return None if rt is None else rt.counters.as_dict()
