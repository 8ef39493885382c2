"""Eviction policy and placement: cost per block against the default, same run.

Every row is blockpool with hazards on; the ``kind`` of a row is the knob's
value, and the report divides each median by the baseline's (``lru``)
median of the same scenario, measured in the same run.

- **eviction** (``eviction=lru | s3fifo | 2q``): a pool of 4,097 blocks, all
  cached. One cycle: ``get_new_blocks(16)`` (evicts 16 keys: the policy
  chooses the victims), ``cache_full_blocks`` of them, a prefix hit on the
  16 blocks published two cycles earlier (``touch``: the policy counts the
  hit), then ``free_blocks`` of both (the policy files each block in its
  segment). 32 blocks handed back per cycle; reported per block.
- **placement** (``placement=lru | ready_first | ready_first_cached |
  runs | runs_cached``):
  one ``allocate_for(16, "h2d")`` (fence included) on a fresh pool of
  4,096 cached free blocks, freed 16 at a time by ``compute`` steps still
  running (a waiting consumer becomes ordered after what it waited on, so
  each round needs a fresh pool: built in pytest-benchmark's ``setup``,
  not timed; 200 rounds of one call). Three queues (:data:`QUEUES`): all
  cached, the 16 coldest ready (``lru`` takes them too; ``ready_first``
  finds no unkeyed block and stops at once; ``ready_first_cached`` takes
  them after looking at 16 blocks and evicts their keys on the slower
  path that sends events); all cached, none ready (``ready_first_cached``
  looks at ``n + CACHED_SCAN`` = 1,040 blocks, 65 distinct shadows, then
  takes the front: its worst case); all unkeyed, 16 ready behind 1,024 in
  flight (both ready-first modes look at 1,040 blocks and take the 16;
  ``lru`` takes the front and waits). ``runs`` looks at the unkeyed front
  (none on the cached queues: it takes LRU's 16 and sorts them; 1,040
  blocks sorted into runs on the unkeyed one); ``runs_cached`` also sorts
  the 1,040 coldest cached blocks into runs: its worst case.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from _pools import BLOCK_SIZE, STREAMS, hashes, keys36

from blockpool import HazardAwareBlockPool

POOL_BLOCKS = 4097
N = 16
ROUNDS = 200
EVICTIONS = ("lru", "s3fifo", "2q")
PLACEMENTS = ("lru", "ready_first", "ready_first_cached", "runs", "runs_cached")


def _eviction_cycle(eviction: str) -> tuple[Callable[[], None], HazardAwareBlockPool]:
    pool = HazardAwareBlockPool(POOL_BLOCKS, streams=STREAMS, eviction=eviction)
    usable = POOL_BLOCKS - 1
    hs = keys36(hashes(usable * 4, salt="policy"))
    everything = pool.get_new_blocks(usable)
    pool.cache_full_blocks(everything, hs[:usable], 0, usable, BLOCK_SIZE)
    tok = pool.issue("compute")
    pool.free_blocks(everything, tok)
    chunks = [hs[i : i + N] for i in range(0, len(hs), N)]
    nxt = itertools.cycle(range(len(chunks))).__next__
    recent: list[list[Any]] = []

    def cycle() -> None:
        blocks = pool.get_new_blocks(N)
        pool.cache_full_blocks(blocks, chunks[nxt()], 0, N, BLOCK_SIZE)
        recent.append(blocks)
        hit = recent.pop(0) if len(recent) > 2 else []
        live = [b for b in hit if b.block_hash is not None and pool.get_cached_block(b.block_hash) is b]
        if live:
            pool.touch(live)
        pool.free_blocks(blocks + live, tok)

    return cycle, pool


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_eviction_cost(benchmark: Any, eviction: str) -> None:
    cycle, pool = _eviction_cycle(eviction)
    for _ in range(8):
        cycle()
    before = pool.stats().evictions
    cycle()
    assert pool.stats().evictions == before + N
    assert pool.get_num_free_blocks() == POOL_BLOCKS - 1
    scenario = f"eviction: get_new_blocks({N}) evicting + cache_full_blocks + touch({N} hits) + free_blocks, per block"
    benchmark.group = scenario
    benchmark.extra_info.update(
        scenario=scenario, kind=eviction, blocks_per_call=2 * N, section="policy", baseline="lru"
    )
    benchmark(cycle)


QUEUES = {
    "cached-coldest-ready": "4,096 cached free blocks, the 16 coldest ready",
    "cached-none-ready": "4,096 cached free blocks, none ready (the window scanned whole)",
    "unkeyed-ready-behind-1024": "4,096 unkeyed free blocks, 16 ready behind 1,024 in flight",
}


def _placement_pool(placement: str, queue: str) -> HazardAwareBlockPool:
    """4,096 free blocks, freed 16 at a time by successive ``compute``
    steps that are all still running (distinct shadows, as a scheduler
    frees request by request), except 16 freed by no step (ready), placed
    as ``queue`` says (see :data:`QUEUES`)."""
    pool = HazardAwareBlockPool(POOL_BLOCKS, streams=STREAMS, placement=placement)
    usable = POOL_BLOCKS - 1
    everything = pool.get_new_blocks(usable)
    if queue.startswith("cached"):
        pool.cache_full_blocks(everything, _PLACE_KEYS, 0, usable, BLOCK_SIZE)
        ready_at = 0 if queue == "cached-coldest-ready" else None
    else:
        ready_at = usable - 1024 - N  # unkeyed blocks are prepended: the last freed lead
    for i in range(0, usable, N):
        pool.free_blocks(everything[i : i + N], token=None if i == ready_at else pool.issue("compute"))
    return pool


_PLACE_KEYS = keys36(hashes(POOL_BLOCKS - 1, salt="place"))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("queue", list(QUEUES))
def test_placement_cost(benchmark: Any, placement: str, queue: str) -> None:
    pool = _placement_pool(placement, queue)
    blocks, fence = pool.allocate_for(N, "h2d")
    finds = (placement == "ready_first_cached" and queue != "cached-none-ready") or (
        placement == "ready_first" and queue.startswith("unkeyed")
    )
    if placement.startswith("runs"):  # one run of 16 ids, ascending
        ids = [b.block_id for b in blocks]
        assert ids == list(range(ids[0], ids[0] + N)), (placement, queue, ids)
    else:
        assert (fence.tokens == ()) == (finds or queue == "cached-coldest-ready"), (placement, queue, fence)
    assert pool.placed_ready == (N if finds else 0)
    pool.free_blocks(blocks, token=None)
    assert pool.get_num_free_blocks() == POOL_BLOCKS - 1

    def setup() -> tuple[tuple[HazardAwareBlockPool], dict[str, Any]]:
        return (_placement_pool(placement, queue),), {}

    def alloc(p: HazardAwareBlockPool) -> None:
        p.allocate_for(N, "h2d")

    scenario = f"placement: allocate_for({N}, h2d) on {QUEUES[queue]}, per block"
    benchmark.group = scenario
    benchmark.extra_info.update(
        scenario=scenario, kind=placement, blocks_per_call=N, section="policy", baseline="lru"
    )
    benchmark.pedantic(alloc, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=2)
