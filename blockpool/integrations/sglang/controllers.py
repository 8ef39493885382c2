"""AROUND hooks on SGLang's HiCache controllers and tree cache.

- ``load`` (``HiCacheController`` and ``HybridCacheController``): the fence
  of the device pages allocated inside (the allocator hook leaves it in
  ``Runtime.last_take``, the union over every shadowed allocation the call
  made: two under ``SWATokenToKVPoolAllocator``) is kept for the queued
  ``CacheOperation``.
  Caller-owned rows (``device_indices=``), side-pool transfers
  (``extra_pools``), an unshadowed allocator and a sorted merge leave it
  unknown.
- ``write`` (both classes): the fence of a write-back is a token at the
  forward stream's tail when ``write`` is called (the pages are in the
  tree: no forward enqueued later writes them); side-pool transfers leave
  it unknown.
- ``start_loading`` / ``start_writing`` (``HiCacheController``, inherited
  by ``HybridCacheController``): the queued operations' fences are merged,
  each token replaced by its launch token (``Runtime.effective``: a token
  no forward was launched after yet leaves the fence unknown).
  In ``audit`` the original runs unchanged (SGLang's ``wait_stream`` kept)
  and the batch is counted. In ``on``, where every fence is known and the
  controller's fence stream is the bound forward stream, the transfer
  stream waits on each incomplete fence event (``wait_event``) and the
  original runs with ``load_fence_stream`` / ``write_fence_stream`` set to
  ``None`` (so it skips its ``wait_stream``), restored afterwards,
  exceptions included. Otherwise the original runs unchanged.
- ``UnifiedRadixCache.check_hicache_events`` (once per scheduler step):
  binds the forward stream, polls the fence events.
- ``UnifiedRadixCache.backup_kv_cache``: counted as a race (its
  device-to-host copy is submitted with no write fence); logged once with
  its source line.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from blockpool.integrations.sglang import hooks as _h

logger = logging.getLogger("blockpool.integrations.sglang")

__all__ = [
    "hook_backup_kv_cache",
    "hook_check_events",
    "hook_load",
    "hook_start_loading",
    "hook_start_writing",
    "hook_write",
    "unfenced_copy_line",
]


def hook_load(original: Callable[..., Any], self: Any, host_indices: Any, *args: Any, **kwargs: Any) -> Any:
    """``load``: keep the fence of the allocation made inside for the
    queued operation."""
    rt = _h._armed()
    if rt is None:
        return original(self, host_indices, *args, **kwargs)
    rt.bind(self.load_fence_stream)
    before = len(self.load_queue)
    rt.last_take = _h.NOT_TAKEN
    rt.loading += 1
    try:
        result = original(self, host_indices, *args, **kwargs)
    finally:
        rt.loading -= 1
        taken, rt.last_take = rt.last_take, _h.NOT_TAKEN
    if len(self.load_queue) > before:
        op = self.load_queue[-1]
        fence: frozenset[int] | None = None
        caller_owned = kwargs.get("device_indices") is not None
        if not caller_owned and not op.pool_transfers and not isinstance(taken, _h._NotTaken):
            fence = taken
        elif not caller_owned and not op.pool_transfers and int(host_indices.numel()) == 0:
            fence = frozenset()
        rt.op_fences[op] = fence
    return result


def hook_write(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``write``: the write-back's fence is a token at the tail now."""
    rt = _h._armed()
    if rt is None:
        return original(self, *args, **kwargs)
    rt.bind(self.write_fence_stream)
    known = self.write_fence_stream is not None and self.write_fence_stream is rt.stream
    token = rt.record() if known else _h.UNBOUND
    rt.pending_write = token  # type: ignore[attr-defined]
    queued = list(self.write_queue)
    try:
        return original(self, *args, **kwargs)
    finally:
        rt.pending_write = None  # type: ignore[attr-defined]
        # Not flushed (flush=False): the operation is still queued.
        for op in self.write_queue:
            if op not in queued and op not in rt.op_fences:
                rt.op_fences[op] = None if op.pool_transfers else frozenset({token})


def _fences(rt: _h.Runtime, ops: list[Any], pending: int | None) -> frozenset[int] | None:
    tokens: set[int] = set()
    for op in ops:
        if op in rt.op_fences:
            fence = rt.op_fences[op]
        elif pending is not None and not op.pool_transfers:
            fence = frozenset({pending})
        else:
            fence = None
        if not _h.fence_known(fence):
            return None
        tokens |= fence  # type: ignore[operator]
    return frozenset(tokens)


def _start(
    original: Callable[..., Any], self: Any, queue_name: str, fence_attr: str, stream_attr: str, kind: str
) -> Any:
    rt = _h._armed()
    queue = getattr(self, queue_name)
    if rt is None or not queue:
        return original(self)
    fence_stream = getattr(self, fence_attr)
    rt.bind(fence_stream)
    rt.poll()
    pending = getattr(rt, "pending_write", None) if kind == "write" else None
    fence = _fences(rt, list(queue), pending)
    c = rt.counters
    if kind == "load":
        c.loads += 1
    else:
        c.writes += 1
    raw = fence
    if fence is not None:
        fence = rt.effective_fence(fence)  # None: a token no forward was launched after yet
    if fence is None or fence_stream is None or fence_stream is not rt.stream:
        c.fallback += 1
        return original(self)
    c.exact += 1
    newest = rt.newest(fence)
    events = []
    if not raw:
        c.fence_empty += 1
    elif newest == 0 or rt.event_of(newest) is None:
        c.fence_complete += 1
    else:
        if rt.launched_after(newest):
            c.fence_behind_tail += 1
        events.append(rt.event_of(newest))
    if rt.mode != "on":
        return original(self)
    transfer_stream = getattr(self.l2_transfer_engine, stream_attr)
    for event in events:
        transfer_stream.wait_event(event)
    c.waits_replaced += 1
    c.events_waited += len(events)
    setattr(self, fence_attr, None)
    try:
        return original(self)
    finally:
        setattr(self, fence_attr, fence_stream)


def hook_start_loading(original: Callable[..., Any], self: Any) -> Any:
    """``start_loading``: see the module's docstring."""
    return _start(original, self, "load_queue", "load_fence_stream", "host_to_device_stream", "load")


def hook_start_writing(original: Callable[..., Any], self: Any) -> Any:
    """``start_writing``: see the module's docstring."""
    return _start(original, self, "write_queue", "write_fence_stream", "device_to_host_stream", "write")


def hook_check_events(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``check_hicache_events``: bind the forward stream, poll the events."""
    rt = _h._armed()
    if rt is not None:
        controller = getattr(self, "cache_controller", None)
        if controller is not None:
            rt.bind(getattr(controller, "load_fence_stream", None))
        rt.poll()
    return original(self, *args, **kwargs)


def unfenced_copy_line(fn: Callable[..., Any]) -> str:
    """``file:line`` of the ``submit_device_to_host`` call in ``fn`` (the
    unwrapped ``backup_kv_cache``), or ``file`` when it is not found.
    O(len(source))."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    try:
        lines, start = inspect.getsourcelines(fn)
        path = inspect.getsourcefile(fn) or "?"
    except (OSError, TypeError):
        return "?"
    for i, line in enumerate(lines):
        if "submit_device_to_host" in line:
            return f"{path}:{start + i}"
    return path


def hook_backup_kv_cache(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``backup_kv_cache``: a device-to-host copy with no write fence (it
    waits only on the schedule stream): counted as a race."""
    rt = _h._armed()
    if rt is not None:
        rt.counters.races += 1
        if not rt.race_logged:
            rt.race_logged = True
            logger.warning(
                "blockpool: race: UnifiedRadixCache.backup_kv_cache submits a device-to-host copy "
                "with no write fence (%s); the forward stream may still write the pages it reads",
                unfenced_copy_line(original),
            )
    return original(self, *args, **kwargs)
