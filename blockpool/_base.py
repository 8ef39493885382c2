"""Shared parts of :class:`~blockpool.pool.HazardAwareBlockPool`: constants,
shadow helpers, the attributes every part uses and the argument checks."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from blockpool.block import FreeBlockQueue, KVCacheBlock
from blockpool.errors import (
    BlockNotAllocatedError,
    ForeignBlockError,
    InvalidArgumentError,
    StaleBlockError,
)
from blockpool.events import KVCacheEvent
from blockpool.hazards import AccessKind, Fence, StreamKind, Token
from blockpool.prefix_cache import PrefixCache
from blockpool.tracker import HazardTracker, StreamState

__all__ = ["PoolBase"]

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


class PoolBase:
    """Attributes of :class:`~blockpool.pool.HazardAwareBlockPool` shared by
    its parts (set in its ``__init__``), and the checks every part uses to
    validate arguments before it changes anything."""

    num_gpu_blocks: int
    pool_id: int
    enable_caching: bool
    hash_block_size: int
    enable_kv_cache_events: bool
    track_hazards: bool
    medium: str
    debug: bool
    lease_timeout: float | None
    _clock: Callable[[], float]
    null_block: KVCacheBlock
    _block_cls: type
    blocks: list[KVCacheBlock]
    free_block_queue: FreeBlockQueue
    prefix_cache: PrefixCache
    kv_event_queue: list[KVCacheEvent]
    tracker: HazardTracker
    _held: dict[int, set[Token]]
    _held_by: dict[Token, list[KVCacheBlock]]
    _leases: SortedList
    _deadline: dict[int, float]
    _expired: set[int]
    _writes: dict[str, dict[int, list[tuple[KVCacheBlock, Token | None, Token | tuple[Token, ...] | None]]]]
    _invalid: set[int]
    _partial: set[int]
    _removal_each: bool
    _retired: dict[int, set[Hashable]]
    _counters: dict[str, int]
    _lookups: int
    _hits: int
    _inbox: object
    _leases_on: bool
    _gens: array | None  # type: ignore[type-arg]
    _alloc_serial: int

    if TYPE_CHECKING:  # implemented by the other parts of the pool

        def _apply_completions(self) -> None: ...
        def _take(self, n: int) -> list[KVCacheBlock]: ...
        def _touch(self, blocks: list[KVCacheBlock]) -> None: ...
        def _enqueue_free(self, blocks: list[KVCacheBlock]) -> None: ...
        def _unhold(self, block_id: int) -> None: ...
        def _fence(
            self, groups: Iterable[tuple[Sequence[KVCacheBlock], AccessKind]], st: StreamState
        ) -> Fence: ...
        def _record(self, blocks: Iterable[KVCacheBlock], token: Token, access: AccessKind) -> None: ...
        def _drop_keys(self, b: KVCacheBlock, reason: str | None = None) -> list[Hashable]: ...
        def _unwritten(self, blocks: Iterable[KVCacheBlock]) -> None: ...
        def get_num_free_blocks(self) -> int: ...

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

    def _check_fresh(self, blocks: list[KVCacheBlock], generations: Iterable[object], what: str) -> None:
        """Raise :class:`StaleBlockError` if a block of ``blocks`` (own
        blocks; null placeholders skipped) has a generation other than the
        one ``generations`` (aligned with ``blocks``, as
        :meth:`generations` returned it) records: it was allocated again
        since. Changes nothing. O(len(blocks)).

        Raises:
            InvalidArgumentError: ``generations`` is not an iterable of ints
                as long as ``blocks``.
            StaleBlockError: the first stale block.
        """
        gens = generations if type(generations) is list else _as_list(generations, "generations")
        if len(gens) != len(blocks):  # type: ignore[arg-type]
            raise InvalidArgumentError(
                f"{what}: {len(gens)} generations for {len(blocks)} blocks; "  # type: ignore[arg-type]
                "pass the tuple pool.generations(blocks) returned for this table"
            )
        now = self._gens
        if now is not None and [now[b.block_id] for b in blocks] == gens and set(map(type, gens)) <= {int}:  # type: ignore[arg-type]
            return  # the usual answer, in one pass and two C-level comparisons
        null = self.null_block
        for b, g in zip(blocks, gens):  # type: ignore[call-overload]
            if type(g) is not int:
                raise InvalidArgumentError(f"{what}: a generation must be an int, got {g!r}")
            if b is null:
                continue
            cur = now[b.block_id] if now is not None else 0
            if cur != g:
                raise StaleBlockError(
                    f"{what}: block {b.block_id} was freed and allocated again since the block "
                    f"table was taken (generation {cur} now, the table has {g}): it holds "
                    "another request's data",
                    b.block_id,
                    cur,
                    g,
                )

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
