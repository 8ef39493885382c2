"""Eviction policies (``eviction=``) and ready-first placement (``placement=``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockpool import HazardAwareBlockPool, StreamKind
from blockpool.core.block import FreeBlockQueue
from blockpool.core.errors import BlockPoolError, InvalidArgumentError
from blockpool.core.eviction import EVICTION_POLICIES, UnknownEvictionPolicyError
from tests.placement_driver import drive

STREAMS = {"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE, "rdma": StreamKind.HOST}


def ids(blocks):
    return [b.block_id for b in blocks]


def cached_pool(eviction: str, n: int = 8) -> tuple[HazardAwareBlockPool, list]:
    """A pool of n usable blocks, all published under keys 100.. and in use."""
    p = HazardAwareBlockPool(n + 1, eviction=eviction, streams=STREAMS)
    bl = p.get_new_blocks(n)
    p.cache_full_blocks(bl, list(range(100, 100 + n)), 0, n, 16)
    return p, bl


def test_lru_is_the_plain_queue_and_the_class_touch():
    p = HazardAwareBlockPool(9)
    assert type(p.free_block_queue) is FreeBlockQueue
    assert "_touch" not in getattr(
        p, "__dict__", {}
    )  # no per-instance hook (a compiled pool has no __dict__)
    assert p.eviction == "lru" and p.placement == "lru"


@pytest.mark.parametrize("bad", ["LRU", "fifo", "", None, 3])
def test_unknown_eviction_or_placement_is_typed(bad):
    with pytest.raises(UnknownEvictionPolicyError) as ei:
        HazardAwareBlockPool(9, eviction=bad)
    assert isinstance(ei.value, InvalidArgumentError) and isinstance(ei.value, BlockPoolError)
    with pytest.raises(UnknownEvictionPolicyError):
        HazardAwareBlockPool(9, placement=bad)


def test_names():
    assert list(EVICTION_POLICIES) == ["lru", "s3fifo", "2q"]


@pytest.mark.parametrize("eviction", ["lru", "2q", "s3fifo"])
def test_hit_blocks_survive_under_non_lru(eviction):
    p, bl = cached_pool(eviction)
    p.touch(bl[:2])  # blocks 1, 2 are prefix hits
    p.free_blocks(bl[:2], token=None)
    p.free_blocks(bl, token=None)  # all free; 1, 2 were hit
    assert ids(p.free_block_queue) == (
        [1, 2, 3, 4, 5, 6, 7, 8] if eviction == "lru" else [3, 4, 5, 6, 7, 8, 1, 2]
    )
    taken = p.get_new_blocks(3)
    assert ids(taken) == ([1, 2, 3] if eviction == "lru" else [3, 4, 5])
    assert p.get_cached_block(101) is (None if eviction == "lru" else p.blocks[2])
    assert (p.get_cached_block(100) is None) == (eviction == "lru")
    assert p.stats().evictions == 3
    p.check()


def test_unkeyed_blocks_first_under_every_policy():
    for ev in EVICTION_POLICIES:
        p, bl = cached_pool(ev, 4)
        p.free_blocks(bl, token=None)  # cached: 1..4 at the back
        p.evict_blocks([3])  # key dropped in place
        got = p.get_new_blocks(4)
        assert sorted(ids(got)) == [1, 2, 3, 4]
        p.check()


def test_2q_never_hit_first_then_hit_blocks_in_lru_order():
    p, bl = cached_pool("2q", 6)
    p.touch([bl[4]])
    p.touch([bl[1]])  # hits on 5 and 2
    p.free_blocks([bl[4], bl[1]], token=None)
    p.free_blocks([bl[5], bl[4], bl[3], bl[2], bl[1], bl[0]], token=None)  # freed 6,5,4,3,2,1
    q = p.free_block_queue
    assert ids(q) == [6, 4, 3, 1, 5, 2]
    assert (q.n_small, q.n_main) == (4, 2)
    assert ids(p.get_new_blocks(5)) == [6, 4, 3, 1, 5]
    p.check()


def test_s3fifo_ghost_sends_a_returning_key_to_main():
    p, bl = cached_pool("s3fifo", 4)
    p.free_blocks(bl, token=None)  # 1..4 never hit: all in S
    q = p.free_block_queue
    assert (q.n_small, q.n_main) == (4, 0)
    (b,) = p.get_new_blocks(1)  # evicts block 1 (key 100) from S: 100 enters the ghost
    assert b.block_id == 1 and list(q.ghost) == [100]
    p.cache_full_blocks([b], [100], 0, 1, 16)  # recomputed and republished
    p.free_blocks([b], token=None)
    assert (q.n_small, q.n_main) == (3, 1) and list(q.ghost) == []
    assert ids(q) == [2, 3, 4, 1]
    p.check()


def test_s3fifo_main_reinserts_hit_blocks_and_small_share():
    p, bl = cached_pool("s3fifo", 10)
    for b in bl[:9]:
        p.touch([b])  # 1..9 hit once
    p.free_blocks(bl[:9], token=None)  # back to ref 1
    p.free_blocks(bl, token=None)  # 1..9 to M (hit), 10 to S
    q = p.free_block_queue
    assert (q.n_small, q.n_main) == (1, 9)
    assert ids(q) == [10, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # S holds 1 of 10 (>= 10%): S's head goes first.
    assert ids(p.get_new_blocks(1)) == [10]
    # S empty: M's head 1 was hit, so it is reinserted (count 1 -> 0) and so
    # is every block after it; the first block met with count 0 is 1 again.
    assert ids(p.get_new_blocks(1)) == [1]
    assert ids(q) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert q.freq == {}
    p.check()


@pytest.mark.parametrize("eviction", ["s3fifo", "2q"])
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.integers(0, 40)), max_size=60))
def test_policy_pools_keep_every_invariant(eviction, ops):
    """Random allocate / publish / hit / free / evict sequences: each pool
    passes check() after every call, and its free count is exactly the
    usable blocks minus those the sequence still references. (Not "the free
    count of an LRU pool driven the same way": a policy keeps other keys, so
    later lookups hit other blocks and the two pools' references differ.)"""
    pools = [HazardAwareBlockPool(17, eviction=e, streams=STREAMS) for e in ("lru", eviction)]
    held: list[list] = [[], []]
    for op, n, key in ops:
        for i, p in enumerate(pools):
            mine = held[i]
            hits = [b for k in range(key, key + 3) if (b := p.get_cached_block(k)) is not None][:1]
            if op == 0 and p.get_num_free_blocks() >= n + sum(1 for b in hits if b.ref_cnt == 0):
                # (a free hit stops being free: it counts against the n new blocks)
                new, _ = p.allocate_for(n, "compute", hits=hits)
                p.cache_full_blocks(new, [key + j for j in range(n)], 0, n, 16) if all(
                    b.block_hash is None for b in new
                ) and not any(p.get_cached_block(key + j) for j in range(n)) else None
                mine.append(hits + new)
            elif op == 1 and mine:
                p.free_blocks(mine.pop(n % len(mine)), token=None)
            elif op == 2:
                b = p.get_cached_block(key)
                if b is not None:
                    p.touch([b])
                    mine.append([b])
            elif op == 3:
                p.evict_blocks([1 + key % 16])
            elif op == 4 and not mine:
                p.reset_prefix_cache()
            p.check()
            assert p.get_num_free_blocks() == 16 - len({b.block_id for lst in mine for b in lst})


# -- placement -----------------------------------------------------------------


def _two_generations(placement: str) -> tuple[HazardAwareBlockPool, object]:
    """Blocks 1, 2 freed long ago (their step ended); blocks 3, 4 freed while
    step 2 still reads them (they sit at the queue's front)."""
    p = HazardAwareBlockPool(9, streams=STREAMS, placement=placement)
    old, _ = p.allocate_for(2, "compute")
    e1 = p.issue("compute")
    young, _ = p.allocate_for(2, "compute")
    e2 = p.issue("compute")
    p.free_blocks(old, token=e1)
    p.complete(e1)
    p.free_blocks(young, token=e2)
    return p, e2


def test_lru_placement_takes_the_front_and_waits():
    p, _e2 = _two_generations("lru")
    assert ids(p.free_block_queue)[:4] == [3, 4, 1, 2]
    got, fence = p.allocate_for(2, "h2d")
    assert ids(got) == [3, 4] and [str(t) for t in fence] == ["compute:2"]


def test_ready_first_takes_ready_blocks_and_waits_on_nothing():
    p, _e2 = _two_generations("ready_first")
    got, fence = p.allocate_for(2, "h2d")
    assert ids(got) == [1, 2] and fence.tokens == ()
    assert p.placed_ready == 6  # 2 each for the two compute allocations, then these 2
    # Not enough ready blocks: the ready ones first, then the queue's front.
    got2, fence2 = p.allocate_for(6, "h2d")  # 5..8 never used: ready
    assert ids(got2) == [5, 6, 7, 8, 3, 4] and [str(t) for t in fence2] == ["compute:2"]
    p.check()


def test_ready_first_counts_waits_the_consumer_already_made():
    p, _e2 = _two_generations("ready_first")
    p.fence_for(p.blocks[3:5], "h2d")  # h2d now waits on compute:2
    got, fence = p.allocate_for(4, "h2d")
    assert ids(got) == [3, 4, 1, 2] and fence.tokens == ()


def test_ready_first_on_the_consumer_own_stream():
    p, _e2 = _two_generations("ready_first")
    got, fence = p.allocate_for(2, "compute")  # compute is ordered after its own steps
    assert ids(got) == [3, 4] and fence.tokens == ()


def test_ready_first_leaves_cached_blocks_in_lru_order():
    p = HazardAwareBlockPool(5, streams=STREAMS, placement="ready_first")
    bl = p.get_new_blocks(4)
    p.cache_full_blocks(bl, [10, 11, 12, 13], 0, 4, 16)
    e = p.issue("compute")
    p.free_blocks(bl[:2], token=e)  # cached, in flight
    p.free_blocks(bl[2:], token=None)  # cached, ready
    got, fence = p.allocate_for(2, "h2d")
    assert ids(got) == [1, 2] and [str(t) for t in fence] == ["compute:1"]


# -- the opt-in for cached blocks (placement="ready_first_cached") -------------


def _cached_generations(placement: str, eviction: str = "lru") -> HazardAwareBlockPool:
    """8 usable blocks, all cached (keys 10..17): 1, 2 freed while step 1
    still reads them (coldest), then 3, 4 freed by an ended step, then 5..8
    freed while step 1 reads them (hottest). No unkeyed block is free."""
    p = HazardAwareBlockPool(
        9, streams=STREAMS, placement=placement, eviction=eviction, enable_kv_cache_events=True
    )
    bl = p.get_new_blocks(8)
    p.cache_full_blocks(bl, list(range(10, 18)), 0, 8, 16)
    e0 = p.issue("compute")
    e1 = p.issue("compute")
    p.free_blocks(bl[2:4], token=e0)
    p.complete(e0)
    p.free_blocks(bl[0:2], token=e1)
    p.free_blocks(bl[4:], token=e1)
    # LRU order: 3, 4 (freed first), then 1, 2, then 5..8.
    p.take_events()
    return p


def test_ready_first_cached_takes_the_coldest_ready_cached_blocks():
    from blockpool.core.events import BlockRemoved

    p = _cached_generations("ready_first_cached")
    assert ids(p.free_block_queue) == [3, 4, 1, 2, 5, 6, 7, 8]
    got, fence = p.allocate_for(2, "h2d")
    assert ids(got) == [3, 4] and fence.tokens == ()
    assert p.take_events() == [BlockRemoved((12,), "GPU"), BlockRemoved((13,), "GPU")]
    assert p.get_cached_block(12) is None and p.get_cached_block(10) is p.blocks[1]
    p.check()


def test_ready_first_cached_skips_not_ready_cold_blocks():
    p = HazardAwareBlockPool(9, streams=STREAMS, placement="ready_first_cached", enable_kv_cache_events=True)
    bl = p.get_new_blocks(8)
    p.cache_full_blocks(bl, list(range(10, 18)), 0, 8, 16)
    e = p.issue("compute")
    p.free_blocks(bl[:4], token=e)  # coldest: in flight
    p.free_blocks(bl[4:], token=None)  # hotter: ready
    p.take_events()
    before = p.stats().evictions
    got, fence = p.allocate_for(3, "h2d")
    assert ids(got) == [5, 6, 7] and fence.tokens == ()
    assert [e.block_hashes for e in p.take_events()] == [(14,), (15,), (16,)]
    assert p.placed_cached == 3 and p.placed_ready == 3
    assert ids(p.free_block_queue) == [1, 2, 3, 4, 8]
    assert p.stats().evictions == before + 3
    # Plain ready_first keeps LRU order among cached blocks: it takes 1..3 and waits.
    p2 = HazardAwareBlockPool(9, streams=STREAMS, placement="ready_first")
    bl2 = p2.get_new_blocks(8)
    p2.cache_full_blocks(bl2, list(range(10, 18)), 0, 8, 16)
    e2 = p2.issue("compute")
    p2.free_blocks(bl2[:4], token=e2)
    p2.free_blocks(bl2[4:], token=None)
    got2, fence2 = p2.allocate_for(3, "h2d")
    assert ids(got2) == [1, 2, 3] and [str(t) for t in fence2] == ["compute:1"]
    p.check()


def test_ready_first_cached_unkeyed_ready_first_then_cached_then_front():
    p = HazardAwareBlockPool(9, streams=STREAMS, placement="ready_first_cached")
    bl = p.get_new_blocks(8)
    p.cache_full_blocks(bl[4:], [20, 21, 22, 23], 0, 4, 16)
    e = p.issue("compute")
    p.free_blocks(bl[:2], token=None)  # unkeyed, ready: front
    p.free_blocks(bl[2:4], token=e)  # unkeyed, in flight: front (before 1, 2)
    p.free_blocks(bl[4:6], token=e)  # cached, in flight: coldest
    p.free_blocks(bl[6:], token=None)  # cached, ready
    assert ids(p.free_block_queue) == [3, 4, 1, 2, 5, 6, 7, 8]
    got, fence = p.allocate_for(6, "h2d")
    # ready unkeyed (1, 2), ready cached (7, 8), then the front (3, 4): waits.
    assert ids(got) == [1, 2, 7, 8, 3, 4] and [str(t) for t in fence] == ["compute:1"]
    assert p.get_cached_block(22) is None and p.get_cached_block(20) is p.blocks[5]
    p.check()


@pytest.mark.parametrize(
    ("window", "want", "waits"), [(1, [1, 2], True), (2, [1, 2], True), (3, [5, 1], True), (4, [5, 6], False)]
)
def test_ready_first_cached_window_bounds_the_scan(window, want, waits):
    p = HazardAwareBlockPool(9, streams=STREAMS, placement="ready_first_cached")
    p.CACHED_SCAN = window  # looks at the n + window coldest cached blocks
    bl = p.get_new_blocks(8)
    p.cache_full_blocks(bl, list(range(10, 18)), 0, 8, 16)
    e = p.issue("compute")
    p.free_blocks(bl[:4], token=e)  # coldest 4: in flight
    p.free_blocks(bl[4:], token=None)  # 5..8: ready
    got, fence = p.allocate_for(2, "h2d")
    assert ids(got) == want
    assert [str(t) for t in fence] == (["compute:1"] if waits else [])
    assert p.placed_cached == sum(1 for i in want if i >= 5)
    p.check()


@pytest.mark.parametrize("eviction", ["s3fifo", "2q"])
def test_ready_first_cached_under_policy_queues(eviction):
    p = HazardAwareBlockPool(9, streams=STREAMS, placement="ready_first_cached", eviction=eviction)
    bl = p.get_new_blocks(8)
    p.cache_full_blocks(bl, list(range(10, 18)), 0, 8, 16)
    p.touch(bl[6:])  # 7, 8 hit: they go to M when freed
    e = p.issue("compute")
    p.free_blocks(bl[:6], token=e)  # S, in flight
    p.free_blocks(bl[6:], token=None)  # 7, 8 -> M (behind the divider), ready
    p.free_blocks(bl[6:], token=None)
    got, fence = p.allocate_for(2, "h2d")
    assert ids(got) == [7, 8] and fence.tokens == ()
    assert p.get_cached_block(16) is None
    q = p.free_block_queue
    assert q.n_main == 0 and q.n_small == 6 and 7 not in q.seg and 7 not in q.freq
    p.check()


def test_ready_first_cached_host_consumer_and_no_ready_block():
    p = _cached_generations("ready_first_cached")
    got, fence = p.allocate_for(2, "rdma")
    assert ids(got) == [3, 4] and fence.tokens == ()
    got, fence = p.allocate_for(2, "rdma")  # nothing ready left: the front, which waits
    assert ids(got) == [1, 2] and [str(t) for t in fence] == ["compute:2"]
    p.check()


def test_ready_first_cached_off_without_hazards_and_bad_name():
    p = HazardAwareBlockPool(9, placement="ready_first_cached", track_hazards=False)
    got, fence = p.allocate_for(3, "compute")
    assert ids(got) == [1, 2, 3] and fence.tokens == ()
    with pytest.raises(UnknownEvictionPolicyError):
        HazardAwareBlockPool(9, placement="ready_first_cache")


@pytest.mark.parametrize("eviction", ["lru", "s3fifo", "2q"])
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 30)), max_size=50))
def test_ready_first_cached_keeps_invariants_and_counts(eviction, ops):
    """Random allocate (compute or h2d) / publish / free (by a running step
    or none) / complete sequences: a ``ready_first_cached`` pool passes
    check() after every call, hands out as many blocks as an LRU pool
    driven the same way, and every block it hands out is fresh (unkeyed,
    ref count 1)."""
    pools = [
        HazardAwareBlockPool(13, streams=STREAMS, eviction=eviction, placement=pl)
        for pl in ("lru", "ready_first_cached")
    ]
    drive(pools, ops)
    assert pools[0].get_num_free_blocks() == pools[1].get_num_free_blocks()
    assert pools[0].placed_cached == 0
