"""Prefix hits: ``touch`` of a cached chain of L blocks (L = 16, 256).

The chain was allocated, published (``cache_full_blocks``) and freed, so
its blocks sit in the free queue (the LRU tail) with their keys: ``touch``
takes each out of the queue and counts the reference, as a prefix hit does.
The untimed setup of each round frees the chain again (with a live
``compute`` token for our pools). 16,385-block pools.

``hit with fence`` (blockpool only): the same hit as the hazard-aware call
``allocate_for(0, "compute", hits=chain)`` (touch plus the RAW fence on the
hits' pending writes), against the same call with hazard tracking off.
"""

from __future__ import annotations

from typing import Any

import pytest
from _pools import BLOCK_SIZE, Request, hashes, keys36, make_pool

POOL_BLOCKS = 16385


def _chain(kind: str, length: int) -> tuple[Any, list[Any], Any]:
    pool = make_pool(kind, POOL_BLOCKS)
    hs = hashes(length, salt="prefix")
    chain = pool.get_new_blocks(length)
    if kind == "vllm":
        pool.cache_full_blocks(Request(hs), chain, 0, length, BLOCK_SIZE, 0)
    else:
        pool.cache_full_blocks(chain, keys36(hs), 0, length, BLOCK_SIZE)
    tok = pool.issue("compute") if kind != "vllm" else None
    return pool, chain, tok


def _free(pool: Any, chain: list[Any], tok: Any) -> None:
    rev = chain[::-1]  # vLLM frees a block table tail first
    if tok is None:
        pool.free_blocks(rev)
    else:
        pool.free_blocks(rev, tok)


@pytest.mark.parametrize("length", [16, 256])
def test_touch_cached_chain(benchmark: Any, kind: str, length: int) -> None:
    pool, chain, tok = _chain(kind, length)
    _free(pool, chain, tok)
    pool.touch(chain)
    assert all(b.ref_cnt == 1 for b in chain)
    scenario = f"touch of a cached chain of {length} (prefix hit)"
    benchmark.group = scenario
    benchmark.extra_info.update(scenario=scenario, kind=kind, blocks_per_call=length, section="prefix")
    rounds = 4000 if length == 16 else 1500
    benchmark.pedantic(
        pool.touch, args=(chain,), setup=lambda: _free(pool, chain, tok), rounds=rounds, warmup_rounds=20
    )
    assert all(b.ref_cnt == 1 for b in chain)


@pytest.mark.parametrize("length", [16, 256])
def test_hit_with_fence(benchmark: Any, ours: str, length: int) -> None:
    from blockpool import AccessKind

    pool, chain, tok = _chain(ours, length)

    def setup() -> None:
        # A load (h2d) wrote the chain and has not ended: the hit's fence
        # names it (RAW). A new load each round, or compute would already
        # be ordered after the previous one.
        pool.tag(chain, pool.issue("h2d"), AccessKind.WRITE)
        _free(pool, chain, tok)

    setup()
    new, fence = pool.allocate_for(0, "compute", hits=chain)
    assert new == [] and (bool(fence) == (ours == "on"))
    scenario = f"prefix hit with fence: allocate_for(0, hits=chain of {length})"
    benchmark.group = scenario
    benchmark.extra_info.update(scenario=scenario, kind=ours, blocks_per_call=length, section="prefix")
    rounds = 4000 if length == 16 else 1500

    def hit() -> None:
        pool.allocate_for(0, "compute", hits=chain)

    benchmark.pedantic(hit, setup=setup, rounds=rounds, warmup_rounds=20)
