"""Counters and snapshots of a pool (value types)."""

from __future__ import annotations

import attrs

__all__ = ["PoolSnapshot", "PoolStats"]


@attrs.frozen(slots=True)
class PoolStats:
    """Counts returned by :meth:`HazardAwareBlockPool.stats`.

    Attributes:
        num_blocks: Usable blocks (the null block excluded).
        free: Blocks in the free queue (allocatable; includes free cached blocks).
        held: Blocks with ref count 0 held back until a host-engine access ends.
        used: Blocks with ref count > 0.
        cached_blocks: Blocks holding at least one prefix-cache key.
        cached_keys: Distinct prefix-cache keys.
        lookups, hits: ``get_cached_block`` calls and the ones that found a block.
        evictions: Blocks whose keys were dropped to reuse them (or by ``evict_blocks``).
        fences: Fences handed out; ``fence_tokens``: their tokens in all;
        empty_fences: fences with no token; host_wait_fences: fences with
            ``needs_host_wait``; max_fence_size: the largest one.
        leases_expired: Held blocks whose lease ran out (still quarantined).
        abandoned: Tokens declared dead by :meth:`~HazardAwareBlockPool.abandon`.
        failed_tokens: Tokens ended by ``fail``.
        unpublished_failed_loads: ``cache_*`` requests skipped because the
            block's load failed.
        loads_begun, stores_begun: Transfers begun (``begin_load``,
            ``begin_store``; refused ones are not counted);
            transfer_fences_nonempty: those whose fence named a token.
    """

    num_blocks: int
    free: int
    held: int
    used: int
    cached_blocks: int
    cached_keys: int
    lookups: int
    hits: int
    evictions: int
    fences: int
    fence_tokens: int
    empty_fences: int
    host_wait_fences: int
    max_fence_size: int
    leases_expired: int
    abandoned: int
    failed_tokens: int
    unpublished_failed_loads: int
    loads_begun: int
    stores_begun: int
    transfer_fences_nonempty: int


@attrs.frozen(slots=True)
class PoolSnapshot:
    """Everything observable about a pool, for "nothing changed" checks.

    Compared by value: two snapshots are equal when ref counts, free queue
    order, held blocks, cache map, shadows, events, marks and counters are.
    """

    ref_counts: tuple[int, ...]
    free_queue: tuple[int, ...]
    held: tuple[tuple[int, tuple[str, ...]], ...]
    cache: tuple[tuple[int, str, int | None], ...]
    shadows: tuple[tuple[int, str, tuple[str, ...]], ...]
    events: tuple[object, ...]
    marks: tuple[
        tuple[str, int, int, int, tuple[int, ...]], ...
    ]  # (stream, last seq, mark, last write, done)
    clocks: tuple[tuple[str, tuple[tuple[str, int], ...], tuple[str, ...]], ...]
    counters: tuple[tuple[str, int], ...]
