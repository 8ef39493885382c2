"""vLLM's ``BlockPool`` surface (0.32, 0.33 and 0.34), backed by :class:`~blockpool.HazardAwareBlockPool`.

:class:`VllmBlockPool` is what vLLM's ``KVCacheCoordinator`` builds once
:func:`blockpool.integrations.vllm.register` has run. The core
(:attr:`VllmBlockPool.core`) does every allocation, free, touch, lookup,
publication and eviction, and owns the free queue, ref counts, key map and
events. The adapter adds only what is vLLM's: its keys
(``BlockHashWithGroupId`` bytes: the core's opaque keys as they are), the
metrics collector hooks, ``unpin_blocks`` watchers, and the forwarding of
other pools' blocks in ``free_blocks``. Its other parts: vLLM's block,
free-queue and key-map types (:mod:`~blockpool.integrations.vllm.blocks`),
vLLM's events, with token ids, from the core's
(:mod:`~blockpool.integrations.vllm.events`), and the process-wide
:data:`SERVED` counters (:mod:`~blockpool.integrations.vllm.served`). Why
composition and vLLM's own block type: ``docs/vllm-design.md``, "Design".

Blocks of no pool (``block.pool is None``), which only vLLM's unit tests
make, are refused here like any other pool's (``ForeignBlockError``); the
parity harness gives them vLLM's treatment
(:mod:`blockpool.integrations.vllm.parity`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes

from blockpool.core.block import block_class_for_pool
from blockpool.core.errors import ForeignBlockError, InvalidArgumentError
from blockpool.core.hazards import AccessKind, StreamKind
from blockpool.core.pool import HazardAwareBlockPool
from blockpool.integrations.vllm.blocks import (
    HashMapView,
    VllmFreeBlockQueue,
    VllmKVCacheBlock,
    VllmNullBlock,
)
from blockpool.integrations.vllm.events import HAS_LOOKAHEAD, VLLM_BLOCK_POOL, VllmEvents
from blockpool.integrations.vllm.hazards import COMPUTE, StepHazards
from blockpool.integrations.vllm.served import SERVED, Served
from blockpool.integrations.vllm.surface import active as active_surface

__all__ = [
    "SERVED",
    "VLLM_BLOCK_POOL",
    "Served",
    "VllmBlockPool",
    "VllmFreeBlockQueue",
    "VllmKVCacheBlock",
]

_READ = AccessKind.READ

_SURFACE = active_surface()
# vLLM 0.32's touch calls the metrics collector's on_block_accessed for the
# null block too (0.33 and later skip the null block there).
_ACCESS_HOOK_ON_NULL = _SURFACE.access_hook_on_null
# vLLM 0.34: KVCacheBlock.pool is a weakref.ref to the pool (its pool frees
# a block of another pool through ``block.pool()``), and free_blocks takes
# evict_first.
_WEAK_POOL_REF = _SURFACE.weak_pool_ref
_EVICT_FIRST = _SURFACE.evict_first

_GROUP_SUFFIX: dict[int, bytes] = {}
"""``{group id: make_block_hash_with_group_id(b"", group id)}``: the 4 bytes
every supported vLLM line appends to a block hash for its group, made once
per group and appended per key (what vLLM 0.34's ``cache_full_blocks``
does), instead of a call of vLLM's helper per key."""


def _group_suffix(group_id: int) -> bytes:
    """The bytes ``make_block_hash_with_group_id`` appends for ``group_id``
    (the packed key is ``block_hash + _group_suffix(group_id)``). O(1)."""
    suffix = _GROUP_SUFFIX.get(group_id)
    if suffix is None:
        suffix = _GROUP_SUFFIX[group_id] = make_block_hash_with_group_id(b"", group_id)  # type: ignore[arg-type]
    return suffix


class VllmBlockPool(VllmEvents):
    """vLLM's ``BlockPool`` (0.32, 0.33 and 0.34) over a :class:`~blockpool.HazardAwareBlockPool`.

    Args: as vLLM's ``BlockPool``:
        num_gpu_blocks: Blocks in the pool, null block included.
        enable_caching: Prefix caching.
        hash_block_size: Tokens per hash block of ``request.block_hashes``.
        enable_kv_cache_events: Queue vLLM ``KVCacheEvent`` s for ``take_events``.
        metrics_collector: vLLM's ``KVCacheMetricsCollector`` or ``None``.
        num_hash_lookahead_tokens: Tokens after each block covered by its hash.
        medium: Storage medium in events.
    and, keyword-only:
        track_hazards: Keep shadows and fences in the core and tag frees with
            the last enqueued step (``None``: the plugin's setting).
        streams: Extra ``{name: StreamKind}`` for the core (``compute`` is
            always there).

    Attributes (vLLM's names): ``blocks``, ``null_block``, ``free_block_queue``,
    ``cached_block_hash_to_block``, ``cached_block_hashes_by_block``,
    ``kv_event_queue``, ``num_gpu_blocks``, ``enable_caching``,
    ``hash_block_size``, ``enable_kv_cache_events``, ``metrics_collector``,
    ``num_hash_lookahead_tokens``, ``medium``; the state ones are the core's
    own objects; ``_weak_self`` (a ``weakref.ref`` to the pool, what each
    block's ``pool`` holds on vLLM 0.34; on earlier lines ``pool`` is the
    pool itself). Ours: ``core`` and ``hazards`` (a
    :class:`~blockpool.integrations.vllm.hazards.StepHazards`, or ``None``
    when hazards are off).

    Raises:
        InvalidArgumentError: ``num_gpu_blocks`` is not an int ``>= 1``, or
            ``num_hash_lookahead_tokens`` is not 0 on a vLLM without
            lookahead hashing (0.32, whose ``BlockPool`` has no such argument).

    Runtime complexity: construction O(num_gpu_blocks); every method as the
    core's (the own-block check a type test per block), plus O(1) per block
    for metrics and events when they are on.
    """

    default_track_hazards = True
    """Used when ``track_hazards`` is ``None``; the plugin sets it from
    ``BLOCKPOOL_VLLM_HAZARDS``."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
        *,
        track_hazards: bool | None = None,
        streams: dict[str, StreamKind] | None = None,
    ) -> None:
        if not HAS_LOOKAHEAD and isinstance(num_hash_lookahead_tokens, str):
            # vLLM 0.32's BlockPool has no lookahead argument: its sixth
            # positional argument is the medium.
            medium, num_hash_lookahead_tokens = num_hash_lookahead_tokens, 0
        if num_hash_lookahead_tokens and not HAS_LOOKAHEAD:
            raise InvalidArgumentError(
                f"num_hash_lookahead_tokens={num_hash_lookahead_tokens}: this vLLM has no lookahead hashing"
            )
        track = self.default_track_hazards if track_hazards is None else track_hazards
        block_cls = block_class_for_pool(VllmKVCacheBlock)  # this pool's alone
        # What every block's ``pool`` holds: a weak reference to this pool
        # where vLLM's blocks hold one (0.34: vLLM's own pool frees a block
        # of another pool through ``block.pool()``), else the pool itself.
        self._weak_self = weakref.ref(self)
        ref: Any = self._weak_self if _WEAK_POOL_REF else self
        self._pool_ref = ref
        block_cls.pool = ref  # a class attribute: no slot per block (VllmKVCacheBlock)
        core = HazardAwareBlockPool(
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            track_hazards=track,
            streams={COMPUTE: StreamKind.DEVICE, **(streams or {})},
            medium=medium,
            removal_events="each",  # vLLM's events (0.32, 0.33): a removal per block that loses a key
            block_factory=lambda block_id: block_cls(block_id) if block_id else VllmNullBlock(0, ref),
            block_class=block_cls,
            free_queue_class=VllmFreeBlockQueue,
        )
        blocks = core.blocks
        self.core = core
        # The core's "completions may be due" object, set once when it is
        # built (its inbox, or True with leases): the hot queries below test
        # it here, without reading the core (a compiled core's attribute is
        # a descriptor call from this interpreted class).
        self._due: Any = core._due
        # The core's event queue, the same list for its lifetime (its
        # take_events empties it in place): tested here after each call that
        # may queue an event, without reading the core's attribute.
        self._core_events: list[Any] = core.kv_event_queue
        # vLLM's scheduler calls get_num_free_blocks some 30 times a step:
        # the core's own method (the same answer: held-back blocks
        # excluded, queued completions applied first), bound on the
        # instance, so no frame of this class's runs per call -- unless the
        # class's method is not this module's own (a subclass's, or a
        # patch of the class made before the pool was built).
        if type(self).get_num_free_blocks is _OWN_GET_NUM_FREE_BLOCKS:
            self.get_num_free_blocks = core.get_num_free_blocks  # type: ignore[method-assign]
        self._core_get_cached_block = core.get_cached_block  # bound once (one call per looked-up block)
        self.hazards: StepHazards | None = StepHazards(core) if track else None

        self.num_gpu_blocks = num_gpu_blocks
        self.medium = medium
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.enable_kv_cache_events = enable_kv_cache_events
        self.metrics_collector = metrics_collector
        self.blocks: list[Any] = blocks
        self.null_block: Any = blocks[0]
        self.free_block_queue: VllmFreeBlockQueue = core.free_block_queue  # type: ignore[assignment]
        self.cached_block_hash_to_block: BlockHashToBlockMap = HashMapView(core.prefix_cache, blocks)
        self.cached_block_hashes_by_block: dict[int, set[Any]] = core.prefix_cache.extra_keys()
        self.kv_event_queue = []
        self._reuse_watchers: dict[int, Callable[[Any], None]] = {}
        SERVED.pools += 1

    def __repr__(self) -> str:
        return (
            f"VllmBlockPool(num_gpu_blocks={self.num_gpu_blocks}, "
            f"free={self.free_block_queue.num_free_blocks}, hazards={self.hazards is not None})"
        )

    # ------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------

    def _check_own(self, *blocks: Any) -> None:
        """Raise :class:`~blockpool.ForeignBlockError` unless every block's
        ``pool`` is this one (for the private key-map calls, which reach
        the core's parts directly). O(len(blocks))."""
        ref = self._pool_ref
        for b in blocks:
            if b.pool is not ref:
                raise ForeignBlockError(f"block {b.block_id} belongs to {b.pool!r}, not to {self!r}")

    def _metrics(self, blocks: Iterable[Any], *hooks: str) -> None:
        """Call the metrics collector's ``hooks`` on each block, every hook
        on a block before the next block (vLLM's order); nothing without a
        collector. O(len(blocks) * len(hooks))."""
        mc = self.metrics_collector
        if mc is not None:
            calls = [getattr(mc, hook) for hook in hooks]
            for b in blocks:
                for call in calls:
                    call(b)

    # ------------------------------------------------------------------
    # allocation
    # ------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        """Take ``num_blocks`` blocks from the front of the core's free
        queue (evicting their keys: removed events), then run vLLM's reuse
        watchers and metrics hooks. O(num_blocks).

        Raises:
            NoFreeBlocksError (a ``ValueError``, as vLLM): not enough free blocks.
        """
        # The evicted keys come back as keys (events on), not as the core's
        # events for this adapter to read and drop: vLLM's own helper makes
        # its events from them, at once (before any hook that may raise),
        # after a failed load's removals from completions the call applied
        # first.
        blocks, removed = self.core.get_new_blocks_with_removed_keys(num_blocks)
        if self._core_events:
            self._pull_events()
        if removed:
            self._emit_block_removed_events(removed)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        if self.metrics_collector is not None:
            if self.enable_caching:  # vLLM evicts each block's keys first
                self._metrics(blocks, "on_block_evicted", "on_block_allocated")
            else:
                self._metrics(blocks, "on_block_allocated")
        if blocks:
            SERVED.allocations += 1
            SERVED.blocks_allocated += len(blocks)
        return blocks

    def touch(self, blocks: Sequence[Any]) -> None:
        """Add a reference to each block (prefix hit); ref count 0 leaves
        the free queue. Null blocks are skipped (the metrics hook sees them
        on vLLM 0.32, as 0.32's pool calls it). O(len(blocks)).

        Raises:
            ForeignBlockError: a block of another pool (nothing changes).
        """
        self.core.touch(blocks)
        if self.metrics_collector is not None:
            self._metrics(
                blocks if _ACCESS_HOOK_ON_NULL else (b for b in blocks if not b.is_null), "on_block_accessed"
            )

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """Drop one reference per block, first = evicted first; blocks of
        another pool (``block.pool``) are forwarded to it, after this pool's,
        as vLLM does (deferred frees span pools). Frees are tagged with the
        last enqueued step token when hazards are on. ``evict_first`` (vLLM
        0.34; on earlier lines only ``False`` is accepted, as their
        ``free_blocks`` has no such argument): blocks that become free go to
        the front of the free queue whatever their keys, evicted before
        other cached blocks (SimpleCPUOffload's lazy mode: their content is
        in the CPU tier). O(len(ordered_blocks)): the core checks ownership
        by type, and only a call naming another pool's block is split by
        ``block.pool``.

        Raises:
            RefCountError: a ref count would go below zero (vLLM corrupts it;
                the core rejects the whole call before any change).
            ForeignBlockError: a block of no pool (``block.pool is None``;
                vLLM frees it as its own) or one its pool does not hold;
                nothing changes.
            InvalidArgumentError: ``evict_first`` on a vLLM line without it;
                nothing changes.
        """
        if evict_first and not _EVICT_FIRST:
            raise InvalidArgumentError(
                f"evict_first: vLLM {_SURFACE.line}'s free_blocks has no such argument"
            )
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        hz = self.hazards
        token = hz.free_token() if hz is not None else None
        others: dict[Any, list[Any]] = {}
        try:
            self.core.free_blocks(blocks, token, _READ, evict_first=evict_first)
        except ForeignBlockError:
            blocks, others = self._split_by_pool(blocks)
            if blocks:
                self.core.free_blocks(blocks, token, _READ, evict_first=evict_first)
        if blocks:
            SERVED.frees += 1
            SERVED.blocks_freed += len(blocks)
        for pool, theirs in others.items():  # after this pool's, as vLLM
            if evict_first:
                pool.free_blocks(theirs, evict_first=True)
            else:
                pool.free_blocks(theirs)

    def _split_by_pool(self, blocks: list[Any]) -> tuple[list[Any], dict[Any, list[Any]]]:
        """This pool's blocks of ``blocks``, and every other pool's by pool,
        null blocks left out, order kept (for :meth:`free_blocks`). On a
        line whose blocks hold a weak reference to their pool
        (:attr:`~blockpool.integrations.vllm.surface.Surface.weak_pool_ref`),
        ``block.pool`` is dereferenced; a block whose pool is gone is
        dropped, as vLLM 0.34 does. O(len(blocks)).

        Raises:
            ForeignBlockError: a block of no pool (``block.pool is None``).
        """
        own: list[Any] = []
        others: dict[Any, list[Any]] = {}
        ref = self._pool_ref
        for b in blocks:
            if b.is_null:
                continue
            p = b.pool
            if p is ref:
                own.append(b)
            elif p is None:
                raise ForeignBlockError(f"block {b.block_id} belongs to no pool (block.pool is None)")
            else:
                if _WEAK_POOL_REF and isinstance(p, weakref.ref):
                    p = p()
                    if p is None:  # its pool is gone: nothing to free it into
                        continue
                others.setdefault(p, []).append(b)
        return own, others

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Callable[[Any], None]) -> None:
        """Release references to blocks that stay readable until reused: a
        block reaching ref count 0 goes to the *tail* of the free queue
        whatever its hash, and ``on_reuse(block)`` fires when
        ``get_new_blocks`` hands it out or the cache is reset. O(len(blocks)).

        Raises:
            AssertionError: a null block or one with ref count 0 (as vLLM),
                before any change.
            RefCountError: a block listed more often than it is referenced.
        """
        block_list = list(blocks)
        for b in block_list:
            assert b.ref_cnt > 0 and not b.is_null
        hz = self.hazards
        self.core.free_blocks(block_list, hz.free_token() if hz is not None else None, _READ, to_tail=True)
        for b in block_list:
            self._reuse_watchers[b.block_id] = on_reuse

    def _notify_reuse(self, blocks: Iterable[Any]) -> None:
        watchers = self._reuse_watchers
        for b in blocks:
            watcher = watchers.pop(b.block_id, None)
            if watcher is not None:
                watcher(b)

    # ------------------------------------------------------------------
    # prefix cache
    # ------------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[Any] | None:
        """The first cached block under ``block_hash`` for each group, or
        ``None`` if any group misses. O(len(kv_cache_group_ids))."""
        get = self._core_get_cached_block
        suffixes = _GROUP_SUFFIX
        cached = []
        for group_id in kv_cache_group_ids:
            suffix = suffixes.get(group_id)
            b = get(block_hash + (suffix if suffix is not None else _group_suffix(group_id)))
            if b is None:
                return None
            cached.append(b)
        SERVED.cache_hits += len(cached)
        return cached

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under the
        request's block hashes for ``kv_cache_group_id`` (null and masked-out
        blocks skipped; a partial entry is promoted) with the core's
        ``publish_full_blocks``, then queue one vLLM ``BlockStored`` with the
        token ids for the positions it published (events on).
        O(num_full_blocks - num_cached_blocks).

        Raises:
            AssertionError: ``block_mask`` of the wrong length (as vLLM).
            InvalidArgumentError: too few block hashes (vLLM: IndexError).
            HashConflictError: a block already cached for the same or a
                longer prefix under another key (vLLM: AssertionError).
        """
        lo, hi = num_cached_blocks, num_full_blocks
        if lo >= hi:
            return
        assert block_mask is None or len(block_mask) == hi - lo
        block_hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        # The new blocks' keys alone (hashes_offset=lo: the core reads
        # position i's at keys[i - lo]), the group's suffix appended to each
        # hash: on the engine's cold caches a mapping by position, or a
        # frame per key, cost more than the keys. Fewer than hi - lo (too
        # few hashes): the core refuses the call.
        suffix = _group_suffix(kv_cache_group_id)
        keys = [h + suffix for h in block_hashes[lo:hi]]
        core = self.core
        published = core.publish_full_blocks(blocks, keys, lo, hi, block_size, block_mask, hashes_offset=lo)
        SERVED.blocks_cached += hi - lo
        if self.enable_kv_cache_events:
            if self._core_events:  # the promotions' removals first, as vLLM's loop queues them
                self._pull_events()
            self._queue_full_blocks_stored(
                request, block_hashes, published, lo, hi, block_size, kv_cache_group_id
            )

    def cache_partial_block(
        self,
        request: Any,
        block: Any,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> bytes | None:
        """Make ``block`` reachable from the prefix boundary ``num_tokens``
        (a multiple of ``hash_block_size``) inside it; see vLLM's docstring.
        Returns the key, or ``None`` for the null block, a block whose load
        failed (with hazards), or a key the core retired (a partial key
        whose block lost it to a full block: ``docs/vllm-differences.md``);
        vLLM's ``single_type_kv_cache_manager`` reads ``None`` as "not
        cached" for its partial-tail bookkeeping. O(keys of the block).

        Raises:
            AssertionError: ``num_tokens`` or ``block_size`` not a multiple
                of ``hash_block_size``, or beyond the request's hashes (as vLLM).
        """
        if block.is_null:
            return None
        assert block_size % self.hash_block_size == 0
        block_hash = self._get_partial_block_hash(request, num_tokens)
        num_hash_tokens = num_tokens // self.hash_block_size * self.hash_block_size
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        self._pull_events()  # first: the core's BlockStored pulled next is this call's
        got = self.core.cache_partial_block(block, key, num_hash_tokens, replace_existing_hashes)
        self._queue_partial_block_stored(request, block_hash, num_tokens, kv_cache_group_id)
        return key if got is not None else None

    def move_block_hashes(self, src_block: Any, dst_block: Any) -> None:
        """Re-point every key of ``src_block`` to ``dst_block``; no events. O(keys).

        Raises:
            HashConflictError: ``dst_block`` holds a key (vLLM: AssertionError).
        """
        self.core.move_block_hashes(src_block, dst_block)

    def _maybe_evict_cached_block(self, block: Any) -> bool:
        """Drop the block's keys (removed events); True if any was mapped to
        it. Runs the metrics eviction hook first, as vLLM. O(keys).

        Raises:
            ForeignBlockError: not this pool's block; nothing changes.
        """
        self._check_own(block)
        self._metrics((block,), "on_block_evicted")
        evicted = bool(self.core.prefix_cache.mapped_keys(block))
        self.core.evict_blocks([block.block_id])
        self._pull_events()
        return evicted

    def _insert_block_hash(self, block_hash_with_group_id: bytes, block: Any, num_tokens: int | None) -> None:
        """vLLM's private insert (no events), used by its CPU offload
        manager: publish in the core's key map. O(1).

        Raises:
            ForeignBlockError: not this pool's block; nothing changes.
        """
        self._check_own(block)
        self.core.prefix_cache.publish(block_hash_with_group_id, block, num_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache keys of the given blocks (in use or free;
        they stay where they are). O(len(block_ids)).

        Raises:
            InvalidArgumentError: an id outside the pool, before any change
                (vLLM: AssertionError after evicting the earlier ids).
        """
        ids = list(block_ids)
        self.core.evict_blocks(ids)
        self._metrics((self.blocks[bid] for bid in ids), "on_block_evicted")
        self._pull_events()

    def reset_prefix_cache(self) -> bool:
        """Drop every key if no block is in use (ref count above 0, as
        vLLM); blocks held back for host transfers keep their hold and lose
        their keys. Fire the reuse watchers, reset metrics, queue
        ``AllBlocksCleared``. Returns False, changing nothing, otherwise.
        O(num_gpu_blocks)."""
        if not self.core.reset_prefix_cache():
            return False
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[bid] for bid in list(self._reuse_watchers)])
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        self._pull_events()
        return True

    # ------------------------------------------------------------------
    # queries (events: VllmEvents)
    # ------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (held-back blocks excluded), queued
        completions applied first (they may release held-back blocks). O(1).

        An instance's own is the core's ``get_num_free_blocks``, bound in
        ``__init__`` (vLLM's scheduler calls it some 30 times a step), so a
        patch of the class made after the pool was built does not reach
        it: patch the instance. This one is the same for the class."""
        if self._due:
            self.core._apply_completions()
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks not free (held-back blocks count as
        used), in [0, 1]: the core's figure, computed as vLLM does (from
        ``get_num_free_blocks``). O(1)."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def is_block_writable(self, block: Any) -> bool:
        """Not null, ref count 1, no key. O(1)."""
        return self.core.is_block_writable(block)


_OWN_GET_NUM_FREE_BLOCKS = VllmBlockPool.__dict__["get_num_free_blocks"]
"""The class's own ``get_num_free_blocks`` (``VllmBlockPool.__init__`` binds
the core's on the instance only while the class still has this one)."""
