"""Scale: ns per block at about 10^4, 10^5 and 10^6 blocks.

``hot set``: ``get_new_blocks(256)`` + ``free_blocks`` with prefix caching
on and no keys: freed unkeyed blocks go back to the front, so the same 256
blocks cycle whatever the pool size. This isolates the allocator's own
scaling (every operation is O(1) per block; nothing walks the pool).

``LRU churn``: every usable block is cached; each call takes the 256 least recently used
blocks (``get_new_blocks(256)``, evicting their keys), publishes them again
(``cache_full_blocks``) and frees them (to the LRU tail), so successive
calls walk the whole pool and every block, key and map entry is touched
once per walk. The usable block count is rounded down to a multiple of 256
(9,984 / 99,840 / 999,936). Two queue orders:

- ``address order``: the LRU order is the order the blocks were created in
  (memory order: the hardware prefetcher helps);
- ``shuffled``: the LRU order is a seeded random permutation, as in a
  server that has run for a while (every block a cache miss at 10^6).

A round walks a quarter of the pool (all of it at 10^4); pytest-benchmark
reports time per call, and ``blocks_per_call`` (256) turns it into ns per
block.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
from _pools import BLOCK_SIZE, Request, hashes, keys36, make_pool

N = 256


@functools.cache
def _hashes(usable: int) -> list[bytes]:
    return hashes(usable, salt="scale")


def _churn(kind: str, usable: int, order: str) -> Callable[[], None]:
    pool = make_pool(kind, usable + 1)
    hs = _hashes(usable)
    every = pool.get_new_blocks(usable)  # ids 1..usable, in order
    if kind == "vllm":
        pool.cache_full_blocks(Request(hs), every, 0, usable, BLOCK_SIZE, 0)
    else:
        pool.cache_full_blocks(every, keys36(hs), 0, usable, BLOCK_SIZE)
    ids = list(range(1, usable + 1))
    if order == "shuffled":
        random.Random(usable).shuffle(ids)
    queue = [pool.blocks[i] for i in ids]
    tok = pool.issue("compute") if kind != "vllm" else None
    if tok is None:
        pool.free_blocks(queue)
    else:
        pool.free_blocks(queue, tok)
    chunks = [ids[c : c + N] for c in range(0, usable, N)]
    nxt = itertools.cycle(range(len(chunks))).__next__
    if kind == "vllm":
        reqs = [Request([hs[i - 1] for i in chunk]) for chunk in chunks]

        def cycle() -> None:
            blocks = pool.get_new_blocks(N)
            pool.cache_full_blocks(reqs[nxt()], blocks, 0, N, BLOCK_SIZE, 0)
            pool.free_blocks(blocks)

    else:
        k36 = keys36(hs)
        keys = [[k36[i - 1] for i in chunk] for chunk in chunks]

        def cycle() -> None:
            blocks = pool.get_new_blocks(N)
            pool.cache_full_blocks(blocks, keys[nxt()], 0, N, BLOCK_SIZE)
            pool.free_blocks(blocks, tok)

    # Check the premise once: a call takes the next chunk, in queue order.
    assert _front_ids(pool, N) == chunks[0]
    cycle()
    assert _front_ids(pool, N) == chunks[1 % len(chunks)]
    return cycle


def _front_ids(pool: Any, n: int) -> list[int]:
    q = pool.free_block_queue
    b = getattr(q, "head", None) or q.fake_free_list_head
    out = []
    for _ in range(n):
        b = b.next_free_block
        out.append(b.block_id)
    return out


SIZES = pytest.mark.parametrize("usable", [9_984, 99_840, 999_936], ids=["1e4", "1e5", "1e6"])


@SIZES
def test_scale_hot_set(benchmark: Any, kind: str, usable: int) -> None:
    pool = make_pool(kind, usable + 1)
    tok = pool.issue("compute") if kind != "vllm" else None
    if tok is None:

        def cycle() -> None:
            pool.free_blocks(pool.get_new_blocks(N))

    else:

        def cycle() -> None:
            pool.free_blocks(pool.get_new_blocks(N), tok)

    cycle()
    assert pool.get_num_free_blocks() == usable
    scenario = f"hot set, ns per block, {usable:,} blocks"
    benchmark.group = "scale, hot set"
    benchmark.extra_info.update(
        scenario=scenario, kind=kind, blocks_per_call=N, section="scale", blocks=usable, order="hot set"
    )
    benchmark(cycle)


@pytest.mark.parametrize("order", ["address order", "shuffled"])
@SIZES
def test_scale_churn(benchmark: Any, kind: str, usable: int, order: str) -> None:
    cycle = _churn(kind, usable, order)
    chunks = usable // N
    iterations = chunks if chunks < 40 else chunks // 4
    rounds = max(8, 2000 // iterations)
    scenario = f"LRU churn, ns per block, {order}, {usable:,} blocks"
    benchmark.group = f"scale, {order}"
    benchmark.extra_info.update(
        scenario=scenario, kind=kind, blocks_per_call=N, section="scale", blocks=usable, order=order
    )
    benchmark.pedantic(cycle, rounds=rounds, iterations=iterations, warmup_rounds=1)
