"""vLLM's record types over the core's: the block, the free queue and the
key-map view that :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`
hands to vLLM, and the view of a request's hashes as the core's keys.

vLLM's code and tests check ``isinstance(x, KVCacheBlock)``, read
``block.pool`` and ``_block_hash``, call ``set_block_hash``, walk the free
queue by vLLM's names and read ``cached_block_hash_to_block``; the core
keeps the state. So the core builds its blocks from
:class:`VllmKVCacheBlock` (one subclass per pool, for the fast own-block
check), its free queue as :class:`VllmFreeBlockQueue`, and vLLM's map view
wraps the core's key dict (``docs/vllm-plugin.md``, "Design"). The core's
keys are vLLM's ``BlockHashWithGroupId`` bytes as they are
(:class:`GroupKeys`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

from blockpool.core.block import FreeBlockQueue
from blockpool.core.hazards import Token
from blockpool.core.prefix_cache import PrefixCache

__all__ = ["GroupKeys", "HashMapView", "VllmFreeBlockQueue", "VllmKVCacheBlock"]


class VllmKVCacheBlock(KVCacheBlock):
    """vLLM's ``KVCacheBlock`` plus the core's shadow slots (``writer``,
    ``readers``), with ``block_hash`` / ``block_hash_num_tokens`` writable
    (the core's key map assigns them; vLLM's ``set_block_hash`` and
    ``reset_hash`` keep working). ``block_hash`` is a slot of its own and
    vLLM's ``_block_hash`` a property over it (the core reads
    ``block_hash`` on every free: a property cost about 25 ns per block
    there), so 11 slots, one of them (vLLM's ``_block_hash``) unused.
    ``pool`` is the owning :class:`VllmBlockPool`. Each pool's blocks are
    of its own subclass (:func:`~blockpool.core.block.block_class_for_pool`,
    same name, no slot added), so the core's own-block check is a type
    test; ``isinstance(b, KVCacheBlock)`` holds as in vLLM."""

    __slots__ = ("block_hash", "readers", "writer")

    def __init__(self, block_id: int, pool: Any = None, is_null: bool = False) -> None:
        KVCacheBlock.__init__(self, block_id, pool=pool, is_null=is_null)
        self.writer: Token | None = None
        self.readers: Any = None

    @property  # type: ignore[override]
    def _block_hash(self) -> Any:
        return self.block_hash

    @_block_hash.setter
    def _block_hash(self, value: Any) -> None:
        self.block_hash = value

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    @block_hash_num_tokens.setter
    def block_hash_num_tokens(self, value: int | None) -> None:
        self._block_hash_num_tokens = value

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and ``copy``) support: a copy as :class:`VllmKVCacheBlock`
        (a pool's own class is not importable by name) with every field but
        ``pool`` and the free-queue links (they would drag the pool and its
        whole queue along): the copy belongs to no pool, and a pool refuses
        it. O(1)."""
        state = (self._block_hash, self._block_hash_num_tokens, self.is_null, self.writer, self.readers)
        return (_unpickle_block, (self.block_id, self.ref_cnt, state))


def _unpickle_block(block_id: int, ref_cnt: int, state: tuple[Any, ...]) -> VllmKVCacheBlock:
    b = VllmKVCacheBlock(block_id)
    b.ref_cnt = ref_cnt
    b._block_hash, b._block_hash_num_tokens, b.is_null, b.writer, b.readers = state
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
    """vLLM's ``BlockHashToBlockMap`` whose ``_cache`` *is* the core's key
    dict: vLLM's methods (and tests reaching into ``_cache``) read and write
    the core's map. O(1) to build."""

    def __init__(self, prefix_cache: PrefixCache) -> None:
        self._cache = prefix_cache.key_map  # type: ignore[assignment]


class GroupKeys(Sequence):  # type: ignore[type-arg]
    """A request's block hashes as the core's keys for one KV cache group:
    item ``i`` is vLLM's ``BlockHashWithGroupId`` of ``hashes[i]``, made on
    demand (no list of the request's whole chain per call). O(1) to build
    and per item."""

    __slots__ = ("_hashes", "_suffix")

    def __init__(self, hashes: Sequence[bytes], group_id: int) -> None:
        self._hashes = hashes
        self._suffix = group_id

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, i: Any) -> Any:
        return make_block_hash_with_group_id(self._hashes[i], self._suffix)  # type: ignore[arg-type]
