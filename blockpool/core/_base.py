"""The pool's own seam between its parts: the attributes every part of
:class:`~blockpool.core.pool.HazardAwareBlockPool` reads, the argument checks,
and the coordination that spans several owned parts: applying completions
(in one place, at the start of every call), taking and freeing blocks,
withdrawing keys with their events, fences and recorded accesses.

Who owns what (each changes its state only through its own methods):

- :class:`~blockpool.core.block.FreeBlockQueue` (``free_block_queue``): free
  blocks in eviction order and their links.
- :class:`~blockpool.core.prefix_cache.PrefixCache` (``prefix_cache``): keys,
  partial and retired marks, the eviction counter (lookups and hits are
  counted by the pool's ``get_cached_block``, :mod:`blockpool.core._caching`).
- :class:`~blockpool.core.holdback.HoldBack` (``holdback``): held blocks, their
  pending host tokens, leases.
- :class:`~blockpool.core.pending_writes.PendingWrites` (``writes``): writes in
  flight, invalid marks, the undo of failed writes.
- :class:`~blockpool.core.load_groups.LoadGroups` (``load_groups``): tokens
  linked as one load (a failure of one withdraws the others' keys).
- :class:`~blockpool.core.tracker.HazardTracker` (``tracker``): streams, tokens,
  clocks, completions.
- :mod:`blockpool.core.shadows`: the blocks' ``writer``/``readers``.
- :class:`~blockpool.core.generations.Generations` (``_gens``): block
  generations.
- :mod:`blockpool.core._refcounts`: ref counts.
- this module: the event queue and the fence counters.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from blockpool.core._mypyc import mypyc_attr
from blockpool.core.block import FreeBlockQueue, KVCacheBlock
from blockpool.core.errors import (
    BlockNotAllocatedError,
    ForeignBlockError,
    InvalidArgumentError,
    InvalidContentError,
    LeaseExpiredWarning,
    SharedBlockError,
)
from blockpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from blockpool.core.generations import Generations, check_fresh
from blockpool.core.hazards import AccessKind, Fence, StreamKind, Token
from blockpool.core.holdback import HoldBack
from blockpool.core.load_groups import LoadGroups, withdraw_linked
from blockpool.core.pending_writes import PendingWrites
from blockpool.core.prefix_cache import PrefixCache
from blockpool.core.shadows import _UNSET, clear, fence_of, settle, shadow_tokens, tag, write
from blockpool.core.tracker import HazardTracker, StreamState

__all__ = ["PoolBase"]

logger = logging.getLogger(__name__)

_DEVICE = StreamKind.DEVICE
_HOST = StreamKind.HOST
_READ = AccessKind.READ
_WRITE = AccessKind.WRITE

_COUNTERS = (  # in a dict; the fence counts (one or two per fence) are native ints: _n_fences, _n_empty_fences
    "fence_tokens",
    "host_wait_fences",
    "max_fence_size",
    "abandoned",
    "unpublished_failed_loads",
    "loads_begun",
    "stores_begun",
    "transfer_fences_nonempty",
)


def _as_list(x: Iterable[object], what: str) -> list:  # type: ignore[type-arg]
    try:
        return list(x)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an iterable, got {x!r}") from None


def _check_key(key: object) -> None:
    """A prefix-cache key is any hashable but ``None`` (``None`` means "no key")."""
    if key is None:
        raise InvalidArgumentError("a block hash cannot be None (None means 'not cached')")
    try:
        hash(key)
    except TypeError:
        raise InvalidArgumentError(f"a block hash must be hashable, got {key!r}") from None


@mypyc_attr(allow_interpreted_subclasses=True)
class PoolBase:
    """The parts of :class:`~blockpool.core.pool.HazardAwareBlockPool` (set in its
    ``__init__``), the checks every public call uses to validate arguments
    before it changes anything, and the coordination between the parts."""

    num_gpu_blocks: int
    pool_id: int
    enable_caching: bool
    hash_block_size: int
    enable_kv_cache_events: bool
    track_hazards: bool
    medium: str
    stored_events: str  # "runs" or "call" (cache_full_blocks' BlockStored events)
    debug: bool
    lease_timeout: float | None
    null_block: KVCacheBlock
    _block_cls: type
    _policy: bool  # a non-LRU eviction policy: its queue counts hits
    blocks: list[KVCacheBlock]
    free_block_queue: FreeBlockQueue
    prefix_cache: PrefixCache
    holdback: HoldBack
    writes: PendingWrites
    load_groups: LoadGroups
    tracker: HazardTracker
    _fresh: set[KVCacheBlock]  # allocated, neither written nor published since
    _track_fills: bool  # whether allocations enter _fresh: caching on, and a stream a load can run on
    _announced: set[KVCacheBlock]  # published before any write since their allocation
    kv_event_queue: list[KVCacheEvent]
    _counters: dict[str, int]
    _n_fences: int
    _n_empty_fences: int
    _key_map: dict[Hashable, int]
    _hits: int
    _misses: int
    # Any, not object: mypyc's non-native class bodies cannot annotate with object.
    _inbox: Any
    _leases_on: bool
    _due: Any  # truthy when _apply_completions may have work (the inbox, or True with leases)
    _gens: Generations | None

    # ------------------------------------------------------------------
    # completions: applied first by every call, here and nowhere else
    # ------------------------------------------------------------------

    def _apply_completions(self) -> None:
        """Apply the completions and failures queued by ``complete``/``fail``
        (any thread) and check expired leases: ended tokens release their
        held blocks, failed writes are undone. Every public call calls this
        first (``docs/api.md``); the hot ones (allocation, frees, lookups,
        fences, tokens issued, transfers begun) test ``self._due`` before
        the call: the condition under which it does anything (the inbox is
        not empty, or leases are on), hoisted to save a Python call per
        lookup (2 million on the trace op log). Never blocks (not a "sync":
        that word is kept for blocking waits). O(1) when nothing is queued;
        else O(queued + newly ended + blocks released)."""
        if self._inbox:
            for token, failed, ended in self.tracker.drain():
                if failed and not ended:
                    self._late_failure(token)
                else:
                    self._on_ended(token, failed, ended)
        if self._leases_on:
            expired = self.holdback.expire()
            if expired:
                tokens = sorted({str(t) for _, pending in expired for t in pending})
                msg = (
                    f"lease expired for held blocks {[bid for bid, _ in expired]}: host transfers "
                    f"{tokens} have not ended; the blocks stay quarantined until abandon()"
                )
                logger.warning(msg)
                warnings.warn(msg, LeaseExpiredWarning, stacklevel=4)

    def _on_ended(self, token: Token, failed: bool, ended: list[tuple[StreamState, list[int]]]) -> None:
        """Tokens ended (``token`` and what it ended, per stream): undo a
        failed write (keys withdrawn, a free block re-queued or held), and
        release the blocks the ended host tokens held."""
        for b in self.writes.ended(token, failed, ended, self.tracker.is_ended):
            self._drop_keys(b)
            if b.ref_cnt == 0 and b.prev_free_block is not None:
                # Free again, but the restored accesses may need a hold.
                self.free_block_queue.remove_n([b])
                self._enqueue_free([b])
        if failed and len(self.load_groups):
            self._withdraw_linked(token)
        if self.holdback.tracking:
            for st, seqs in ended:
                if st.kind is _HOST:
                    for seq in seqs:
                        released = self.holdback.release(Token(st.name, seq, _HOST))
                        if released:
                            first = self.holdback.evict_first(released)
                            if first:  # freed with evict_first while held: the queue's front
                                marked = set(first)
                                self._enqueue_free([b for b in released if b not in marked])
                                self._enqueue_free(first, evict_first=True)
                            else:
                                self._enqueue_free(released)

    def _late_failure(self, token: Token) -> None:
        """``token`` failed after it had already ended: every block whose
        write in effect is still ``token``'s loses its keys and is not
        published until rewritten. O(num_gpu_blocks); failures are rare."""
        for b in self.writes.late_failure(token, self.blocks):
            self._drop_keys(b)
        if len(self.load_groups):
            self._withdraw_linked(token)

    def _withdraw_linked(self, token: Token) -> None:
        """``token`` failed: every block whose write in effect is another
        token linked with it (:meth:`link_loads`) loses its keys and is not
        published until rewritten (marked invalid by ``token``); its shadow,
        holds and token stay. O(num_gpu_blocks) when ``token`` is linked,
        O(1) otherwise; failures are rare."""
        members = self.load_groups.members(token)
        if not members:
            return
        others = [t for t in members if not (t.seq == token.seq and t.stream == token.stream)]
        for b in withdraw_linked(token, others, self.writes, self.blocks):
            self._drop_keys(b)

    # ------------------------------------------------------------------
    # blocks in and out of the free queue
    # ------------------------------------------------------------------

    def _enqueue_free(
        self, blocks: list[KVCacheBlock], to_tail: bool = False, evict_first: bool = False
    ) -> None:
        """Put blocks that reached ref count 0 in the free queue (unkeyed to
        the front, keyed to the back; all to the back with ``to_tail``, all
        to the front with ``evict_first``) or, when a host-engine access on
        them has not ended, hold them back (with ``evict_first``, they go to
        the front when released). O(len(blocks))."""
        if self.track_hazards and self.tracker.host_pending():
            blocks = self.holdback.hold_back(blocks, self.tracker.is_ended, evict_first and not to_tail)
        q = self.free_block_queue
        if to_tail or evict_first or not self.enable_caching:
            if to_tail:
                q.append_n(blocks)
            else:
                q.prepend_n(blocks)
            return
        first: list[KVCacheBlock] = []
        last: list[KVCacheBlock] = []
        for b in blocks:
            if b.block_hash is None:
                first.append(b)
            else:
                last.append(b)
        q.prepend_n(first)
        q.append_n(last)

    # ------------------------------------------------------------------
    # keys and events
    # ------------------------------------------------------------------

    def _drop_keys(self, b: KVCacheBlock, reason: str | None = None) -> list[Hashable]:
        """Withdraw every key of ``b``, with a removed event for each key
        the prefix cache reports (:meth:`PrefixCache.reportable`).
        ``reason`` (see :class:`BlockRemoved`): by default ``"load_failed"``
        for a block whose load failed, else ``"evicted"``. Returns the keys
        withdrawn. O(keys of the block)."""
        keys = self.prefix_cache.remove(b)
        if keys and self.enable_kv_cache_events:
            if reason is None:
                reason = "load_failed" if self.writes.is_invalid(b.block_id) else "evicted"
            self._removed(self.prefix_cache.reportable(keys), reason)
        return keys

    def _removed(self, keys: Iterable[Hashable], reason: str) -> None:
        """Queue one removed event per key (events on). O(len(keys))."""
        if self.enable_kv_cache_events:
            medium = self.medium
            self.kv_event_queue.extend([BlockRemoved((k,), medium, reason) for k in keys])

    def _stored(
        self, keys: tuple[Hashable, ...], parent: Hashable | None, size: int | None, ids: tuple[int, ...]
    ) -> None:
        """Queue a stored event (events on). O(len(keys))."""
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockStored(keys, parent, size, ids, self.medium))

    def _cleared(self) -> None:
        """Queue an all-cleared event (events on). O(1)."""
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared(self.medium))

    def take_events(self) -> list[KVCacheEvent]:
        """Take and clear the queued KV cache events (``[]`` when disabled),
        after applying queued completions (a failed load's removed events).
        ``kv_event_queue`` stays the same list (emptied in place), so a
        reference to it held by an adapter stays good. O(events)."""
        if (
            self._due
        ):  # hot call (once a step, and after each adapter call): _apply_completions' test, hoisted
            self._apply_completions()
        if not self.enable_kv_cache_events:
            return []
        queue = self.kv_event_queue
        events = queue.copy()
        queue.clear()
        return events

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    # ------------------------------------------------------------------
    # fences and accesses
    # ------------------------------------------------------------------

    def _fence(self, groups: Iterable[tuple[list[KVCacheBlock], AccessKind]], st: StreamState) -> Fence:
        """:func:`~blockpool.core.shadows.fence_of`, counted. O(blocks + k^2)."""
        fence = fence_of(groups, st, self.tracker, self.debug)
        self._n_fences += 1
        n = len(fence.tokens)
        if not n:
            self._n_empty_fences += 1
            return fence
        c = self._counters
        c["fence_tokens"] += n
        c["max_fence_size"] = max(c["max_fence_size"], n)
        if fence.needs_host_wait:
            c["host_wait_fences"] += 1
        return fence

    def _tag(self, blocks: Sequence[KVCacheBlock], token: Token, access: AccessKind) -> None:
        """Record ``token``'s ``access`` in the shadows of ``blocks`` (nulls
        skipped). A write also hands what it replaced, in the same pass, to
        the pending writes (a failed write puts it back). The caller checked
        the order first (:meth:`_check_write_order`). O(len(blocks))."""
        if type(blocks) is not list:
            blocks = list(blocks)  # a tuple from free_blocks: the passes below take lists
        if access is _WRITE:
            if self._fresh or self._announced:
                self._written(blocks)
            self.tracker.wrote(token)
            self.writes.began(token, write(blocks, token, self.null_block))
        else:
            tag(blocks, token, access, self.tracker.is_ended)
            clear(self.null_block)  # the null block never has a shadow

    def _written(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A write was recorded on ``blocks``: none of them is a fill's
        target any more (:meth:`_check_exclusive`). The callers test
        ``self._fresh or self._announced`` first (both are usually empty).
        O(len(blocks))."""
        fresh = self._fresh
        if fresh:
            fresh.difference_update(blocks)
        announced = self._announced
        if announced:
            announced.difference_update(blocks)

    def _announce(self, b: KVCacheBlock) -> None:
        """``b`` is being published: if nothing wrote it since its
        allocation, its keys announce the content a fill will load
        (:meth:`_check_exclusive`). The callers test ``self._fresh`` first.
        O(1)."""
        fresh = self._fresh
        if b in fresh:
            fresh.discard(b)
            self._announced.add(b)

    def _check_write_order(self, blocks: Sequence[KVCacheBlock], token: Token) -> None:
        """Refuse a write by ``token`` (not ended) to a block whose shadow
        holds an access ordered after ``token`` (:meth:`HazardTracker.later_than`):
        a write recorded out of the order the work runs in, which no
        shadow of one writer can hold exactly. A block already written by
        ``token`` passes (the same write again). O(1) when no token was
        issued after ``token`` (the usual case); else O(len(blocks)),
        once per run of shared shadow objects.

        Raises:
            InvalidArgumentError: the first such block (nothing changed).
        """
        later = self.tracker.later_than(token)
        if later is None:
            return
        seq, stream = token.seq, token.stream
        null = self.null_block
        lw: object = _UNSET
        lr: object = _UNSET
        for b in blocks:
            w = b.writer
            r = b.readers
            if b is null or (w is lw and r is lr):
                continue
            lw, lr = w, r
            if w is not None and w.seq == seq and w.stream == stream:
                continue  # this write again
            for t in shadow_tokens(b):
                if later(t):
                    raise InvalidArgumentError(
                        f"a write by {token} to block {b.block_id} is recorded after {t}'s access, "
                        f"which is ordered after {token}: record accesses in the order they run"
                    )

    def _ended_write(self, blocks: Sequence[KVCacheBlock], token: Token) -> None:
        """A write by ``token`` recorded after ``token`` ended (or with
        hazards off). Failed: it never happened (:meth:`_unwritten`).
        Otherwise, with hazards on, ``token`` becomes the writer of each
        block whose writer slot holds no write that may still run or ran
        after it (:func:`~blockpool.core.shadows.settle`), so that a late
        failure report of ``token`` still withdraws their keys; fences do
        not change (an ended token is never waited on). Invalid marks stay:
        whether this write ran before or after the failed write that left
        a mark is not known, and a mark only withholds publication (the
        safe side). O(len(blocks))."""
        if self._fresh or self._announced:
            self._written(blocks)
        if self.tracker.has_failed(token):
            self._unwritten(blocks, token)
        elif self.track_hazards:
            self.tracker.wrote(token)
            settle(blocks, token, self.null_block, self.tracker.is_ended)

    def _unwritten(self, blocks: Iterable[KVCacheBlock], token: Token) -> None:
        """A write by ``token`` recorded after ``token`` had failed: it
        never happened, so the blocks' content is not what their keys name:
        withdraw the keys and mark the content invalid (no shadow changes).
        O(len(blocks))."""
        null = self.null_block
        data = [b for b in blocks if b is not null]
        if self._fresh or self._announced:
            self._written(data)
        self.writes.mark_invalid(data, token)
        for b in data:
            self._drop_keys(b)

    # ------------------------------------------------------------------
    # validation helpers (raise before any change)
    # ------------------------------------------------------------------

    def _own(self, b: object) -> KVCacheBlock:
        try:
            if self.blocks[b.block_id] is b and b.block_id >= 0:  # type: ignore[attr-defined]
                return b  # type: ignore[return-value]
        except (AttributeError, IndexError, TypeError):
            if not isinstance(b, KVCacheBlock):
                raise InvalidArgumentError(f"expected a KVCacheBlock, got {b!r}") from None
        raise ForeignBlockError(f"block {getattr(b, 'block_id', b)!r} does not belong to this pool")

    def _own_all(self, blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """``blocks`` as a list (the caller's own list when it is one), every
        block checked to be this pool's: one identity test per block
        (``blocks[b.block_id] is b``); raises as :meth:`_own` otherwise."""
        block_list = blocks if type(blocks) is list else _as_list(blocks, "blocks")
        own = self.blocks
        cls = self._block_cls
        try:
            for x in block_list:
                b: KVCacheBlock = x  # typed: native reads in the compiled build (a TypeError otherwise)
                if type(b) is not cls and own[b.block_id] is not b:
                    break
            else:
                return block_list
        except (AttributeError, IndexError, TypeError):
            pass
        return [self._own(b) for b in block_list]  # raises the typed error

    def _data_blocks(self, blocks: Iterable[KVCacheBlock], what: str) -> list[KVCacheBlock]:
        """Own (:meth:`_own_all`), non-null, allocated blocks; null
        placeholders are skipped."""
        null = self.null_block
        out = [b for b in self._own_all(blocks) if b is not null]
        for b in out:
            if b.ref_cnt <= 0:
                raise BlockNotAllocatedError(
                    f"{what}: block {b.block_id} is not allocated (ref count 0); "
                    "hold a reference (allocate or touch) for the transfer's duration"
                )
        return out

    def _check_exclusive(self, blocks: list[KVCacheBlock], what: str, fill: bool = False) -> None:
        """Refuse a write replacing the content of a published block that
        more than one holder holds (ref count above 1 and a key: a prefix
        hit other requests may be reading): their reads are recorded only
        when they free the block, so no fence can order the write before
        them. A block with no key can have been shared only by its own
        request's holders (a connector's pin for a transfer's retries), so
        it is not refused. With ``fill`` (a load), a block whose keys were
        published before any write since its allocation is not refused
        either: nobody has read content from it, and the load is the fill
        its keys announce (vLLM publishes an external prefix's keys when it
        allocates the blocks, and another request can hit them before the
        load begins); the load becomes its writer, so every holder's later
        access is fenced after it, and its failure withdraws the keys.
        ``blocks``: allocated data blocks (:meth:`_data_blocks`).
        O(len(blocks)).

        Raises:
            SharedBlockError: the first such block.
        """
        pc = self.prefix_cache
        announced = self._announced if fill else None
        for b in blocks:
            if announced and b in announced:
                continue
            if b.ref_cnt > 1 and (b.block_hash is not None or pc.keys_of(b)):
                raise SharedBlockError(
                    f"{what}: block {b.block_id} is a cached block held by {b.ref_cnt} holders (ref count "
                    f"{b.ref_cnt}); another request that took it as a prefix hit may still read it and its reads "
                    "are recorded only when it frees it, so no fence can order this write after them: write into "
                    "a block only this request holds (allocate a fresh one, or copy-on-write)",
                    b.block_id,
                    b.ref_cnt,
                )

    def _check_valid_content(self, blocks: list[KVCacheBlock], what: str) -> None:
        """Refuse a read that would carry a block's content elsewhere (a
        store, a copy's source) while that content is known bad: a failed
        load or copy wrote it and nothing has rewritten it since
        (:class:`~blockpool.core.pending_writes.PendingWrites` marks).
        O(1) when no block is marked, else O(len(blocks)).

        Raises:
            InvalidContentError: the first such block.
        """
        writes = self.writes
        if not writes.has_invalid():
            return
        for b in blocks:
            if writes.is_invalid(b.block_id):
                raise InvalidContentError(
                    f"{what}: block {b.block_id} holds no valid content (a write into it failed and nothing has "
                    "written it since): it would carry garbage under valid keys; write the block again first",
                    b.block_id,
                )

    def _check_fresh(self, blocks: list[KVCacheBlock], generations: Iterable[object], what: str) -> None:
        """:func:`blockpool.core.generations.check_fresh` for this pool.
        O(len(blocks)).

        Raises:
            InvalidArgumentError: ``generations`` is not an iterable of ints
                as long as ``blocks``.
            StaleBlockError: the first stale block.
        """
        gens = generations if type(generations) is list else _as_list(generations, "generations")
        check_fresh(self._gens, blocks, gens, self.null_block, what)  # type: ignore[arg-type]

    @staticmethod
    def _check_count(n: object) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidArgumentError(f"block count must be an int >= 0, got {n!r}")
        return n

    @staticmethod
    def _check_access(access: object) -> AccessKind:
        if not isinstance(access, AccessKind):
            raise InvalidArgumentError(f"access must be an AccessKind, got {access!r}")
        return access
