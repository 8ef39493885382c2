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
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

from blockpool.core import placement as _placement
from blockpool.core._base import _COUNTERS, _DEVICE, _READ, _WRITE
from blockpool.core._mypyc import mypyc_attr
from blockpool.core._refcounts import RefCountOps
from blockpool.core.block import (
    FreeBlockQueue,
    KVCacheBlock,
    NullBlock,
    block_class_for_pool,
    check_block_class,
)
from blockpool.core.errors import InvalidArgumentError, NoFreeBlocksError
from blockpool.core.events import MEDIUM_GPU, KVCacheEvent
from blockpool.core.eviction import EVICTION_POLICIES, UnknownEvictionPolicyError, make_free_queue
from blockpool.core.hazards import EMPTY_FENCE, AccessKind, Fence, StreamKind
from blockpool.core.holdback import HoldBack
from blockpool.core.load_groups import LoadGroups
from blockpool.core.pending_writes import PendingWrites
from blockpool.core.placement import PLACEMENTS
from blockpool.core.prefix_cache import PrefixCache
from blockpool.core.tracker import HazardTracker, StreamState

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgAccess, ArgBool, ArgFloat, ArgInt, ArgStr

__all__ = ["PLACEMENTS", "HazardAwareBlockPool"]


class _NoBlock:
    """A class no block has: with a block factory and no ``block_class``,
    every block is checked by identity (``blocks[b.block_id] is b``)."""


@mypyc_attr(allow_interpreted_subclasses=True)
class HazardAwareBlockPool(RefCountOps):
    """A KV-cache block pool (vLLM v1 semantics) that hands out exact fences.

    Args:
        num_gpu_blocks: Blocks in the pool, null block included (``>= 1``).
        enable_caching: Prefix caching: freed cached blocks go to the LRU tail
            and stay reachable by key until evicted. Flags (this one,
            ``enable_kv_cache_events``, ``track_hazards``, ``debug``) take
            any value, read by its truth, and are stored as bools.
        hash_block_size: Tokens per hash block (kept for vLLM parity; the core
            treats keys as opaque).
        enable_kv_cache_events: Queue :mod:`blockpool.core.events` for ``take_events``.
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
        debug: Fences carry :class:`~blockpool.core.hazards.FenceReason` per token.
        medium: Storage medium reported in events.
        removal_events: When a ``BlockRemoved`` is sent for a key: ``"last"``
            (default) when the last block holding it loses it, so an event
            always means the key is gone; ``"each"`` whenever a block loses
            it, even while another block still holds it (vLLM 0.33's events,
            which the vLLM adapter reproduces).
        stored_events: The ``BlockStored`` events of
            :meth:`cache_full_blocks`: ``"runs"`` one per run of consecutive
            newly published positions, parented on the key of the position
            just before the run (every event a chain of the prefix tree);
            ``"call"`` one per call listing every newly published block,
            parented on the key at ``num_cached_blocks - 1`` (vLLM 0.33's
            events, wrong across a gap: ``docs/vllm-differences.md``).
            ``None`` (default): ``"call"`` with ``removal_events="each"``
            (vLLM's events throughout), ``"runs"`` otherwise.
        eviction: Which free cached block loses its keys first:
            ``"lru"`` (default: vLLM's order, exactly), ``"s3fifo"`` or
            ``"2q"`` (keep blocks that were hit longer; see
            :mod:`blockpool.core.eviction` for each policy and its source).
        placement: Which free blocks :meth:`allocate_for` hands out:
            ``"lru"`` (default: the queue's front, as :meth:`get_new_blocks`),
            ``"ready_first"`` (free unkeyed blocks whose shadow is empty for
            the consumer first, looking at most ``n + PLACEMENT_SCAN``) or
            ``"ready_first_cached"`` (then ready cached blocks among the
            ``n + CACHED_SCAN`` coldest, their keys evicted: a prefix that
            might still be hit, for a fence with nothing in it), or a
            run-aware mode: ``"runs"`` (blocks in the fewest runs of
            consecutive block ids among the unkeyed front's first
            ``n + RUN_SCAN``, ascending, so a transfer posts few
            descriptors; LRU still chooses every evicted key),
            ``"runs_cached"`` (may take runs among the ``n + RUN_SCAN``
            coldest cached blocks too, evicting their keys) or
            ``"ready_first_runs"`` (runs of ready blocks). See
            :mod:`blockpool.core.placement` and ``docs/replay.md``. Only
            :meth:`allocate_for` places.
        block_factory: ``block_factory(block_id)`` makes each block record
            (an adapter's subclass of the host framework's block type, say);
            block 0 must be a null block (``is_null`` true); the records hash
            by identity (no ``__eq__`` without ``__hash__``). Default: the
            core's :class:`~blockpool.core.block.KVCacheBlock`.
        block_class: With ``block_factory``: the class of the blocks it
            makes, made for this pool alone
            (:func:`~blockpool.core.block.block_class_for_pool`): a block of
            exactly this class is this pool's, a type test per block (the
            fast own-block check the default blocks get). Without it, or for
            blocks of another class, the check is by identity
            (``blocks[b.block_id] is b``).
        free_queue_class: The :class:`~blockpool.core.block.FreeBlockQueue`
            subclass to build (with ``eviction="lru"``; an adapter's subclass
            adding names, say).

    Raises:
        InvalidArgumentError: ``num_gpu_blocks`` or ``hash_block_size`` is
            not an int ``>= 1``, a stream spec is bad, ``removal_events``
            is not ``"last"`` or ``"each"``, or ``stored_events`` not
            ``"runs"``, ``"call"`` or ``None``.
        UnknownEvictionPolicyError: ``eviction`` or ``placement`` is not a
            known name (an :class:`InvalidArgumentError`).
        InvalidArgumentError: ``block_factory`` made a null block (block 0)
            whose ``is_null`` is false, or blocks that are not hashable
            (the pool keys held blocks by the record, which must hash by
            identity), or ``free_queue_class`` with an
            ``eviction`` other than ``"lru"``; ``block_class`` without
            ``block_factory``, not a class, importable by its name (a copy
            made by pickling would pass as this pool's), or already another
            pool's.

    Runtime complexity: construction is O(num_gpu_blocks).
    """

    PLACEMENT_SCAN = _placement.PLACEMENT_SCAN
    """Unkeyed free blocks ``placement="ready_first"`` looks at beyond the
    ``n`` it needs, at most (:data:`blockpool.core.placement.PLACEMENT_SCAN`)."""

    CACHED_SCAN = _placement.CACHED_SCAN
    """The window of ``placement="ready_first_cached"``
    (:data:`blockpool.core.placement.CACHED_SCAN`)."""

    RUN_SCAN = _placement.RUN_SCAN
    """The window of the run-aware placements
    (:data:`blockpool.core.placement.RUN_SCAN`); set it per pool to trade
    contiguity for cost and, under ``"runs_cached"``, hit rate."""

    def __init__(
        self,
        num_gpu_blocks: ArgInt,
        enable_caching: ArgBool = True,
        hash_block_size: ArgInt = 16,
        enable_kv_cache_events: ArgBool = False,
        *,
        track_hazards: ArgBool = True,
        streams: Mapping[str, StreamKind] | None = None,
        lease_timeout: ArgFloat | None = None,
        clock: Callable[[], float] = time.monotonic,
        debug: ArgBool = False,
        medium: ArgStr = MEDIUM_GPU,
        removal_events: ArgStr = "last",
        stored_events: ArgStr | None = None,
        eviction: ArgStr = "lru",
        placement: ArgStr = "lru",
        block_factory: Callable[[int], KVCacheBlock] | None = None,
        free_queue_class: type[FreeBlockQueue] | None = None,
        block_class: type[KVCacheBlock] | None = None,
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or isinstance(num_gpu_blocks, bool) or num_gpu_blocks < 1:
            raise InvalidArgumentError(f"num_gpu_blocks must be an int >= 1, got {num_gpu_blocks!r}")
        try:
            size: int = operator.index(hash_block_size)
        except TypeError:
            size = 0
        if size < 1 or isinstance(hash_block_size, bool):
            raise InvalidArgumentError(f"hash_block_size must be an int >= 1, got {hash_block_size!r}")
        if lease_timeout is not None and not lease_timeout > 0:
            raise InvalidArgumentError(f"lease_timeout must be > 0 or None, got {lease_timeout!r}")
        if removal_events not in ("last", "each"):
            raise InvalidArgumentError(f"removal_events must be 'last' or 'each', got {removal_events!r}")
        if stored_events is None:
            stored_events = "call" if removal_events == "each" else "runs"
        elif stored_events not in ("runs", "call"):
            raise InvalidArgumentError(f"stored_events must be 'runs', 'call' or None, got {stored_events!r}")
        self.stored_events = stored_events
        if placement not in PLACEMENTS:
            raise UnknownEvictionPolicyError(
                f"unknown placement {placement!r}; choose from {', '.join(PLACEMENTS)}"
            )
        if eviction not in EVICTION_POLICIES:
            make_free_queue(eviction, [], 0)  # raises the typed error
        if free_queue_class is not None and eviction != "lru":
            raise InvalidArgumentError("free_queue_class needs eviction='lru'")
        if block_class is not None:
            check_block_class(block_class, block_factory)
        self.eviction = eviction
        self._policy = eviction != "lru"  # the queue counts hits
        self.placement = placement
        # ready_first_runs places one block as ready_first does (one block is one run)
        self._ready_first = placement in ("ready_first", "ready_first_cached", "ready_first_runs")
        self._ready_cached = placement == "ready_first_cached"
        self._runs = placement in ("runs", "runs_cached", "ready_first_runs")
        self.placed_ready = 0  # blocks a ready-first placement handed out ahead of the queue's front
        self.placed_cached = 0  # cached blocks placement took out of eviction order (their keys evicted)
        self.num_gpu_blocks = num_gpu_blocks
        # Flags as bools (any truthy value counts; the compiled build's
        # attributes take bools).
        self.enable_caching = bool(enable_caching)
        self.hash_block_size = size
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.track_hazards = bool(track_hazards)
        self.medium = medium
        self.debug = bool(debug)
        self.lease_timeout = lease_timeout

        if block_factory is None:
            # This pool's own block class: "is b mine" becomes a type test
            # (block_class_for_pool says why); other blocks are checked by identity,
            # as a factory's blocks are unless it names their class (block_class).
            block_cls: type[KVCacheBlock] = block_class_for_pool(KVCacheBlock)
            self._block_cls = block_cls
            self.null_block: KVCacheBlock = NullBlock(0)
            # Sized exactly (a list grown by appends keeps up to 1/8 spare slots).
            self.blocks: list[KVCacheBlock] = [self.null_block] * num_gpu_blocks
            self.blocks[1:] = map(block_cls, range(1, num_gpu_blocks))
        else:
            self._block_cls = _NoBlock if block_class is None else block_class
            self.blocks = [block_factory(i) for i in range(num_gpu_blocks)]
            self.null_block = self.blocks[0]
            if not self.null_block.is_null:
                raise InvalidArgumentError("block_factory(0) must make a null block (is_null true)")
            for cls in {type(b) for b in self.blocks}:
                if getattr(cls, "__hash__", None) is None:
                    raise InvalidArgumentError(
                        f"block_factory made {cls.__qualname__} blocks, which are not hashable "
                        "(a class defining __eq__ must define __hash__, by identity)"
                    )
            if block_class is not None:
                check_block_class(block_class, block_factory, claim=True)
        if free_queue_class is None:
            self.free_block_queue = make_free_queue(eviction, self.blocks[1:], num_gpu_blocks)
        else:
            self.free_block_queue = free_queue_class(self.blocks[1:])

        self.prefix_cache = PrefixCache(self.blocks, removal_each=removal_events == "each")
        self._key_map = self.prefix_cache.key_map  # read in place by get_cached_block (never replaced)
        self._hits = 0  # get_cached_block's counters (stats(): lookups = hits + misses)
        self._misses = 0
        self.holdback = HoldBack(lease_timeout, clock)
        self.writes = PendingWrites()
        self.load_groups = LoadGroups()
        # The fill a key announces (PoolBase._check_exclusive): blocks
        # allocated and neither written nor published since (_fresh), and
        # blocks published before any write since their allocation
        # (_announced). Both small: a write or a new allocation clears them.
        self._fresh: set[KVCacheBlock] = set()
        self._announced: set[KVCacheBlock] = set()
        # One list for the pool's lifetime (take_events empties it in
        # place): an adapter may bind it once and test it without a read
        # of this object's attribute.
        self.kv_event_queue: list[KVCacheEvent] = []

        # This pool's identity, stamped on its tokens (Token.pool): a token
        # of another pool is refused (ForeignTokenError). Random, so that
        # pools in different processes differ too.
        self.pool_id: int = secrets.randbits(62) + 1
        self.tracker = HazardTracker(self.pool_id)
        for name, kind in (streams if streams is not None else {"compute": _DEVICE}).items():
            self.tracker.add_stream(name, kind)
        # A fill needs a load, which needs a stream beside the one the
        # steps run on: until a second stream exists, allocations do not
        # enter _fresh (nothing could fill them), so a pool without
        # transfers pays nothing for the fill rule on its hot paths.
        self._track_fills = bool(enable_caching) and len(self.tracker.streams) > 1

        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._n_fences = 0
        self._n_empty_fences = 0
        # _apply_completions tests these two: the completion inbox (a
        # deque, appended from any thread) and whether leases are on; the
        # hot calls test _due, truthy exactly when one of them is (one
        # attribute test per lookup, not two). Set here only, never again:
        # the vLLM adapter binds the same object once.
        self._inbox = self.tracker._inbox
        self._leases_on = lease_timeout is not None
        self._due = True if self._leases_on else self._inbox
        # Block generations (stale block tables): off (None) until the first
        # generations() call, then one unsigned 64-bit word per block, set to
        # the serial of the allocation that handed the block out.
        self._gens = None

    # ------------------------------------------------------------------
    # allocation (vLLM surface)
    # ------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: ArgInt) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting
        their prefix-cache keys (one removed event per key). Held blocks are
        never taken. Same as vLLM's ``get_new_blocks``; the fence of the
        access that will use them comes from :meth:`fence_for` when it begins
        (or use :meth:`allocate_for`). O(num_blocks).

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(4)
        >>> [b.block_id for b in pool.get_new_blocks(2)], pool.get_num_free_blocks()
        ([1, 2], 1)

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int ``>= 0``.
            NoFreeBlocksError: fewer than ``num_blocks`` blocks are free.
        """
        return self._new_blocks(num_blocks, None)

    def get_new_blocks_with_removed_keys(
        self, num_blocks: ArgInt
    ) -> tuple[list[KVCacheBlock], list[Hashable]]:
        """:meth:`get_new_blocks` for an adapter that sends its own removed
        events (vLLM's adapter: vLLM's events, by vLLM's own helper): the
        same blocks, checks and errors, but with events on the keys the
        blocks lost are returned, in the order :meth:`get_new_blocks` would
        queue their removed events (one per key), and no event is queued
        for them (``[]`` with events off). The events' reason (``evicted``
        or ``load_failed``) is not returned. The events of the queued
        completions the call applies first (a failed load's removals) are
        queued as usual: they come before these keys. O(num_blocks).

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(3, enable_kv_cache_events=True)
        >>> blocks = pool.get_new_blocks(2)
        >>> pool.cache_full_blocks(blocks, ["h0", "h1"], 0, 2, 16)
        >>> pool.free_blocks(blocks)
        >>> _ = pool.take_events()
        >>> new, removed = pool.get_new_blocks_with_removed_keys(2)
        >>> [b.block_id for b in new], removed, pool.take_events()
        ([1, 2], ['h0', 'h1'], [])

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int ``>= 0``.
            NoFreeBlocksError: fewer than ``num_blocks`` blocks are free.
        """
        removed: list[Hashable] = []
        return self._new_blocks(num_blocks, removed), removed

    def _new_blocks(self, num_blocks: ArgInt, keys_out: list[Hashable] | None) -> list[KVCacheBlock]:
        """:meth:`get_new_blocks`, the removed keys appended to ``keys_out``
        instead of queued when it is a list (events on). O(num_blocks)."""
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        n = num_blocks if type(num_blocks) is int and num_blocks >= 0 else self._check_count(num_blocks)
        if n > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"Cannot get {n} free blocks from the pool "
                f"({self.free_block_queue.num_free_blocks} free, {len(self.holdback)} held back)"
            )
        blocks = self._take(n, keys_out)
        if self._gens is None:
            return blocks
        return self._gens.stamp(blocks)

    def allocate_for(
        self,
        num_blocks: ArgInt,
        stream: ArgStr,
        *,
        hits: Sequence[KVCacheBlock] = (),
        access: ArgAccess = AccessKind.WRITE,
    ) -> tuple[list[KVCacheBlock], Fence]:
        """Atomically touch the prefix hits ``hits`` and allocate
        ``num_blocks`` new blocks for a consumer on ``stream``; return the new
        blocks and the fence the consumer must wait on (reading the hits:
        RAW; ``access`` on the new blocks: WAR/WAW). Records that ``stream``
        waits on the fence. Changes nothing when it cannot succeed; hits that
        sit in the free queue are counted once (they stop being free).
        O(len(hits) + num_blocks); with a ready-first ``placement``, plus at
        most ``PLACEMENT_SCAN`` (+ ``CACHED_SCAN`` for
        ``"ready_first_cached"``) blocks looked at; with a run-aware one,
        O(W log W), W = ``num_blocks + 2 * RUN_SCAN``.

        Example: a load allocated while the step that read the freed blocks
        still runs waits on that step (WAR), then on nothing once it ended::

            >>> from blockpool import HazardAwareBlockPool, StreamKind
            >>> pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE})
            >>> step = pool.issue("compute")
            >>> pool.free_blocks(pool.get_new_blocks(3), token=step)
            >>> blocks, fence = pool.allocate_for(2, "h2d")
            >>> [b.block_id for b in blocks], [str(t) for t in fence]
            ([1, 2], ['compute:1'])
            >>> pool.complete(step)
            >>> pool.allocate_for(1, "h2d")[1].tokens
            ()

        Raises:
            InvalidArgumentError: bad count or access kind.
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a hit is not a block of this pool.
            NoFreeBlocksError: not enough free blocks once the hits are taken.
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        n = num_blocks if type(num_blocks) is int and num_blocks >= 0 else self._check_count(num_blocks)
        if access is not _WRITE and access is not _READ:
            access = self._check_access(access)
        st = self.tracker.state(stream)
        hit_list = self._own_all(hits) if hits else []
        # Free hits leave the queue: counted (distinct) only when as many
        # as were listed could refuse the call.
        available = self.free_block_queue.num_free_blocks
        in_queue = 0
        if n > available - len(hit_list):
            in_queue = len({b.block_id for b in hit_list if b.ref_cnt == 0 and b.prev_free_block is not None})
            available -= in_queue
        if n > available:
            raise NoFreeBlocksError(
                f"Cannot allocate {n} new blocks with {len(hit_list)} prefix hits: "
                f"{available} free once the {in_queue} free hits are taken"
            )
        if hit_list:
            self._touch(hit_list)
        if self._runs and n > 1:
            new = self._take_runs(n, st)
        elif self._ready_first and n and self.track_hazards:
            new = self._take_ready(n, st)
        else:
            new = self._take(n)
        if self._gens is not None:
            self._gens.stamp(new)
        if not self.track_hazards:
            return new, EMPTY_FENCE
        return new, self._fence(((hit_list, _READ), (new, access)), st)

    def _take_ready(self, n: int, st: StreamState) -> list[KVCacheBlock]:
        """Ready-first placement (:func:`blockpool.core.placement.find_ready`):
        ``n`` free blocks for a consumer on ``st``, the ready ones first,
        then the queue's front. O(n + PLACEMENT_SCAN + CACHED_SCAN)."""
        q = self.free_block_queue
        ready, cached = _placement.find_ready(
            q, n, st, self.tracker, self.PLACEMENT_SCAN, self.CACHED_SCAN if self._ready_cached else None
        )
        if not ready and not cached:
            return self._take(n)
        ready.extend(cached)
        q.take_n(ready)
        self.placed_cached += len(cached)
        self.placed_ready += len(ready)
        self._claim(ready)
        return ready + self._take(n - len(ready)) if len(ready) < n else ready

    def _take_runs(self, n: int, st: StreamState) -> list[KVCacheBlock]:
        """Run-aware placement (:func:`blockpool.core.placement.find_runs`): ``n``
        free blocks in the fewest runs the window allows, then the rest from
        the queue's front; ascending block ids. O(W log W), W = ``n + 2 *
        RUN_SCAN``."""
        q = self.free_block_queue
        ready = st if self.placement == "ready_first_runs" and self.track_hazards else None
        got = _placement.find_runs(q, n, ready, self.tracker, self.RUN_SCAN, self.placement == "runs_cached")
        q.take_n(got)
        if ready is not None:
            self.placed_ready += len(got)
        self.placed_cached += sum(1 for b in got if b.block_hash is not None)
        self._claim(got)
        if len(got) < n:
            got.extend(self._take(n - len(got)))
        got.sort(key=_placement._block_id)
        return got
