"""vLLM's record types over the core's: the block, the free queue and the
key-map view that :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`
hands to vLLM.

vLLM's code and tests read ``block.pool`` and ``_block_hash``, call
``set_block_hash``, walk the free queue by vLLM's names and read
``cached_block_hash_to_block``; the core keeps the state. So the core
builds its blocks as :class:`VllmKVCacheBlock` (one subclass per pool, for
the fast own-block check) and :class:`VllmNullBlock`, its free queue as
:class:`VllmFreeBlockQueue`, and vLLM's map view wraps the core's key dict
(``docs/vllm-design.md``, "Design"). The blocks are the core's record
class with vLLM's names added, not vLLM's dataclass: the compiled core
reads its records natively and takes no other class. The core's keys are
vLLM's ``BlockHashWithGroupId`` bytes as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import MemberDescriptorType
from typing import TYPE_CHECKING, Any

from vllm.v1.core.block_pool import BlockHashToBlockMap

from blockpool.core.block import FreeBlockQueue, KVCacheBlock, NullBlock
from blockpool.core.errors import InvalidArgumentError
from blockpool.core.prefix_cache import PrefixCache

__all__ = ["HashMapView", "VllmFreeBlockQueue", "VllmKVCacheBlock", "VllmNullBlock"]


# Whether the core's block record is the compiled build's native class (its
# fields getset descriptors) rather than the pure build's slots.
_NATIVE_RECORD = not isinstance(KVCacheBlock.__dict__.get("block_id"), MemberDescriptorType)

if TYPE_CHECKING:  # the mixin reads and writes the core record's fields
    _Record = KVCacheBlock
else:
    _Record = object


class _VllmBlockSurface(_Record):
    """vLLM's ``KVCacheBlock`` surface over the core's block record: the
    names vLLM's code and tests use that the core's record spells
    otherwise (no state of its own)."""

    __slots__ = ()
    pool: Any

    @property
    def _block_hash(self) -> Any:
        """vLLM's field name for the primary key (the core's ``block_hash``). O(1)."""
        return self.block_hash

    @_block_hash.setter
    def _block_hash(self, value: Any) -> None:
        self.block_hash = value

    @property
    def _block_hash_num_tokens(self) -> int | None:
        """vLLM's field name for ``block_hash_num_tokens``. O(1)."""
        return self.block_hash_num_tokens

    @_block_hash_num_tokens.setter
    def _block_hash_num_tokens(self, value: int | None) -> None:
        self.block_hash_num_tokens = value

    def set_block_hash(self, block_hash: Any, num_tokens: int | None = None) -> None:
        """vLLM's ``set_block_hash``: set the primary key on a block that has
        none (the record only; the pool's key map is the caller's, as in
        vLLM). O(1).

        Raises:
            AssertionError: the block already has a key (as vLLM).
        """
        assert self.block_hash is None and self.block_hash_num_tokens is None, (
            "The block already has a hash. This should not happen."
        )
        self.block_hash = block_hash
        self.block_hash_num_tokens = num_tokens

    def __repr__(self) -> str:
        # vLLM's format (ids of the free-queue neighbours, not their records).
        prev, nxt = self.prev_free_block, self.next_free_block
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"_block_hash={self.block_hash!r}, _block_hash_num_tokens={self.block_hash_num_tokens}, "
            f"prev_free_block={None if prev is None else prev.block_id}, "
            f"next_free_block={None if nxt is None else nxt.block_id})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and ``copy``) support: a copy as :class:`VllmKVCacheBlock`
        or :class:`VllmNullBlock` (a pool's own class is not importable by
        name) with every field but ``pool`` and the free-queue links (they
        would drag the pool and its whole queue along): the copy belongs to
        no pool, and a pool refuses it. O(1)."""
        state = (self.block_hash, self.block_hash_num_tokens, self.writer, self.readers)
        null = isinstance(self, VllmNullBlock)
        return (_unpickle_block, (self.block_id, self.ref_cnt, null, state))


class VllmKVCacheBlock(_VllmBlockSurface, KVCacheBlock):
    """The core's block record (:class:`blockpool.core.block.KVCacheBlock`:
    its 8 slots, the shadow ``writer`` / ``readers`` among them) with
    vLLM's ``KVCacheBlock`` surface: ``pool`` (the owning
    :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`'s reference,
    or ``None``), ``_block_hash`` and ``_block_hash_num_tokens`` as
    properties over the core's fields, ``set_block_hash``, ``reset_hash``,
    ``is_null`` and vLLM's ``repr``. Built as vLLM builds its blocks,
    ``VllmKVCacheBlock(block_id, pool=None)``.

    No slot is added in the pure-Python build (8 fields per block, as
    vLLM's ``KVCacheBlock``) and one in the compiled build: a full
    ``gc.collect()`` walks each slot of each cached block
    (``docs/performance.md``, "Garbage collection"). ``pool`` and
    ``is_null``, the same for every block of a pool, are class attributes:
    ``pool`` of each pool's own subclass (below; ``None`` here), ``is_null``
    false here and true on :class:`VllmNullBlock`. A block's ``pool`` is
    its class's: the constructor refuses another, and neither may be
    assigned on a block (nothing in vLLM or the core does).

    In the compiled build ``block_id`` is also a slot of this class, set
    once in ``__init__``: vLLM's own code reads it (block tables,
    ``get_block_ids``, the allocation count), CPython reads a slot of an
    interpreted class in 9 ns, and the compiled core's record field is a
    getset descriptor call (50 ns, boxing an int above 256 on every read).
    The compiled core reads its own field, which holds the same value.
    Nothing may assign ``block_id`` after construction.

    It is the core's class, not vLLM's, so that the compiled (mypyc) core's
    native block access takes it (``docs/vllm-design.md``, "Design"):
    ``isinstance(b, vllm.v1.core.kv_cache_utils.KVCacheBlock)`` is false
    (nothing in vLLM 0.32/0.33 tests it but ``BlockHashToBlockMap``, which
    :class:`HashMapView` overrides), and ``==`` is identity (vLLM's
    dataclass ``==`` compares the fields of two blocks of one class; a
    pool's blocks differ in ``block_id``). Each pool's blocks are of its own
    subclass (:func:`~blockpool.core.block.block_class_for_pool`, same name,
    no slot added, ``pool`` set on it), so the core's own-block check is a
    type test."""

    __slots__ = ("block_id",) if _NATIVE_RECORD else ()
    pool: Any = None
    is_null = False

    def __init__(self, block_id: int, pool: Any = None) -> None:
        """O(1).

        Raises:
            InvalidArgumentError: ``pool`` is neither ``None`` nor this
                class's ``pool`` (a pool's blocks are of its own class).
        """
        if pool is not None and pool is not type(self).pool:
            raise InvalidArgumentError(
                f"a block's pool is its class's ({type(self).pool!r}), got {pool!r}: "
                "a pool's blocks are of the class it made for them"
            )
        KVCacheBlock.__init__(self, block_id)
        if _NATIVE_RECORD:
            self.block_id = block_id  # the interpreted copy (class docstring)


class VllmNullBlock(_VllmBlockSurface, NullBlock):
    """Block 0 of a :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`:
    the core's null block (``is_null`` true; never allocated, freed, cached
    or a transfer's block) with the same vLLM surface as
    :class:`VllmKVCacheBlock` (``block_id`` and ``is_null`` copied into
    slots of its own likewise)."""

    __slots__ = ("block_id", "is_null", "pool")

    def __init__(self, block_id: int = 0, pool: Any = None) -> None:
        NullBlock.__init__(self, block_id)
        self.pool = pool
        self.block_id = block_id
        self.is_null = True


def _unpickle_block(block_id: int, ref_cnt: int, null: bool, state: tuple[Any, ...]) -> Any:
    b: Any = (VllmNullBlock if null else VllmKVCacheBlock)(block_id)
    b.ref_cnt = ref_cnt
    b.block_hash, b.block_hash_num_tokens, b.writer, b.readers = state
    return b


class VllmFreeBlockQueue(FreeBlockQueue):
    """The core's free queue with vLLM's ``FreeKVCacheBlockQueue`` names
    added (no state of its own). Mutators bypass the pool, as in vLLM."""

    __slots__ = ()

    @property
    def fake_free_list_head(self) -> Any:
        """The head sentinel (vLLM's name). O(1)."""
        return self.head

    @property
    def fake_free_list_tail(self) -> Any:
        """The tail sentinel (vLLM's name). O(1)."""
        return self.tail

    def popleft(self) -> Any:
        """Remove and return the first free block. O(1).

        Raises:
            ValueError: the queue is empty (as vLLM).
        """
        if self.num_free_blocks <= 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def append(self, block: Any) -> None:
        """Insert ``block`` at the back. O(1)."""
        self.append_n([block])

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block, front to back. O(n)."""
        return list(self)

    def iter_blocks_after(self, cursor: Any) -> Iterator[Any]:
        """Free blocks in eviction order after ``cursor`` (from the front
        when ``None``). O(1) per block."""
        b = self.head.next_free_block if cursor is None else cursor.next_free_block
        tail = self.tail
        while b is not None and b is not tail:
            yield b
            b = b.next_free_block


class HashMapView(BlockHashToBlockMap):
    """vLLM's ``BlockHashToBlockMap`` over the core's key map: its
    ``_cache`` *is* the core's ``{key: first block id}`` dict, its
    ``_dup_ids`` the core's ``{key: {block_id: None}}`` of keys several
    blocks hold and its ``_blocks`` the pool's block list
    (:attr:`~blockpool.core.prefix_cache.PrefixCache.key_map`,
    :attr:`~blockpool.core.prefix_cache.PrefixCache.dup_ids`): vLLM's
    methods, and tests reaching into ``_cache`` or ``_dup_ids``, read and
    write the core's map. O(1) to build.

    That is vLLM 0.34's own representation, so on 0.34 these are vLLM's
    methods in effect; vLLM 0.32 and 0.33 kept blocks in ``_cache`` (one
    block, or a ``{block_id: block}`` dict), and nothing of theirs outside
    the class reads it, so the methods below, vLLM 0.34's, serve every
    line. A block is mapped by its id: one inserted from outside the pool
    (vLLM's unit tests make such blocks) reads back as the pool's block of
    that id, as in vLLM 0.34. Each O(1)."""

    def __init__(self, prefix_cache: PrefixCache, blocks: list[Any]) -> None:
        self._prefix_cache = prefix_cache
        self._blocks = blocks
        self._cache = prefix_cache.key_map  # type: ignore[assignment]
        self._dup_ids = prefix_cache.dup_ids

    def get_one_block(self, key: Any) -> Any:
        """Any block mapped to ``key`` (the first inserted), or ``None``."""
        return self._prefix_cache.lookup(key)

    def contain(self, key: Any, block_id: int) -> bool:
        """Whether ``key`` maps to block ``block_id``."""
        return self._prefix_cache.holds(key, block_id)

    def insert(self, key: Any, block: Any) -> None:
        """Map ``key`` to ``block``'s id too."""
        self._prefix_cache.link(key, block.block_id)

    def pop(self, key: Any, block_id: int) -> Any:
        """Unmap block ``block_id`` from ``key``; the pool's block of that
        id, or ``None`` when ``key`` did not map to it (the map unchanged)."""
        return self._blocks[block_id] if self._prefix_cache.unlink(key, block_id) else None

    def __len__(self) -> int:
        """Number of distinct keys."""
        return len(self._cache)

    def clear(self) -> None:
        """Drop every key (both dicts; the blocks' own keys are the
        caller's, as in vLLM)."""
        self._cache.clear()
        self._dup_ids.clear()
