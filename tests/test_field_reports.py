"""Faults reported from the field (issue #4): one test per expected behaviour.

``eN`` is the token of step N on ``compute``; ``h2d``/``d2h`` are DMA
streams, ``rdma`` a host-driven engine.
"""

from __future__ import annotations

import warnings

import pytest

from blockpool import (
    AccessKind,
    AllBlocksCleared,
    BlockRemoved,
    HazardAwareBlockPool,
    LeaseExpiredWarning,
    RefCountError,
    Token,
)
from tests.conftest import ids, make_pool, toks


def steps(pool: HazardAwareBlockPool, n: int) -> list[Token]:
    return [pool.issue("compute") for _ in range(n)]


# 1. Load into a block compute may still be reading (WAR) -------------------


def test_load_into_blocks_freed_mid_step_waits_exactly_on_that_step(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    e1, e2, e3 = steps(pool, 3)
    pool.complete(e2)
    pool.free_blocks(list(reversed(a)), token=e3)
    blocks, fence = pool.allocate_for(2, "h2d")
    assert sorted(ids(blocks)) == sorted(ids(a))
    assert toks(fence) == {"compute:3"}
    assert not fence.needs_host_wait


def test_load_into_blocks_last_read_by_completed_step_gets_empty_fence(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    (e3,) = steps(pool, 1)
    pool.free_blocks(a, token=e3)
    pool.complete(e3)
    blocks, fence = pool.allocate_for(2, "h2d")
    assert ids(blocks) == ids(a) and not fence
    token, load_fence = pool.begin_load(blocks, "h2d")
    assert not load_fence


def test_load_fence_after_device_consumer_already_waited_is_empty(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    (e3,) = steps(pool, 1)
    pool.free_blocks(a, token=e3)
    blocks, fence = pool.allocate_for(2, "h2d")
    assert toks(fence) == {"compute:1"}
    _, load_fence = pool.begin_load(blocks, "h2d")
    assert not load_fence  # h2d is already ordered after e3


# 2. Store waits for the last writer; a block freed mid-store carries the store


def test_store_waits_for_last_writer(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    *_, e5 = steps(pool, 5)
    pool.tag([b], e5, AccessKind.WRITE)
    s1, fence = pool.begin_store([b], "d2h")
    assert toks(fence) == {"compute:5"}
    assert str(s1) == "d2h:1"


def test_block_freed_mid_store_is_fenced_on_the_store_for_compute(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    *_, e5 = steps(pool, 5)
    pool.tag([b], e5, AccessKind.WRITE)
    s1, _ = pool.begin_store([b], "d2h")
    e6 = pool.issue("compute")
    pool.free_blocks([b], token=e6)
    again, fence = pool.allocate_for(1, "compute")
    assert again == [b]
    assert toks(fence) == {"d2h:1"}


# 3. Async scheduling: tag with the last enqueued step ------------------------


def test_free_tags_last_enqueued_step_not_the_deciding_one(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    e7 = pool.issue("compute")
    e8 = pool.issue("compute")  # enqueued before step 7 completes
    pool.tag([b], e8, AccessKind.WRITE)
    # step 7's output arrives: the request finished, free its block.
    pool.complete(e7)
    assert pool.last_token("compute") == e8
    pool.free_blocks([b], token=pool.last_token("compute"))
    again, fence = pool.allocate_for(1, "rdma")
    assert again == [b]
    assert toks(fence) == {"compute:2"}
    assert fence.needs_host_wait  # an RDMA engine must event.synchronize() first


def test_host_engine_never_gets_a_block_with_pending_step_and_empty_fence(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(3)
    e1 = pool.issue("compute")
    pool.free_blocks(a, token=e1)
    blocks, fence = pool.allocate_for(3, "rdma")
    assert set(ids(blocks)) == set(ids(a))
    assert list(fence) == [e1] and fence.needs_host_wait


# 4. Aborted load: hold, then release exactly once -----------------------------


def aborted_load(pool: HazardAwareBlockPool) -> tuple[list, Token, Token]:
    blocks, _ = pool.allocate_for(4, "rdma")
    l1, _ = pool.begin_load(blocks[:2], "rdma")
    l2, _ = pool.begin_load(blocks[2:], "rdma")
    return blocks, l1, l2


def test_aborted_load_holds_blocks_until_their_transfer_ends(pool: HazardAwareBlockPool) -> None:
    blocks, l1, l2 = aborted_load(pool)
    pool.fail(l1)
    pool.free_blocks(list(reversed(blocks)))
    assert pool.held_block_ids() == ids(blocks[2:])
    assert pool.get_num_free_blocks() == 9 - 2
    with pytest.raises(Exception):
        pool.get_new_blocks(8)
    pool.complete(l2)
    assert pool.held_block_ids() == []
    assert pool.get_num_free_blocks() == 9
    pool.check()


def test_aborted_load_releases_at_once_when_transfers_already_ended(pool: HazardAwareBlockPool) -> None:
    blocks, l1, l2 = aborted_load(pool)
    pool.fail(l1)
    pool.complete(l2)
    pool.free_blocks(blocks)
    assert pool.held_block_ids() == []
    assert pool.get_num_free_blocks() == 9


def test_held_block_is_released_exactly_once(pool: HazardAwareBlockPool) -> None:
    blocks, l1, l2 = aborted_load(pool)
    pool.free_blocks(blocks)
    pool.complete(l2)
    pool.complete(l2)
    pool.complete(l1)
    assert pool.get_num_free_blocks() == 9
    assert sorted(ids(pool.free_block_queue)) == list(range(1, 10))
    pool.check()


def test_expired_lease_is_reported_but_blocks_stay_quarantined() -> None:
    now = [0.0]
    pool = make_pool(lease_timeout=5.0, clock=lambda: now[0])
    blocks, l1, l2 = aborted_load(pool)
    pool.free_blocks(blocks)
    now[0] = 4.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.poll()
    now[0] = 5.0
    with pytest.warns(LeaseExpiredWarning, match=r"\[1, 2, 3, 4\]"):
        pool.poll()
    assert pool.stats().leases_expired == 4
    assert pool.expired_leases() == [1, 2, 3, 4]
    assert pool.held_block_ids() == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.poll()  # reported once, not again


def test_abandon_releases_quarantined_blocks() -> None:
    now = [0.0]
    pool = make_pool(lease_timeout=1.0, clock=lambda: now[0])
    blocks, l1, l2 = aborted_load(pool)
    pool.free_blocks(blocks)
    now[0] = 2.0
    with pytest.warns(LeaseExpiredWarning):
        pool.poll()
    assert pool.abandon(l1) == [1, 2]
    assert pool.abandon(l2) == [3, 4]
    assert pool.get_num_free_blocks() == 9
    assert pool.stats().abandoned == 2 and pool.stats().leases_expired == 4
    pool.check()


def test_failed_load_never_publishes_block_hashes(pool: HazardAwareBlockPool) -> None:
    blocks, l1, l2 = aborted_load(pool)
    pool.cache_full_blocks(blocks, ["k1", "k2", "k3", "k4"], 0, 2, block_size=16)
    pool.take_events()
    pool.fail(l1)
    pool.poll()
    assert pool.get_cached_block("k1") is None and pool.get_cached_block("k2") is None
    assert pool.take_events() == [BlockRemoved(("k1",)), BlockRemoved(("k2",))]
    pool.cache_full_blocks(blocks, ["k1", "k2", "k3", "k4"], 0, 4, block_size=16)
    assert pool.get_cached_block("k1") is None
    assert pool.get_cached_block("k3") is blocks[2]
    assert pool.stats().unpublished_failed_loads == 2


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
    new, fence = pool.allocate_for(4, "compute", hits=hits)
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
    s, fence = pool.begin_store(table, "d2h")
    assert list(fence) == [t] and pool.null_block.readers is None


def test_free_of_null_placeholder_table_frees_only_data_blocks(pool: HazardAwareBlockPool) -> None:
    b5, b6 = pool.get_new_blocks(2)
    pool.free_blocks([pool.null_block, pool.null_block, b5, b6])
    assert pool.get_num_free_blocks() == 9
    assert pool.null_block.ref_cnt == 0
    pool.check()


# 8. One block, several keys ---------------------------------------------------


def test_promoted_block_is_counted_once_and_evicted_with_its_key(pool: HazardAwareBlockPool) -> None:
    (p,) = pool.get_new_blocks(1)
    pool.cache_partial_block(p, "h1", 8)
    pool.cache_full_blocks([p], ["h2"], 0, 1, block_size=16)
    pool.free_blocks([p])
    s = pool.stats()
    assert (s.free, s.used, s.held, s.cached_blocks) == (9, 0, 0, 1)
    pool.take_events()
    pool.get_new_blocks(9)
    assert pool.take_events() == [BlockRemoved(("h2",))]
    assert pool.get_cached_block("h1") is None and pool.get_cached_block("h2") is None


def test_block_with_two_keys_loses_both_on_eviction(pool: HazardAwareBlockPool) -> None:
    (p,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([p], ["full"], 0, 1, block_size=16)
    pool.cache_partial_block(p, "part", 8)
    pool.free_blocks([p])
    assert pool.stats().cached_blocks == 1 and pool.stats().cached_keys == 2
    assert pool.get_num_free_blocks() == 9 and pool.get_usage() == 0.0
    pool.take_events()
    pool.get_new_blocks(9)
    assert sorted(e.block_hashes[0] for e in pool.take_events()) == ["full", "part"]


def test_same_key_on_two_blocks_counts_each_block_once(pool: HazardAwareBlockPool) -> None:
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], ["h"], 0, 1, block_size=16)
    pool.cache_full_blocks([b], ["h"], 0, 1, block_size=16)
    pool.free_blocks([a, b])
    s = pool.stats()
    assert (s.free, s.cached_blocks, s.cached_keys) == (9, 2, 1)
    assert s.free + s.held + s.used == s.num_blocks
    pool.check()


# 9. Reset and eviction order with transfers in flight ---------------------------


def test_reset_refused_while_cached_blocks_are_stored_then_succeeds(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h1", "h2"], 0, 2, block_size=16)
    s1, _ = pool.begin_store(a, "rdma")
    pool.free_blocks(list(reversed(a)))
    pool.take_events()
    assert pool.held_block_ids() == [1, 2]
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block("h1") is a[0]
    pool.complete(s1)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block("h1") is None and pool.get_cached_block("h2") is None
    assert pool.get_num_free_blocks() == 9
    assert pool.take_events() == [AllBlocksCleared()]


def test_reset_refused_while_store_source_is_still_referenced(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h1", "h2"], 0, 2, block_size=16)
    s1, _ = pool.begin_store(a, "d2h")
    assert pool.reset_prefix_cache() is False
    pool.complete(s1)
    pool.free_blocks(a)
    assert pool.reset_prefix_cache() is True


def test_eviction_takes_chain_tail_first_and_keeps_prefix_hits() -> None:
    pool = make_pool(4)  # 3 usable blocks
    chain = pool.get_new_blocks(3)
    pool.cache_full_blocks(chain, ["h1", "h2", "h3"], 0, 3, block_size=16)
    pool.free_blocks(list(reversed(chain)))
    pool.take_events()
    (b,) = pool.get_new_blocks(1)
    assert b is chain[2]
    assert pool.take_events() == [BlockRemoved(("h3",))]
    assert pool.get_cached_block("h1") is chain[0]
    assert pool.get_cached_block("h2") is chain[1]
