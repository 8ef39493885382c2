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
it; measured in ``docs/replay.md``.

The run-aware modes hand out blocks in runs of consecutive block ids, so
that a transfer of them posts one descriptor per run (NIXL, Mooncake, a
``cudaMemcpy`` batch). ``"runs"``: among the first ``n + RUN_SCAN`` blocks
of the unkeyed front (interchangeable for the prefix cache: they hold no
key, so which of them is taken changes no hit), the fewest runs
(:func:`fewest_runs`); the rest, if the unkeyed front is short, from the
queue's front, so LRU still chooses every evicted key; the result in
ascending block-id order. ``"runs_cached"`` (the opt-in for cached
blocks): when the unkeyed front holds fewer than ``n``, the window also
takes in the ``n + RUN_SCAN`` coldest free cached blocks, so a run may
evict a key a little younger than the coldest. ``"ready_first_runs"``:
``"runs"`` over the *ready* blocks of the window. Only ``allocate_for``
places; ``get_new_blocks`` has no consumer to place for.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from blockpool.core.block import FreeBlockQueue, KVCacheBlock
from blockpool.core.shadows import shadow_ready
from blockpool.core.tracker import HazardTracker, StreamState

__all__ = [
    "CACHED_SCAN",
    "PLACEMENTS",
    "PLACEMENT_SCAN",
    "RUN_SCAN",
    "fewest_runs",
    "find_ready",
    "find_runs",
    "run_spans",
]

PLACEMENTS: tuple[str, ...] = (
    "lru",
    "ready_first",
    "ready_first_cached",
    "runs",
    "runs_cached",
    "ready_first_runs",
)
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

RUN_SCAN = 1024
"""The window of the run-aware placements: unkeyed free blocks (and, for
``"runs_cached"``, coldest cached ones) they look at beyond the ``n`` they
need, at most. Bounds the cost of one allocation (a pass over the window
and a sort of it) and, for ``"runs_cached"``, how young a key it may evict:
the trade is measured in ``docs/replay.md``."""

_UNSET = object()
_block_id = operator.attrgetter("block_id")


def _window(
    q: FreeBlockQueue,
    n: int,
    st: StreamState | None,
    tracker: HazardTracker,
    scan: int,
    cached_scan: int | None,
    first_n: bool,
) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
    """The candidates of a placement, without taking them: of the first
    ``n + scan`` blocks of the unkeyed front, those with an empty shadow
    for a consumer on ``st`` (every one with ``st=None``); then, when they
    are fewer than ``n``, the unkeyed front was scanned whole and
    ``cached_scan`` is given, the same of the ``n + cached_scan`` coldest
    cached blocks. With ``first_n``, the scan stops once ``n`` are found.
    Readiness is decided once per distinct shadow (blocks freed together
    share it). Returns ``(unkeyed, cached)``. O(n + scan + cached_scan)."""
    b = q.head.next_free_block
    tail = q.tail
    lw: object = _UNSET
    lr: object = _UNSET
    ok = True
    found: list[KVCacheBlock] = []
    scanned = 0
    limit = n + scan
    while b is not tail and scanned < limit:
        assert b is not None
        if b.block_hash is not None or b.block_id < 0:
            break  # the cached part (or the policy queue's divider)
        if st is not None:
            w, r = b.writer, b.readers
            if w is not lw or r is not lr:
                lw, lr = w, r
                ok = shadow_ready(w, r, st, tracker)
        if ok:
            found.append(b)
            if first_n and len(found) == n:
                break
        scanned += 1
        b = b.next_free_block
    cached: list[KVCacheBlock] = []
    if (
        cached_scan is not None
        and len(found) < n
        and (b is tail or b.block_hash is not None or b.block_id < 0)  # type: ignore[union-attr]
    ):
        # The unkeyed front was scanned whole: the cached part, from the
        # eviction end (its coldest block), within the window.
        need = n - len(found)
        limit = n + cached_scan
        scanned = 0
        while b is not tail and scanned < limit:
            assert b is not None
            if b.block_id >= 0:  # not the policy queue's divider
                if st is not None:
                    w, r = b.writer, b.readers
                    if w is not lw or r is not lr:
                        lw, lr = w, r
                        ok = shadow_ready(w, r, st, tracker)
                if ok:
                    cached.append(b)
                    if first_n and len(cached) == need:
                        break
                scanned += 1
            b = b.next_free_block
    return found, cached


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
    Returns ``(unkeyed, cached)``. O(n + scan + cached_scan)."""
    return _window(q, n, st, tracker, scan, cached_scan, first_n=True)


def find_runs(
    q: FreeBlockQueue,
    n: int,
    st: StreamState | None,
    tracker: HazardTracker,
    scan: int = RUN_SCAN,
    cached: bool = False,
) -> list[KVCacheBlock]:
    """Run-aware placement: up to ``n`` (``>= 2``) free blocks of ``q`` in
    the fewest runs of consecutive block ids the window allows, without
    taking them. Candidates: the first ``n + scan`` blocks of the unkeyed
    front (with ``st``: only those with an empty shadow for a consumer on
    ``st``); with ``cached``, when those are fewer than ``n`` and the
    unkeyed front was scanned whole, also the ``n + scan`` coldest free
    cached blocks. With more than ``n`` candidates, :func:`fewest_runs` of
    them; otherwise all of them (the caller takes the rest from the
    queue's front). O(W log W), W = ``n + 2 * scan``."""
    unkeyed, cold = _window(q, n, st, tracker, scan, scan if cached else None, first_n=False)
    cand = unkeyed + cold
    return fewest_runs(cand, n) if len(cand) > n else cand


def run_spans(ids: Sequence[int]) -> list[tuple[int, int]]:
    """The maximal runs of consecutive ids in the ascending ``ids``, as
    ``(length, start index)`` pairs, in order. O(len(ids)).

    >>> run_spans([1, 2, 3, 7, 8, 20])
    [(3, 0), (2, 3), (1, 5)]
    """
    spans: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            spans.append((i - start, start))
            start = i
    return spans


def fewest_runs(cand: list[KVCacheBlock], n: int) -> list[KVCacheBlock]:
    """``n`` of the distinct blocks ``cand`` (``len(cand) > n``) in the
    fewest runs of consecutive block ids: the smallest maximal run of them
    with at least ``n`` blocks (best fit, as extent allocators choose, which
    keeps the longer runs whole for later transfers), else the longest runs
    first, ties to the lower id. Greedy longest-first is optimal: no ``k``
    runs hold more blocks than the ``k`` longest. Returns them in ascending
    block-id order. O(len(cand) log len(cand)).

    >>> from blockpool.core.block import KVCacheBlock
    >>> [b.block_id for b in fewest_runs([KVCacheBlock(i) for i in (9, 1, 2, 3, 5, 6)], 2)]
    [5, 6]
    """
    cand = sorted(cand, key=_block_id)
    runs = run_spans([b.block_id for b in cand])
    fits = [rs for rs in runs if rs[0] >= n]
    if fits:
        _, s0 = min(fits)
        return cand[s0 : s0 + n]
    runs.sort(key=lambda rs: (-rs[0], rs[1]))
    chosen: list[KVCacheBlock] = []
    for length, s0 in runs:
        chosen.extend(cand[s0 : s0 + min(length, n - len(chosen))])
        if len(chosen) == n:
            break
    chosen.sort(key=_block_id)
    return chosen
