"""VllmBlockPool: vLLM 0.33's BlockPool surface over HazardAwareBlockPool.

Needs vLLM (skipped otherwise); scripts/vllm_parity.sh runs it in the vLLM
venv. Each behaviour is checked against vLLM's own BlockPool where vLLM
defines it, by driving both with the same calls.
"""

from __future__ import annotations

import random
import weakref
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.block_pool")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from blockpool import ForeignBlockError, InvalidArgumentError, RefCountError, StreamKind
from blockpool.core.block import KVCacheBlock as CoreKVCacheBlock
from blockpool.integrations.vllm import events as vllm_events
from blockpool.integrations.vllm.blocks import VllmNullBlock
from blockpool.integrations.vllm.parity import LOOSE_BLOCKS, ParityBlockPool
from blockpool.integrations.vllm.pool import SERVED, VLLM_BLOCK_POOL, VllmBlockPool, VllmKVCacheBlock
from tests.conftest import ids, toks

BS = 4


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    init_none_hash(sha256)


def request(rid: str, tokens: list[int], block_size: int = BS) -> Request:
    sp = SamplingParams(max_tokens=17)
    sp.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def pools(n: int = 10, **kw: Any) -> tuple[Any, VllmBlockPool]:
    kw.setdefault("enable_kv_cache_events", True)
    return VLLM_BLOCK_POOL(n, True, BS, **kw), VllmBlockPool(n, True, BS, **kw)


def state(pool: Any) -> tuple[object, ...]:
    """Everything vLLM exposes about a pool, comparable across classes."""
    # Block ids per key: vLLM 0.34's map (and ours) holds one id per key
    # plus the ids of keys cached by several blocks (``_dup_ids``); vLLM's
    # before 0.34, a block or a {block_id: block} dict.
    dups = getattr(pool.cached_block_hash_to_block, "_dup_ids", {})
    cache = {
        k: sorted(dups[k])
        if k in dups
        else sorted(v)
        if isinstance(v, dict)
        else [v if isinstance(v, int) else v.block_id]
        for k, v in pool.cached_block_hash_to_block._cache.items()
    }
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        ids(pool.free_block_queue.get_all_free_blocks()),
        cache,
        {k: sorted(v) for k, v in pool.cached_block_hashes_by_block.items()},
        pool.get_num_free_blocks(),
    )


def test_blocks_are_core_records_with_vllms_surface_owned_by_the_adapter() -> None:
    """The adapter's blocks are the core's record class (what the compiled
    core reads natively), each with vLLM's names over the core's fields."""
    theirs, ours = pools()
    assert all(isinstance(b, CoreKVCacheBlock) and b.pool is ours._pool_ref for b in ours.blocks)
    # block.pool as vLLM's own blocks hold it: a weak reference to the pool
    # on vLLM 0.34, the pool itself before.
    if isinstance(theirs.blocks[1].pool, weakref.ref):
        assert ours._pool_ref is ours._weak_self and ours.blocks[1].pool() is ours
    else:
        assert theirs.blocks[1].pool is theirs and ours._pool_ref is ours
    assert ours.null_block is ours.blocks[0] and ours.null_block.is_null
    assert type(ours.null_block) is VllmNullBlock
    assert not any(b.is_null for b in ours.blocks[1:])
    blk = ours.blocks[1]
    key = make_block_hash_with_group_id(b"h", 0)
    blk.set_block_hash(key, BS)
    assert (blk._block_hash, blk._block_hash_num_tokens, blk.block_hash, blk.block_hash_num_tokens) == (
        key,
        BS,
        key,
        BS,
    )
    with pytest.raises(AssertionError, match="already has a hash"):
        blk.set_block_hash(key)
    blk.reset_hash()
    assert (blk._block_hash, blk.block_hash_num_tokens) == (None, None)
    assert repr(blk) == (  # vLLM's format; block 1 is the free queue's front (after the head, id -1)
        "KVCacheBlock(block_id=1, ref_cnt=0, _block_hash=None, _block_hash_num_tokens=None, "
        "prev_free_block=-1, next_free_block=2)"
    )


def test_the_block_id_and_is_null_vllm_reads_are_the_ones_the_core_reads() -> None:
    # block_id and is_null are copied into slots of the adapter's block
    # class (vLLM's interpreted reads of them are then CPython slot reads):
    # the core's own reads (its events' block ids, compiled or not) and
    # vLLM's agree for every block, and for a pickled copy.
    import pickle

    ours = VllmBlockPool(6, True, BS, enable_kv_cache_events=True)
    assert [b.is_null for b in ours.blocks] == [True, False, False, False, False, False]
    assert [b.block_id for b in ours.blocks] == list(range(6))
    blocks = ours.get_new_blocks(5)
    ours.core.cache_full_blocks(blocks, [f"k{i}" for i in range(5)], 0, 5, BS)
    (stored,) = ours.core.take_events()
    assert list(stored.block_ids) == [b.block_id for b in blocks] == [1, 2, 3, 4, 5]
    copies = [pickle.loads(pickle.dumps(b)) for b in (ours.null_block, blocks[4])]
    assert [(c.block_id, c.is_null, type(c)) for c in copies] == [
        (0, True, VllmNullBlock),
        (5, False, VllmKVCacheBlock),
    ]


def test_the_free_count_is_the_cores_own_unless_the_class_has_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours = VllmBlockPool(10, True, BS)
    assert ours.get_num_free_blocks == ours.core.get_num_free_blocks
    ours.get_new_blocks(3)
    assert (ours.get_num_free_blocks(), ours.get_usage()) == (6, pytest.approx(3 / 9))
    monkeypatch.setattr(
        ours, "get_num_free_blocks", lambda: 8
    )  # an instance patch: get_usage reads it, as vLLM's
    assert ours.get_usage() == pytest.approx(1 / 9)

    class SevenFree(VllmBlockPool):
        def get_num_free_blocks(self) -> int:
            return 7

    seven = SevenFree(10, True, BS)
    assert (seven.get_num_free_blocks(), seven.get_usage()) == (7, pytest.approx(2 / 9))
    monkeypatch.setattr(
        VllmBlockPool, "get_num_free_blocks", lambda self: 5
    )  # a class patch before the pool is built
    assert VllmBlockPool(10, True, BS).get_num_free_blocks() == 5


def test_key_map_view_holds_block_ids_as_vllm_034_does_and_the_gc_skips_it() -> None:
    """vLLM 0.34's ``BlockHashToBlockMap``: ``_cache`` maps a key to its
    first block's id, ``_dup_ids`` lists every id of a key several blocks
    hold; the view's dicts are the core's, and a map of bytes keys and int
    ids is one the cyclic GC does not track (vLLM 0.34's own tests check
    it). A block from outside the pool (vLLM's class, as its unit tests
    make) is mapped by its id, as vLLM 0.34 maps it."""
    import gc

    ours = VllmBlockPool(6, True, BS)
    view = ours.cached_block_hash_to_block
    b1, b2, b3 = ours.blocks[1:4]
    loose = KVCacheBlock(block_id=5)  # vLLM's class, as its unit tests make
    k, k2 = make_block_hash_with_group_id(b"k", 0), make_block_hash_with_group_id(b"k2", 0)
    assert (view.get_one_block(k), view.contain(k, 1), view.pop(k, 1), len(view)) == (None, False, None, 0)
    view.insert(k, b1)
    assert view._cache == {k: 1} and view._dup_ids == {} and view.get_one_block(k) is b1
    assert (view.contain(k, 1), view.contain(k, 2)) == (True, False)
    assert view.pop(k, 2) is None and view._cache == {k: 1}  # another id: unchanged
    view.insert(k, b2)
    view.insert(k, loose)
    view.insert(k, b2)  # already there: unchanged
    assert view._cache == {k: 1} and view._dup_ids == {k: {1: None, 2: None, 5: None}}
    assert view.get_one_block(k) is b1
    assert (view.contain(k, 2), view.contain(k, 5), view.contain(k, 3)) == (True, True, False)
    assert view.pop(k, 1) is b1 and view._cache == {k: 2} and view._dup_ids == {k: {2: None, 5: None}}
    assert view.pop(k, 3) is None and view._dup_ids == {k: {2: None, 5: None}}
    assert view.pop(k, 2) is b2 and view._cache == {k: 5} and view._dup_ids == {}
    assert view.get_one_block(k) is ours.blocks[5]  # by id: the pool's block 5
    assert view.pop(k, 5) is ours.blocks[5] and k not in view._cache
    view.insert(k2, b3)
    assert len(view) == 1 and view._cache is ours.core.prefix_cache.key_map
    assert view._dup_ids is ours.core.prefix_cache.dup_ids and view._blocks is ours.blocks
    assert not gc.is_tracked(view._cache)
    view.clear()
    assert (view._cache, view._dup_ids, len(view)) == ({}, {}, 0)


def test_the_core_caches_blocks_under_the_map_vllms_view_reads() -> None:
    import gc

    ours = VllmBlockPool(8, True, BS)
    blocks = ours.get_new_blocks(3)
    keys = [make_block_hash_with_group_id(bytes([i]), 0) for i in range(2)]
    ours.core.cache_full_blocks(blocks[:2], keys, 0, 2, BS)
    ours.core.cache_full_blocks(blocks[2:], keys[:1], 0, 1, BS)  # a second block under keys[0]
    view = ours.cached_block_hash_to_block
    assert view._cache == {keys[0]: blocks[0].block_id, keys[1]: blocks[1].block_id}
    assert view._dup_ids == {keys[0]: {blocks[0].block_id: None, blocks[2].block_id: None}}
    assert view.get_one_block(keys[0]) is blocks[0] and view.contain(keys[0], blocks[2].block_id)
    assert not gc.is_tracked(view._cache)
    ours.free_blocks(blocks)
    ours.core.evict_blocks({blocks[0].block_id})
    assert view._cache == {keys[0]: blocks[2].block_id, keys[1]: blocks[1].block_id} and view._dup_ids == {}
    assert ours.core.get_cached_block(keys[0]) is blocks[2]
    ours.core.check()


def test_a_block_carries_vllms_fields_and_no_slot_for_its_pool_or_is_null() -> None:
    """``pool`` and ``is_null`` are class attributes (the pool's own block
    class holds its ``pool``): a block is the core's record, plus, in the
    compiled build, a slot copy of ``block_id``. A full ``gc.collect()``
    walks every slot of every cached block."""
    import sys

    from blockpool import HazardAwareBlockPool
    from blockpool.integrations.vllm.blocks import _NATIVE_RECORD

    ours, core = VllmBlockPool(4, True, BS), HazardAwareBlockPool(4)
    blk = ours.blocks[1]
    assert sys.getsizeof(blk) == sys.getsizeof(core.blocks[1]) + (8 if _NATIVE_RECORD else 0)
    assert (blk.pool, blk.is_null, ours.null_block.is_null) == (ours._pool_ref, False, True)
    assert "pool" in vars(type(blk)) and type(blk).__slots__ == ()
    with pytest.raises(AttributeError):
        blk.pool = None  # a block's pool is its class's
    assert blk.pool is ours._pool_ref


def test_a_block_built_with_another_pool_than_its_class_is_refused() -> None:
    ours = VllmBlockPool(4, True, BS)
    cls = type(ours.blocks[1])
    made = cls(9, ours._pool_ref)  # its class's pool: accepted
    assert (made.block_id, made.pool, made.ref_cnt, made.block_hash) == (9, ours._pool_ref, 0, None)
    with pytest.raises(InvalidArgumentError, match="a block's pool is its class's"):
        VllmKVCacheBlock(9, ours._pool_ref)  # the shared class's pool is None
    with pytest.raises(InvalidArgumentError):
        cls(9, VllmBlockPool(4, True, BS)._pool_ref)
    assert VllmKVCacheBlock(9).pool is None and VllmKVCacheBlock(9, None).block_id == 9


def test_each_pool_has_its_own_block_class_so_the_own_check_is_a_type_test() -> None:
    a, b = VllmBlockPool(4, True, BS), VllmBlockPool(4, True, BS)
    cls = type(a.blocks[1])
    assert cls is not type(b.blocks[1]) and cls is not VllmKVCacheBlock
    assert cls.__name__ == "VllmKVCacheBlock" and issubclass(cls, VllmKVCacheBlock)
    assert {type(x) for x in a.blocks[1:]} == {cls}  # the null block is checked by identity
    assert a.core._block_cls is cls


def test_blocks_pickle_as_vllm_kv_cache_blocks_of_no_pool() -> None:
    import copy
    import pickle

    ours = VllmBlockPool(4, True, BS)
    blk = ours.get_new_blocks(1)[0]
    key = make_block_hash_with_group_id(b"h", 0)
    ours.core.cache_full_blocks([blk], [key], 0, 1, BS)
    for c in (pickle.loads(pickle.dumps(blk)), copy.copy(blk), copy.deepcopy(blk)):
        assert type(c) is VllmKVCacheBlock and c.pool is None
        assert (c.block_id, c.ref_cnt, c.block_hash, c.block_hash_num_tokens, c.is_null) == (
            1,
            1,
            key,
            BS,
            False,
        )
        assert c.prev_free_block is None and c.next_free_block is None
        with pytest.raises(ForeignBlockError):
            ours.free_blocks([c])
    assert blk.ref_cnt == 1


def test_blocks_of_another_pool_are_forwarded_and_of_no_pool_refused() -> None:
    a, b = VllmBlockPool(4, True, BS), VllmBlockPool(4, True, BS)
    xa, xb = a.get_new_blocks(1)[0], b.get_new_blocks(1)[0]
    a.free_blocks([xa, b.null_block, xb])
    assert (xa.ref_cnt, xb.ref_cnt, a.get_num_free_blocks(), b.get_num_free_blocks()) == (0, 0, 3, 3)
    ya = a.get_new_blocks(1)[0]
    with pytest.raises(ForeignBlockError):
        a.free_blocks([ya, KVCacheBlock(block_id=2)])
    assert (ya.ref_cnt, a.get_num_free_blocks()) == (1, 2)
    for call in (
        lambda: a._maybe_evict_cached_block(xb),
        lambda: a._insert_block_hash(b"k", xb, None),
    ):
        with pytest.raises(ForeignBlockError):
            call()
    assert a.cached_block_hash_to_block._cache == {}


def test_state_objects_are_the_cores() -> None:
    _, ours = pools()
    assert ours.free_block_queue is ours.core.free_block_queue
    assert ours.cached_block_hash_to_block._cache is ours.core.prefix_cache.key_map
    assert ours.cached_block_hashes_by_block is ours.core.prefix_cache.extra_keys()


def test_allocations_are_served_and_counted_by_the_core() -> None:
    _, ours = pools()
    before = SERVED.blocks_allocated
    got = ours.get_new_blocks(3)
    assert ids(got) == [1, 2, 3]
    assert SERVED.blocks_allocated == before + 3
    assert ours.core.stats().used == 3


def test_same_calls_give_same_state_and_events_as_vllm() -> None:
    theirs, ours = pools(12)
    for p in (theirs, ours):
        r = request("a", list(range(14)))
        r2 = request("b", list(range(8)) + [99] * 6)
        a = p.get_new_blocks(4)
        p.cache_full_blocks(r, a, 0, 3, BS, 0)
        b = p.get_new_blocks(2)
        p.cache_full_blocks(r2, a[:2] + b, 2, 3, BS, 1)
        p.free_blocks(reversed(a))
        hit = p.get_cached_block(r.block_hashes[0], [0])
        p.touch(hit)
        p.get_new_blocks(7)
        p.evict_blocks({hit[0].block_id, 9})
        p.free_blocks(hit + b)
    assert state(ours) == state(theirs)
    assert ours.take_events() == theirs.take_events()


def test_random_call_sequences_match_vllm() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        theirs, ours = pools(9)
        held: tuple[list[Any], list[Any]] = ([], [])
        reqs = [request(f"r{i}", [rng.randrange(3) for _ in range(12)]) for i in range(3)]
        for _ in range(30):
            op = rng.randrange(5)
            k = rng.randrange(1, 4)
            i = rng.randrange(3)
            for p, h in zip((theirs, ours), held):
                if op == 0 and p.get_num_free_blocks() >= k:
                    h.append(p.get_new_blocks(k))
                elif op == 1 and h:
                    p.free_blocks(reversed(h.pop(i % len(h))))
                elif op == 2 and h and all(b.block_hash is None for b in h[i % len(h)]):
                    p.cache_full_blocks(reqs[i], h[i % len(h)], 0, len(h[i % len(h)]), BS, 0)
                elif op == 3:
                    hit = p.get_cached_block(reqs[i].block_hashes[0], [0])
                    if hit:
                        p.touch(hit)
                        h.append(hit)
                elif op == 4:
                    p.evict_blocks({k, 2 * k})
            assert state(ours) == state(theirs), seed
        assert ours.take_events() == theirs.take_events(), seed
        ours.core.check()


def test_cached_block_event_carries_token_ids_and_group() -> None:
    _, ours = pools()
    r = request("a", list(range(9)))
    blocks = ours.get_new_blocks(2)
    ours.cache_full_blocks(r, blocks, 0, 2, BS, 3)
    (ev,) = ours.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.token_ids == list(range(8)) and ev.group_idx == 3 and ev.block_size == BS


@pytest.mark.skipif(
    not vllm_events.HAS_LOOKAHEAD,
    reason="this vLLM's BlockPool has no lookahead hashing (0.32); tests/test_vllm_versions.py covers the rest",
)
def test_stored_events_match_vllm_for_partials_nulls_masks_and_lookahead() -> None:
    theirs, ours = pools(12, num_hash_lookahead_tokens=2)
    for p in (theirs, ours):
        r = request("a", list(range(34)))
        a = p.get_new_blocks(3)
        table = [a[0], p.null_block, a[1], a[2]]
        p.cache_partial_block(r, a[0], 4, 0, 2 * BS)  # 4 tokens into a block of 8
        p.cache_full_blocks(r, table, 0, 2, 2 * BS, 0)  # promotes a[0], skips the null block
        p.cache_full_blocks(r, table, 2, 3, 2 * BS, 0, block_mask=[False])  # nothing stored
        p.cache_partial_block(r, a[2], 28, 0, 2 * BS)
        p.cache_full_blocks(r, table, 2, 4, 2 * BS, 1, block_mask=[True, False])
    assert state(ours) == state(theirs)
    assert ours.take_events() == theirs.take_events()


def test_stored_event_lists_only_the_blocks_the_core_published() -> None:
    ours = VllmBlockPool(10, True, BS, enable_kv_cache_events=True)
    ours.hazards.add_stream("nixl", StreamKind.DEVICE)
    r = request("a", list(range(12)))
    a = ours.get_new_blocks(3)
    ours.hazards.begin_load("a", a[:1], "nixl", key="job")
    ours.hazards.finish("job", failed=True)
    ours.cache_full_blocks(r, a, 0, 2, BS, 0)  # the failed load's block is refused
    ours.cache_full_blocks(r, a, 1, 3, BS, 0)  # a[1] already holds its key (vLLM: AssertionError)
    first, second = ours.take_events()
    assert first.block_hashes == [maybe_convert_block_hash(r.block_hashes[1])]
    assert first.token_ids == list(range(8)) and len(first.extra_keys or [None]) == 1
    assert second.block_hashes == [maybe_convert_block_hash(r.block_hashes[2])]
    assert second.parent_block_hash == maybe_convert_block_hash(r.block_hashes[0])


def test_eviction_event_is_vllms_block_removed_per_key() -> None:
    _, ours = pools()
    r = request("a", list(range(8)))
    blocks = ours.get_new_blocks(2)
    ours.cache_full_blocks(r, blocks, 0, 2, BS, 1)
    ours.take_events()
    ours.evict_blocks({blocks[0].block_id})
    (ev,) = ours.take_events()
    assert (
        isinstance(ev, BlockRemoved)
        and ev.block_hashes == [maybe_convert_block_hash(r.block_hashes[0])]
        and ev.group_idx == 1
    )


def test_reset_queues_all_blocks_cleared() -> None:
    _, ours = pools()
    assert ours.reset_prefix_cache()
    assert ours.take_events() == [AllBlocksCleared()]


def test_free_forwards_blocks_of_another_pool() -> None:
    theirs, ours = pools()
    mine, other = ours.get_new_blocks(1), theirs.get_new_blocks(1)
    ours.free_blocks(mine + other)
    assert theirs.get_num_free_blocks() == 9 and ours.get_num_free_blocks() == 9


def test_vllm_pool_forwards_our_blocks_back_to_us() -> None:
    theirs, ours = pools()
    mine = ours.get_new_blocks(2)
    theirs.free_blocks(mine)
    assert ours.get_num_free_blocks() == 9 and mine[0].ref_cnt == 0


def test_free_below_zero_raises_and_changes_nothing() -> None:
    _, ours = pools()
    (b,) = ours.get_new_blocks(1)
    before = state(ours)
    with pytest.raises(RefCountError):
        ours.free_blocks([b, b])
    assert state(ours) == before


def test_a_shared_key_passes_to_its_next_block_when_the_first_is_evicted() -> None:
    _, ours = pools(4)
    key = make_block_hash_with_group_id(b"h", 0)
    a, b = ours.blocks[1], ours.blocks[2]
    for blk in (a, b):
        blk.set_block_hash(key)
        ours.cached_block_hash_to_block.insert(key, blk)
    view = ours.cached_block_hash_to_block
    assert (view._cache, view._dup_ids) == ({key: 1}, {key: {1: None, 2: None}})
    ours._maybe_evict_cached_block(a)
    assert (view._cache, view._dup_ids, view.get_one_block(key)) == ({key: 2}, {}, b)
    ours._maybe_evict_cached_block(b)
    assert (view._cache, view._dup_ids) == ({}, {})


def test_parity_pool_caches_blocks_of_no_pool_as_vllm_does() -> None:
    ours = ParityBlockPool(10, True, BS, enable_kv_cache_events=True)
    r = request("a", list(range(8)))
    loose = [KVCacheBlock(block_id=i) for i in (1, 2)]
    ours.cache_full_blocks(r, loose, 0, 2, BS, 0)
    # The map holds block ids (vLLM 0.34's): the hit is the block of id 2
    # (vLLM 0.34's own pool answers with its block of that id).
    (hit,) = ours.get_cached_block(r.block_hashes[1], [0])
    assert hit.block_id == 2 and loose[1].block_hash is not None
    assert ours._maybe_evict_cached_block(loose[1]) is True
    assert ours.get_cached_block(r.block_hashes[1], [0]) is None
    with pytest.raises(ForeignBlockError):
        VllmBlockPool(10, True, BS).cache_full_blocks(r, loose, 0, 2, BS, 0)


def test_parity_pool_leaves_blocks_of_no_pool_alone_in_free_blocks() -> None:
    ours = ParityBlockPool(4, True, BS)
    got = ours.get_new_blocks(2)
    before = LOOSE_BLOCKS["ignored"]
    ours.free_blocks([got[0], KVCacheBlock(block_id=3), got[1]])
    assert (LOOSE_BLOCKS["ignored"] - before, ours.get_num_free_blocks()) == (1, 3)


def test_unpinned_block_goes_to_tail_and_watcher_fires_on_reuse() -> None:
    _, ours = pools(4)
    a = ours.get_new_blocks(2)
    seen: list[int] = []
    ours.unpin_blocks([a[0]], lambda b: seen.append(b.block_id))
    assert ids(ours.free_block_queue.get_all_free_blocks()) == [3, 1]
    ours.get_new_blocks(2)
    assert seen == [1]


class Collector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_block_allocated(self, b: Any) -> None:
        self.calls.append(("alloc", b.block_id))

    def on_block_accessed(self, b: Any) -> None:
        self.calls.append(("access", b.block_id))

    def on_block_evicted(self, b: Any) -> None:
        self.calls.append(("evict", b.block_id))

    def reset(self) -> None:
        self.calls.append(("reset", -1))


def test_metrics_hooks_fire_as_in_vllm() -> None:
    calls = []
    for cls in (VLLM_BLOCK_POOL, VllmBlockPool):
        mc = Collector()
        p = cls(6, True, BS, metrics_collector=mc)
        a = p.get_new_blocks(2)
        p.touch(a[:1] + [p.null_block])
        p.evict_blocks({a[1].block_id})
        p.free_blocks(a)
        p.free_blocks(a[:1])
        p.reset_prefix_cache()
        calls.append(mc.calls)
    assert calls[0] == calls[1]


def test_free_is_tagged_with_the_last_scheduled_step() -> None:
    _, ours = pools()
    assert ours.hazards is not None
    ours.hazards.add_stream("nixl", StreamKind.HOST)

    class Out:
        total_num_scheduled_tokens = 8
        new_block_ids_to_zero = None

    blocks = ours.get_new_blocks(2)
    ours.hazards.step_record(Out())
    ours.free_blocks(blocks)
    again = ours.get_new_blocks(9)  # the whole free queue
    assert set(ids(blocks)) <= set(ids(again))
    # compute is ordered after its own steps: nothing to wait for, tagged or not
    assert toks(ours.core.fence_for(again, "compute")) == set()
    # blocks nobody freed carry no token; the freed ones carry step 1, which
    # another stream must wait for (empty if the free was not tagged)
    untouched = [b for b in again if b not in blocks]
    assert toks(ours.core.fence_for(untouched, "nixl")) == set()
    assert toks(ours.core.fence_for(blocks, "nixl")) == {"compute:1"}
    ours.hazards.step_record(Out())
    ours.free_blocks(again)
    t = ours.hazards.begin_load("r", ours.get_new_blocks(2), "nixl")
    assert toks(t.fence) == {"compute:2"}


def test_hazards_off_gives_a_plain_pool() -> None:
    ours = VllmBlockPool(6, True, BS, track_hazards=False)
    assert ours.hazards is None and not ours.core.track_hazards


def test_register_binds_ours_where_vllm_builds_its_pool_and_unregister_restores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm.v1.core.block_pool as bp
    import vllm.v1.core.kv_cache_coordinator as co

    from blockpool.integrations import vllm as plugin

    monkeypatch.delenv(plugin.ENV_PLUGIN, raising=False)
    was_installed = plugin.is_installed()
    plugin.register()
    plugin.register()
    assert plugin.is_installed() and co.BlockPool is VllmBlockPool and bp.BlockPool is VllmBlockPool
    plugin.unregister()
    assert co.BlockPool is VLLM_BLOCK_POOL and bp.BlockPool is VLLM_BLOCK_POOL
    if was_installed:
        plugin.register()


def test_a_stored_event_queued_by_the_core_earlier_is_not_taken_for_this_calls() -> None:
    ours = VllmBlockPool(10, True, BS, enable_kv_cache_events=True)
    r = request("a", list(range(12)))
    a = ours.get_new_blocks(3)
    key = make_block_hash_with_group_id(r.block_hashes[2], 0)
    ours.core.cache_full_blocks(a, [None, None, key], 2, 3, BS)  # queued in the core, not pulled yet
    ours.cache_full_blocks(r, a, 2, 3, BS, 0, block_mask=[False])  # this call publishes nothing
    stored = [e for e in ours.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[]]  # this call's (vLLM queues one, empty); not the core's


def test_a_block_listed_twice_in_one_cache_full_blocks_call_matches_vllm() -> None:
    theirs, ours = pools(6)
    for p in (theirs, ours):
        r = request("a", list(range(9)))
        (b,) = p.get_new_blocks(1)
        p.cache_full_blocks(r, [b, b], 0, 2, BS, 0)  # vLLM promotes at the second entry
    assert state(ours) == state(theirs)
    assert ours.take_events() == theirs.take_events()
    ours.core.check()


def test_too_few_block_hashes_are_refused_before_any_change() -> None:

    ours = VllmBlockPool(10, True, BS, enable_kv_cache_events=True)
    r = request("a", list(range(9)))  # two full blocks: two hashes
    a = ours.get_new_blocks(3)
    ours.take_events()
    before = state(ours)
    with pytest.raises(InvalidArgumentError, match="2 block hashes for 3 full blocks"):
        ours.cache_full_blocks(r, a, 1, 3, BS, 0)
    assert state(ours) == before and ours.take_events() == []


def test_a_failed_loads_removals_reach_take_events_when_nothing_else_is_queued() -> None:
    # The adapter moves the core's events only when the core queued some or
    # has completions to apply: a failure reported from another thread
    # since the last call must still withdraw the keys, with vLLM's events.
    ours = VllmBlockPool(10, True, BS, enable_kv_cache_events=True)
    ours.hazards.add_stream("nixl", StreamKind.HOST)
    r = request("a", list(range(9)))
    a = ours.get_new_blocks(2)
    load = ours.hazards.begin_load("a", a, "nixl")
    ours.cache_full_blocks(r, a, 0, 2, BS, 0)
    ours.take_events()
    ours.core.fail(load.token)
    removed = [e for e in ours.take_events() if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [
        maybe_convert_block_hash(h) for h in r.block_hashes[:2]
    ]
    assert ours.get_cached_block(r.block_hashes[0], [0]) is None


def test_usage_is_vllms_figure_and_the_cores_held_blocks_included() -> None:
    theirs, ours = pools(10)
    for p in (theirs, ours):
        p.get_new_blocks(3)
    assert ours.get_usage() == theirs.get_usage() == ours.core.get_usage() == pytest.approx(3 / 9)
    ours.hazards.add_stream("nixl", StreamKind.HOST)
    (b,) = ours.get_new_blocks(1)
    ours.hazards.begin_load("x", [b], "nixl")
    ours.free_blocks([b])  # held back while the load may still write it: used
    assert ours.core.held_block_ids() == [b.block_id]
    assert ours.get_usage() == ours.core.get_usage() == pytest.approx(4 / 9)
    assert VllmBlockPool(1, True, BS).get_usage() == VLLM_BLOCK_POOL(1, True, BS).get_usage() == 0.0


def test_free_count_applies_a_completion_queued_from_another_thread_first() -> None:
    ours = VllmBlockPool(10, True, BS)
    ours.hazards.add_stream("nixl", StreamKind.HOST)
    (b,) = ours.get_new_blocks(1)
    load = ours.hazards.begin_load("x", [b], "nixl")
    ours.free_blocks([b])  # held back while the load may still write it
    free = ours.get_num_free_blocks()
    ours.core.complete(load.token)  # queued, as a transfer thread reports it
    assert ours.get_num_free_blocks() == free + 1
    assert ours.core.held_block_ids() == []


def test_cache_full_blocks_deep_into_a_long_request_publishes_with_vllms_keys_and_event() -> None:
    # The keys are made for positions lo - 1 .. hi - 1 only (not padded to lo).
    theirs, ours = pools(40)
    r = request("a", list(range(30 * BS + 1)))
    for p in (theirs, ours):
        blocks = p.get_new_blocks(30)
        p.cache_full_blocks(r, blocks, 0, 28, BS, 0)
        p.cache_full_blocks(r, blocks, 28, 30, BS, 0)
    assert state(ours) == state(theirs)
    assert ours.take_events() == theirs.take_events()


def test_the_cores_removals_and_resets_moved_together_keep_their_order() -> None:
    # The adapter hands a run of the core's removals to vLLM's helper in one
    # call: the events around a reset must keep the core's order.
    ours = VllmBlockPool(10, True, BS, enable_kv_cache_events=True)
    r = request("a", list(range(9)))
    keys = [make_block_hash_with_group_id(h, 0) for h in r.block_hashes]
    core = ours.core
    a = core.get_new_blocks(2)
    core.cache_full_blocks(a, keys, 0, 2, BS)
    core.free_blocks(a)
    core.evict_blocks([b.block_id for b in a])
    core.reset_prefix_cache()
    core.cache_full_blocks(core.get_new_blocks(1), keys, 0, 1, BS)
    core.evict_blocks([b.block_id for b in core.blocks if b.block_hash is not None])
    events = ours.take_events()
    assert [type(e).__name__ for e in events] == [
        "BlockRemoved",
        "BlockRemoved",
        "AllBlocksCleared",
        "BlockRemoved",
    ]
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [
        [maybe_convert_block_hash(h)] for h in (r.block_hashes[0], r.block_hashes[1], r.block_hashes[0])
    ]


@pytest.mark.parametrize("cls", [VllmBlockPool, ParityBlockPool], ids=lambda c: c.__name__)
def test_every_method_of_vllms_pool_has_vllms_parameters_on_ours(cls: type) -> None:
    """vLLM's code calls its pool by keyword too (0.34's SimpleCPUOffload:
    ``free_blocks(blocks, evict_first=...)``): every method vLLM's
    ``BlockPool`` defines is on ours with vLLM's parameter names, in order
    (ours may add optional ones after them)."""
    import inspect

    checked = 0
    for name, fn in vars(VLLM_BLOCK_POOL).items():
        if not inspect.isfunction(fn):
            continue
        if name.startswith("_") and not hasattr(cls, name):
            continue  # a private helper of vLLM's own methods, which ours replace
        theirs = [p for p in inspect.signature(fn).parameters]
        params = inspect.signature(getattr(cls, name)).parameters.values()
        if name == "__init__" and "num_hash_lookahead_tokens" not in theirs:
            # vLLM 0.32: no lookahead argument; its medium, passed in that
            # place, is taken as the medium
            assert cls(4, True, BS, False, None, "CPU_TIER").medium == "CPU_TIER"
            continue
        if [p.kind for p in params][1:] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
            continue  # passed through unchanged (ParityBlockPool.__init__)
        positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        mine = [p.name for p in positional]
        assert mine[: len(theirs)] == theirs, (name, mine, theirs)
        # anything more (evict_first before vLLM 0.34) is optional
        assert all(p.default is not inspect.Parameter.empty for p in positional[len(theirs) :]), name
        checked += 1
    assert checked >= 20  # vLLM's public methods at least


def test_evict_first_frees_as_vllms_pool_where_vllm_has_it_and_is_refused_unchanged_elsewhere() -> None:
    import inspect

    theirs, ours = pools()
    has = "evict_first" in inspect.signature(VLLM_BLOCK_POOL.free_blocks).parameters
    for p in (theirs, ours) if has else (ours,):
        r = request("a", list(range(3 * BS)))
        blocks = p.get_new_blocks(3)
        p.cache_full_blocks(r, blocks, 0, 3, BS, 0)
        old = p.get_new_blocks(1)
        p.free_blocks(old)
        if has:
            p.free_blocks(blocks[::-1], evict_first=True)
    if has:
        assert state(ours) == state(theirs)
        assert ours.take_events() == theirs.take_events()
        assert [b.block_id for b in ours.free_block_queue.get_all_free_blocks()][:3] == [3, 2, 1]
    else:
        before = state(ours)
        blocks = [ours.blocks[i] for i in (1, 2, 3)]
        with pytest.raises(InvalidArgumentError, match="evict_first"):
            ours.free_blocks(blocks, evict_first=True)
        assert state(ours) == before
