"""The prefix cache: the block-hash -> block map and the bookkeeping beside it.

vLLM's key model (``vllm/v1/core/block_pool.py``, ``BlockHashToBlockMap``):
a key may map to several blocks (vLLM does not de-duplicate identical full
blocks, so block tables stay append-only), and a block may hold several keys
(a partial-block key plus, after promotion, its full-block key). The primary
key lives on the block record (``block.block_hash``); extra keys live in a
side table so the common one-key block costs no extra object.

One representation, vLLM 0.34's own (``BlockHashToBlockMap``): the key map
holds block *ids*, each key's first block (``{key: block_id}``), and a key
that several blocks hold also has, in a second dict, every one of their ids
in insertion order (``{key: {block_id: None}}``); the first block leaves, the
next takes its place. A dict of bytes (or str, or int) keys and int values
holds no object the cyclic garbage collector follows, so CPython (3.10 to
3.13; 3.14 no longer untracks dicts by itself) leaves it untracked: a pool
full of cached blocks adds no map to walk to each full ``gc.collect()``.
The vLLM adapter hands these very dicts to vLLM's
``cached_block_hash_to_block`` view (:attr:`PrefixCache.key_map`,
:attr:`PrefixCache.dup_ids`), so vLLM's code and the core read and write
one map.

>>> from blockpool.core.block import KVCacheBlock
>>> blocks = [KVCacheBlock(i) for i in range(3)]
>>> pc = PrefixCache(blocks)
>>> a, b = blocks[1], blocks[2]
>>> pc.publish("k", a, 16), pc.publish("k", b, 16), pc.publish("k", b, 16)
(True, True, False)
>>> [x.block_id for x in pc.blocks_of("k")], pc.lookup("k") is a, pc.key_map, pc.dup_ids
([1, 2], True, {'k': 1}, {'k': {1: None, 2: None}})
>>> pc.remove(a), pc.remove(a), a.block_hash, pc.key_map, pc.dup_ids
(['k'], [], None, {'k': 2}, {})
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvariantError

__all__ = ["PrefixCache"]


class PrefixCache:
    """Owns the prefix cache's state; nothing else changes it.

    Owns: the key map (key -> first block id) and the ids of keys several
    blocks hold (key -> ``{block_id: None}``, insertion order), the extra
    keys of each block (block id -> keys beyond its primary one), the
    blocks whose primary key is a partial-block key, the keys *retired*
    from a block by a promotion (never published for it again until its
    content changes), the ``block_hash`` / ``block_hash_num_tokens`` fields
    of the block records, and the eviction counter (the pool counts its
    own lookups and hits: it reads :attr:`key_map` in place).

    Args:
        blocks: The pool's block records, indexed by block id (the list
            itself, read in place: the map holds ids).
        removal_each: Which removals :meth:`reportable` reports: every key a
            block loses (``True``, vLLM's events), or only keys no block
            holds any more (``False``).

    Every method is O(1) per key or block touched unless it says otherwise.
    """

    __slots__ = ("_blocks", "_dups", "_each", "_extra", "_map", "_partial", "_retired", "evictions")

    def __init__(self, blocks: list[KVCacheBlock], removal_each: bool = False) -> None:
        self._blocks = blocks
        self._map: dict[Hashable, int] = {}
        self._dups: dict[Hashable, dict[int, None]] = {}
        self._extra: dict[int, set[Hashable]] = {}
        self._partial: set[int] = set()
        self._retired: dict[int, set[Hashable]] = {}
        self._each = removal_each
        self.evictions = 0

    def __len__(self) -> int:
        """Number of distinct keys. O(1)."""
        return len(self._map)

    # -- reads -----------------------------------------------------------------

    @property
    def key_map(self) -> dict[Hashable, int]:
        """The live key map, ``{key: id of its first block}`` (vLLM 0.34's
        ``BlockHashToBlockMap._cache``). For vLLM's view of it (the
        adapter's ``cached_block_hash_to_block``); the core changes it only
        through this class's methods. O(1)."""
        return self._map

    @property
    def dup_ids(self) -> dict[Hashable, dict[int, None]]:
        """The live ``{key: {block_id: None}}`` of keys several blocks hold,
        every id in insertion order (vLLM 0.34's
        ``BlockHashToBlockMap._dup_ids``). O(1)."""
        return self._dups

    def extra_keys(self) -> dict[int, set[Hashable]]:
        """The live ``{block_id: extra keys}`` table (vLLM's
        ``cached_block_hashes_by_block`` view). O(1)."""
        return self._extra

    def lookup(self, key: Hashable) -> KVCacheBlock | None:
        """The first block under ``key`` or ``None``. O(1). (The pool's
        ``get_cached_block`` reads :attr:`key_map` in place and counts its
        own lookups and hits.)

        Raises:
            TypeError: ``key`` is not hashable.
            TypeError, IndexError: the map holds under ``key`` something
                that does not index the pool's block list (only code
                outside the core can put it there).
        """
        bid = self._map.get(key)
        return None if bid is None else self._blocks[bid]

    def blocks_of(self, key: Hashable) -> list[KVCacheBlock]:
        """Every block under ``key`` (``[]`` if none). O(blocks under it)."""
        dups = self._dups.get(key)
        if dups is not None:
            blocks = self._blocks
            return [blocks[i] for i in dups]
        bid = self._map.get(key)
        return [] if bid is None else [self._blocks[bid]]

    def contains(self, key: Hashable, block: KVCacheBlock) -> bool:
        """Whether ``key`` maps to ``block`` (to its block id: the caller
        passes the pool's own blocks). O(1)."""
        return self.holds(key, block.block_id)

    def holds(self, key: Hashable, bid: int) -> bool:
        """Whether ``key`` maps to block id ``bid``. O(1)."""
        if self._dups:
            dups = self._dups.get(key)
            if dups is not None:
                return bid in dups
        return self._map.get(key) == bid

    def keys_of(self, block: KVCacheBlock) -> list[Hashable]:
        """Every key the block holds, primary first. O(keys of the block)."""
        keys: list[Hashable] = []
        if block.block_hash is not None:
            keys.append(block.block_hash)
        extra = self._extra.get(block.block_id)
        if extra:
            keys.extend(extra)
        return keys

    def mapped_keys(self, block: KVCacheBlock) -> list[Hashable]:
        """The block's keys that the map still points at it (code outside
        the core, vLLM's tests, may pop map entries). O(keys)."""
        bid = block.block_id
        return [key for key in self.keys_of(block) if self.holds(key, bid)]

    def is_partial(self, block_id: int) -> bool:
        """Whether the block's primary key is a partial-block key. O(1)."""
        return block_id in self._partial

    def is_retired(self, block_id: int, key: Hashable) -> bool:
        """Whether ``key`` was retired from the block by a promotion. O(1)."""
        retired = self._retired.get(block_id)
        return retired is not None and key in retired

    def reportable(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Of ``keys`` just removed from a block, those whose removal is
        reported (every one with ``removal_each``, else those no block
        holds any more). O(len(keys))."""
        if self._each:
            return list(keys)
        m = self._map
        return [k for k in keys if k not in m]

    def items(self) -> Iterator[tuple[Hashable, list[KVCacheBlock]]]:
        """``(key, blocks)`` for every key. O(keys + blocks)."""
        for key in self._map:
            yield key, self.blocks_of(key)

    # -- changes -----------------------------------------------------------------

    def publish(
        self, key: Hashable, block: KVCacheBlock, num_tokens: int | None, partial: bool = False
    ) -> bool:
        """Make ``block`` reachable under ``key``: its primary key (covering
        ``num_tokens``; a partial-block key when ``partial``) if it has none,
        else an extra key. Returns False, changing nothing, if the key is
        its primary key or the map lists the block under it already.
        vLLM 0.34's ``_insert_block_hash``, case for case, also where code
        outside the core edited the map: a block without a key takes it
        even if the map lists the block under it, and an extra key the map
        lost is mapped again. O(1)."""
        bid = block.block_id
        if block.block_hash is None:
            block.block_hash = key
            block.block_hash_num_tokens = num_tokens
            if partial:
                self._partial.add(bid)
        elif block.block_hash == key or self.holds(key, bid):
            return False
        else:
            self._extra.setdefault(bid, set()).add(key)
        self.link(key, bid)
        return True

    def link(self, key: Hashable, bid: int) -> None:
        """Map ``key`` to block ``bid`` in the map only (the block's record
        is the caller's; vLLM 0.34's ``BlockHashToBlockMap.insert``: nothing
        changes where the key maps to the block already). Takes the id, not
        the block, so a block of any class maps as vLLM 0.34 maps it. O(1)."""
        first = self._map.setdefault(key, bid)
        if first != bid:
            self._dups.setdefault(key, {first: None})[bid] = None

    def publish_full(
        self,
        blocks: list[KVCacheBlock],
        keys: list[Hashable],
        indices: list[int],
        block_size: int | None,
        keys_offset: int = 0,
    ) -> tuple[list[int], list[Hashable]]:
        """Publish full block ``blocks[i]`` under ``keys[i - keys_offset]``
        for each ``i`` of ``indices`` (covering ``(i + 1) * block_size``
        tokens), promoting
        a block that holds another key first (its keys removed and
        retired: a key from before the call, whose shorter prefix the caller
        checked, or one this call gave it at an earlier index, the longer
        prefix winning as in vLLM's one-by-one loop). Returns
        the indices newly published and the reportable keys the promotions
        removed, in order. The caller checked every argument. O(len(indices)).
        """
        m = self._map
        published: list[int] = []
        removed: list[Hashable] = []
        for i in indices:
            b = blocks[i]
            key = keys[i - keys_offset]
            if b.block_hash is None:
                # publish() for a block holding no key, inline.
                # (A map that lists the block under the key already, edited
                # from outside the core, is left as it is: the block takes
                # the key, as vLLM 0.34's _insert_block_hash gives it.)
                bid = b.block_id
                first = m.setdefault(key, bid)
                if first != bid:
                    dups = self._dups.get(key)
                    if dups is None:
                        self._dups[key] = {first: None, bid: None}
                    else:
                        dups[bid] = None
                b.block_hash = key
                b.block_hash_num_tokens = (i + 1) * block_size if block_size else None
            else:
                if b.block_hash != key:  # a shorter prefix's key: promoted
                    removed.extend(self.reportable(self.promote(b)))
                if not self.publish(key, b, (i + 1) * block_size if block_size else None):
                    continue
            published.append(i)
        return published, removed

    def remove(self, block: KVCacheBlock) -> list[Hashable]:
        """Withdraw every key of ``block``; returns the keys that mapped to
        it (primary first), as vLLM reports removals. The block forgets all
        its keys, and that its primary key was partial, either way.
        O(keys of the block)."""
        keys = self.keys_of(block)
        bid = block.block_id
        if self._partial:
            self._partial.discard(bid)
        if not keys:
            return keys
        self._extra.pop(bid, None)
        removed = [key for key in keys if self.unlink(key, bid)]
        block.block_hash = None
        block.block_hash_num_tokens = None
        return removed

    def unlink(self, key: Hashable, bid: int) -> bool:
        """Take block ``bid`` from under ``key`` in the map only (the block's
        record is the caller's; vLLM 0.34's ``BlockHashToBlockMap.pop``: the
        next id takes the first's place). Returns whether it was there.
        O(1)."""
        all_dups = self._dups
        dups = all_dups.get(key) if all_dups else None
        if dups is None:
            if self._map.get(key) != bid:
                return False
            del self._map[key]
        else:
            if bid not in dups:
                return False
            del dups[bid]
            self._map[key] = next(iter(dups))
            if len(dups) == 1:
                del all_dups[key]
        return True

    def promote(self, block: KVCacheBlock) -> list[Hashable]:
        """:meth:`remove` for a block about to be published under a key for
        a longer prefix: the removed keys are also retired for the block
        (see :meth:`is_retired`). Returns them. O(keys of the block)."""
        keys = self.remove(block)
        if keys:
            self._retired.setdefault(block.block_id, set()).update(keys)
        return keys

    def unretire(self, block_id: int) -> None:
        """Forget the keys retired from the block (its content was
        replaced). O(1)."""
        self._retired.pop(block_id, None)

    def evict_for_reuse(
        self, blocks: list[KVCacheBlock], report: bool, keys_out: list[Hashable] | None = None
    ) -> list[tuple[KVCacheBlock, list[Hashable]]]:
        """Blocks just taken for new content: withdraw their keys (blocks
        without one are skipped: a caller may pass only the keyed ones);
        counts one eviction per block that held a key. What was retired or
        partial about the old content goes with :meth:`forget_marks`, which
        the caller calls for every block taken. A block whose only key maps to
        it alone costs one dict deletion. With ``report``, returns
        ``(block, reportable keys)`` for each block that lost keys (else
        ``[]``); with ``report`` and ``keys_out``, appends the reportable
        keys to ``keys_out`` instead, in the same order, and returns ``[]``.
        O(len(blocks) + keys)."""
        m = self._map
        extra = self._extra
        dups = self._dups
        out: list[tuple[KVCacheBlock, list[Hashable]]] = []
        evicted = 0
        for b in blocks:
            key = b.block_hash
            if key is None:
                continue
            evicted += 1
            if (extra and b.block_id in extra) or (dups and key in dups) or m.get(key) != b.block_id:
                keys = self.remove(b)
                if report:
                    if keys_out is not None:
                        keys_out.extend(self.reportable(keys))
                    else:
                        out.append((b, self.reportable(keys)))
            else:  # remove() for a block whose one key maps to it alone, inline
                del m[key]
                b.block_hash = None
                b.block_hash_num_tokens = None
                if report:  # reportable: removed from every block
                    if keys_out is not None:
                        keys_out.append(key)
                    else:
                        out.append((b, [key]))
        if evicted:
            self.evictions += evicted
        return out

    def forget_marks(self, blocks: list[KVCacheBlock]) -> None:
        """``blocks`` were taken for new content: what was retired or
        partial about the old content goes. O(1) when no block has such a
        mark, else O(len(blocks))."""
        if self._partial or self._retired:
            partial, retired = self._partial, self._retired
            for b in blocks:
                partial.discard(b.block_id)
                retired.pop(b.block_id, None)

    def evict(self, block: KVCacheBlock) -> list[Hashable]:
        """:meth:`remove` counted as an eviction when the block held a key
        (``evict_blocks``). O(keys of the block)."""
        if not self.keys_of(block):
            return []
        self.evictions += 1
        return self.remove(block)

    def move(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Re-point every key of ``src`` to ``dst`` (``dst`` holds none), with
        the partial mark and retired keys. O(keys)."""
        ntok = src.block_hash_num_tokens
        was_partial = src.block_id in self._partial
        retired = self._retired.pop(src.block_id, None)
        self._retired.pop(dst.block_id, None)
        if retired:
            self._retired[dst.block_id] = retired
        first = True
        for key in self.remove(src):
            self.publish(key, dst, ntok if first else None, partial=first and was_partial)
            first = False

    def clear(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop every key; ``blocks``: every block record that may hold one.
        O(len(blocks) + keys)."""
        self._map.clear()
        self._dups.clear()
        self._extra.clear()
        self._partial.clear()
        self._retired.clear()
        for b in blocks:
            b.block_hash = None
            b.block_hash_num_tokens = None

    def _check(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Assert the invariants against the pool's ``blocks``: the map and
        the blocks' keys agree both ways, no key maps to no block, to a
        foreign or to the null block; extra keys only beside a primary key;
        partial and retired marks name data blocks. O(blocks + keys).

        Raises:
            InvariantError: the first broken invariant.
        """
        # Read as objects: code outside the core (vLLM's, through the view)
        # can put anything in these dicts, and the compiled build would
        # refuse a non-int where the annotations say int.
        raw_map: dict[Hashable, object] = self._map  # type: ignore[assignment]
        raw_dups: dict[Hashable, dict[object, None]] = self._dups  # type: ignore[assignment]
        for key, bid in raw_map.items():
            if type(bid) is not int or not 0 < bid < len(blocks):
                raise InvariantError(f"key {key!r} maps to {bid!r}, not a data block's id")
        for key, dups in raw_dups.items():
            if len(dups) < 2 or raw_map.get(key) != next(iter(dups)):
                raise InvariantError(f"key {key!r}: its ids {list(dups)} are not the map's first and more")
            if not all(type(i) is int and 0 < i < len(blocks) for i in dups):
                raise InvariantError(f"key {key!r} maps to {list(dups)}, not all data blocks' ids")
        seen_pairs = set()
        for key, owners in self.items():
            if not owners:
                raise InvariantError(f"key {key!r} maps to no block")
            for b in owners:
                if blocks[b.block_id] is not b or b.is_null:
                    raise InvariantError(f"key {key!r} maps to a foreign or null block")
                if key not in self.keys_of(b):
                    raise InvariantError(f"key {key!r} maps to block {b.block_id} which lacks it")
                seen_pairs.add((key, b.block_id))
        for b in blocks:
            for key in self.keys_of(b):
                if (key, b.block_id) not in seen_pairs:
                    raise InvariantError(f"block {b.block_id} holds key {key!r} the map lacks")
        for bid, extra in self._extra.items():
            if extra and blocks[bid].block_hash is None:
                raise InvariantError(f"block {bid} has extra keys but no primary key")
        for bid in (*self._partial, *self._retired):
            if not 0 < bid < len(blocks):
                raise InvariantError(f"partial or retired mark on {bid!r}, not a data block")
