"""The shadow functions and the pending writes that undo them
(`blockpool.core.shadows`, `blockpool.core.pending_writes`): a write saves
what it replaced grouped by shared shadow objects, and a failed write puts
back each block's own shadow, however the groups were formed."""

from __future__ import annotations

from blockpool import AccessKind, HazardAwareBlockPool
from blockpool.core.block import KVCacheBlock
from blockpool.core.hazards import StreamKind, Token
from blockpool.core.pending_writes import PendingWrites
from blockpool.core.shadows import tag, with_read, write
from blockpool.core.tracker import HazardTracker
from tests.conftest import toks

R, W = AccessKind.READ, AccessKind.WRITE


def never(_: Token) -> bool:
    return False


def test_write_groups_blocks_by_shared_shadow_objects_and_leaves_out_null_and_own_writes() -> None:
    null, a, b, c, d = (KVCacheBlock(i) for i in range(5))
    t1, t2, s = Token("compute", 1), Token("compute", 2), Token("d2h", 1)
    write([a, b, c], t1, null)
    tag([b, c], s, R, never)  # b and c share one readers object
    replaced = write([null, a, b, c, d], t2, null)
    assert [(w, r, [x.block_id for x in g]) for w, r, g in replaced] == [
        (t1, None, [1]),
        (t1, (s,), [2, 3]),
        (None, None, [4]),
    ]
    assert (null.writer, null.readers) == (None, None)  # the null block is never written
    assert all((x.writer, x.readers) == (t2, None) for x in (a, b, c, d))
    assert write([a, d], t2, null) == []  # written by t2 already: nothing replaced


def test_readers_are_a_tuple_even_for_one_reader() -> None:
    t = Token("d2h", 1)
    assert with_read(None, t, never) == (t,)
    assert with_read((Token("d2h", 1),), Token("d2h", 2), never) == (Token("d2h", 2),)
    assert with_read((t,), Token("xfer", 1, StreamKind.HOST), never) == (t, Token("xfer", 1, StreamKind.HOST))


def test_a_failed_grouped_write_restores_each_blocks_own_shadow() -> None:
    tr = HazardTracker()
    for name in ("compute", "d2h", "h2d"):
        tr.add_stream(name, StreamKind.DEVICE)
    pw = PendingWrites()
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    t1 = tr.issue("compute")
    pw.began(t1, write([a, b, c], t1, None), [a, b, c])
    s = tr.issue("d2h")
    tag([b, c], s, R, tr.is_ended)
    load = tr.issue("h2d")
    pw.began(load, write([a, b, c], load, None), [a, b, c])
    undone = pw.ended(load, True, tr.end(load, True), tr.is_ended)
    assert [x.block_id for x in undone] == [1, 2, 3]
    assert (a.writer, a.readers) == (t1, None)
    assert (b.writer, b.readers) == (c.writer, c.readers) == (t1, (s,))
    assert all(pw.is_invalid(i) for i in (1, 2, 3))


def test_a_failed_write_rewritten_since_hands_its_replaced_shadow_to_the_later_write_of_that_block_only() -> (
    None
):
    tr = HazardTracker()
    for name in ("compute", "h2d", "rdma"):
        tr.add_stream(name, StreamKind.DEVICE)
    pw = PendingWrites()
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    step = tr.issue("compute")
    tag([a, b], step, R, tr.is_ended)
    first = tr.issue("h2d")
    pw.began(first, write([a, b], first, None), [a, b])  # one group: (None, (step,), [a, b])
    second = tr.issue("rdma")
    pw.began(second, write([a], second, None), [a])  # a rewritten since
    assert [x.block_id for x in pw.ended(first, True, tr.end(first, True), tr.is_ended)] == [2]
    assert (b.writer, b.readers) == (None, (step,))  # b: back to before the failed write
    assert a.writer is second  # a: still the later write's
    assert [x.block_id for x in pw.ended(second, True, tr.end(second, True), tr.is_ended)] == [1]
    assert (a.writer, a.readers) == (None, (step,))  # not back to the failed first write


def test_the_fence_after_a_failed_grouped_write_names_each_blocks_restored_readers() -> None:
    pool = HazardAwareBlockPool(
        8,
        streams={
            "compute": StreamKind.DEVICE,
            "h2d": StreamKind.DEVICE,
            "d2h": StreamKind.DEVICE,
            "rdma": StreamKind.DEVICE,
        },
    )
    x, y = pool.get_new_blocks(2)
    store = pool.begin_store([y], "d2h")[0]  # only y is read by a store
    load, _ = pool.begin_load([x, y], "h2d")
    pool.fail(load)
    assert toks(pool.fence_for([x], "rdma")) == set()
    assert toks(pool.fence_for([y], "rdma")) == {str(store)}
