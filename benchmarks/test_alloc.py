"""Allocation and free: ``get_new_blocks(n)`` then ``free_blocks``, n = 1, 16, 256.

Three modes (the ``scenario`` of each row):

- ``caching off``: a pool without prefix caching;
- ``caching on``: prefix caching on, blocks never cached (freed unkeyed
  blocks go back to the front of the queue and are reused: no eviction);
- ``caching on, evicting``: every free block is cached, so each allocation
  evicts its blocks' keys (the free queue is LRU); the cycle re-publishes
  the blocks (``cache_full_blocks``) before freeing them, so the next
  allocation evicts again. This cycle therefore times three calls.

Each pool is 4,097 blocks (4,096 usable). ``on`` frees with a live
``compute`` token (the last enqueued step, as a scheduler does), which
records a read in every block's shadow and checks it for pending host
accesses; ``off`` makes the same calls with hazard tracking off; ``vllm``
calls vLLM's ``free_blocks(blocks)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from _pools import BLOCK_SIZE, Request, hashes, keys36, make_pool

POOL_BLOCKS = 4097


def _cycle(kind: str, n: int, mode: str) -> tuple[Callable[[], Any], Any]:
    pool = make_pool(kind, POOL_BLOCKS, caching=(mode != "caching off"))
    usable = POOL_BLOCKS - 1
    tok = pool.issue("compute") if kind != "vllm" else None
    if mode != "caching on, evicting":
        if kind == "vllm":

            def cycle() -> None:
                pool.free_blocks(pool.get_new_blocks(n))

        else:

            def cycle() -> None:
                pool.free_blocks(pool.get_new_blocks(n), tok)

        return cycle, pool
    # Evicting: publish every block (ids 1..usable, the queue's order), then
    # each cycle takes the n least recently used blocks, whose ids are known:
    # chunk c holds ids c*n+1 .. c*n+n. The key lists per chunk are made here.
    hs = hashes(usable, salt="alloc")
    chunks = usable // n
    everything = pool.get_new_blocks(usable)
    if kind == "vllm":
        pool.cache_full_blocks(Request(hs), everything, 0, usable, BLOCK_SIZE, 0)
        reqs = [Request(hs[c * n : c * n + n]) for c in range(chunks)]
    else:
        pool.cache_full_blocks(everything, keys36(hs), 0, usable, BLOCK_SIZE)
        keys = [keys36(hs[c * n : c * n + n]) for c in range(chunks)]
    pool.free_blocks(everything)
    nxt = itertools.cycle(range(chunks)).__next__
    if kind == "vllm":

        def cycle() -> None:
            blocks = pool.get_new_blocks(n)
            pool.cache_full_blocks(reqs[nxt()], blocks, 0, n, BLOCK_SIZE, 0)
            pool.free_blocks(blocks)

    else:

        def cycle() -> None:
            blocks = pool.get_new_blocks(n)
            pool.cache_full_blocks(blocks, keys[nxt()], 0, n, BLOCK_SIZE)
            pool.free_blocks(blocks, tok)

    return cycle, pool


@pytest.mark.parametrize("mode", ["caching off", "caching on", "caching on, evicting"])
@pytest.mark.parametrize("n", [1, 16, 256])
def test_alloc_free(benchmark: Any, kind: str, n: int, mode: str) -> None:
    cycle, pool = _cycle(kind, n, mode)
    for _ in range(3):  # warm up, and check the steady state before timing it
        cycle()
    before = pool.get_num_free_blocks()
    cycle()
    assert pool.get_num_free_blocks() == before == POOL_BLOCKS - 1
    if mode == "caching on, evicting" and kind != "vllm":
        assert pool.stats().evictions >= 4 * n
    scenario = (
        f"get_new_blocks({n}) + free_blocks, {mode}"
        if mode != "caching on, evicting"
        else (f"get_new_blocks({n}) + cache_full_blocks + free_blocks, evicting")
    )
    benchmark.group = scenario
    benchmark.extra_info.update(scenario=scenario, kind=kind, blocks_per_call=n, section="alloc")
    benchmark(cycle)
