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

import logging
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from sortedcontainers import SortedList

from blockpool.block import FreeBlockQueue, KVCacheBlock, NullBlock, block_class_for_pool
from blockpool.errors import (
    BlockNotAllocatedError,
    ForeignBlockError,
    HashConflictError,
    InvalidArgumentError,
    InvariantError,
    LeaseExpiredWarning,
    NoFreeBlocksError,
    NullBlockError,
    RefCountError,
)
from blockpool.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from blockpool.prefix_cache import PrefixCache
from blockpool.hazards import EMPTY_FENCE, AccessKind, Fence, FenceReason, StreamKind, Token
from blockpool.stats import PoolSnapshot, PoolStats
from blockpool.tracker import HazardTracker, StreamState

__all__ = ["HazardAwareBlockPool"]

logger = logging.getLogger(__name__)

_DEVICE = StreamKind.DEVICE
_HOST = StreamKind.HOST
_UNSET = object()  # "no previous value" for the per-call identity memos
_READ = AccessKind.READ
_WRITE = AccessKind.WRITE

_COUNTERS = (
    "lookups",
    "hits",
    "evictions",
    "fences",
    "fence_tokens",
    "empty_fences",
    "host_wait_fences",
    "max_fence_size",
    "leases_expired",
    "abandoned",
    "unpublished_failed_loads",
)


def _same_key(a: Token, b: Token) -> bool:
    """Whether two tokens share a shadow slot: the same device stream (the
    newer covers the older), or equal host tokens (each host token apart).
    Compares fields, not ``==``: Token's attrs-made ``__eq__``/``__hash__``
    are Python functions, too slow for a per-block path."""
    return a.stream == b.stream and (a.kind is not _HOST or a.seq == b.seq)


def _shadow_tokens(b: KVCacheBlock) -> list[Token]:
    out: list[Token] = []
    if b.writer is not None:
        out.append(b.writer)
    r = b.readers
    if r is not None:
        out.extend([r] if type(r) is Token else r)  # type: ignore[arg-type]
    return out


def _with_read(r: Token | tuple[Token, ...] | None, t: Token, ended: Callable[[Token], bool]) -> Token | tuple[Token, ...]:
    """The readers of a block after a read by ``t``, from its readers ``r``:
    newest token per device stream, each host token apart. A single earlier
    reader that has ended is dropped. The result is a new value (readers are
    shared between blocks and never mutated). O(len(r))."""
    if r is None:
        return t
    if type(r) is Token:
        if _same_key(r, t):  # type: ignore[arg-type]
            return t if r.seq < t.seq else r  # type: ignore[union-attr]
        if ended(r):  # type: ignore[arg-type]
            return t
        return (r, t)  # type: ignore[return-value]
    for i, x in enumerate(r):  # type: ignore[arg-type]
        if _same_key(x, t):
            return r[:i] + (t,) + r[i + 1 :] if x.seq < t.seq else r  # type: ignore[index,operator,return-value]
    return r + (t,)  # type: ignore[operator,return-value]


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


class HazardAwareBlockPool:
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

    Raises:
        InvalidArgumentError: ``num_gpu_blocks`` is not an int ``>= 1``, or a
            stream spec is bad.

    Runtime complexity: construction is O(num_gpu_blocks).
    """

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
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or isinstance(num_gpu_blocks, bool) or num_gpu_blocks < 1:
            raise InvalidArgumentError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        if lease_timeout is not None and not lease_timeout > 0:
            raise InvalidArgumentError(f"lease_timeout must be > 0 or None, got {lease_timeout!r}")
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
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])

        self.prefix_cache = PrefixCache()
        self.kv_event_queue: list[KVCacheEvent] = []

        self.tracker = HazardTracker()
        for name, kind in (streams if streams is not None else {"compute": _DEVICE}).items():
            self.tracker.add_stream(name, kind)

        # Held blocks: block_id -> host tokens still pending on it.
        self._held: dict[int, set[Token]] = {}
        self._held_by: dict[Token, list[KVCacheBlock]] = {}
        self._leases: SortedList = SortedList()  # (deadline, block_id)
        self._deadline: dict[int, float] = {}  # lease of each held block
        self._expired: set[int] = set()
        # Loads in flight: stream -> {seq: blocks}; used to unpublish on failure.
        # Writes begun by begin_load / begin_copy and not yet ended:
        # stream -> {seq: [(block, writer before, readers before)]}. A failed
        # write restores what it replaced (it may have failed before its
        # waits) and unpublishes the blocks' keys.
        self._writes: dict[str, dict[int, list[tuple[KVCacheBlock, Token | None, object]]]] = {}
        # Blocks whose content is invalid (their load failed) until rewritten.
        self._invalid: set[int] = set()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # Lookups and hits are counted on the hottest path (one per block of
        # a prefix): plain ints, folded into the counters by stats().
        self._lookups = 0
        self._hits = 0
        # Hot paths test these two before calling _sync (which does the work):
        # the completion inbox (a deque, appended from any thread) and
        # whether leases are on.
        self._inbox = self.tracker._inbox
        self._leases_on = lease_timeout is not None

    # ------------------------------------------------------------------
    # streams, tokens, completions
    # ------------------------------------------------------------------

    def add_stream(self, name: str, kind: StreamKind = StreamKind.DEVICE) -> None:
        """Register a stream (idempotent for the same kind). O(1).

        Raises:
            InvalidArgumentError: empty name, bad kind, or the name is already
                registered with another kind.
        """
        self.tracker.add_stream(name, kind)

    @property
    def streams(self) -> dict[str, StreamKind]:
        """Registered streams and their kinds."""
        return {n: s.kind for n, s in self.tracker.streams.items()}

    def issue(self, stream: str) -> Token:
        """Issue the next token of ``stream`` (e.g. step N's "forward done"
        on ``compute``). The token is ordered after everything the stream has
        waited on so far. O(#streams).

        Raises:
            UnknownStreamError: ``stream`` was never registered.
        """
        if self._inbox or self._leases_on:
            self._sync()
        return self.tracker.issue(stream)

    def last_token(self, stream: str) -> Token | None:
        """The newest token issued on ``stream`` (``None`` before the first).
        With async scheduling, this is what a free must be tagged with: step
        N+1 may already be enqueued when step N's output frees a request.
        O(1).

        Raises:
            UnknownStreamError: ``stream`` is not registered.
        """
        st = self.tracker.state(stream)
        return Token(st.name, st.last_seq, st.kind) if st.last_seq else None

    def complete(self, token: Token) -> None:
        """The work up to ``token`` finished. Callable from any thread; applied
        at the start of the pool's next call (or :meth:`poll`). For a
        ``DEVICE`` stream this ends every earlier token too; for a ``HOST``
        engine only ``token``. Idempotent. O(1) here; applying it releases
        the blocks held on it.

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
        """
        self.tracker.submit(token, False)

    def fail(self, token: Token) -> None:
        """The work of ``token`` ended without doing its job (a failed
        transfer). Like :meth:`complete`, plus: blocks a failed *load* wrote
        lose their prefix-cache keys (removed events) and are never published
        until rewritten.

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
        """
        self.tracker.submit(token, True)

    def abandon(self, token: Token) -> list[int]:
        """The operator's or connector's word that the engine behind ``token``
        stopped: the token is ended as failed now, and the blocks held on it
        are released. Returns the block ids released. O(blocks held on it).

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
        """
        self._sync()
        self.tracker.validate(token)
        before = set(self._held)
        ended = self.tracker.end(token, True)
        if ended:
            self._counters["abandoned"] += 1
        self._on_ended(token, True, ended)
        return sorted(before - set(self._held))

    def poll(self) -> None:
        """Apply queued completions and check leases now. O(completions)."""
        self._sync()

    def is_ended(self, token: Token) -> bool:
        """Whether ``token`` is known to have ended (completed or failed).
        Applies queued completions first.

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
        """
        self._sync()
        self.tracker.validate(token)
        return self.tracker.is_ended(token)

    def _sync(self) -> None:
        tracker = self.tracker
        if tracker._inbox:
            for token, failed, ended in tracker.drain():
                self._on_ended(token, failed, ended)
        if self._leases:
            self._check_leases()

    def _on_ended(
        self, token: Token, failed: bool, ended: list[tuple[StreamState, list[int]]]
    ) -> None:
        for st, seqs in ended:
            writes = self._writes.get(st.name)
            if writes:
                for seq in seqs:
                    before = writes.pop(seq, None)
                    if before is not None and failed and seq == token.seq and st.name == token.stream:
                        self._undo_failed_write(token, before)
            if st.kind is _HOST and self._held_by:
                for seq in seqs:
                    self._release_held(Token(st.name, seq, _HOST))

    def _release_held(self, token: Token) -> None:
        # Blocks held together share one pending set (see _enqueue_free), so
        # the set is usually the same object block after block: discard once.
        held = self._held
        leases = self._leases_on
        release: list[KVCacheBlock] = []
        last = None
        for b in self._held_by.pop(token, ()):
            pending = held.get(b.block_id)
            if pending is None:
                continue  # released already (a touch took it)
            if pending is not last:
                last = pending
                pending.discard(token)
            if not pending:
                if leases:
                    self._unhold(b.block_id)
                else:
                    del held[b.block_id]
                release.append(b)
        if release:
            self._enqueue_free(release)

    def _undo_failed_write(
        self, token: Token, before: list[tuple[KVCacheBlock, Token | None, object]]
    ) -> None:
        """A load or copy failed: it may have failed before its own waits, so
        the accesses it replaced in each block's shadow may still run; put
        them back (with the reads recorded since), mark the content invalid
        and withdraw the blocks' keys."""
        ended = self.tracker.is_ended
        for b, writer, readers in before:
            if b.writer is None or b.writer.stream != token.stream or b.writer.seq != token.seq:
                continue  # rewritten since: the newer write replaced it
            merged = readers
            later = b.readers
            for t in () if later is None else ((later,) if type(later) is Token else later):  # type: ignore[union-attr]
                merged = _with_read(merged, t, ended)  # type: ignore[arg-type]
            b.writer = writer
            b.readers = merged  # type: ignore[assignment]
            self._invalid.add(b.block_id)
            self._drop_keys(b)
            if b.ref_cnt == 0 and b.prev_free_block is not None:
                # Free again, but the restored accesses may need a hold.
                self.free_block_queue.remove(b)
                self._enqueue_free([b])

    def _check_leases(self) -> None:
        now = self._clock()
        leases = self._leases
        expired: list[int] = []
        while leases and leases[0][0] <= now:
            deadline, bid = leases.pop(0)
            if self._deadline.get(bid) == deadline and bid not in self._expired:
                self._expired.add(bid)
                expired.append(bid)
        if expired:
            self._counters["leases_expired"] += len(expired)
            tokens = sorted({str(t) for bid in expired for t in self._held[bid]})
            msg = (
                f"lease expired for held blocks {expired}: host transfers {tokens} "
                "have not ended; the blocks stay quarantined until abandon()"
            )
            logger.warning(msg)
            warnings.warn(msg, LeaseExpiredWarning, stacklevel=3)

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
            for b in block_list:
                if b.__class__ is not cls and own[b.block_id] is not b:
                    break
            else:
                return block_list
        except (AttributeError, IndexError, TypeError):
            pass
        return [self._own(b) for b in block_list]  # raises the typed error

    def _data_blocks(self, blocks: Iterable[KVCacheBlock], what: str) -> list[KVCacheBlock]:
        """Own, non-null, allocated blocks (null placeholders are skipped)."""
        out = []
        own = self.blocks
        null = self.null_block
        cls = self._block_cls
        for b in blocks:
            try:
                mine = b.__class__ is cls or own[b.block_id] is b
            except (AttributeError, IndexError, TypeError):
                mine = False
            if not mine:
                self._own(b)
            if b is null:
                continue
            if b.ref_cnt <= 0:
                raise BlockNotAllocatedError(
                    f"{what}: block {b.block_id} is not allocated (ref count 0); "
                    "hold a reference (allocate or touch) for the transfer's duration"
                )
            out.append(b)
        return out

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
            self._sync()
        n = num_blocks if type(num_blocks) is int and num_blocks >= 0 else self._check_count(num_blocks)
        if n > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"Cannot get {n} free blocks from the pool "
                f"({self.free_block_queue.num_free_blocks} free, {len(self._held)} held back)"
            )
        return self._take(n)

    def _take(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` free blocks, evict their keys, give each ref count 1.
        Eviction is inline: a block whose only key maps to it alone costs one
        dict deletion; anything else (extra keys, a shared key, events on)
        goes through :meth:`_drop_keys`."""
        blocks = self.free_block_queue.popleft_n(n)
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
        O(len(hits) + num_blocks).

        Raises:
            InvalidArgumentError: bad count or access kind.
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a hit is not a block of this pool.
            NoFreeBlocksError: not enough free blocks once the hits are taken.
        """
        if self._inbox or self._leases_on:
            self._sync()
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
        new = self._take(n)
        if not self.track_hazards:
            return new, EMPTY_FENCE
        return new, self._fence(((hit_list, _READ), (new, access)), st)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix hit or pin); a block with ref
        count 0 leaves the free queue (or the held set). The null block is
        skipped. O(len(blocks)).

        Raises:
            ForeignBlockError: a block is not of this pool (nothing changes).
        """
        if self._inbox or self._leases_on:
            self._sync()
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
        token: Token | None = None,
        access: AccessKind = AccessKind.READ,
    ) -> None:
        """Drop one reference per listed block, in eviction order (first =
        evicted first). A block reaching ref count 0 goes to the front of the
        free queue if it has no key (reused first) or caching is off, to the
        back if cached (LRU), or into the held set while a host-engine access
        on it has not ended. ``token``: the last enqueued access to the blocks
        (e.g. the newest scheduled step on ``compute``), recorded as an
        ``access`` in their shadows. Null blocks are skipped. A block may
        repeat as often as it is referenced. O(len(ordered_blocks)).

        Raises:
            ForeignBlockError: a block of another pool.
            RefCountError: a ref count would go below zero (whole call rejected).
            UnknownStreamError, UnknownTokenError: a token the pool never issued.
        """
        if self._inbox or self._leases_on:
            self._sync()
        blocks = (
            ordered_blocks if isinstance(ordered_blocks, (list, tuple)) else _as_list(ordered_blocks, "blocks")
        )
        record = False
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
            for i, b in enumerate(blocks):  # noqa: B007
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
        if zero:
            self._enqueue_free(zero)

    def _enqueue_free(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks that reached ref count 0 in the free queue (unkeyed to
        the front, keyed to the back) or, when a host-engine access on them
        has not ended, into the held set. Blocks freed together usually share
        their shadow objects, so the hold decision is made once per distinct
        ``(writer, readers)`` pair and the held blocks of that pair share one
        pending set. O(len(blocks))."""
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
                if w is not None or r is not None:
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

    # ------------------------------------------------------------------
    # hazards: fences and accesses
    # ------------------------------------------------------------------

    def fence_for(
        self,
        blocks: Iterable[KVCacheBlock],
        stream: str,
        access: AccessKind = AccessKind.WRITE,
    ) -> Fence:
        """The fence for an ``access`` by ``stream`` to ``blocks`` beginning
        now, and record that ``stream`` waits on it. A write waits for each
        block's writer and readers (WAW, WAR), a read for the writer (RAW);
        minus ended tokens, tokens on ``stream`` itself when it is a device
        stream, tokens ``stream`` is already ordered after, and tokens covered
        by another token of the fence. Null blocks are skipped.
        O(len(blocks) + k^2), k = distinct streams/host tokens found.

        Raises:
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``access`` is not an AccessKind.
        """
        if self._inbox or self._leases_on:
            self._sync()
        st = self.tracker.state(stream)
        access = self._check_access(access)
        block_list = self._own_all(blocks)
        if not self.track_hazards:
            return EMPTY_FENCE
        return self._fence(((block_list, access),), st)

    def _fence(
        self,
        groups: Iterable[tuple[Sequence[KVCacheBlock], AccessKind]],
        st: StreamState,
    ) -> Fence:
        # Candidates: newest token per device stream, each host token apart
        # (keyed by (stream, seq): Token's own hash is a Python function).
        # Blocks allocated together were mostly freed together and share
        # their shadow objects, so a writer or readers object identical to
        # the previous block's adds nothing and is skipped: per block, the
        # scan is two attribute reads and two identity tests.
        cand: dict[object, Token] = {}
        why: dict[Token, FenceReason] | None = {} if self.debug else None
        get = cand.get
        lw: object = _UNSET
        lr: object = _UNSET
        for blocks, access in groups:
            write = access is _WRITE
            for b in blocks:
                w = b.writer
                if w is not None and w is not lw:
                    lw = w
                    k: object = w.stream if w.kind is not _HOST else (w.stream, w.seq)
                    cur = get(k)
                    if cur is None or cur.seq < w.seq:
                        cand[k] = w
                        if why is not None:
                            why[w] = FenceReason(w, b.block_id, "writer", access)
                if write:
                    r = b.readers
                    if r is not None and r is not lr:
                        lr = r
                        for t in (r,) if type(r) is Token else r:  # type: ignore[union-attr]
                            k = t.stream if t.kind is not _HOST else (t.stream, t.seq)
                            cur = get(k)
                            if cur is None or cur.seq < t.seq:
                                cand[k] = t
                                if why is not None:
                                    why[t] = FenceReason(t, b.block_id, "reader", access)
        c = self._counters
        c["fences"] += 1
        if not cand:
            c["empty_fences"] += 1
            return EMPTY_FENCE
        tokens = self.tracker.reduce(cand.values(), st)
        if not tokens:
            c["empty_fences"] += 1
            return EMPTY_FENCE
        self.tracker.wait(st, tokens)
        host_wait = st.kind is _HOST or any(t.kind is _HOST for t in tokens)
        c["fence_tokens"] += len(tokens)
        if len(tokens) > c["max_fence_size"]:
            c["max_fence_size"] = len(tokens)
        if host_wait:
            c["host_wait_fences"] += 1
        reasons: tuple[FenceReason, ...] = ()
        if why is not None:
            tokens.sort(key=lambda t: (t.stream, t.seq))
            reasons = tuple(why[t] for t in tokens)
        return Fence(tokens, host_wait, reasons)

    def _record(self, blocks: Iterable[KVCacheBlock], token: Token, access: AccessKind) -> None:
        """Write ``token`` into the shadows of ``blocks`` (nulls skipped).

        A write replaces the shadow. A read joins the readers
        (:func:`_with_read`); readers values are immutable and shared, so the
        new value is computed once per distinct old value and assigned to
        every block that had it: one identity test and one store per block."""
        null = self.null_block
        if access is _WRITE:
            for b in blocks:
                b.writer = token
                b.readers = None
            null.writer = null.readers = None  # the null block never has a shadow
            invalid = self._invalid
            if invalid:
                for b in blocks:
                    invalid.discard(b.block_id)
            return
        ended = self.tracker.is_ended
        last_in: object = _UNSET
        last_out: Token | tuple[Token, ...] | None = None
        for b in blocks:
            r = b.readers
            if r is not last_in:
                last_in = r
                last_out = _with_read(r, token, ended)
            b.readers = last_out
        null.readers = None

    def tag(self, blocks: Iterable[KVCacheBlock], token: Token, access: AccessKind) -> None:
        """Record that ``token``'s work accesses ``blocks`` (e.g. step N's
        forward writes the blocks receiving new tokens). The caller ordered
        that work after the blocks' fences (:meth:`fence_for` /
        :meth:`allocate_for`). A write replaces the shadow; a read joins it.
        Null blocks are skipped. O(len(blocks)).

        Raises:
            ForeignBlockError, UnknownStreamError, UnknownTokenError,
            InvalidArgumentError: as the names say; nothing changes.
        """
        if self._inbox or self._leases_on:
            self._sync()
        self.tracker.validate(token)
        access = self._check_access(access)
        block_list = self._own_all(blocks)
        if self.track_hazards and not self.tracker.is_ended(token):
            self._record(block_list, token, access)
        elif access is _WRITE and self._invalid:
            for b in block_list:
                self._invalid.discard(b.block_id)

    def _begin(
        self,
        groups: tuple[tuple[list[KVCacheBlock], AccessKind], ...],
        stream: str,
        st: StreamState,
    ) -> tuple[Token, Fence]:
        fence = self._fence(groups, st) if self.track_hazards else EMPTY_FENCE
        token = self.tracker.issue(stream, fence.tokens)
        if self.track_hazards:
            before = [
                (b, b.writer, b.readers) for blocks, access in groups if access is _WRITE for b in blocks
            ]
            if before:
                self._writes.setdefault(stream, {})[token.seq] = before
            for blocks, access in groups:
                self._record(blocks, token, access)
        return token, fence

    def begin_copy(
        self, pairs: Iterable[tuple[KVCacheBlock, KVCacheBlock]], stream: str = "compute"
    ) -> tuple[Token, Fence]:
        """Begin copy-on-write / block copies ``(src, dst)`` on ``stream``:
        returns the copy's token (a read of every ``src``, a write of every
        ``dst``) and the fence the copy waits on. O(len(pairs)).

        Raises:
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a block of another pool.
            NullBlockError: the null block as a source or destination.
            BlockNotAllocatedError: a block with ref count 0.
            InvalidArgumentError: a pair is not a 2-tuple.
        """
        if self._inbox or self._leases_on:
            self._sync()
        st = self.tracker.state(stream)
        srcs: list[KVCacheBlock] = []
        dsts: list[KVCacheBlock] = []
        for pair in pairs:
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"a copy is a (src, dst) pair, got {pair!r}") from None
            for b in (src, dst):
                self._own(b)
                if b.is_null:
                    raise NullBlockError("the null block cannot be copied from or into")
            srcs.append(src)
            dsts.append(dst)
        self._data_blocks(srcs + dsts, "copy")
        return self._begin(((srcs, _READ), (dsts, _WRITE)), stream, st)

    def begin_load(self, blocks: Iterable[KVCacheBlock], stream: str) -> tuple[Token, Fence]:
        """Begin a load (external tier -> GPU) into ``blocks`` on ``stream``
        (a DMA stream or a host engine): returns the load's token (the new
        writer of every block) and the fence it waits on (WAR on the last
        readers, WAW on the last writer). If the load fails, the blocks lose
        their keys and are not published until rewritten. Null placeholders
        are skipped. O(len(blocks)).

        Raises:
            UnknownStreamError, ForeignBlockError, BlockNotAllocatedError.
        """
        if self._inbox or self._leases_on:
            self._sync()
        st = self.tracker.state(stream)
        data = self._data_blocks(blocks, "load")
        return self._begin(((data, _WRITE),), stream, st)

    def begin_store(self, blocks: Iterable[KVCacheBlock], stream: str) -> tuple[Token, Fence]:
        """Begin a store / offload (GPU -> external tier) from ``blocks`` on
        ``stream``: returns the store's token (a reader of every block; a
        later write waits on it, WAR) and the fence it waits on (RAW on the
        last writer). Null placeholders are skipped. O(len(blocks)).

        Raises:
            UnknownStreamError, ForeignBlockError, BlockNotAllocatedError.
        """
        if self._inbox or self._leases_on:
            self._sync()
        st = self.tracker.state(stream)
        data = self._data_blocks(blocks, "store")
        return self._begin(((data, _READ),), stream, st)

    # ------------------------------------------------------------------
    # prefix cache (vLLM surface, request-agnostic keys)
    # ------------------------------------------------------------------

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        """The first cached block under ``block_hash`` (any opaque hashable),
        or ``None``. O(1): one dict lookup.

        Raises:
            InvalidArgumentError: ``block_hash`` is not hashable.
        """
        if self._inbox:
            self._sync()  # a queued failed load must unpublish its keys first
        try:
            v = self.prefix_cache._map.get(block_hash)
        except TypeError:
            raise InvalidArgumentError(f"block hash must be hashable, got {block_hash!r}") from None
        self._lookups += 1
        if v is None:
            return None
        self._hits += 1
        # A key shared by several blocks maps to {block_id: block} (PrefixCache).
        return next(iter(v.values())) if type(v) is dict else v  # type: ignore[union-attr,return-value]

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[Hashable],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int | None = None,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under
        ``block_hashes[i]`` (one key per block, aligned with ``blocks``).
        Null or masked-out blocks are skipped; so are blocks whose load
        failed. A block already holding a shorter-prefix key is promoted
        (its old keys removed, with events). Emits one stored event.
        O(num_full_blocks - num_cached_blocks).

        Raises:
            InvalidArgumentError: counts out of range, too few hashes, mask
                of the wrong length, a key that is ``None`` or unhashable, a
                ``block_size`` that is not a positive int.
            ForeignBlockError: a block of another pool.
            HashConflictError: a block already cached under a different key
                for the same or a longer prefix.
        """
        if self._inbox or self._leases_on:
            self._sync()
        lo, hi = num_cached_blocks, num_full_blocks
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo and hi <= len(blocks)):
            raise InvalidArgumentError(
                f"need 0 <= num_cached_blocks <= num_full_blocks <= len(blocks), got {lo}, {hi}, {len(blocks)}"
            )
        if lo >= hi:
            return
        if len(block_hashes) < hi:
            raise InvalidArgumentError(f"{len(block_hashes)} block hashes for {hi} full blocks")
        try:
            if block_mask is not None and len(block_mask) != hi - lo:
                raise InvalidArgumentError(f"block_mask has {len(block_mask)} entries, expected {hi - lo}")
        except TypeError:
            raise InvalidArgumentError(f"block_mask must be a sequence of bool, got {block_mask!r}") from None
        if block_size is not None and (
            not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0
        ):
            raise InvalidArgumentError(f"block_size must be a positive int or None, got {block_size!r}")
        # Pass 1 checks everything (nothing changes if it raises); pass 2
        # publishes. A block with no key yet (the common case) is inserted
        # inline: one dict lookup and one store; promotions and blocks that
        # already hold a key go through the prefix cache's insert.
        own = self.blocks
        null = self.null_block
        cls = self._block_cls
        mask = block_mask
        promote: set[int] = set()
        for i in range(lo, hi):
            b = blocks[i]
            try:
                mine = b.__class__ is cls or own[b.block_id] is b
            except (AttributeError, IndexError, TypeError):
                mine = False
            if not mine:
                self._own(b)
            if b is null or (mask is not None and not mask[i - lo]):
                continue
            key = block_hashes[i]
            _check_key(key)
            h = b.block_hash
            if h is not None:
                if h != key:
                    ntok = (i + 1) * block_size if block_size else None
                    old = b.block_hash_num_tokens
                    if old is None or ntok is None or old >= ntok:
                        raise HashConflictError(
                            f"block {b.block_id} is cached under {h!r} "
                            f"({old} tokens); it cannot also be full block {key!r} ({ntok} tokens)"
                        )
                    promote.add(i)
        pc = self.prefix_cache
        m = pc._map
        invalid = self._invalid
        events = self.enable_kv_cache_events
        stored: list[Hashable] = []
        ids: list[int] = []
        for i in range(lo, hi):
            b = blocks[i]
            if b is null or (mask is not None and not mask[i - lo]):
                continue
            if invalid and b.block_id in invalid:
                self._counters["unpublished_failed_loads"] += 1
                continue
            key = block_hashes[i]
            if b.block_hash is None:
                # PrefixCache.insert for a block holding no key, inline.
                v = m.get(key)
                if v is None:
                    m[key] = b
                elif v is b or (type(v) is dict and b.block_id in v):  # type: ignore[operator]
                    continue
                elif type(v) is dict:
                    v[b.block_id] = b  # type: ignore[index]
                else:
                    m[key] = {v.block_id: v, b.block_id: b}  # type: ignore[union-attr,dict-item]
                b.block_hash = key
                b.block_hash_num_tokens = (i + 1) * block_size if block_size else None
            else:
                if i in promote:
                    self._drop_keys(b)
                if not pc.insert(key, b, (i + 1) * block_size if block_size else None):
                    continue
            if events:
                stored.append(key)
                ids.append(b.block_id)
        if stored and self.enable_kv_cache_events:
            parent = block_hashes[lo - 1] if lo > 0 else None
            self.kv_event_queue.append(
                BlockStored(tuple(stored), parent, block_size, tuple(ids), self.medium)
            )

    def cache_partial_block(
        self,
        block: KVCacheBlock,
        block_hash: Hashable,
        num_tokens: int,
        replace_existing_hashes: bool = False,
        parent_block_hash: Hashable | None = None,
    ) -> Hashable | None:
        """Make ``block`` reachable under a partial-prefix key covering
        ``num_tokens`` tokens (vLLM's partial entries). A block whose primary
        key covers fewer tokens is promoted (old keys removed, with events);
        one whose key covers more keeps it and gains ``block_hash`` as an
        extra key. ``replace_existing_hashes``: the content was replaced, drop
        every key first. Returns the key, or ``None`` for the null block or a
        block whose load failed. O(keys of the block).

        Raises:
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``num_tokens`` is not a positive int, or
                ``block_hash`` is ``None`` or unhashable.
        """
        if self._inbox or self._leases_on:
            self._sync()
        b = self._own(block)
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidArgumentError(f"num_tokens must be a positive int, got {num_tokens!r}")
        _check_key(block_hash)
        if b.is_null:
            return None
        if b.block_id in self._invalid:
            self._counters["unpublished_failed_loads"] += 1
            return None
        pc = self.prefix_cache
        already = b.block_hash == block_hash or pc.contains(block_hash, b)
        if replace_existing_hashes:
            self._drop_keys(b)
            already = False
        elif (
            not already
            and b.block_hash is not None
            and b.block_hash_num_tokens is not None
            and b.block_hash_num_tokens < num_tokens
        ):
            self._drop_keys(b)
        pc.insert(block_hash, b, num_tokens)
        if not already and self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockStored((block_hash,), parent_block_hash, num_tokens, (b.block_id,), self.medium)
            )
        return block_hash

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-point every key of ``src_block`` to ``dst_block`` (the prefix
        cache keeps a private copy while the owner keeps writing ``src``). No
        events. O(keys).

        Raises:
            ForeignBlockError: a block of another pool.
            NullBlockError: either block is the null block.
            HashConflictError: ``dst_block`` already holds a key.
        """
        self._sync()
        src, dst = self._own(src_block), self._own(dst_block)
        if src.is_null or dst.is_null:
            raise NullBlockError("the null block holds no prefix-cache keys")
        if self.prefix_cache.keys_of(dst):
            raise HashConflictError(f"block {dst.block_id} already holds prefix-cache keys")
        ntok = src.block_hash_num_tokens
        first = True
        for key in self.prefix_cache.remove_block(src):
            self.prefix_cache.insert(key, dst, ntok if first else None)
            first = False

    def _drop_keys(self, b: KVCacheBlock) -> None:
        keys = self.prefix_cache.remove_block(b)
        if keys and self.enable_kv_cache_events:
            medium = self.medium
            self.kv_event_queue.extend(BlockRemoved((k,), medium) for k in keys)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache keys of the given blocks (removed events).
        Blocks stay where they are (in use, or free at the same queue
        position). O(len(block_ids)).

        Raises:
            InvalidArgumentError: an id outside ``0 .. num_gpu_blocks - 1``
                (checked for all ids before any change).
        """
        self._sync()
        ids = _as_list(block_ids, "block_ids")
        for bid in ids:
            if not isinstance(bid, int) or not 0 <= bid < self.num_gpu_blocks:
                raise InvalidArgumentError(
                    f"invalid block_id {bid!r}: the pool has {self.num_gpu_blocks} blocks"
                )
        for bid in ids:
            b = self.blocks[bid]
            if self.prefix_cache.keys_of(b):
                self._drop_keys(b)
                self._counters["evictions"] += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every key (one all-cleared event) if no block is in use or
        held; else change nothing and return False. O(num_gpu_blocks)."""
        self._sync()
        busy = self.num_gpu_blocks - 1 - self.free_block_queue.num_free_blocks
        if busy:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet "
                "(%d held back for host transfers)",
                busy,
                len(self._held),
            )
            return False
        self.prefix_cache.clear()
        for b in self.blocks:
            b.reset_hash()
        self._invalid.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared(self.medium))
        logger.info("Successfully reset prefix cache")
        return True

    # ------------------------------------------------------------------
    # queries
    # ------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (held blocks excluded). O(1) plus queued
        completions."""
        if self._inbox or self._leases_on:
            self._sync()
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks not free (held count as used), in [0, 1]. O(1)."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Whether the sole owner may write ``block`` in place (not null, ref
        count 1, no key). O(1).

        Raises:
            InvalidArgumentError: ``block`` is not a block record.
        """
        if not isinstance(block, KVCacheBlock):
            raise InvalidArgumentError(f"expected a KVCacheBlock, got {block!r}")
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    def held_block_ids(self) -> list[int]:
        """Blocks held back for pending host-engine accesses, sorted. O(h log h)."""
        self._sync()
        return sorted(self._held)

    def expired_leases(self) -> list[int]:
        """Held blocks whose lease expired (still quarantined), sorted."""
        self._sync()
        return sorted(self._expired)

    def take_events(self) -> list[KVCacheEvent]:
        """Take and clear the queued KV cache events (``[]`` when disabled),
        after applying queued completions (a failed load's removed events).
        O(1)."""
        if self._inbox:
            self._sync()
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def _all_counters(self) -> dict[str, int]:
        return {**self._counters, "lookups": self._lookups, "hits": self._hits}

    def stats(self) -> PoolStats:
        """Counters and occupancy. O(num_gpu_blocks)."""
        self._sync()
        free = self.free_block_queue.num_free_blocks
        held = len(self._held)
        usable = self.num_gpu_blocks - 1
        cached = sum(1 for b in self.blocks if b.block_hash is not None)
        return PoolStats(
            num_blocks=usable,
            free=free,
            held=held,
            used=usable - free - held,
            cached_blocks=cached,
            cached_keys=len(self.prefix_cache),
            failed_tokens=sum(s.failed for s in self.tracker.streams.values()),
            **self._all_counters(),
        )

    # ------------------------------------------------------------------
    # invariants and snapshots
    # ------------------------------------------------------------------

    def check(self) -> None:
        """Assert every invariant; raises :class:`InvariantError` naming the
        first one broken. O(num_gpu_blocks + cached keys).

        Checked: the null block is never free, held, referenced or cached;
        the free queue's links and count agree; free blocks have ref count 0
        and are not held; held blocks have ref count 0 and a pending host
        token; ref counts >= 0; free + held + used = total; no block is
        counted twice; key map <-> block keys agree both ways.
        """
        free_list = self.free_block_queue.check()
        free_ids = [b.block_id for b in free_list]
        free_set = set(free_ids)
        if len(free_set) != len(free_ids):
            raise InvariantError("a block appears twice in the free queue")
        null = self.null_block
        if 0 in free_set or null.ref_cnt != 0 or null.block_hash is not None or 0 in self._held:
            raise InvariantError("the null block is free, held, referenced or cached")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise InvariantError(f"block {b.block_id} has ref count {b.ref_cnt}")
            if b.block_id in free_set and b.ref_cnt != 0:
                raise InvariantError(f"free block {b.block_id} has ref count {b.ref_cnt}")
        for bid, pending in self._held.items():
            if bid in free_set or self.blocks[bid].ref_cnt != 0 or not pending:
                raise InvariantError(f"held block {bid} is free, referenced or has no pending token")
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        zero_not_free = sum(
            1 for b in self.blocks[1:] if b.ref_cnt == 0 and b.block_id not in free_set
        )
        if zero_not_free != len(self._held):
            raise InvariantError(
                f"{zero_not_free} unreferenced blocks are outside the free queue but "
                f"{len(self._held)} are held"
            )
        if len(free_set) + len(self._held) + used != self.num_gpu_blocks - 1:
            raise InvariantError("free + held + used != total")
        seen_pairs = set()
        for key, blocks in self.prefix_cache.items():
            if not blocks:
                raise InvariantError(f"key {key!r} maps to no block")
            for b in blocks:
                if self.blocks[b.block_id] is not b or b.is_null:
                    raise InvariantError(f"key {key!r} maps to a foreign or null block")
                if key not in self.prefix_cache.keys_of(b):
                    raise InvariantError(f"key {key!r} maps to block {b.block_id} which lacks it")
                seen_pairs.add((key, b.block_id))
        for b in self.blocks:
            for key in self.prefix_cache.keys_of(b):
                if (key, b.block_id) not in seen_pairs:
                    raise InvariantError(f"block {b.block_id} holds key {key!r} the map lacks")
        for bid, extra in self.prefix_cache.extra_keys().items():
            if extra and self.blocks[bid].block_hash is None:
                raise InvariantError(f"block {bid} has extra keys but no primary key")

    def snapshot(self) -> PoolSnapshot:
        """A comparable picture of all observable state (tests: take one
        before a failing call, compare after). O(num_gpu_blocks)."""
        pc = self.prefix_cache
        tr = self.tracker
        return PoolSnapshot(
            ref_counts=tuple(b.ref_cnt for b in self.blocks),
            free_queue=tuple(b.block_id for b in self.free_block_queue),
            held=tuple(
                (bid, tuple(sorted(map(str, toks)))) for bid, toks in sorted(self._held.items())
            ),
            cache=tuple(
                (b.block_id, repr(k), b.block_hash_num_tokens if k == b.block_hash else None)
                for b in self.blocks
                for k in pc.keys_of(b)
            ),
            shadows=tuple(
                (b.block_id, str(b.writer), tuple(sorted(map(str, _shadow_tokens(b)))))
                for b in self.blocks
                if b.writer is not None or b.readers is not None
            ),
            events=tuple(self.kv_event_queue),
            marks=tuple(
                (n, s.last_seq, s.mark, tuple(s.done)) for n, s in sorted(tr.streams.items())
            ),
            clocks=tuple(
                (n, tuple(sorted(s.clock.dev.items())), tuple(sorted(map(str, s.clock.host))))
                for n, s in sorted(tr.streams.items())
            ),
            counters=tuple(sorted(self._all_counters().items())) + (("invalid", len(self._invalid)),),
        )
