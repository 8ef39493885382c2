"""Run-aware placement (``placement="runs" | "runs_cached" | "ready_first_runs"``):
a transfer of the blocks posts one descriptor per run of consecutive block ids."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockpool import HazardAwareBlockPool, StreamKind
from blockpool.core.block import KVCacheBlock
from blockpool.core.placement import PLACEMENTS
from blockpool.core.placement import fewest_runs as _fewest_runs
from blockpool.replay.machine import min_runs, runs
from tests.placement_driver import drive

STREAMS = {"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE, "rdma": StreamKind.HOST}


def ids(blocks):
    return [b.block_id for b in blocks]


def interleaved(placement: str, n: int = 12, **kw) -> HazardAwareBlockPool:
    """Blocks 1..n taken, then freed unkeyed in the order the scheduler of a
    two-request batch frees them: odd ids (one request, reversed), then even
    ids. The unkeyed front is then ``[n, n-2, .., 2, n-1, .., 1]`` (the last
    freed lead): no two neighbours in the queue are neighbours in id."""
    p = HazardAwareBlockPool(n + 5, streams=STREAMS, placement=placement, **kw)
    bl = p.get_new_blocks(n)
    p.free_blocks(bl[0::2][::-1], token=None)
    p.free_blocks(bl[1::2][::-1], token=None)
    return p


def test_runs_is_a_placement_name():
    assert {"runs", "runs_cached", "ready_first_runs"} <= set(PLACEMENTS)


def test_lru_hands_out_the_front_in_queue_order_one_run_per_block():
    p = interleaved("lru")
    got, _ = p.allocate_for(4, "h2d")
    assert ids(got) == [12, 10, 8, 6] and runs(got) == 4


def test_runs_takes_one_run_of_the_unkeyed_front_in_ascending_order():
    p = interleaved("runs")
    got, fence = p.allocate_for(4, "h2d")
    # The candidates are ids 1..12 (+ the 4 never used, 13..16): one run;
    # best fit takes its first 4.
    assert ids(got) == [1, 2, 3, 4] and runs(got) == 1 and fence.tokens == ()
    p.check()


def test_runs_best_fit_keeps_the_longer_run_whole():
    p = HazardAwareBlockPool(17, streams=STREAMS, placement="runs")
    bl = p.get_new_blocks(16)
    keep = [b for b in bl if b.block_id in (4, 9)]  # cuts 1..16 into 1-3, 5-8, 10-16
    p.free_blocks([b for b in bl if b not in keep], token=None)
    got, _ = p.allocate_for(4, "h2d")
    assert ids(got) == [5, 6, 7, 8]  # the smallest run that holds 4, not the 7-long one
    got2, _ = p.allocate_for(7, "h2d")
    assert ids(got2) == list(range(10, 17))
    p.check()


def test_runs_without_a_fitting_run_takes_the_longest_runs_first():
    p = HazardAwareBlockPool(17, streams=STREAMS, placement="runs")
    bl = p.get_new_blocks(16)
    keep = [b for b in bl if b.block_id in (3, 6, 11)]  # runs 1-2, 4-5, 7-10, 12-16
    p.free_blocks([b for b in bl if b not in keep], token=None)
    got, _ = p.allocate_for(8, "h2d")
    # 12-16 (5) then 3 of 7-10: two runs, ascending.
    assert ids(got) == [7, 8, 9, 12, 13, 14, 15, 16] and runs(got) == 2


def test_runs_leaves_which_cached_block_is_evicted_to_lru():
    """All free blocks cached: ``runs`` evicts exactly LRU's victims (it
    only sorts them); ``runs_cached`` may take a younger run."""
    victims = {}
    for placement in ("lru", "runs", "runs_cached"):
        p = HazardAwareBlockPool(13, streams=STREAMS, placement=placement)
        bl = p.get_new_blocks(12)
        p.cache_full_blocks(bl, list(range(100, 112)), 0, 12, 16)
        # LRU order: 1, 3, 5, 2, 4, 6 (coldest first), then 7..12.
        p.free_blocks([bl[0], bl[2], bl[4], bl[1], bl[3], bl[5]], token=None)
        p.free_blocks(bl[6:], token=None)
        got, _ = p.allocate_for(3, "h2d")
        victims[placement] = ids(got)
        assert p.get_cached_block(100) is None or placement == "runs_cached"
        p.check()
    assert victims["lru"] == [1, 3, 5]
    assert victims["runs"] == [1, 3, 5]
    assert victims["runs_cached"] == [1, 2, 3]  # best fit among the 3 + RUN_SCAN coldest


def test_runs_cached_prefers_unkeyed_blocks_over_keys():
    p = HazardAwareBlockPool(13, streams=STREAMS, placement="runs_cached")
    bl = p.get_new_blocks(12)
    p.cache_full_blocks(bl[:6], list(range(100, 106)), 0, 6, 16)
    p.free_blocks(bl, token=None)  # 7..12 unkeyed at the front, 1..6 cached behind
    got, _ = p.allocate_for(4, "h2d")
    assert ids(got) == [7, 8, 9, 10]
    assert all(p.get_cached_block(k) is not None for k in range(100, 106))
    assert p.placed_cached == 0


def test_ready_first_runs_takes_ready_blocks_in_runs():
    p = HazardAwareBlockPool(13, streams=STREAMS, placement="ready_first_runs")
    bl = p.get_new_blocks(12)
    e = p.issue("compute")
    p.free_blocks(bl[:6], token=e)  # 1..6 still read by a running step
    p.free_blocks(bl[6:], token=None)  # 7..12 ready
    got, fence = p.allocate_for(4, "h2d")
    assert ids(got) == [7, 8, 9, 10] and fence.tokens == ()
    plain = HazardAwareBlockPool(13, streams=STREAMS, placement="runs")
    pb = plain.get_new_blocks(12)
    e2 = plain.issue("compute")
    plain.free_blocks(pb[:6], token=e2)
    plain.free_blocks(pb[6:], token=None)
    got2, fence2 = plain.allocate_for(4, "h2d")
    assert ids(got2) == [1, 2, 3, 4] and [str(t) for t in fence2] == ["compute:1"]


def test_runs_with_one_block_or_too_few_candidates_falls_back_to_the_front():
    p = interleaved("runs", n=4)  # front: 4, 2, 3, 1, then 5.. never used
    one, _ = p.allocate_for(1, "h2d")
    assert ids(one) == [4]  # n == 1: any block is one run; the front, as lru
    p.check()


def test_fewest_runs_helpers_agree_with_brute_force():
    assert runs([KVCacheBlock(i) for i in (4, 5, 6, 9)]) == 2
    assert runs([KVCacheBlock(i) for i in (6, 5, 4)]) == 3
    assert min_runs([1, 2, 3, 7, 8, 20], 4) == 2
    with pytest.raises(ValueError):
        min_runs([1, 2], 3)


def _brute_force_min_runs(free: set[int], n: int) -> int:
    """The fewest runs over every ``n``-subset of ``free`` (small sets only)."""
    return min(runs([KVCacheBlock(i) for i in sorted(c)]) for c in itertools.combinations(sorted(free), n))


@settings(max_examples=200, deadline=None)
@given(free=st.sets(st.integers(1, 16), min_size=2, max_size=10), n=st.integers(1, 9))
def test_fewest_runs_choice_is_optimal(free, n):
    """``placement.fewest_runs`` picks ``n`` distinct free blocks, ascending,
    in exactly as many runs as the best ``n``-subset of the free set (brute
    force over every subset); the replay's floor ``min_runs`` agrees."""
    if n >= len(free):
        n = len(free) - 1
    cand = [KVCacheBlock(i) for i in sorted(free, reverse=True)]
    got = _fewest_runs(cand, n)
    ids_ = [b.block_id for b in got]
    assert len(set(ids_)) == n and set(ids_) <= free and ids_ == sorted(ids_)
    best = _brute_force_min_runs(free, n)
    assert runs(got) == best == min_runs(free, n)


@pytest.mark.parametrize("placement", ["runs", "runs_cached", "ready_first_runs"])
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 30)), max_size=50))
def test_runs_placements_keep_every_invariant(placement, ops):
    """Random allocate / publish / free / complete sequences: a run-aware
    pool passes check() after every call, has as many free blocks as an LRU
    pool driven the same way, hands out fresh blocks (unkeyed, ref count 1)
    in ascending id order, and with ``runs`` never evicts a key LRU would
    not have evicted (the same keys stay cached)."""
    pools = [HazardAwareBlockPool(13, streams=STREAMS, placement=pl) for pl in ("lru", placement)]

    def ascending(i: int, new: list) -> None:
        if i == 1 and len(new) > 1:
            assert ids(new) == sorted(ids(new))

    def same_keys() -> None:
        if placement == "runs":
            cached = [sorted(k for k in range(40) if p.get_cached_block(k) is not None) for p in pools]
            assert cached[0] == cached[1]

    drive(pools, ops, on_alloc=ascending, after_op=same_keys)
    assert pools[0].get_num_free_blocks() == pools[1].get_num_free_blocks()


# -- what limits ready-first placement: ready free blocks at placement ----------


def _ready_scenario() -> tuple[HazardAwareBlockPool, object]:
    p = HazardAwareBlockPool(11, streams=STREAMS)
    bl = p.get_new_blocks(10)
    e1 = p.issue("compute")
    p.free_blocks(bl[:4], token=e1)  # read by a running step
    p.free_blocks(bl[4:6], token=None)  # ready
    return p, e1


def test_num_ready_free_blocks_counts_blocks_with_an_empty_fence_for_the_stream():
    p, e1 = _ready_scenario()
    assert p.num_ready_free_blocks("h2d") == 2
    assert p.num_ready_free_blocks("compute") == 6  # a step is ordered after its own stream's steps
    # The count agrees with the fence a write would get, block by block
    # (each asked on a fresh copy of the scenario: fence_for records a wait).
    for stream in ("h2d", "rdma", "compute"):
        empty = 0
        for i in range(p.get_num_free_blocks()):
            q, _ = _ready_scenario()
            empty += not q.fence_for([list(q.free_block_queue)[i]], stream).tokens
        assert empty == p.num_ready_free_blocks(stream), stream
    p.complete(e1)
    assert p.num_ready_free_blocks("h2d") == 6


def test_num_ready_free_blocks_unknown_stream_is_typed_and_changes_nothing():
    from blockpool.core.errors import UnknownStreamError

    p = HazardAwareBlockPool(5, streams=STREAMS)
    bl = p.get_new_blocks(2)
    p.free_blocks(bl, token=p.issue("compute"))
    before = (p.get_num_free_blocks(), [b.block_id for b in p.free_block_queue], p.stats())
    with pytest.raises(UnknownStreamError):
        p.num_ready_free_blocks("nvlink")
    assert (p.get_num_free_blocks(), [b.block_id for b in p.free_block_queue], p.stats()) == before


def test_num_ready_free_blocks_without_hazards_is_every_free_block():
    p = HazardAwareBlockPool(5, track_hazards=False)
    p.get_new_blocks(1)
    assert p.num_ready_free_blocks("compute") == 3


def test_ready_first_runs_places_a_single_block_as_ready_first_does():
    got = {}
    for placement in ("ready_first", "ready_first_runs"):
        p = HazardAwareBlockPool(6, streams=STREAMS, placement=placement)
        bl = p.get_new_blocks(5)
        step = p.issue("compute")
        p.free_blocks(bl[2:], token=None)  # 3, 4, 5 ready
        p.free_blocks(bl[:2], token=step)  # 1, 2 at the front, read by a running step
        blocks, fence = p.allocate_for(1, "h2d")
        got[placement] = ([b.block_id for b in blocks], fence.tokens, p.placed_ready)
    assert got["ready_first_runs"] == got["ready_first"] == ([3], (), 1)


def test_ready_first_runs_counts_the_ready_blocks_it_placed():
    p = HazardAwareBlockPool(13, streams=STREAMS, placement="ready_first_runs")
    bl = p.get_new_blocks(12)
    p.free_blocks(bl[:6], token=p.issue("compute"))
    p.free_blocks(bl[6:], token=None)
    p.allocate_for(4, "h2d")
    assert p.placed_ready == 4 and p.placed_cached == 0
