"""Allocation and free in the pool (``blockpool/core/pool.py``): a block listed
twice in one free, a failed allocation leaves no trace, the null block is
never data. One test per behaviour.
"""

from __future__ import annotations

import pytest

from blockpool import (
    HazardAwareBlockPool,
    RefCountError,
)
from tests.conftest import ids, make_pool

# 5. The same block twice in one free call -------------------------------------


def test_block_listed_twice_with_one_reference_is_rejected_unchanged(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    before = pool.snapshot()
    with pytest.raises(RefCountError, match="block 1"):
        pool.free_blocks([b, b])
    assert pool.snapshot() == before
    assert b.ref_cnt == 1


def test_block_listed_twice_with_two_references_is_freed_once(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.free_blocks([b, b])
    assert b.ref_cnt == 0
    assert ids(pool.free_block_queue).count(b.block_id) == 1
    assert pool.get_num_free_blocks() == 9
    pool.check()


# 6. A failed allocation leaves no trace ---------------------------------------


def cached_and_freed() -> tuple[HazardAwareBlockPool, list]:
    pool = make_pool(7)  # 6 usable blocks
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h1", "h2"], 0, 2, block_size=16)
    pool.free_blocks(list(reversed(a)))
    pool.take_events()
    assert pool.get_num_free_blocks() == 6
    return pool, a


def test_allocation_needing_hits_plus_too_many_new_blocks_changes_nothing() -> None:
    pool, hits = cached_and_freed()
    e1 = pool.issue("compute")
    before = pool.snapshot()
    with pytest.raises(ValueError, match="Cannot allocate 5"):
        pool.allocate_for(5, "compute", hits=hits)
    assert pool.snapshot() == before
    assert pool.issue("compute").seq == e1.seq + 1


def test_allocation_with_hits_counts_free_hits_once() -> None:
    pool, hits = cached_and_freed()
    new, _fence = pool.allocate_for(4, "compute", hits=hits)
    assert len(new) == 4 and not set(ids(new)) & set(ids(hits))
    assert pool.get_num_free_blocks() == 0
    assert [h.ref_cnt for h in hits] == [1, 1]
    assert pool.get_cached_block("h1") is hits[0]
    pool.check()


# 7. The null block is never data ----------------------------------------------


def test_null_block_is_never_allocated_counted_or_cached(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(9)
    assert pool.null_block not in blocks
    assert pool.get_num_free_blocks() == 0
    table = [pool.null_block, pool.null_block, *blocks[:2]]
    pool.cache_full_blocks(table, ["n0", "n1", "k2", "k3"], 0, 4, block_size=16)
    assert pool.null_block.block_hash is None
    assert pool.get_cached_block("n0") is None


def test_loads_and_stores_skip_null_placeholders(pool: HazardAwareBlockPool) -> None:
    b5, b6 = pool.get_new_blocks(2)
    table = [pool.null_block, pool.null_block, b5, b6]
    t, _ = pool.begin_load(table, "h2d")
    assert pool.null_block.writer is None and b5.writer == t and b6.writer == t
    _s, fence = pool.begin_store(table, "d2h")
    assert list(fence) == [t] and pool.null_block.readers is None


def test_free_of_null_placeholder_table_frees_only_data_blocks(pool: HazardAwareBlockPool) -> None:
    b5, b6 = pool.get_new_blocks(2)
    pool.free_blocks([pool.null_block, pool.null_block, b5, b6])
    assert pool.get_num_free_blocks() == 9
    assert pool.null_block.ref_cnt == 0
    pool.check()


def test_evict_first_frees_cached_blocks_to_the_front_in_listed_order_keeping_their_keys() -> None:
    """vLLM 0.34's ``free_blocks(..., evict_first=True)``: blocks whose
    content another tier holds go to the front of the free queue (evicted
    before older cached blocks), in the listed order, still cached until
    reused."""
    pool = HazardAwareBlockPool(6)
    old, a, b = pool.get_new_blocks(1)[0], *pool.get_new_blocks(2)
    pool.publish_full_blocks([old], [b"old"], 0, 1, 16)
    pool.publish_full_blocks([a, b], [b"a", b"b"], 0, 2, 16)
    pool.free_blocks([old])  # an older cached block: at the back, LRU
    pool.free_blocks([b, a], evict_first=True)
    assert ids(pool.free_block_queue)[:2] == [b.block_id, a.block_id]
    assert ids(pool.free_block_queue)[-1] == old.block_id
    assert pool.get_cached_block(b"a") is a and pool.get_cached_block(b"b") is b
    assert pool.get_new_blocks(1) == [b]  # evicted first, before `old`
    assert pool.get_cached_block(b"b") is None and pool.get_cached_block(b"old") is old


@pytest.mark.parametrize("caching", [True, False])
def test_free_flags_are_read_by_their_truth_and_free_every_block(caching: bool) -> None:
    """``to_tail`` and ``evict_first`` given as ints place as the bools of
    their truth (the compiled build's placement takes bools: a non-bool
    reached it after the ref counts had dropped, leaving blocks outside the
    free queue)."""
    for flags, want in (({"evict_first": 1}, [2, 1, 4, 3]), ({"evict_first": 0}, [4, 3, 2, 1])):
        pool = HazardAwareBlockPool(5, caching)
        a, b, c = pool.get_new_blocks(3)
        if caching:
            pool.publish_full_blocks([a, b, c], [b"a", b"b", b"c"], 0, 3, 16)
        pool.free_blocks([c])
        pool.free_blocks([b, a], **flags)
        if caching:
            assert ids(pool.free_block_queue) == want, flags
        assert pool.get_num_free_blocks() == 4
        pool.check()
    pool = HazardAwareBlockPool(5, caching)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a, b], to_tail=1)
    assert ids(pool.free_block_queue)[-2:] == [1, 2] and pool.get_num_free_blocks() == 4
    pool.check()


def test_evict_first_false_keeps_lru_order_for_cached_blocks() -> None:
    pool = HazardAwareBlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.publish_full_blocks([a], [b"a"], 0, 1, 16)
    pool.free_blocks([a, b], evict_first=False)
    assert ids(pool.free_block_queue)[0] == b.block_id and ids(pool.free_block_queue)[-1] == a.block_id
