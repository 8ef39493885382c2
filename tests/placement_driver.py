"""One random-sequence driver for the placement property tests: the same
allocate (compute or h2d) / publish / free (by a running step or none) /
complete sequence applied to several pools side by side."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from blockpool import HazardAwareBlockPool
from blockpool.core.block import KVCacheBlock

Ops = Sequence[tuple[int, int, int]]


def drive(
    pools: Sequence[HazardAwareBlockPool],
    ops: Ops,
    on_alloc: Callable[[int, list[KVCacheBlock]], None] | None = None,
    after_op: Callable[[], None] | None = None,
) -> None:
    """Apply ``ops`` (``(op, n, key)``: 0 allocate ``n`` and publish keys
    ``key..key+n-1`` unless one is cached, 1 free a held table tagged by a
    new step or none, 2 complete the oldest step, 3 free the newest table
    untagged) to every pool, in step. After each call: ``check()``, and
    every allocation hands out ``n`` distinct fresh blocks (unkeyed, ref
    count 1); ``on_alloc(pool index, blocks)`` for more; ``after_op()``
    once all pools took an op."""
    held: list[list[list[KVCacheBlock]]] = [[] for _ in pools]
    toks: list[list] = [[] for _ in pools]
    for op, n, key in ops:
        for i, p in enumerate(pools):
            mine = held[i]
            if op == 0 and p.get_num_free_blocks() >= n:
                new, _fence = p.allocate_for(n, "h2d" if key % 2 else "compute")
                assert len(new) == n and len({b.block_id for b in new}) == n
                assert all(b.block_hash is None and b.ref_cnt == 1 for b in new)
                if on_alloc is not None:
                    on_alloc(i, new)
                if not any(p.get_cached_block(key + j) for j in range(n)):
                    p.cache_full_blocks(new, [key + j for j in range(n)], 0, n, 16)
                mine.append(new)
            elif op == 1 and mine:
                t = p.issue("compute") if key % 3 else None
                if t is not None:
                    toks[i].append(t)
                p.free_blocks(mine.pop(n % len(mine)), token=t)
            elif op == 2 and toks[i]:
                p.complete(toks[i].pop(0))
            elif op == 3 and mine:
                p.free_blocks(mine.pop(), token=None)
            p.check()
        if after_op is not None:
            after_op()
