"""The prefix cache (``blockpool/core/prefix_cache.py``, ``blockpool/core/_caching.py``):
one block with several keys, reset and eviction order with transfers in
flight. Faults reported from the field (issue #4): one test per behaviour.
"""

from __future__ import annotations

import pytest

from blockpool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HazardAwareBlockPool,
    InvalidArgumentError,
)
from tests.conftest import make_pool

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


def test_a_block_listed_twice_in_one_cache_full_blocks_call_keeps_the_longer_prefix_as_vllm_does() -> None:
    # Field report (review, session 5): the two-pass publish gave the block
    # both full keys; vLLM's one-by-one loop promotes it at the second entry.
    pool = make_pool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b, b], ["n0", "n1"], 0, 2, 16)
    assert pool.get_cached_block("n0") is None and pool.get_cached_block("n1") is b
    assert (b.block_hash, b.block_hash_num_tokens, pool.prefix_cache.keys_of(b)) == ("n1", 32, ["n1"])
    # The events describe the cache after the call (#22 point 1): n0 was never
    # announced, so it is neither stored nor removed (vLLM 0.33 sends
    # BlockRemoved(n0) then BlockStored((n0, n1)): a router would keep n0).
    assert pool.take_events() == [BlockStored(("n1",), "n0", 16, (1,), "GPU")]
    pool.check()


def test_publish_full_blocks_publishes_as_cache_full_blocks_and_queues_no_stored_event() -> None:
    # Two pools, the same calls: publish_full_blocks leaves the key map and
    # the blocks as cache_full_blocks does, returns the positions it newly
    # published (gaps: the null block, a masked-out block, a block already
    # holding its key), and queues only the promotions' removed events.
    twins = [make_pool(10, removal_events="each") for _ in range(2)]
    got = []
    for pool, publish in zip(twins, (True, False)):
        a = pool.get_new_blocks(4)
        pool.cache_partial_block(a[3], "p3", 72)  # a[3]: a partial key at position 4, promoted below
        pool.cache_full_blocks(a, ["h0", "h1"], 1, 2, 16)  # a[1] holds h1 already
        pool.take_events()
        table = [a[0], a[1], pool.null_block, a[2], a[3]]
        keys = ["h0", "h1", "hn", "h2", "h3"]
        if publish:
            got.append(pool.publish_full_blocks(table, keys, 0, 5, 16, block_mask=[True, True, True, False, True]))
        else:
            pool.cache_full_blocks(table, keys, 0, 5, 16, block_mask=[True, True, True, False, True])
        got.append(pool.take_events())
    positions, published_events, cached_events = got
    assert positions == [0, 4]
    assert published_events == [BlockRemoved(("p3",))]
    assert [e.reason for e in published_events] == ["promoted"]  # reason is not part of ==
    assert [e.reason for e in cached_events if isinstance(e, BlockRemoved)] == ["promoted"]
    assert cached_events == [
        BlockRemoved(("p3",)),
        BlockStored(("h0", "h3"), None, 16, (twins[1].blocks[1].block_id, twins[1].blocks[4].block_id)),
    ]
    assert twins[0].snapshot() == twins[1].snapshot()
    assert [twins[0].get_cached_block(k) for k in ("h0", "h3", "p3", "h2")] == [
        twins[0].blocks[1], twins[0].blocks[4], None, None,
    ]


def test_publish_full_blocks_refuses_a_bad_key_before_publishing_any() -> None:
    pool = make_pool(10)
    a = pool.get_new_blocks(3)
    pool.take_events()
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="hashable"):
        pool.publish_full_blocks(a, ["h0", ["unhashable"], "h2"], 0, 3, 16)
    assert pool.snapshot() == before and pool.take_events() == []
    assert pool.get_cached_block("h0") is None


def test_publish_full_blocks_with_hashes_offset_reads_only_the_new_positions_keys() -> None:
    # hashes_offset=k: block_hashes[j] is position k + j's key. The same
    # table published from a full key list and from the new keys alone
    # leaves the same pool (keys, token counts, promotions' events).
    twins = [make_pool(10, removal_events="each") for _ in range(2)]
    got = []
    for pool, tail in zip(twins, (False, True)):
        a = pool.get_new_blocks(5)
        pool.cache_full_blocks(a, ["h0", "h1"], 0, 2, 16)
        pool.cache_partial_block(a[3], "p3", 56)  # promoted at position 3 below
        pool.take_events()
        keys = ["h0", "h1", "h2", "h3", "h4"]
        if tail:
            got.append(pool.publish_full_blocks(a, keys[2:], 2, 5, 16, hashes_offset=2))
        else:
            got.append(pool.publish_full_blocks(a, keys, 2, 5, 16))
        got.append(pool.take_events())
    assert got[0] == got[2] == [2, 3, 4]
    assert got[1] == got[3] == [BlockRemoved(("p3",))]
    assert twins[0].snapshot() == twins[1].snapshot()
    assert [twins[1].get_cached_block(k) for k in ("h2", "h3", "h4", "p3")] == [*twins[1].blocks[3:6], None]
    assert twins[1].blocks[5].block_hash_num_tokens == 5 * 16  # position 4, not index 2 of the keys


@pytest.mark.parametrize(
    ("keys", "offset", "match"),
    [
        (["h2"], 3, "hashes_offset"),  # past num_cached_blocks (2)
        (["h2", "h3"], -1, "hashes_offset"),
        (["h2", "h3"], True, "hashes_offset"),  # a bool is not a position
        (["h2", "h3"], 1.0, "hashes_offset"),
        (["h2"], 2, "3 block hashes for 4 full blocks \\(1 from position 2\\)"),  # position 3 has none
    ],
)
def test_publish_full_blocks_refuses_a_bad_hashes_offset_before_publishing_any(
    keys: list[str], offset: object, match: str
) -> None:
    pool = make_pool(10)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, ["h0", "h1"], 0, 2, 16)
    pool.take_events()
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match=match):
        pool.publish_full_blocks(a, keys, 2, 4, 16, hashes_offset=offset)  # type: ignore[arg-type]
    assert pool.snapshot() == before and pool.take_events() == []
    assert pool.get_cached_block("h2") is None


def test_publish_full_blocks_with_an_offset_below_num_cached_blocks_shifts_every_read() -> None:
    # hashes_offset=1 with num_cached_blocks=2: position i's key is
    # block_hashes[i - 1], not block_hashes[i - num_cached_blocks].
    pool = make_pool(10)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, ["h0", "h1"], 0, 2, 16)
    assert pool.publish_full_blocks(a, ["h1", "h2", "h3"], 2, 4, 16, hashes_offset=1) == [2, 3]
    assert [pool.get_cached_block(k) for k in ("h2", "h3")] == a[2:4]
    assert [b.block_hash_num_tokens for b in a[2:4]] == [3 * 16, 4 * 16]
