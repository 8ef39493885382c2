"""The prefix cache (``blockpool/core/prefix_cache.py``, ``blockpool/core/_caching.py``):
one block with several keys, reset and eviction order with transfers in
flight. One test per behaviour.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blockpool import (
    AccessKind,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HazardAwareBlockPool,
    InvalidArgumentError,
    KVCacheBlock,
    NoFreeBlocksError,
    StreamKind,
    Token,
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


def test_reset_while_cached_blocks_are_held_for_a_store_drops_their_keys_and_keeps_the_hold(
    pool: HazardAwareBlockPool,
) -> None:
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h1", "h2"], 0, 2, block_size=16)
    s1, _ = pool.begin_store(a, "rdma")
    pool.free_blocks(list(reversed(a)))
    pool.take_events()
    assert pool.held_block_ids() == [1, 2]
    assert pool.reset_prefix_cache() is True  # held blocks (ref count 0) do not stop it
    assert pool.get_cached_block("h1") is None and pool.get_cached_block("h2") is None
    assert pool.held_block_ids() == [1, 2] and pool.get_num_free_blocks() == 7
    assert pool.take_events() == [AllBlocksCleared()]
    pool.complete(s1)
    assert pool.held_block_ids() == [] and pool.get_num_free_blocks() == 9
    pool.check()


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
    # vLLM's one-by-one loop promotes the block at the second entry, so it
    # ends with the longer key only (a two-pass publish would give it both).
    pool = make_pool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b, b], ["n0", "n1"], 0, 2, 16)
    assert pool.get_cached_block("n0") is None and pool.get_cached_block("n1") is b
    assert (b.block_hash, b.block_hash_num_tokens, pool.prefix_cache.keys_of(b)) == ("n1", 32, ["n1"])
    # The events describe the cache after the call: n0 was never
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
            got.append(
                pool.publish_full_blocks(table, keys, 0, 5, 16, block_mask=[True, True, True, False, True])
            )
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
        twins[0].blocks[1],
        twins[0].blocks[4],
        None,
        None,
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


# get_new_blocks_with_removed_keys: the evicted keys returned, not queued ------


@pytest.mark.parametrize("removal_events", ["each", "last"])
@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(0, 7)), max_size=50))
# A failure reported before an allocation that evicts: its removals first.
@example(ops=[(0, 3, 0), (1, 5, 0), (3, 0, 0), (2, 1, 0), (4, 0, 1), (0, 5, 0)])
def test_get_new_blocks_with_removed_keys_returns_the_keys_get_new_blocks_would_queue(
    removal_events: str, ops: list[tuple[int, int, int]]
) -> None:
    # Twin pools, the same calls, one allocating with get_new_blocks, the
    # other with get_new_blocks_with_removed_keys: the same blocks come out;
    # the second queues only the events of the call's first step (a failed
    # load's removals, from the completions it applies), as the first queues
    # them, and returns the keys of the removed events the first queues after
    # those, in order; the pools stay equal. Keys repeat across blocks (with
    # "last" a key is reported once no block holds it), loads fail.
    twins = [
        make_pool(8, removal_events=removal_events, streams={"compute": StreamKind.DEVICE}) for _ in range(2)
    ]
    held: list[list[KVCacheBlock]] = [[], []]
    loads: list[list[Token]] = [[], []]
    for op, n, k in ops:
        calls = []
        for i, pool in enumerate(twins):
            mine = held[i]
            if op == 0:  # allocate
                # The queue read without a call: a completion reported since
                # the last call (a failure) is applied by the allocation.
                before = list(pool.kv_event_queue)
                pool.kv_event_queue.clear()
                n = min(
                    n, pool.free_block_queue.num_free_blocks
                )  # one stream, a device one: nothing is held back
                got, removed = (
                    (pool.get_new_blocks(n), None) if i == 0 else pool.get_new_blocks_with_removed_keys(n)
                )
                calls.append((before, [b.block_id for b in got], removed, pool.take_events()))
                mine.extend(got)
            elif op == 1:  # publish the newest uncached blocks, one key each (of 4: shared)
                for j, b in enumerate(x for x in mine[-n - 1 :] if x.block_hash is None):
                    pool.cache_full_blocks([b], [f"h{(k + j) % 4}"], 0, 1, 16)
            elif op == 2 and mine:  # free the oldest
                pool.free_blocks(mine[: n + 1], token=None)
                del mine[: n + 1]
            elif op == 3 and mine:  # a load into the newest block, in flight
                loads[i].append(pool.issue("compute"))
                pool.tag(mine[-1:], loads[i][-1], AccessKind.WRITE)
            elif op == 4 and loads[i]:  # the oldest load fails (k odd) or ends
                t = loads[i].pop(0)
                pool.fail(t) if k % 2 else pool.complete(t)
        if calls:
            (before0, ids0, _, events0), (before1, ids1, removed, events1) = calls
            assert (before0, ids0) == (before1, ids1)
            assert events0[: len(events1)] == events1
            assert all(isinstance(e, BlockRemoved) and e.reason == "load_failed" for e in events1)
            assert all(isinstance(e, BlockRemoved) for e in events0[len(events1) :])
            assert removed == [key for e in events0[len(events1) :] for key in e.block_hashes]
    twins[0].poll()
    twins[1].poll()
    assert twins[0].snapshot() == twins[1].snapshot()


def test_get_new_blocks_with_removed_keys_leaves_a_failed_loads_removals_queued_before_its_keys() -> None:
    pool = make_pool(4, streams={"compute": StreamKind.DEVICE})
    a, b = pool.get_new_blocks(2)
    load = pool.issue("compute")
    pool.tag([a], load, AccessKind.WRITE)
    pool.cache_full_blocks([a, b], ["ka", "kb"], 0, 2, 16)
    pool.free_blocks([b], token=None)  # b, cached, at the free queue's tail
    pool.take_events()
    pool.fail(load)  # applied at the next call's start: "ka" withdrawn
    got, removed = pool.get_new_blocks_with_removed_keys(2)
    assert ([x.block_id for x in got], removed) == ([3, 2], ["kb"])
    assert [(e.block_hashes, e.reason) for e in pool.take_events()] == [(("ka",), "load_failed")]


def test_get_new_blocks_with_removed_keys_returns_no_keys_with_events_off() -> None:
    pool = make_pool(4, enable_kv_cache_events=False)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, ["h0", "h1", "h2"], 0, 3, 16)
    pool.free_blocks(blocks)
    got, removed = pool.get_new_blocks_with_removed_keys(2)
    assert ([b.block_id for b in got], removed, pool.get_cached_block("h0")) == ([1, 2], [], None)
    assert pool.get_cached_block("h2") is blocks[2]


@pytest.mark.parametrize(
    ("num_blocks", "error", "match"),
    [
        (-1, InvalidArgumentError, ">= 0"),
        (1.5, InvalidArgumentError, "int"),
        (4, NoFreeBlocksError, "Cannot get 4"),
    ],
)
def test_get_new_blocks_with_removed_keys_refuses_a_bad_count_changing_nothing(
    num_blocks: object, error: type[Exception], match: str
) -> None:
    pool = make_pool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, ["h0", "h1", "h2"], 0, 3, 16)
    pool.free_blocks(blocks)
    pool.take_events()
    before = pool.snapshot()
    with pytest.raises(error, match=match):
        pool.get_new_blocks_with_removed_keys(num_blocks)  # type: ignore[arg-type]
    assert pool.snapshot() == before and pool.take_events() == []


def test_take_events_empties_the_same_queue_in_place() -> None:
    # An adapter binds kv_event_queue once (the vLLM adapter does): the
    # pool never replaces the list.
    pool = make_pool(4)
    queue = pool.kv_event_queue
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, ["h0"], 0, 1, 16)
    assert len(queue) == 1
    assert pool.take_events() == [BlockStored(("h0",), None, 16, (1,))]
    assert pool.kv_event_queue is queue and queue == []


# The key map holds block ids -----------------------------------------------------


def test_the_key_map_holds_first_block_ids_and_a_shared_keys_ids_apart() -> None:
    import gc

    pool = HazardAwareBlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b], [b"k0", b"k1"], 0, 2, block_size=16)
    pool.cache_full_blocks([c], [b"k0"], 0, 1, block_size=16)
    pc = pool.prefix_cache
    assert pc.key_map == {b"k0": a.block_id, b"k1": b.block_id}
    assert pc.dup_ids == {b"k0": {a.block_id: None, c.block_id: None}}
    assert not gc.is_tracked(pc.key_map)  # bytes keys, int values: the collector skips it
    pool.free_blocks([a, b, c])
    pool.evict_blocks([a.block_id])  # the first block of b"k0" leaves: c takes its place
    assert pc.key_map == {b"k0": c.block_id, b"k1": b.block_id} and pc.dup_ids == {}
    assert pool.get_cached_block(b"k0") is c
    pool.check()


def test_a_block_the_map_lists_under_a_key_it_lacks_takes_the_key_when_published() -> None:
    """Code outside the core (vLLM's tests, through the adapter's view) may
    list a block under a key the block does not hold: publishing that key
    for it gives the block the key (so its reuse withdraws it), the map as
    it was, as vLLM 0.34's ``_insert_block_hash`` does."""
    from blockpool.core.prefix_cache import PrefixCache

    blocks = [KVCacheBlock(i) for i in range(5)]
    pc = PrefixCache(blocks)
    pc.key_map["k"] = 1
    pc.key_map["j"] = 1
    pc.dup_ids["j"] = {1: None, 3: None}
    published, removed = pc.publish_full(blocks, [None, "k", "k", "j"], [1, 2, 3], 16)
    assert (published, removed) == ([1, 2, 3], [])
    assert (blocks[1].block_hash, blocks[2].block_hash, blocks[3].block_hash) == ("k", "k", "j")
    assert pc.key_map == {"k": 1, "j": 1}
    assert pc.dup_ids == {"k": {1: None, 2: None}, "j": {1: None, 3: None}}
    pc.key_map["p"] = 4
    assert pc.publish("p", blocks[4], 8, partial=True) is True
    assert (blocks[4].block_hash, pc.is_partial(4), pc.key_map["p"]) == ("p", True, 4)
    assert pc.publish("p", blocks[4], 8) is False  # it holds the key now


def test_a_pool_withdraws_a_key_the_map_listed_before_the_block_took_it() -> None:
    pool = HazardAwareBlockPool(4)
    pool.prefix_cache.key_map["k"] = 1  # edited from outside the core
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 1
    pool.cache_full_blocks([b], ["k"], 0, 1, block_size=16)
    assert b.block_hash == "k"
    pool.free_blocks([b])
    pool.get_new_blocks(3)  # reuses block 1 for new content
    assert pool.get_cached_block("k") is None and pool.prefix_cache.key_map == {}
    pool.check()


@pytest.mark.parametrize("bad", ["1", 99, 2**70, None.__class__])
def test_a_key_map_value_that_is_no_block_id_is_an_invariant_error_on_lookup(bad: object) -> None:
    from blockpool.core.errors import InvariantError

    pool = HazardAwareBlockPool(4)
    pool.prefix_cache.key_map["k"] = bad  # type: ignore[assignment]  # edited from outside the core
    before = pool.stats()
    with pytest.raises(InvariantError, match="not a block id"):
        pool.get_cached_block("k")
    with pytest.raises(InvalidArgumentError, match="hashable"):
        pool.get_cached_block(["k"])
    assert pool.stats() == before and pool.prefix_cache.key_map == {"k": bad}


def test_an_extra_key_the_map_lost_is_mapped_again_when_published_again() -> None:
    """As vLLM 0.34's ``_insert_block_hash``: the map, not the block's own
    record of its extra keys, says whether the key still finds the block."""
    pool = HazardAwareBlockPool(4, removal_events="each")
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"full"], 0, 1, block_size=16)
    pool.cache_partial_block(a, b"part", 8)
    del pool.prefix_cache.key_map[b"part"]  # popped from outside the core
    assert pool.get_cached_block(b"part") is None
    pool.cache_partial_block(a, b"part", 8)
    assert pool.get_cached_block(b"part") is a and pool.prefix_cache.key_map[b"part"] == a.block_id
    pool.check()


def test_a_keyed_block_the_map_lists_under_another_key_gets_no_extra_key() -> None:
    """As vLLM 0.34's ``_insert_block_hash``: a block that holds a key and
    that the map already lists under another (inserted from outside the
    core) is left as it is."""
    from blockpool.core.prefix_cache import PrefixCache

    blocks = [KVCacheBlock(i) for i in range(3)]
    pc = PrefixCache(blocks)
    assert pc.publish("full", blocks[1], 16) is True
    pc.key_map["part"] = 1
    assert pc.publish("part", blocks[1], 8) is False
    assert pc.keys_of(blocks[1]) == ["full"] and pc.extra_keys() == {}
