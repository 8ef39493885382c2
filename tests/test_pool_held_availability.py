"""Blocks held back for host transfers do not cost availability beyond the
hold itself: a prefix-cache reset succeeds while only held blocks are busy
(they keep their hold and lose their keys), and a block freed with
``evict_first`` while held goes to the free queue's front when released."""

from __future__ import annotations

import logging

import pytest

from blockpool import AccessKind, AllBlocksCleared, HazardAwareBlockPool
from tests.conftest import ids, make_pool

WRITE = AccessKind.WRITE


def _stored_and_freed(pool: HazardAwareBlockPool, n: int, keys: list[str], **free_kw: object):  # type: ignore[no-untyped-def]
    """``n`` cached blocks a host store still reads, freed by their request."""
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(blocks, keys, 0, n, block_size=16)
    pool.tag(blocks, pool.issue("compute"), WRITE)
    store, _ = pool.begin_store(blocks, "rdma")
    pool.free_blocks(blocks, token=None, **free_kw)  # type: ignore[arg-type]
    assert sorted(pool.held_block_ids()) == sorted(ids(blocks))
    return blocks, store


# -- reset_prefix_cache while blocks are held ----------------------------------


def test_a_reset_with_only_held_blocks_busy_succeeds_and_they_keep_their_hold() -> None:
    pool = make_pool()
    blocks, store = _stored_and_freed(pool, 2, ["h0", "h1"])
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert (pool.get_cached_block("h0"), pool.get_cached_block("h1")) == (None, None)
    assert [b.block_hash for b in blocks] == [None, None]
    assert sorted(pool.held_block_ids()) == ids(blocks)  # the store may still read them
    assert pool.get_num_free_blocks() == 7
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check()
    pool.complete(store)
    assert pool.held_block_ids() == [] and pool.get_num_free_blocks() == 9  # every block came back
    pool.check()


def test_a_reset_with_a_block_in_use_still_fails_and_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = make_pool()
    _stored_and_freed(pool, 1, ["h0"])
    (used,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([used], ["u"], 0, 1, block_size=16)
    pool.take_events()
    before = pool.snapshot()
    with caplog.at_level(logging.WARNING):
        assert pool.reset_prefix_cache() is False
    assert pool.snapshot() == before and pool.take_events() == []
    assert "some blocks (1) are not freed yet" in caplog.text


# -- held blocks keep evict_first -----------------------------------------------


def test_a_held_block_freed_with_evict_first_goes_to_the_front_when_released() -> None:
    pool = make_pool(6)
    older = pool.get_new_blocks(2)  # cached blocks freed before: evicted before the held ones by LRU
    pool.cache_full_blocks(older, ["o0", "o1"], 0, 2, block_size=16)
    pool.free_blocks(older, token=None)
    blocks, store = _stored_and_freed(pool, 2, ["h0", "h1"], evict_first=True)
    pool.complete(store)
    assert pool.held_block_ids() == []
    assert [b.block_id for b in pool.free_block_queue][:2] == ids(
        blocks
    )  # evicted first, in the listed order
    assert pool.get_new_blocks(2) == blocks
    pool.check()


def test_a_held_block_freed_without_evict_first_keeps_the_lru_placement() -> None:
    pool = make_pool(6)
    older = pool.get_new_blocks(2)
    pool.cache_full_blocks(older, ["o0", "o1"], 0, 2, block_size=16)
    pool.free_blocks(older, token=None)
    blocks, store = _stored_and_freed(pool, 2, ["h0", "h1"])
    pool.complete(store)
    pool.poll()
    assert [b.block_id for b in pool.free_block_queue][-2:] == ids(blocks)  # keyed: the back
    pool.check()


def test_a_held_evict_first_block_taken_back_by_a_hit_forgets_the_placement() -> None:
    pool = make_pool(6)
    blocks, store = _stored_and_freed(pool, 2, ["h0", "h1"], evict_first=True)
    pool.touch(blocks[:1])  # a prefix hit takes it back before the store ends
    pool.free_blocks(blocks[:1], token=None)  # freed again, without evict_first: held, default placement
    pool.complete(store)
    pool.poll()
    order = [b.block_id for b in pool.free_block_queue]
    assert order[0] == blocks[1].block_id and order[-1] == blocks[0].block_id
    pool.check()
