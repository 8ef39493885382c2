"""Placement: which free blocks ``allocate_for`` hands out, as functions
over the free queue and the hazard tracker.

``"lru"`` takes the queue's front (as ``get_new_blocks``). The ready-first
modes look for free blocks whose shadow is empty for the consumer (every
access on them ended, or the consumer is already ordered after it) and take
those first, so the consumer's fence has nothing in it.

``"ready_first"``: free *unkeyed* blocks whose shadow is empty for the
consumer first, in queue order, then the rest in queue order. It looks at
most ``n + PLACEMENT_SCAN`` blocks of the queue's unkeyed front; cached
blocks keep their order. ``"ready_first_cached"`` (the opt-in for cached
blocks) does the same, then, while it still needs blocks, looks at the
first ``n + CACHED_SCAN`` free *cached* blocks from the eviction end (the
coldest: LRU order under ``eviction="lru"``, segment S then M under the
other policies; reached only when the unkeyed front was scanned whole) and
takes those with an empty shadow too, evicting their keys (removed events
as for any eviction), ahead of the not-ready blocks at the queue's front.
The trade: a prefix that might still be hit, for a fence with nothing in
it; measured in ``docs/replay.md``. Only ``allocate_for`` places;
``get_new_blocks`` has no consumer to place for.
"""

from __future__ import annotations

from blockpool.block import FreeBlockQueue, KVCacheBlock
from blockpool.shadows import shadow_ready
from blockpool.tracker import HazardTracker, StreamState

__all__ = ["CACHED_SCAN", "PLACEMENTS", "PLACEMENT_SCAN", "find_ready"]

PLACEMENTS: tuple[str, ...] = ("lru", "ready_first", "ready_first_cached")
"""Placement modes of :meth:`HazardAwareBlockPool.allocate_for`."""

PLACEMENT_SCAN = 4096
"""Unkeyed free blocks ``placement="ready_first"`` looks at beyond the
``n`` it needs, at most (bounds the cost of one allocation)."""

CACHED_SCAN = 1024
"""The window of ``placement="ready_first_cached"``: free cached blocks
it looks at, from the eviction end, beyond the ``n`` it needs, at most.
Only a ready block among the coldest ``n + CACHED_SCAN`` is taken out
of eviction order, which bounds both the cost of one allocation and
how hot a prefix it may evict."""

_UNSET = object()


def find_ready(
    q: FreeBlockQueue,
    n: int,
    st: StreamState,
    tracker: HazardTracker,
    scan: int = PLACEMENT_SCAN,
    cached_scan: int | None = None,
) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
    """Ready-first placement: up to ``n`` free blocks of ``q`` with an empty
    shadow for a consumer on ``st``, without taking them. Unkeyed blocks
    first (at most ``n + scan`` looked at, in queue order); with
    ``cached_scan`` (``ready_first_cached``), then cached blocks among the
    ``n + cached_scan`` coldest, when the unkeyed front was scanned whole.
    Returns ``(unkeyed, cached)``. Readiness is decided once per distinct
    shadow (blocks freed together share it). O(n + scan + cached_scan)."""
    b = q.head.next_free_block
    tail = q.tail
    limit = n + scan
    ready: list[KVCacheBlock] = []
    lw: object = _UNSET
    lr: object = _UNSET
    ok = False
    scanned = 0
    while b is not tail and scanned < limit:
        assert b is not None
        if b.block_hash is not None or b.block_id < 0:
            break  # the cached part (or the policy queue's divider)
        w, r = b.writer, b.readers
        if w is not lw or r is not lr:
            lw, lr = w, r
            ok = shadow_ready(w, r, st, tracker)
        if ok:
            ready.append(b)
            if len(ready) == n:
                break
        scanned += 1
        b = b.next_free_block
    cached: list[KVCacheBlock] = []
    if cached_scan is not None and len(ready) < n and (b is tail or b.block_hash is not None or b.block_id < 0):  # type: ignore[union-attr]
        # The unkeyed front was scanned whole: the cached part, from
        # the eviction end (its coldest block), within the window.
        need = n - len(ready)
        limit = n + cached_scan
        scanned = 0
        while b is not tail and scanned < limit:
            assert b is not None
            if b.block_id >= 0:  # not the policy queue's divider
                w, r = b.writer, b.readers
                if w is not lw or r is not lr:
                    lw, lr = w, r
                    ok = shadow_ready(w, r, st, tracker)
                if ok:
                    cached.append(b)
                    if len(cached) == need:
                        break
                scanned += 1
            b = b.next_free_block
    return ready, cached
