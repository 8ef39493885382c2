"""Per-block records and the free block queue.

The layout follows vLLM v1 (``vllm/v1/core/kv_cache_utils.py``): a slotted
record per block, and a free queue that is a doubly linked list threaded
through the records themselves (no per-operation objects, O(1) removal from
the middle for prefix hits). The code is written afresh; names are vLLM's so
that a reader of vLLM recognises every field.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, TypeVar

from blockpool.core._mypyc import mypyc_attr
from blockpool.core.errors import InvalidArgumentError, InvariantError

if TYPE_CHECKING:
    from blockpool.core.hazards import Token

__all__ = ["FreeBlockQueue", "KVCacheBlock", "block_class_for_pool", "check_block_class"]

_B = TypeVar("_B")


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheBlock:
    """Metadata of one KV-cache block (the data lives in the GPU tensor).

    Attributes:
        block_id: Index in the pool, ``0 .. num_gpu_blocks - 1`` (0 is the null block).
        ref_cnt: Number of holders (requests, pinned transfers).
        block_hash: Primary prefix-cache key, or ``None`` when not cached.
        block_hash_num_tokens: Prefix tokens covered by ``block_hash``.
        prev_free_block, next_free_block: Links of the free queue; only
            :class:`FreeBlockQueue` (and its policy subclasses) touches them,
            except that a held block (outside the queue) carries its hold
            in ``next_free_block``
            (:class:`~blockpool.core.holdback.HoldMark`, written by
            :class:`~blockpool.core.holdback.HoldBack`).
        writer: Shadow: the last write not known to have ended (a token), or ``None``.
        readers: Shadow: reads since that write: ``None`` or a tuple of
            tokens (the newest read per device stream, each host
            token apart). Immutable and shared: blocks freed or read together
            hold the same object, so the pool does its hazard work once per
            distinct shadow, not once per block; it replaces the value,
            never mutates it.

    Memory: 8 slots (the same count as vLLM's ``KVCacheBlock``); the null
    block is a subclass instance so ``is_null`` costs no slot.
    """

    __slots__ = (
        "block_hash",
        "block_hash_num_tokens",
        "block_id",
        "next_free_block",
        "prev_free_block",
        "readers",
        "ref_cnt",
        "writer",
    )

    is_null = False

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None
        self.block_hash_num_tokens: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.writer: Token | None = None
        self.readers: tuple[Token, ...] | None = None

    def reset_hash(self) -> None:
        """Forget the primary key (the pool removes the map entries). O(1)."""
        self.block_hash = None
        self.block_hash_num_tokens = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={self.block_hash!r})"
        )

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle support: a copy of the record, as the nearest class
        importable by name (a pool's own class, from
        :func:`block_class_for_pool`, is not: it pickles as
        :class:`KVCacheBlock`), with every field but the free-queue links
        (they would drag the whole queue along; the copy has ``None``). The
        copy belongs to no pool: a pool refuses it as another pool's block.
        O(1)."""
        cls = next(c for c in type(self).__mro__ if _importable(c))
        state = (
            self.block_id,
            self.ref_cnt,
            self.block_hash,
            self.block_hash_num_tokens,
            self.writer,
            self.readers,
        )
        return (_unpickle_block, (cls, state))


def _importable(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    return getattr(module, cls.__qualname__, None) is cls


def _unpickle_block(cls: type[KVCacheBlock], state: tuple[object, ...]) -> KVCacheBlock:
    b = cls.__new__(cls)
    b.prev_free_block = b.next_free_block = None
    b.block_id, b.ref_cnt, b.block_hash, b.block_hash_num_tokens, b.writer, b.readers = state  # type: ignore[assignment]
    return b


@mypyc_attr(allow_interpreted_subclasses=True)
class NullBlock(KVCacheBlock):
    """Block 0: a placeholder in block tables. Never allocated, never free,
    never cached, never the source or destination of a transfer."""

    __slots__ = ()
    is_null = True


def block_class_for_pool(base: type[_B] = KVCacheBlock) -> type[_B]:  # type: ignore[assignment]
    """A fresh subclass of ``base`` (default :class:`KVCacheBlock`; no slot
    added, so no memory added per block) for the blocks of one pool, with
    ``base``'s name and module (``repr``, ``isinstance`` and pickling see
    ``base``).

    Why: a pool must reject another pool's blocks. ``pool.blocks[b.block_id]
    is b`` answers that but reads the id's int object and the pool's block
    list, two memory reads outside the block that miss the cache once the
    pool is large (about 200 ns per block at 200,000 blocks on the benchmark
    machine, against 40 ns for touching the block at all). A block whose
    type is its pool's own class belongs to that pool, and the type sits in
    the block's header, which any use of the block reads anyway. The class
    is not importable by its name (that name is ``base``'s), so no copy
    made by pickling is of it; blocks of any other class are checked by
    identity. An adapter passes ``base`` = its subclass of the host
    framework's block type and hands the class to
    :class:`~blockpool.HazardAwareBlockPool` as ``block_class``. O(1); the
    class costs about 1 KB per pool.

    Raises:
        InvalidArgumentError: ``base`` is not a class.

    >>> cls = block_class_for_pool()
    >>> cls.__name__, issubclass(cls, KVCacheBlock), cls is KVCacheBlock
    ('KVCacheBlock', True, False)
    """
    if not isinstance(base, type):
        raise InvalidArgumentError(f"base must be a class, got {base!r}")
    namespace = {"__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__}
    return type(base.__name__, (base,), namespace)


_CLAIMED: weakref.WeakSet[type] = weakref.WeakSet()
"""Every ``block_class`` a pool was built with: one pool per class."""


def check_block_class(cls: object, factory: object, claim: bool = False) -> None:
    """Check that ``cls`` can be a pool's own block class (``block_class``
    of :class:`~blockpool.HazardAwareBlockPool`); with ``claim``, record it
    as taken (the pool is built). O(1).

    Raises:
        InvalidArgumentError: ``factory`` is ``None`` (the pool would not
            make blocks of ``cls``), ``cls`` is not a class, is importable
            by its name (a copy made by pickling would be of it), or is
            already another pool's.
    """
    if factory is None:
        raise InvalidArgumentError("block_class needs block_factory")
    if not isinstance(cls, type):
        raise InvalidArgumentError(f"block_class must be a class, got {cls!r}")
    if _importable(cls):
        raise InvalidArgumentError(
            f"block_class {cls.__qualname__} is importable by its name; make one with block_class_for_pool(base)"
        )
    if cls in _CLAIMED:
        raise InvalidArgumentError(f"block_class {cls.__qualname__} is already another pool's")
    if claim:
        _CLAIMED.add(cls)


@mypyc_attr(allow_interpreted_subclasses=True)
class FreeBlockQueue:
    """Free blocks in eviction order, as an intrusive doubly linked list.

    Front = next to be handed out. Freed unhashed blocks are prepended (reused
    first, better GPU locality); freed cached blocks are appended (LRU).
    Every operation is O(1) per block and allocates nothing but the returned
    lists.
    """

    __slots__ = ("head", "num_free_blocks", "tail")

    def __init__(self, blocks: list[KVCacheBlock]):
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self.tail
        self.tail.prev_free_block = prev
        self.num_free_blocks = len(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks front to back. O(n)."""
        b = self.head.next_free_block
        tail = self.tail
        while b is not tail:
            assert b is not None
            yield b
            b = b.next_free_block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks (caller checked ``n``). O(n)."""
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        b = self.head.next_free_block
        for _ in range(n):
            assert b is not None
            out.append(b)
            nxt = b.next_free_block
            b.prev_free_block = b.next_free_block = None
            b = nxt
        assert b is not None
        self.head.next_free_block = b
        b.prev_free_block = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, b: KVCacheBlock) -> None:
        """Unlink ``b`` (which must be in the queue). O(1)."""
        prev, nxt = b.prev_free_block, b.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        b.prev_free_block = b.next_free_block = None
        self.num_free_blocks -= 1

    def remove_n(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Unlink every block of ``blocks`` that is in the queue (prefix hits
        on free blocks); returns those that were not (held back, say), in
        order: ``[]`` when all were. O(len(blocks)).

        >>> q = FreeBlockQueue([KVCacheBlock(i) for i in range(1, 4)])
        >>> a, b, c = list(q)
        >>> q.remove_n([c, a]), [x.block_id for x in q], q.remove_n([a])
        ([], [2], [KVCacheBlock(block_id=1, ref_cnt=0, block_hash=None)])
        """
        missing: list[KVCacheBlock] = []
        removed = 0
        for b in blocks:
            prev = b.prev_free_block
            if prev is not None:
                nxt = b.next_free_block
                prev.next_free_block = nxt
                nxt.prev_free_block = prev  # type: ignore[union-attr]
                b.prev_free_block = b.next_free_block = None
                removed += 1
            else:
                missing.append(b)
        self.num_free_blocks -= removed
        return missing

    def take_n(self, blocks: list[KVCacheBlock]) -> None:
        """Unlink ``blocks`` (each in the queue) to hand them out from
        anywhere in the queue (placement), as :meth:`popleft_n` hands out
        its front: a policy queue forgets their hit counts. O(len(blocks))."""
        self.remove_n(blocks)

    def on_hit(self, blocks: list[KVCacheBlock]) -> None:
        """A prefix hit on ``blocks`` (before their ref counts grow); the
        LRU queue counts nothing. O(1)."""

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert ``blocks`` at the front, keeping their order. O(len)."""
        if not blocks:
            return
        first = self.head.next_free_block
        prev = self.head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = first
        assert first is not None
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert ``blocks`` at the back, keeping their order (a policy queue:
        each at the back of its segment). O(len)."""
        if not blocks:
            return
        prev = self.tail.prev_free_block
        assert prev is not None
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self.tail
        self.tail.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def contains(self, b: KVCacheBlock) -> bool:
        """Whether ``b`` is linked in (O(1): linked blocks have both links)."""
        return b.prev_free_block is not None

    def check(self) -> list[KVCacheBlock]:
        """Walk the list, verifying links and the count. O(n). Raises
        :class:`InvariantError`."""
        seen: list[KVCacheBlock] = []
        prev = self.head
        b = self.head.next_free_block
        while b is not self.tail:
            if b is None or b.prev_free_block is not prev:
                raise InvariantError("free queue links are broken")
            seen.append(b)
            if len(seen) > self.num_free_blocks:
                raise InvariantError("free queue is longer than num_free_blocks")
            prev, b = b, b.next_free_block
        if self.tail.prev_free_block is not prev:
            raise InvariantError("free queue tail link is broken")
        if len(seen) != self.num_free_blocks:
            raise InvariantError(f"num_free_blocks={self.num_free_blocks} but {len(seen)} blocks are linked")
        return seen
