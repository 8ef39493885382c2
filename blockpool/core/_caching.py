"""The prefix-cache surface of the pool (vLLM's key model, request-agnostic
keys): lookup, publish, partial keys, moves, eviction, reset."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, NoReturn

from blockpool.core._base import _as_list, _check_key, logger
from blockpool.core._introspection import IntrospectionOps
from blockpool.core._mypyc import mypyc_attr
from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import HashConflictError, InvalidArgumentError, InvariantError, NullBlockError

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgBlock, ArgBool, ArgInt

__all__ = ["CacheOps"]


@mypyc_attr(allow_interpreted_subclasses=True)
class CacheOps(IntrospectionOps):
    """Prefix-cache operations of the pool (one class of its line of
    single inheritance: ``docs/architecture.md``)."""

    # ------------------------------------------------------------------
    # prefix cache (vLLM surface, request-agnostic keys)
    # ------------------------------------------------------------------

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        """The first cached block under ``block_hash`` (any opaque hashable),
        or ``None``. O(1): one dict lookup.

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(4)
        >>> blocks = pool.get_new_blocks(2)
        >>> pool.cache_full_blocks(blocks, ["h0", "h1"], 0, 2, 16)
        >>> pool.get_cached_block("h1").block_id, pool.get_cached_block("h2")
        (2, None)

        Raises:
            InvalidArgumentError: ``block_hash`` is not hashable.
            InvariantError: the key map holds under ``block_hash``
                something that does not index the pool's block list (only
                code outside the core, through the vLLM adapter's view, can
                put it there).
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()  # a queued failed load must unpublish its keys first
        # The hottest call (one per block of every prefix looked up): the
        # key map read in place (read only: PrefixCache changes it) and the
        # pool's own lookup counters, instead of PrefixCache.lookup's call.
        try:
            bid = self._key_map.get(block_hash)
            if bid is None:
                self._misses += 1
                return None
            block = self.blocks[bid]
        except (TypeError, IndexError, OverflowError):
            self._bad_lookup(block_hash)
        self._hits += 1  # one counter per call: lookups = hits + misses (stats())
        return block

    def _bad_lookup(self, block_hash: object) -> NoReturn:
        """Why ``get_cached_block``'s look-up failed (``TypeError``,
        ``IndexError`` or ``OverflowError``): the key is not hashable
        (``InvalidArgumentError``), or the map holds a value that does not
        index the pool's block list, which only code outside the core can
        put there through the adapter's view (``InvariantError``; the
        compiled build checks the value's type and size). O(1)."""
        try:
            hash(block_hash)
        except TypeError:
            raise InvalidArgumentError(f"block hash must be hashable, got {block_hash!r}") from None
        raw: dict[object, object] = self._key_map  # type: ignore[assignment]
        raise InvariantError(
            f"the key map holds {raw.get(block_hash)!r} under {block_hash!r}, not a block id"
        ) from None

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[Hashable],
        num_cached_blocks: ArgInt,
        num_full_blocks: ArgInt,
        block_size: ArgInt | None = None,
        block_mask: Sequence[bool] | None = None,
        generations: Sequence[int] | None = None,
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under
        ``block_hashes[i]`` (one key per block, aligned with ``blocks``).
        Null or masked-out blocks are skipped; so are blocks whose load
        failed. A block already holding a shorter-prefix key is promoted
        (its old keys removed, with events). With events on, queues one
        ``BlockStored`` per run of consecutive newly published positions
        (none when nothing is newly published): each lists its run's keys
        and block ids in table order, and its parent is the key of the
        position just before the run (``None`` at position 0), so a gap (a
        null or masked-out block, a failed load, a block that already held
        its key) splits the event and every event chains onto the prefix it
        extends. A pool built with ``stored_events="call"`` sends vLLM
        0.33's events instead: one per call, parented at
        ``num_cached_blocks - 1`` (``docs/vllm-differences.md``).
        ``generations`` (aligned with ``blocks``, from :meth:`generations`
        when the table was built): refuse the table if a block to publish
        was freed and allocated again since (its keys would name another
        request's data). O(num_full_blocks - num_cached_blocks).

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(4)
        >>> blocks = pool.get_new_blocks(2)
        >>> pool.cache_full_blocks(blocks, ["h0", "h1"], 0, 2, 16)
        >>> pool.free_blocks(blocks[::-1])
        >>> pool.get_cached_block("h0").block_id, pool.get_num_free_blocks()   # free, still a hit
        (1, 3)

        Raises:
            InvalidArgumentError: counts out of range (``num_cached_blocks >
                num_full_blocks`` included), too few hashes, mask
                of the wrong length, a key that is ``None`` or unhashable, a
                ``block_size`` that is not a positive int, ``generations``
                not one int per block.
            ForeignBlockError: a block of another pool.
            StaleBlockError: with ``generations``, a block to publish was
                allocated again since they were taken.
            HashConflictError: a block already cached under a different key
                for the same or a longer prefix.
        """
        lo = num_cached_blocks
        published, removed = self._publish_full(
            blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size, block_mask, generations
        )
        if not self.enable_kv_cache_events:
            return
        if self.stored_events == "call":  # vLLM 0.33's events
            self._removed(removed, "promoted")
            if published:
                self._stored(
                    tuple(block_hashes[i] for i in published),
                    block_hashes[lo - 1] if lo > 0 else None,
                    block_size,
                    tuple(blocks[i].block_id for i in published),
                )
            return
        if removed:
            # A block listed twice is promoted at its later entry: the key
            # it got at the earlier one was never announced, so neither
            # its stored nor its removed event is sent.
            stale = {i for i in published if blocks[i].block_hash != block_hashes[i]}
            if stale:
                never = {block_hashes[i] for i in stale}
                published = [i for i in published if i not in stale]
                removed = [k for k in removed if k not in never]
            self._removed(removed, "promoted")
        self._stored_runs(blocks, block_hashes, published, block_size)

    def publish_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[Hashable],
        num_cached_blocks: ArgInt,
        num_full_blocks: ArgInt,
        block_size: ArgInt | None = None,
        block_mask: Sequence[bool] | None = None,
        generations: Sequence[int] | None = None,
        *,
        hashes_offset: ArgInt = 0,
    ) -> list[int]:
        """:meth:`cache_full_blocks` for an adapter that sends its own
        ``BlockStored`` events (vLLM's carry the request's token ids): the
        same checks, errors and publication, and with events on the same
        removed events for promoted keys (one per key, in order, as
        ``stored_events="call"`` sends them), but no ``BlockStored``.
        Returns the positions newly published, ascending (a block listed
        twice, promoted at its later entry, appears at both, as in vLLM's
        own loop). Only the keys of positions ``num_cached_blocks`` to
        ``num_full_blocks - 1`` are read, and ``len(block_hashes)``; with
        ``hashes_offset=k`` (``0 <= k <= num_cached_blocks``)
        ``block_hashes[j]`` is the key of position ``k + j``, so an adapter
        that makes its keys per call passes only the new blocks' (``k =
        num_cached_blocks``: ``num_full_blocks - num_cached_blocks`` keys),
        neither a table-long list nor a mapping. O(num_full_blocks -
        num_cached_blocks).

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(5, enable_kv_cache_events=True)
        >>> blocks = pool.get_new_blocks(3)
        >>> pool.publish_full_blocks(blocks, ["h0", None, "h2"], 0, 3, 16, block_mask=[True, False, True])
        [0, 2]
        >>> pool.take_events(), pool.get_cached_block("h2").block_id
        ([], 3)
        >>> more = blocks + pool.get_new_blocks(1)  # positions 0-2 done: the new block's key alone
        >>> pool.publish_full_blocks(more, ["h3"], 3, 4, 16, hashes_offset=3)
        [3]

        Raises:
            InvalidArgumentError: (as :meth:`cache_full_blocks`, each before
                anything is published) counts out of range, too few hashes
                (fewer than ``num_full_blocks - hashes_offset``), mask
                of the wrong length, a key that is ``None`` or unhashable, a
                ``block_size`` that is not a positive int, ``generations``
                not one int per block; ``hashes_offset`` not an int in
                ``[0, num_cached_blocks]``.
            ForeignBlockError: a block of another pool.
            StaleBlockError: with ``generations``, a block to publish was
                allocated again since they were taken.
            HashConflictError: a block already cached under a different key
                for the same or a longer prefix.
        """
        published, removed = self._publish_full(
            blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size, block_mask, generations,
            hashes_offset,
        )  # fmt: skip
        if removed:
            self._removed(removed, "promoted")
        return published

    def _publish_full(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[Hashable],
        num_cached_blocks: ArgInt,
        num_full_blocks: ArgInt,
        block_size: ArgInt | None,
        block_mask: Sequence[bool] | None,
        generations: Sequence[int] | None,
        hashes_offset: ArgInt = 0,
    ) -> tuple[list[int], list[Hashable]]:
        """Check every argument of :meth:`cache_full_blocks` (raising before
        any change), then publish. Returns the positions newly published and
        the reportable keys the promotions removed, in order
        (:meth:`~blockpool.core.prefix_cache.PrefixCache.publish_full`); no
        events. Position ``i``'s key is ``block_hashes[i - hashes_offset]``
        (:meth:`publish_full_blocks`). O(num_full_blocks - num_cached_blocks),
        plus a copy of ``blocks`` and ``block_hashes`` when they are not
        lists."""
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        lo, hi = num_cached_blocks, num_full_blocks
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= len(blocks)):
            raise InvalidArgumentError(
                f"need 0 <= num_cached_blocks <= num_full_blocks <= len(blocks), got {lo!r}, {hi!r}, {len(blocks)}"
            )
        off = hashes_offset
        if not (isinstance(off, int) and not isinstance(off, bool) and 0 <= off <= lo):
            raise InvalidArgumentError(f"need 0 <= hashes_offset <= num_cached_blocks ({lo}), got {off!r}")
        if lo == hi:
            return [], []
        if len(block_hashes) < hi - off:
            raise InvalidArgumentError(  # counted in table positions, whatever the offset
                f"{off + len(block_hashes)} block hashes for {hi} full blocks"
                + (f" ({len(block_hashes)} from position {off})" if off else "")
            )
        try:
            if block_mask is not None and len(block_mask) != hi - lo:
                raise InvalidArgumentError(f"block_mask has {len(block_mask)} entries, expected {hi - lo}")
        except TypeError:
            raise InvalidArgumentError(f"block_mask must be a sequence of bool, got {block_mask!r}") from None
        if block_size is not None and (
            not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0
        ):
            raise InvalidArgumentError(f"block_size must be a positive int or None, got {block_size!r}")
        # Lists (the caller's own when they are): indexed natively in the
        # compiled build, where a Sequence is indexed by a generic call.
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        block_hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        # Pass 1 checks everything (nothing changes if it raises) and lists
        # the blocks to publish; pass 2 (the prefix cache) publishes.
        self._own_all(blocks[lo:hi])
        null = self.null_block
        mask = block_mask
        if generations is not None:
            self._fresh_range(blocks, generations, lo, hi, mask)
        writes = self.writes
        invalid = writes.has_invalid()
        refused = 0
        publish: list[int] = []
        for i in range(lo, hi):
            b = blocks[i]
            if b is null or (mask is not None and not mask[i - lo]):
                continue
            key: Hashable | None = block_hashes[i - off]
            if key is None:
                _check_key(key)  # raises
            try:
                hash(key)  # _check_key, inline: a call per block showed in profiles
            except TypeError:
                _check_key(key)  # raises the typed error
            h = b.block_hash
            if h is not None and h != key:  # promoted in pass 2: only a longer prefix may
                ntok = (i + 1) * block_size if block_size else None
                old = b.block_hash_num_tokens
                if old is None or ntok is None or old >= ntok:
                    raise HashConflictError(
                        f"block {b.block_id} is cached under {h!r} "
                        f"({old} tokens); it cannot also be full block {key!r} ({ntok} tokens)"
                    )
            if invalid and writes.is_invalid(b.block_id):
                refused += 1
                continue
            publish.append(i)
        if refused:
            self._count("unpublished_failed_loads", refused)
        if self._fresh:
            for i in publish:
                self._announce(blocks[i])
        return self.prefix_cache.publish_full(blocks, block_hashes, publish, block_size, off)

    def _stored_runs(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[Hashable],
        published: Sequence[int],
        block_size: int | None,
    ) -> None:
        """Queue one ``BlockStored`` per run of consecutive positions of
        ``published`` (ascending positions of the table newly published),
        so every event is a chain: its keys follow one another in the
        table and its parent is the key of the position just before the
        run (``None`` for a run starting at position 0), whether that
        position was published by this call, held its key already, or is a
        gap (the null block, a masked-out block, a failed load): e.g.
        positions 0, 2, 3 give ``(k0,)`` with parent ``None`` and ``(k2,
        k3)`` with parent ``k1``. O(len(published))."""
        start = 0
        for j in range(1, len(published) + 1):
            if j < len(published) and published[j] == published[j - 1] + 1:
                continue
            run = published[start:j]
            first = run[0]
            self._stored(
                tuple(block_hashes[i] for i in run),
                block_hashes[first - 1] if first > 0 else None,
                block_size,
                tuple(blocks[i].block_id for i in run),
            )
            start = j

    def _fresh_range(
        self,
        blocks: Sequence[KVCacheBlock],
        generations: Sequence[int],
        lo: int,
        hi: int,
        mask: Sequence[bool] | None,
    ) -> None:
        """:meth:`_check_fresh` for the blocks ``cache_full_blocks``
        publishes: ``blocks[lo:hi]`` not masked out, ``generations`` aligned
        with the whole table. O(len(blocks))."""
        gens = generations if type(generations) in (tuple, list) else _as_list(generations, "generations")
        if len(gens) != len(blocks):
            raise InvalidArgumentError(
                f"cache_full_blocks: {len(gens)} generations for a table of {len(blocks)} blocks"
            )
        if mask is None:
            self._check_fresh(list(blocks[lo:hi]), list(gens[lo:hi]), "cache_full_blocks")
            return
        idx = [i for i in range(lo, hi) if mask[i - lo]]
        self._check_fresh([blocks[i] for i in idx], [gens[i] for i in idx], "cache_full_blocks")

    def cache_partial_block(
        self,
        block: ArgBlock,
        block_hash: Hashable,
        num_tokens: ArgInt,
        replace_existing_hashes: ArgBool = False,
        parent_block_hash: Hashable | None = None,
        generation: ArgInt | None = None,
    ) -> Hashable | None:
        """Make ``block`` reachable under a partial-prefix key covering
        ``num_tokens`` tokens of the sequence (the prefix length up to the
        key's boundary, counted as in :meth:`cache_full_blocks`, where full
        block ``i`` covers ``(i + 1) * block_size`` tokens; vLLM's partial
        entries). A block whose primary key is a partial key covering fewer
        tokens is promoted (old keys removed, with events, and retired); one
        whose key covers more keeps it and gains ``block_hash`` as an extra
        key. ``replace_existing_hashes``: the content was replaced, drop every
        key (and forget the retired ones) first.

        A key retired from this block by a promotion (here or in
        :meth:`cache_full_blocks`) stays retired for the block until its
        content changes (it is handed out again, its content is replaced, or
        the prefix cache is reset): publishing it again does nothing, emits
        no event and returns ``None`` (an engine that repeats its partial
        publication every step does not bring a stale key back).

        ``generation`` (the block's entry of :meth:`generations`, taken
        when its table was built): refuse the block if it was freed and
        allocated again since (the key would name another request's data).

        Returns the key, or ``None`` for the null block, a block whose load
        failed, or a retired key. O(keys of the block).

        Raises:
            ForeignBlockError: a block of another pool.
            StaleBlockError: with ``generation``, the block was allocated
                again since it was taken; nothing changes.
            InvalidArgumentError: ``num_tokens`` is not a positive int, or
                reaches past the end of the block: the block's primary key
                is a full-block key covering fewer tokens (a partial key lies
                inside its block); or ``block_hash`` is ``None`` or
                unhashable; ``generation`` is not an int. Nothing changes.
        """
        self._apply_completions()
        b = self._own(block)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens <= 0:
            raise InvalidArgumentError(f"num_tokens must be a positive int, got {num_tokens!r}")
        _check_key(block_hash)
        if generation is not None:
            self._check_fresh([b], (generation,), "cache_partial_block")
        if b.is_null:
            return None
        bid = b.block_id
        pc = self.prefix_cache
        old = b.block_hash_num_tokens
        if (
            not replace_existing_hashes
            and b.block_hash is not None
            and not pc.is_partial(bid)
            and old is not None
            and num_tokens > old
        ):
            raise InvalidArgumentError(
                f"block {bid} is a full block covering {old} tokens (key {b.block_hash!r}); "
                f"a partial key inside it cannot cover {num_tokens} tokens"
            )
        if self.writes.is_invalid(bid):
            self._count("unpublished_failed_loads")
            return None
        already = b.block_hash == block_hash or pc.contains(block_hash, b)
        if replace_existing_hashes:
            pc.unretire(bid)
            self._drop_keys(b, "replaced")
            already = False
        elif not already and pc.is_retired(bid, block_hash):
            return None
        elif not already and b.block_hash is not None and old is not None and old < num_tokens:
            # a longer partial key of the same block
            self._removed(pc.reportable(pc.promote(b)), "promoted")
        if self._fresh:
            self._announce(b)
        pc.publish(block_hash, b, num_tokens, partial=True)
        if not already:
            self._stored((block_hash,), parent_block_hash, num_tokens, (bid,))
        return block_hash

    def move_block_hashes(self, src_block: ArgBlock, dst_block: ArgBlock) -> None:
        """Re-point every key of ``src_block`` to ``dst_block`` (the prefix
        cache keeps a private copy while the owner keeps writing ``src``). No
        events; the keys retired from ``src`` move with them. O(keys).

        Raises:
            ForeignBlockError: a block of another pool.
            NullBlockError: either block is the null block.
            HashConflictError: ``dst_block`` already holds a key.
        """
        self._apply_completions()
        src, dst = self._own(src_block), self._own(dst_block)
        if src.is_null or dst.is_null:
            raise NullBlockError("the null block holds no prefix-cache keys")
        if self.prefix_cache.keys_of(dst):
            raise HashConflictError(f"block {dst.block_id} already holds prefix-cache keys")
        self.prefix_cache.move(src, dst)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache keys of the given blocks (removed events).
        Blocks stay where they are (in use, or free at the same queue
        position). O(len(block_ids)).

        Raises:
            InvalidArgumentError: an id outside ``0 .. num_gpu_blocks - 1``
                (checked for all ids before any change).
        """
        self._apply_completions()
        ids = _as_list(block_ids, "block_ids")
        for bid in ids:
            if type(bid) is bool or not isinstance(bid, int) or not 0 <= bid < self.num_gpu_blocks:
                raise InvalidArgumentError(
                    f"invalid block_id {bid!r}: the pool has {self.num_gpu_blocks} blocks"
                )
        pc = self.prefix_cache
        for bid in ids:
            b = self.blocks[bid]
            keys = pc.evict(b)
            if keys:
                self._removed(pc.reportable(keys), "evicted")

    def reset_prefix_cache(self, *, while_running: ArgBool = False) -> bool:
        """Drop every key (one all-cleared event).

        By default (vLLM's behaviour) only when no block is in use (ref
        count above 0): otherwise nothing changes and it returns False.
        Blocks held back for host transfers (ref count 0, a transfer may
        still touch them) do not stop it: they keep their hold and lose
        their keys, and go to the free queue when their transfers end. With
        ``while_running=True`` it withdraws every key even while requests
        run: blocks in use or held keep their content, ref counts, shadows and
        places (in-use blocks stay in use, free blocks keep their queue
        positions, held blocks stay held), only their keys go, so nothing is
        a prefix hit afterwards until published again. Blocks whose load
        failed stay unpublishable until rewritten. Returns True when the keys
        were dropped. O(num_gpu_blocks).
        """
        self._apply_completions()
        busy = self.num_gpu_blocks - 1 - self.free_block_queue.num_free_blocks
        if busy - len(self.holdback) > 0 and not while_running:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                busy - len(self.holdback),
            )
            return False
        self.prefix_cache.clear(self.blocks)
        if not busy:
            self.writes.clear_invalid()  # every block is free: each is rewritten before it is published
        self._cleared()
        logger.info(
            "Successfully reset prefix cache%s", f" ({busy} blocks in use or held kept)" if busy else ""
        )
        return True
