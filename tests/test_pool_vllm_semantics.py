"""vLLM 0.33 BlockPool semantics that the pool must reproduce exactly."""

from __future__ import annotations

import pytest

from blockpool import AllBlocksCleared, BlockRemoved, BlockStored, HazardAwareBlockPool
from tests.conftest import ids, make_pool


def test_null_block_is_block_zero_and_never_free(pool: HazardAwareBlockPool) -> None:
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null
    assert pool.get_num_free_blocks() == 9
    assert 0 not in ids(pool.free_block_queue)


def test_fresh_pool_hands_out_blocks_in_id_order(pool: HazardAwareBlockPool) -> None:
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert [pool.blocks[i].ref_cnt for i in range(5)] == [0, 1, 1, 1, 0]


def test_get_new_blocks_zero_returns_empty(pool: HazardAwareBlockPool) -> None:
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 9


def test_freed_unhashed_blocks_are_reused_first_in_given_order(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(3)
    pool.free_blocks([a[2], a[0], a[1]])
    assert ids(pool.free_block_queue)[:3] == [3, 1, 2]
    assert ids(pool.get_new_blocks(2)) == [3, 1]


def test_freed_cached_blocks_go_to_lru_tail(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h1", "h2"], 0, 2, block_size=16)
    pool.free_blocks(list(reversed(a)))
    assert ids(pool.free_block_queue)[-2:] == [2, 1]
    assert ids(pool.free_block_queue)[0] == 3


def test_caching_disabled_puts_every_freed_block_first() -> None:
    pool = make_pool(enable_caching=False)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h1", "h2"], 0, 2)
    pool.free_blocks(a)
    assert ids(pool.free_block_queue)[:2] == [1, 2]


def test_touch_removes_free_cached_block_from_queue_and_counts_ref(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, ["h"], 0, 1, block_size=16)
    pool.free_blocks(a)
    assert pool.get_num_free_blocks() == 9
    hit = pool.get_cached_block("h")
    assert hit is a[0]
    pool.touch([hit, pool.null_block])
    assert hit.ref_cnt == 1
    assert pool.get_num_free_blocks() == 8
    assert pool.null_block.ref_cnt == 0


def test_touch_of_held_block_by_two_requests_counts_two(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(1)
    pool.touch(a)
    assert a[0].ref_cnt == 2
    pool.free_blocks(a)
    assert pool.get_num_free_blocks() == 8
    pool.free_blocks(a)
    assert pool.get_num_free_blocks() == 9


def test_allocation_evicts_cached_block_and_emits_removed_event(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(9)
    pool.cache_full_blocks(a, [f"h{i}" for i in range(9)], 0, 9, block_size=16)
    pool.take_events()
    pool.free_blocks(list(reversed(a)))
    b = pool.get_new_blocks(1)
    assert ids(b) == [9]
    assert b[0].block_hash is None
    assert pool.get_cached_block("h8") is None
    assert pool.take_events() == [BlockRemoved(("h8",))]


def test_cache_full_blocks_emits_one_stored_event_with_parent(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, ["h1", "h2", "h3"], 0, 1, block_size=16)
    pool.cache_full_blocks(a, ["h1", "h2", "h3"], 1, 3, block_size=16)
    assert pool.take_events() == [
        BlockStored(("h1",), None, 16, (1,)),
        BlockStored(("h2", "h3"), "h1", 16, (2, 3)),
    ]
    assert a[2].block_hash_num_tokens == 48


def test_cache_full_blocks_skips_null_and_masked_blocks(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    table = [pool.null_block, a[0], a[1]]
    pool.cache_full_blocks(table, ["h0", "h1", "h2"], 0, 3, block_size=16, block_mask=[True, False, True])
    assert pool.null_block.block_hash is None
    assert a[0].block_hash is None
    assert a[1].block_hash == "h2"


def test_same_key_on_two_blocks_is_not_deduplicated(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks([a[0]], ["h"], 0, 1, block_size=16)
    pool.cache_full_blocks([a[1]], ["h"], 0, 1, block_size=16)
    assert pool.get_cached_block("h") is a[0]
    pool.evict_blocks({a[0].block_id})
    assert pool.get_cached_block("h") is a[1]


def test_partial_block_promotion_replaces_partial_key(pool: HazardAwareBlockPool) -> None:
    (p,) = pool.get_new_blocks(1)
    assert pool.cache_partial_block(p, "h-partial", 8) == "h-partial"
    pool.cache_full_blocks([p], ["h-full"], 0, 1, block_size=16)
    assert pool.get_cached_block("h-partial") is None
    assert pool.get_cached_block("h-full") is p
    assert pool.take_events() == [
        BlockStored(("h-partial",), None, 8, (1,)),
        BlockRemoved(("h-partial",)),
        BlockStored(("h-full",), None, 16, (1,)),
    ]


def test_partial_key_inside_a_full_block_becomes_an_extra_key(pool: HazardAwareBlockPool) -> None:
    (p,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([p], ["full"], 0, 1, block_size=16)
    pool.cache_partial_block(p, "part", 8)
    assert pool.get_cached_block("part") is p
    assert p.block_hash == "full"
    pool.evict_blocks([p.block_id])
    assert pool.get_cached_block("part") is None and pool.get_cached_block("full") is None


def test_move_block_hashes_repoints_every_key_without_events(pool: HazardAwareBlockPool) -> None:
    src, dst = pool.get_new_blocks(2)
    pool.cache_full_blocks([src], ["full"], 0, 1, block_size=16)
    pool.cache_partial_block(src, "part", 8)
    pool.take_events()
    pool.move_block_hashes(src, dst)
    assert pool.get_cached_block("full") is dst and pool.get_cached_block("part") is dst
    assert src.block_hash is None and dst.block_hash_num_tokens == 16
    assert pool.take_events() == []
    pool.check()


def test_evict_blocks_keeps_in_use_block_allocated(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, ["h"], 0, 1, block_size=16)
    pool.evict_blocks({a[0].block_id})
    assert a[0].ref_cnt == 1 and a[0].block_hash is None
    assert pool.get_cached_block("h") is None


def test_reset_prefix_cache_fails_while_blocks_in_use(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, ["h"], 0, 1, block_size=16)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block("h") is a[0]
    assert pool.take_events() == []


def test_reset_prefix_cache_clears_keys_and_emits_one_event(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h1", "h2"], 0, 2, block_size=16)
    pool.free_blocks(a)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block("h1") is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]


def test_usage_counts_used_fraction_of_usable_blocks(pool: HazardAwareBlockPool) -> None:
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(3 / 9)


def test_is_block_writable_only_for_sole_uncached_owner(pool: HazardAwareBlockPool) -> None:
    a, b = pool.get_new_blocks(2)
    pool.touch([b])
    assert pool.is_block_writable(a)
    assert not pool.is_block_writable(b)
    assert not pool.is_block_writable(pool.null_block)
    pool.cache_full_blocks([a], ["h"], 0, 1)
    assert not pool.is_block_writable(a)


def test_take_events_is_empty_when_events_disabled() -> None:
    pool = make_pool(enable_kv_cache_events=False)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, ["h"], 0, 1)
    assert pool.take_events() == []


def test_free_of_null_block_is_a_noop(pool: HazardAwareBlockPool) -> None:
    before = pool.snapshot()
    pool.free_blocks([pool.null_block, pool.null_block])
    assert pool.snapshot() == before


def test_stats_count_cache_lookups_and_hits(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, ["h"], 0, 1)
    pool.get_cached_block("h")
    pool.get_cached_block("missing")
    s = pool.stats()
    assert (s.lookups, s.hits, s.cached_blocks, s.cached_keys, s.used, s.free) == (2, 1, 1, 1, 1, 8)


def test_prefix_cache_removal_reports_only_keys_that_mapped_and_leaves_no_empty_entry() -> None:
    from blockpool.core.block import KVCacheBlock
    from blockpool.core.prefix_cache import PrefixCache

    blocks = [KVCacheBlock(i) for i in range(3)]
    pc = PrefixCache(blocks)
    a, b = blocks[1], blocks[2]
    pc.publish("k", a, 16)
    pc.publish("k", b, 16)
    # As left by code that pops entries directly (vLLM's tests do): block 1
    # no longer under "k", block 2 alone.
    del pc.dup_ids["k"]
    pc.key_map["k"] = 2
    assert pc.remove(b) == ["k"]
    assert pc.remove(a) == []
    assert len(pc) == 0 and not pc.dup_ids and a.block_hash is None
