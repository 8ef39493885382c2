"""Block records (``blockpool/core/block.py``): one behaviour per test."""

from __future__ import annotations

import pickle

import pytest

from blockpool import AccessKind, ForeignBlockError, HazardAwareBlockPool
from blockpool.core.block import KVCacheBlock, NullBlock

FIELDS = ("block_id", "ref_cnt", "block_hash", "block_hash_num_tokens", "writer", "readers")


def fields(b: KVCacheBlock) -> tuple[object, ...]:
    return tuple(getattr(b, f) for f in FIELDS)


def test_a_pools_block_pickles_with_its_fields_but_not_its_queue_links(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a[:2], ["k1", "k2"], 0, 2, block_size=16)
    e1 = pool.issue("compute")
    pool.tag(a[1:], e1, AccessKind.WRITE)
    pool.free_blocks(a[:2], token=pool.issue("compute"))
    for b in a:
        back = pickle.loads(pickle.dumps(b))
        assert type(back) is KVCacheBlock and type(b) is not KVCacheBlock  # the pool's own class
        assert fields(back) == fields(b)
        assert (back.prev_free_block, back.next_free_block) == (None, None)
    assert fields(pickle.loads(pickle.dumps(a[1]))) == (2, 0, "k2", 32, e1, pool.last_token("compute"))


def test_the_null_block_pickles_as_a_null_block(pool: HazardAwareBlockPool) -> None:
    back = pickle.loads(pickle.dumps(pool.null_block))
    assert type(back) is NullBlock and back.is_null and fields(back) == fields(pool.null_block)


def test_an_unpickled_block_belongs_to_no_pool(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(ForeignBlockError):
        pool.free_blocks([pickle.loads(pickle.dumps(b))])
    assert (b.ref_cnt, pool.get_num_free_blocks()) == (1, 8)
