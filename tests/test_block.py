"""Block records (``blockpool/core/block.py``): one behaviour per test."""

from __future__ import annotations

import pickle

import pytest

from blockpool import AccessKind, ForeignBlockError, HazardAwareBlockPool, InvalidArgumentError
from blockpool.core.block import KVCacheBlock, NullBlock, block_class_for_pool

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
    assert fields(pickle.loads(pickle.dumps(a[1]))) == (2, 0, "k2", 32, e1, (pool.last_token("compute"),))


def test_the_null_block_pickles_as_a_null_block(pool: HazardAwareBlockPool) -> None:
    back = pickle.loads(pickle.dumps(pool.null_block))
    assert type(back) is NullBlock and back.is_null and fields(back) == fields(pool.null_block)


def test_an_unpickled_block_belongs_to_no_pool(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(ForeignBlockError):
        pool.free_blocks([pickle.loads(pickle.dumps(b))])
    assert (b.ref_cnt, pool.get_num_free_blocks()) == (1, 8)


class Adapted(KVCacheBlock):
    """An adapter's block type (the host framework's record, say)."""

    __slots__ = ()


def factory(cls: type[KVCacheBlock]) -> object:
    return lambda i: NullBlock(0) if i == 0 else cls(i)


def test_a_factorys_blocks_of_the_pools_own_class_are_checked_by_type() -> None:
    cls = block_class_for_pool(Adapted)
    assert (cls.__name__, cls.__module__, cls.__qualname__) == ("Adapted", __name__, "Adapted")
    pool = HazardAwareBlockPool(4, block_factory=factory(cls), block_class=cls)
    assert [type(b) for b in pool.blocks] == [NullBlock, cls, cls, cls] and pool._block_cls is cls
    got = pool.get_new_blocks(2)
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 3
    other = HazardAwareBlockPool(4, block_factory=factory(block_class_for_pool(Adapted)))
    with pytest.raises(ForeignBlockError):
        pool.free_blocks([other.blocks[1]])
    assert type(pickle.loads(pickle.dumps(pool.blocks[1]))) is Adapted


@pytest.mark.parametrize(
    ("make_cls", "with_factory", "message"),
    [
        (lambda: block_class_for_pool(Adapted), False, "needs block_factory"),
        (lambda: Adapted, True, "importable by its name"),
        (lambda: "Adapted", True, "must be a class"),
    ],
)
def test_a_bad_block_class_is_refused(make_cls: object, with_factory: bool, message: str) -> None:
    cls = make_cls()  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError, match=message):
        HazardAwareBlockPool(4, block_factory=factory(Adapted) if with_factory else None, block_class=cls)


class ComparedByFields(KVCacheBlock):
    """A block type with a field-wise ``==`` (vLLM's dataclass's), so no hash."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlock) and other.block_id == self.block_id


def test_a_factory_of_unhashable_blocks_is_refused_and_does_not_claim_its_block_class() -> None:
    cls = block_class_for_pool(ComparedByFields)
    with pytest.raises(InvalidArgumentError, match="ComparedByFields blocks, which are not hashable"):
        HazardAwareBlockPool(4, block_factory=factory(cls), block_class=cls)
    # refused again, not as "already another pool's"
    with pytest.raises(InvalidArgumentError, match="not hashable"):
        HazardAwareBlockPool(4, block_factory=factory(cls), block_class=cls)


def test_a_block_class_serves_one_pool_only_and_a_failed_build_does_not_claim_it() -> None:
    cls = block_class_for_pool(Adapted)
    with pytest.raises(InvalidArgumentError, match="null block"):
        HazardAwareBlockPool(4, block_factory=cls, block_class=cls)  # block 0 not null
    HazardAwareBlockPool(4, block_factory=factory(cls), block_class=cls)
    with pytest.raises(InvalidArgumentError, match="already another pool's"):
        HazardAwareBlockPool(4, block_factory=factory(cls), block_class=cls)
