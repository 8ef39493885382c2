"""``HazardAwareBlockPool``: vLLM v1's block pool plus exact hazard fences.

Allocation, ref counts, the free queue, prefix caching and KV cache events
behave as in vLLM 0.33.0's ``vllm.v1.core.block_pool.BlockPool`` (see
``docs/vllm-differences.md`` for every deliberate difference). On top, every
block carries a *shadow* (last write not known to have ended, reads since)
and every call that begins an access returns the fence it must wait on. The
hazard model is ``docs/hazard-model.md``.

Example (doctest)::

    >>> from blockpool import HazardAwareBlockPool, StreamKind
    >>> pool = HazardAwareBlockPool(8, enable_caching=True, hash_block_size=16,
    ...                             streams={"compute": StreamKind.DEVICE,
    ...                                      "h2d": StreamKind.DEVICE})
    >>> blocks, fence = pool.allocate_for(2, "compute")
    >>> e3 = pool.issue("compute")          # step 3 reads the blocks
    >>> pool.free_blocks(blocks, token=e3)  # freed while step 3 still runs
    >>> again, fence = pool.allocate_for(2, "h2d")
    >>> [b.block_id for b in again], [str(t) for t in fence]
    ([1, 2], ['compute:1'])
    >>> pool.complete(e3)
    >>> pool.fence_for(again, "h2d")
    Fence(tokens=(), needs_host_wait=False)
"""
from __future__ import annotations

import operator
import secrets
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from sortedcontainers import SortedList

from blockpool._base import (
    _COUNTERS,
    _DEVICE,
    _HOST,
    _READ,
    _UNSET,
    _WRITE,
    _as_list,
    _shadow_tokens,
)
from blockpool._caching import CacheOps
from blockpool._fences import FenceOps
from blockpool._introspection import IntrospectionOps
from blockpool._tokens import TokenOps
from blockpool.block import KVCacheBlock, NullBlock, block_class_for_pool
from blockpool.errors import (
    InvalidArgumentError,
    NoFreeBlocksError,
    RefCountError,
)
from blockpool.events import MEDIUM_GPU, KVCacheEvent
from blockpool.eviction import (
    EVICTION_POLICIES,
    PolicyFreeBlockQueue,
    UnknownEvictionPolicyError,
    make_free_queue,
)
from blockpool.hazards import EMPTY_FENCE, LAST_STEP, AccessKind, Fence, FreeTag, StreamKind, Token
from blockpool.prefix_cache import PrefixCache
from blockpool.tracker import HazardTracker, StreamState

__all__ = ["PLACEMENTS", "HazardAwareBlockPool"]

_block_id = operator.attrgetter("block_id")

def _fewest_runs(cand: list[KVCacheBlock], n: int) -> list[KVCacheBlock]:
    """``n`` of the distinct blocks ``cand`` (``len(cand) > n``) in the
    fewest runs of consecutive block ids: the smallest maximal run of them
    with at least ``n`` blocks (best fit, as extent allocators choose, which
    keeps the longer runs whole), else the longest runs first, ties to the
    lower id. Greedy longest-first is optimal: no ``k`` runs hold more
    blocks than the ``k`` longest. O(len(cand) log len(cand))."""
    cand = sorted(cand, key=_block_id)
    runs: list[tuple[int, int]] = []  # (length, start index in cand)
    start = 0
    for i in range(1, len(cand) + 1):
        if i == len(cand) or cand[i].block_id != cand[i - 1].block_id + 1:
            runs.append((i - start, start))
            start = i
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
    return chosen


PLACEMENTS: tuple[str, ...] = ("lru", "ready_first", "ready_first_cached", "runs", "runs_cached", "ready_first_runs")
"""Placement modes of :meth:`HazardAwareBlockPool.allocate_for`."""


class HazardAwareBlockPool(TokenOps, FenceOps, CacheOps, IntrospectionOps):
    """A KV-cache block pool (vLLM v1 semantics) that hands out exact fences.

    Args:
        num_gpu_blocks: Blocks in the pool, null block included (``>= 1``).
        enable_caching: Prefix caching: freed cached blocks go to the LRU tail
            and stay reachable by key until evicted.
        hash_block_size: Tokens per hash block (kept for vLLM parity; the core
            treats keys as opaque).
        enable_kv_cache_events: Queue :mod:`blockpool.events` for ``take_events``.
        track_hazards: Keep shadows and compute fences. ``False`` gives a plain
            pool (every fence empty, nothing held back) for comparison.
        streams: ``{name: StreamKind}`` to register; default ``{"compute": DEVICE}``.
            More can be added with :meth:`add_stream`.
        lease_timeout: Seconds a block may stay held for a host-engine access
            before it is reported (a :class:`LeaseExpiredWarning` and
            ``stats().leases_expired``); it stays quarantined until
            :meth:`abandon`. ``None``: no lease.
        clock: Time source for leases (seconds); inject one for deterministic
            tests and replays.
        debug: Fences carry :class:`~blockpool.hazards.FenceReason` per token.
        medium: Storage medium reported in events.
        removal_events: When a ``BlockRemoved`` is sent for a key: ``"last"``
            (default) when the last block holding it loses it, so an event
            always means the key is gone; ``"each"`` whenever a block loses
            it, even while another block still holds it (vLLM 0.33's events,
            which the vLLM adapter reproduces).
        eviction: Which free cached block loses its keys first:
            ``"lru"`` (default: vLLM's order, exactly), ``"s3fifo"`` or
            ``"2q"`` (keep blocks that were hit longer; see
            :mod:`blockpool.eviction` for each policy and its source).
        placement: Which free blocks :meth:`allocate_for` hands out:
            ``"lru"`` (default: the queue's front, as :meth:`get_new_blocks`)
            or ``"ready_first"``: free *unkeyed* blocks whose shadow is
            empty for the consumer (every access on them ended, or the
            consumer is already ordered after it) first, in queue order,
            then the rest in queue order. It looks at most
            ``n + PLACEMENT_SCAN`` blocks of the queue's unkeyed front;
            cached blocks keep their order. ``"ready_first_cached"``
            (the opt-in for cached blocks) does the same, then, while it
            still needs blocks, looks at the first ``n + CACHED_SCAN``
            free *cached* blocks from the eviction end (the coldest: LRU
            order under ``eviction="lru"``, segment S then M under the
            other policies; reached only when the unkeyed front was
            scanned whole) and takes those with an empty shadow too,
            evicting their keys (removed events as for any eviction), ahead
            of the not-ready blocks at the queue's front. The trade: a
            prefix that might still be hit, for a fence with nothing in
            it; measured in ``docs/replay.md``. ``"runs"``: the blocks
            come in runs of consecutive block ids, so that a transfer of
            them posts one descriptor per run (NIXL, Mooncake, a
            ``cudaMemcpy`` batch): among the first ``n + RUN_SCAN``
            blocks of the unkeyed front (interchangeable for the prefix
            cache: they hold no key, so which of them is taken changes no
            hit), the smallest run of free ids that holds all ``n``
            (best fit, as an extent allocator does), else the longest runs
            first; the rest, if the unkeyed front is short, from the
            queue's front; the result in ascending block-id order.
            Which cached blocks lose their keys stays LRU's choice (they
            are only handed out in id order). ``"runs_cached"`` (the opt-in
            for cached blocks): when the unkeyed front holds fewer than
            ``n``, the window also takes in the ``n + RUN_SCAN`` coldest
            free cached blocks, so a run may evict a key a little younger
            than the coldest (the trade is measured in ``docs/replay.md``).
            ``"ready_first_runs"``: ``"runs"`` over the *ready* blocks of
            the window (empty shadow for the consumer), then the queue's
            front. Only
            :meth:`allocate_for` places; :meth:`get_new_blocks` has no
            consumer to place for.

    Raises:
        InvalidArgumentError: ``num_gpu_blocks`` is not an int ``>= 1``, a
            stream spec is bad, or ``removal_events`` is not ``"last"`` or
            ``"each"``.
        UnknownEvictionPolicyError: ``eviction`` or ``placement`` is not a
            known name (an :class:`InvalidArgumentError`).

    Runtime complexity: construction is O(num_gpu_blocks).
    """

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
    """The window of the ``"runs"`` placements: unkeyed free blocks they
    look at beyond the ``n`` they need, at most (bounds the cost of one
    allocation: one pass over the window and a sort of it)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        hash_block_size: int = 16,
        enable_kv_cache_events: bool = False,
        *,
        track_hazards: bool = True,
        streams: Mapping[str, StreamKind] | None = None,
        lease_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        debug: bool = False,
        medium: str = MEDIUM_GPU,
        removal_events: str = "last",
        eviction: str = "lru",
        placement: str = "lru",
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or isinstance(num_gpu_blocks, bool) or num_gpu_blocks < 1:
            raise InvalidArgumentError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        if lease_timeout is not None and not lease_timeout > 0:
            raise InvalidArgumentError(f"lease_timeout must be > 0 or None, got {lease_timeout!r}")
        if removal_events not in ("last", "each"):
            raise InvalidArgumentError(f"removal_events must be 'last' or 'each', got {removal_events!r}")
        if placement not in PLACEMENTS:
            raise UnknownEvictionPolicyError(
                f"unknown placement {placement!r}; choose from {', '.join(PLACEMENTS)}"
            )
        if eviction not in EVICTION_POLICIES:
            make_free_queue(eviction, [], 0)  # raises the typed error
        self._removal_each = removal_events == "each"
        self.eviction = eviction
        self.placement = placement
        self._ready_first = placement in ("ready_first", "ready_first_cached")
        self._ready_cached = placement == "ready_first_cached"
        self._runs = placement in ("runs", "runs_cached", "ready_first_runs")
        self._runs_cached = placement == "runs_cached"
        self._runs_ready = placement == "ready_first_runs"
        self.placed_ready = 0  # blocks ready-first placement handed out ahead of the queue's front
        self.placed_cached = 0  # of those, cached blocks (ready_first_cached) whose keys were evicted
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.track_hazards = track_hazards
        self.medium = medium
        self.debug = debug
        self.lease_timeout = lease_timeout
        self._clock = clock

        self.null_block: KVCacheBlock = NullBlock(0)
        # This pool's own block class: "is b mine" becomes a type test
        # (block_class_for_pool says why); other blocks are checked by identity.
        self._block_cls = block_cls = block_class_for_pool()
        # Sized exactly (a list grown by appends keeps up to 1/8 spare slots).
        self.blocks: list[KVCacheBlock] = [self.null_block] * num_gpu_blocks
        self.blocks[1:] = map(block_cls, range(1, num_gpu_blocks))
        self.free_block_queue = make_free_queue(eviction, self.blocks[1:], num_gpu_blocks)
        if eviction != "lru":
            # The policy counts hits; LRU keeps the class's _touch untouched.
            self._touch = self._touch_counted  # type: ignore[method-assign]

        self.prefix_cache = PrefixCache()
        self.kv_event_queue: list[KVCacheEvent] = []

        # This pool's identity, stamped on its tokens (Token.pool): a token
        # of another pool is refused (ForeignTokenError). Random, so that
        # pools in different processes differ too.
        self.pool_id: int = secrets.randbits(62) + 1
        self.tracker = HazardTracker(self.pool_id)
        for name, kind in (streams if streams is not None else {"compute": _DEVICE}).items():
            self.tracker.add_stream(name, kind)

        # Held blocks: block_id -> host tokens still pending on it.
        self._held: dict[int, set[Token]] = {}
        self._held_by: dict[Token, list[KVCacheBlock]] = {}
        self._leases: SortedList = SortedList()  # (deadline, block_id)
        self._deadline: dict[int, float] = {}  # lease of each held block
        self._expired: set[int] = set()
        # Writes begun by begin_load / begin_copy and not yet ended:
        # stream -> {seq: [(block, writer before, readers before)]}. A failed
        # write restores what it replaced (it may have failed before its
        # waits) and unpublishes the blocks' keys.
        self._writes: dict[str, dict[int, list[tuple[KVCacheBlock, Token | None, Token | tuple[Token, ...] | None]]]] = {}
        # Blocks whose content is invalid (their load failed) until rewritten.
        self._invalid: set[int] = set()
        # Prefix-cache bookkeeping beside the key map: blocks whose primary
        # key is a partial key (cache_partial_block), and keys retired from a
        # block by a promotion (never republished for it until it is reused).
        self._partial: set[int] = set()
        self._retired: dict[int, set[Hashable]] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # Lookups and hits are counted on the hottest path (one per block of
        # a prefix): plain ints, folded into the counters by stats().
        self._lookups = 0
        self._hits = 0
        # Hot paths test these two before calling _apply_completions (which does the work):
        # the completion inbox (a deque, appended from any thread) and
        # whether leases are on.
        self._inbox = self.tracker._inbox
        self._leases_on = lease_timeout is not None
        # Block generations (stale block tables): off (None) until the first
        # generations() call, then one unsigned 64-bit word per block, set to
        # the serial of the allocation that handed the block out.
        self._gens = None
        self._alloc_serial = 0

    # ------------------------------------------------------------------
    # allocation (vLLM surface)
    # ------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting
        their prefix-cache keys (one removed event per key). Held blocks are
        never taken. Same as vLLM's ``get_new_blocks``; the fence of the
        access that will use them comes from :meth:`fence_for` when it begins
        (or use :meth:`allocate_for`). O(num_blocks).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int ``>= 0``.
            NoFreeBlocksError: fewer than ``num_blocks`` blocks are free.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        n = num_blocks if type(num_blocks) is int and num_blocks >= 0 else self._check_count(num_blocks)
        if n > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"Cannot get {n} free blocks from the pool "
                f"({self.free_block_queue.num_free_blocks} free, {len(self._held)} held back)"
            )
        if self._gens is None:
            return self._take(n)
        return self._stamp(self._take(n))

    def _take(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` free blocks from the queue's front and :meth:`_claim`
        them. O(n)."""
        return self._claim(self.free_block_queue.popleft_n(n))

    def _claim(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Blocks just taken off the free queue: evict their keys, give each
        ref count 1, forget the old content's marks. Eviction is inline: a
        block whose only key maps to it alone costs one dict deletion;
        anything else (extra keys, a shared key, events on) goes through
        :meth:`_drop_keys`. Returns ``blocks``. O(len(blocks))."""
        pc = self.prefix_cache
        m = pc._map
        extra = pc._extra
        slow = self.enable_kv_cache_events
        evicted = 0
        for b in blocks:
            key = b.block_hash
            if key is not None:
                evicted += 1
                if slow or (extra and b.block_id in extra) or m.get(key) is not b:
                    self._drop_keys(b)
                else:
                    del m[key]
                    b.block_hash = None
                    b.block_hash_num_tokens = None
            b.ref_cnt = 1
        if evicted:
            self._counters["evictions"] += evicted
        invalid = self._invalid
        if invalid:
            for b in blocks:
                invalid.discard(b.block_id)
        if self._partial or self._retired:  # new content: forget the old one's keys
            partial, retired = self._partial, self._retired
            for b in blocks:
                partial.discard(b.block_id)
                retired.pop(b.block_id, None)
        return blocks

    def allocate_for(
        self,
        num_blocks: int,
        stream: str,
        *,
        hits: Sequence[KVCacheBlock] = (),
        access: AccessKind = AccessKind.WRITE,
    ) -> tuple[list[KVCacheBlock], Fence]:
        """Atomically touch the prefix hits ``hits`` and allocate
        ``num_blocks`` new blocks for a consumer on ``stream``; return the new
        blocks and the fence the consumer must wait on (reading the hits:
        RAW; ``access`` on the new blocks: WAR/WAW). Records that ``stream``
        waits on the fence. Changes nothing when it cannot succeed; hits that
        sit in the free queue are counted once (they stop being free).
        O(len(hits) + num_blocks); with a ready-first ``placement``, plus at
        most ``PLACEMENT_SCAN`` (+ ``CACHED_SCAN`` for
        ``"ready_first_cached"``) blocks looked at.

        Raises:
            InvalidArgumentError: bad count or access kind.
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a hit is not a block of this pool.
            NoFreeBlocksError: not enough free blocks once the hits are taken.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        n = num_blocks if type(num_blocks) is int and num_blocks >= 0 else self._check_count(num_blocks)
        if access is not _WRITE and access is not _READ:
            access = self._check_access(access)
        st = self.tracker.state(stream)
        hit_list = self._own_all(hits) if hits else []
        in_queue = (
            len({b.block_id for b in hit_list if b.ref_cnt == 0 and b.prev_free_block is not None})
            if hit_list
            else 0
        )
        available = self.free_block_queue.num_free_blocks - in_queue
        if n > available:
            raise NoFreeBlocksError(
                f"Cannot allocate {n} new blocks with {len(hit_list)} prefix hits: "
                f"{available} free once the {in_queue} free hits are taken"
            )
        if hit_list:
            self._touch(hit_list)
        if self._runs and n > 1:
            new = self._take_runs(n, st if self._runs_ready and self.track_hazards else None)
        elif self._ready_first and n and self.track_hazards:
            new = self._take_ready(n, st)
        else:
            new = self._take(n)
        if self._gens is not None:
            self._stamp(new)
        if not self.track_hazards:
            return new, EMPTY_FENCE
        return new, self._fence(((hit_list, _READ), (new, access)), st)

    def _stamp(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Give newly allocated ``blocks`` a new generation (the serial of
        this allocation), once :meth:`generations` turned generations on.
        Returns ``blocks``. O(len(blocks))."""
        self._alloc_serial = serial = self._alloc_serial + 1
        gens = self._gens
        assert gens is not None
        for b in blocks:
            gens[b.block_id] = serial
        return blocks

    def _take_ready(self, n: int, st: StreamState) -> list[KVCacheBlock]:
        """Ready-first placement: ``n`` free blocks for a consumer on ``st``.
        Unkeyed blocks with an empty shadow for it first (at most
        ``n + PLACEMENT_SCAN`` looked at); with ``ready_first_cached``, then
        cached blocks with an empty shadow among the ``n + CACHED_SCAN``
        coldest (their keys evicted); then the queue's front (see the class
        docstring). Readiness is decided once per distinct shadow (blocks
        freed together share it). O(n + PLACEMENT_SCAN + CACHED_SCAN)."""
        q = self.free_block_queue
        b = q.head.next_free_block
        tail = q.tail
        limit = n + self.PLACEMENT_SCAN
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
                ok = self._shadow_ready(w, r, st)
            if ok:
                ready.append(b)
                if len(ready) == n:
                    break
            scanned += 1
            b = b.next_free_block
        cached: list[KVCacheBlock] = []
        if self._ready_cached and len(ready) < n and (b is tail or b.block_hash is not None or b.block_id < 0):  # type: ignore[union-attr]
            # The unkeyed front was scanned whole: the cached part, from
            # the eviction end (its coldest block), within the window.
            need = n - len(ready)
            limit = n + self.CACHED_SCAN
            scanned = 0
            while b is not tail and scanned < limit:
                assert b is not None
                if b.block_id >= 0:  # not the policy queue's divider
                    w, r = b.writer, b.readers
                    if w is not lw or r is not lr:
                        lw, lr = w, r
                        ok = self._shadow_ready(w, r, st)
                    if ok:
                        cached.append(b)
                        if len(cached) == need:
                            break
                    scanned += 1
                b = b.next_free_block
        if not ready and not cached:
            return self._take(n)
        for b in ready:
            q.remove(b)
        for b in cached:
            q.remove(b)
        self.placed_cached += len(cached)
        ready.extend(cached)
        freq = q.freq if isinstance(q, PolicyFreeBlockQueue) else None
        if freq:
            for b in ready:
                freq.pop(b.block_id, None)
        self._claim(ready)
        self.placed_ready += len(ready)
        return ready + self._take(n - len(ready)) if len(ready) < n else ready

    def _take_runs(self, n: int, st: StreamState | None) -> list[KVCacheBlock]:
        """Run-aware placement: ``n >= 2`` free blocks in as few runs of
        consecutive block ids as the window allows, ascending. Candidates
        are the first ``n + RUN_SCAN`` blocks of the unkeyed front (with
        ``st``: only those with an empty shadow for a consumer on ``st``);
        with ``runs_cached``, when those are fewer than ``n``, also the
        ``n + RUN_SCAN`` coldest free cached blocks (their keys evicted if
        taken). Of the candidates: the smallest maximal run holding all
        ``n`` (best fit, which keeps longer runs whole for later
        transfers), else the longest runs first (the fewest runs); when
        the candidates are fewer than ``n``, all of them and the rest from
        the queue's front. O(W log W), W = ``n + 2 * RUN_SCAN``."""
        q = self.free_block_queue
        b = q.head.next_free_block
        tail = q.tail
        limit = n + self.RUN_SCAN
        cand: list[KVCacheBlock] = []
        lw: object = _UNSET
        lr: object = _UNSET
        ok = True
        scanned = 0
        while b is not tail and scanned < limit:
            assert b is not None
            if b.block_hash is not None or b.block_id < 0:
                break  # the cached part (or the policy queue's divider)
            if st is not None:
                w, r = b.writer, b.readers
                if w is not lw or r is not lr:
                    lw, lr = w, r
                    ok = self._shadow_ready(w, r, st)
            if ok:
                cand.append(b)
            scanned += 1
            b = b.next_free_block
        if self._runs_cached and len(cand) < n and (b is tail or b.block_hash is not None or b.block_id < 0):  # type: ignore[union-attr]
            # The unkeyed front was scanned whole: the coldest cached blocks too.
            scanned = 0
            while b is not tail and scanned < limit:
                assert b is not None
                if b.block_id >= 0:  # not the policy queue's divider
                    if st is not None:
                        w, r = b.writer, b.readers
                        if w is not lw or r is not lr:
                            lw, lr = w, r
                            ok = self._shadow_ready(w, r, st)
                    if ok:
                        cand.append(b)
                    scanned += 1
                b = b.next_free_block
        if len(cand) > n:
            cand = _fewest_runs(cand, n)
        cached = 0
        for b in cand:
            q.remove(b)
            if b.block_hash is not None:
                cached += 1
        self.placed_cached += cached
        freq = q.freq if isinstance(q, PolicyFreeBlockQueue) else None
        if freq:
            for b in cand:
                freq.pop(b.block_id, None)
        self._claim(cand)
        if len(cand) < n:
            cand.extend(self._take(n - len(cand)))
        cand.sort(key=_block_id)
        return cand

    def _shadow_ready(self, w: Token | None, r: Token | tuple[Token, ...] | None, st: StreamState) -> bool:
        """Whether a write by ``st`` to a block with shadow ``(w, r)`` waits
        on nothing. O(k^2), k = tokens in the shadow."""
        if w is None and r is None:
            return True
        toks: list[Token] = [] if w is None else [w]
        if r is not None:
            toks.extend((r,) if type(r) is Token else r)  # type: ignore[arg-type]
        return not self.tracker.reduce(toks, st)

    def _touch_counted(self, blocks: list[KVCacheBlock]) -> None:
        """:meth:`_touch` for a non-LRU eviction policy: the queue counts
        the hits first. O(len(blocks))."""
        self.free_block_queue.on_hit(blocks)  # type: ignore[attr-defined]
        HazardAwareBlockPool._touch(self, blocks)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix hit or pin); a block with ref
        count 0 leaves the free queue (or the held set). The null block is
        skipped. O(len(blocks)).

        Raises:
            ForeignBlockError: a block is not of this pool (nothing changes).
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        self._touch(self._own_all(blocks))

    def _touch(self, blocks: list[KVCacheBlock]) -> None:
        # A free block leaves the queue: FreeBlockQueue.remove's unlinking,
        # inline (the per-block method call was a third of a prefix hit).
        q = self.free_block_queue
        held = self._held
        null = self.null_block
        removed = 0
        for b in blocks:
            if b is null:
                continue
            if b.ref_cnt == 0:
                prev = b.prev_free_block
                if prev is not None:
                    nxt = b.next_free_block
                    prev.next_free_block = nxt
                    nxt.prev_free_block = prev  # type: ignore[union-attr]
                    b.prev_free_block = b.next_free_block = None
                    removed += 1
                elif held:
                    self._unhold(b.block_id)
            b.ref_cnt += 1
        q.num_free_blocks -= removed

    def free_blocks(
        self,
        ordered_blocks: Iterable[KVCacheBlock],
        token: Token | FreeTag | None = LAST_STEP,
        access: AccessKind = AccessKind.READ,
    ) -> None:
        """Drop one reference per listed block, in eviction order (first =
        evicted first). A block reaching ref count 0 goes to the front of the
        free queue if it has no key (reused first) or caching is off, to the
        back if cached (LRU), or into the held set while a host-engine access
        on it has not ended. Null blocks are skipped. A block may repeat as
        often as it is referenced. O(len(ordered_blocks)).

        ``token``: the last enqueued access to the blocks, recorded as an
        ``access`` in their shadows, so the next user of the blocks waits for
        it. Safe by default: the default, :data:`~blockpool.hazards.LAST_STEP`,
        is the newest token issued on the pool's ``compute`` stream (the last
        enqueued step, as the hazard model asks), or nothing when no token
        was issued there, no ``compute`` stream is registered, or hazards are
        off. Pass the token explicitly to tag another access, or
        ``token=None`` to record none (opt-out: the caller knows nothing in
        flight touches the blocks). A ``WRITE`` is undone if ``token`` fails,
        as for :meth:`tag`.

        Raises:
            ForeignBlockError: a block of another pool.
            RefCountError: a ref count would go below zero (whole call rejected).
            UnknownStreamError, UnknownTokenError: a token the pool never issued.
            ForeignTokenError: a token issued by another pool.
            InvalidArgumentError: ``access`` is not an :class:`AccessKind`,
                or ``blocks`` is not iterable.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        blocks = (
            ordered_blocks if isinstance(ordered_blocks, (list, tuple)) else _as_list(ordered_blocks, "blocks")
        )
        record = False
        if token is LAST_STEP:
            st = self.tracker.streams.get("compute") if self.track_hazards else None
            token = Token(st.name, st.last_seq, st.kind) if st is not None and st.last_seq else None
        if token is not None:
            st = self.tracker.validate(token)
            if access is not _READ and access is not _WRITE:
                self._check_access(access)
            # Record the access unless the token has ended (tracker.is_ended, inline).
            record = self.track_hazards and not (
                token.seq <= st.mark or (st.kind is _HOST and token.seq in st.done)
            )
        own = self.blocks
        null = self.null_block
        cls = self._block_cls
        zero: list[KVCacheBlock] = []
        i = 0
        try:
            for i, b in enumerate(blocks):
                if b.__class__ is not cls and own[b.block_id] is not b:
                    self._own(b)
                if b is null:
                    continue
                rc = b.ref_cnt - 1
                if rc < 0:
                    raise RefCountError(
                        f"free_blocks would take block {b.block_id}'s ref count below zero "
                        f"(listed {sum(1 for x in blocks if x is b)} times)"
                    )
                b.ref_cnt = rc
                if rc == 0:
                    zero.append(b)
        except Exception as exc:
            for b in blocks[:i]:
                if b is not null:
                    b.ref_cnt += 1
            if isinstance(exc, (IndexError, AttributeError, TypeError)):
                self._own(blocks[i])  # raises the typed error
            raise
        if record:
            self._record(blocks, token, access)  # type: ignore[arg-type]
        elif access is _WRITE and token is not None and self.tracker.has_failed(token):
            self._unwritten(blocks)  # a write by a token that failed never happened
        if zero:
            self._enqueue_free(zero)

    def num_ready_free_blocks(self, stream: str) -> int:
        """Free blocks a write on ``stream`` could begin on without waiting:
        every access on them ended, or ``stream`` is already ordered after
        it (their fence for ``stream`` would be empty). Held blocks are not
        free. With ``track_hazards=False``, every free block. The figure
        ready-first placement works with: a load of ``n`` blocks can have
        an empty fence only if this is at least ``n`` when it is placed.
        O(free blocks); readiness is decided once per distinct shadow.

        Raises:
            UnknownStreamError: ``stream`` is not registered.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        st = self.tracker.state(stream)
        if not self.track_hazards:
            return self.free_block_queue.num_free_blocks
        lw: object = _UNSET
        lr: object = _UNSET
        ok = True
        count = 0
        for b in self.free_block_queue:
            if b.block_id < 0:
                continue  # a policy queue's divider
            w, r = b.writer, b.readers
            if w is not lw or r is not lr:
                lw, lr = w, r
                ok = self._shadow_ready(w, r, st)
            count += ok
        return count

    def allocatable_if_freed(self, blocks: Iterable[KVCacheBlock]) -> list[bool]:
        """Whether freeing ``blocks`` now (one reference per listing, as
        :meth:`free_blocks`) would make each allocatable at once: its ref
        count reaches 0 and no host-engine access on it is pending (else
        :meth:`free_blocks` would hold it back). One answer per listed
        block, in order; the null block is never allocatable. A device
        access still in flight does not prevent it (the next user gets a
        fence instead). Changes nothing (it applies queued completions
        first, like every call). O(len(blocks)).

        Raises:
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``blocks`` is not iterable.
            RefCountError: a block is listed more often than it is
                referenced (:meth:`free_blocks` would refuse the call).
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        block_list = self._own_all(blocks)
        listed: dict[int, int] = {}
        for b in block_list:
            if b is not self.null_block:
                listed[b.block_id] = listed.get(b.block_id, 0) + 1
        for bid, n in listed.items():
            if self.blocks[bid].ref_cnt < n:
                raise RefCountError(
                    f"block {bid} is listed {n} times but referenced {self.blocks[bid].ref_cnt} times"
                )
        check_host = self.track_hazards and self.tracker.host_pending()
        out = []
        for b in block_list:
            if b is self.null_block or b.ref_cnt != listed[b.block_id]:
                out.append(False)
            elif check_host:
                ended = self.tracker.is_ended
                out.append(not any(t.kind is _HOST and not ended(t) for t in _shadow_tokens(b)))
            else:
                out.append(True)
        return out

    def _enqueue_free(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks that reached ref count 0 in the free queue (unkeyed to
        the front, keyed to the back) or, when a host-engine access on them
        has not ended, into the held set. Blocks freed together usually share
        their readers value, so the hold decision is made once per distinct
        ``(host writer, readers)`` pair (a device writer never holds a block)
        and the held blocks of that pair share one pending set.
        O(len(blocks))."""
        first: list[KVCacheBlock] = []
        last: list[KVCacheBlock] = []
        caching = self.enable_caching
        if self.track_hazards and self.tracker.host_pending():
            lw: object = _UNSET
            lr: object = _UNSET
            pend: tuple[set[Token], list[list[KVCacheBlock]]] | None = None
            held = self._held
            leases = self._leases_on
            for b in blocks:
                w = b.writer
                r = b.readers
                if w is not None and w.kind is not _HOST:
                    w = None  # a device writer never holds a block back
                if w is not None or (r is not None and (type(r) is not Token or r.kind is _HOST)):  # type: ignore[union-attr]
                    # Some host token in the shadow. The decision depends on
                    # the host writer (rare) and the readers value, which
                    # blocks read together share: recompute only on change.
                    if w is not lw or r is not lr:
                        lw, lr = w, r
                        pend = self._pending_host(w, r)
                    if pend is not None:
                        # Hold b back on the pending host tokens; blocks with
                        # this shadow share the pending set.
                        held[b.block_id] = pend[0]
                        for lst in pend[1]:
                            lst.append(b)
                        if leases:
                            self._lease(b)
                        continue
                if b.block_hash is None or not caching:
                    first.append(b)
                else:
                    last.append(b)
        else:
            for b in blocks:
                if b.block_hash is None or not caching:
                    first.append(b)
                else:
                    last.append(b)
        q = self.free_block_queue
        q.prepend_n(first)
        q.append_n(last)

    def _pending_host(
        self, w: Token | None, r: Token | tuple[Token, ...] | None
    ) -> tuple[set[Token], list[list[KVCacheBlock]]] | None:
        """For a shadow ``(writer, readers)``: the host tokens in it that have
        not ended, and the ``_held_by`` list of each; ``None`` when there are
        none (the block need not be held)."""
        if (w is None or w.kind is not _HOST) and (r is None or (type(r) is Token and r.kind is not _HOST)):  # type: ignore[union-attr]
            return None  # no host token at all: the usual case
        if r is None:
            toks: tuple[Token, ...] = () if w is None else (w,)
        elif type(r) is Token:
            toks = (r,) if w is None else (w, r)  # type: ignore[assignment]
        else:
            toks = r if w is None else (w, *r)  # type: ignore[assignment,misc]
        ended = self.tracker.is_ended
        pending = {t for t in toks if t.kind is _HOST and not ended(t)}
        if not pending:
            return None
        held_by = self._held_by
        return pending, [held_by.setdefault(t, []) for t in pending]

    def _lease(self, b: KVCacheBlock) -> None:
        """Start the lease of held block ``b`` (leases on)."""
        assert self.lease_timeout is not None
        deadline = self._clock() + self.lease_timeout
        self._deadline[b.block_id] = deadline
        self._leases.add((deadline, b.block_id))

    def _unhold(self, block_id: int) -> None:
        self._held.pop(block_id, None)
        if self._deadline:
            self._deadline.pop(block_id, None)
        if self._expired:
            self._expired.discard(block_id)
