"""The shadow functions and the pending writes that undo them
(`blockpool.core.shadows`, `blockpool.core.pending_writes`): a write saves
what it replaced grouped by shared shadow objects, and a failed write puts
back each block's own shadow, however the groups were formed."""

from __future__ import annotations

import pytest

from blockpool import AccessKind, HazardAwareBlockPool, InvalidArgumentError
from blockpool.core.block import KVCacheBlock
from blockpool.core.events import BlockRemoved
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
    pw.began(t1, write([a, b, c], t1, None))
    s = tr.issue("d2h")
    tag([b, c], s, R, tr.is_ended)
    load = tr.issue("h2d")
    pw.began(load, write([a, b, c], load, None))
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
    pw.began(first, write([a, b], first, None))  # one group: (None, (step,), [a, b])
    second = tr.issue("rdma")
    pw.began(second, write([a], second, None))  # a rewritten since
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


# -- a token that wrote a block twice, another write in between -------------

HB_STREAMS = {"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE, "nic": StreamKind.HOST}


def test_a_write_recorded_after_a_later_write_that_waited_on_it_is_refused_and_changes_nothing() -> None:
    from tests.hb_model import HBModel

    pool, hb = HazardAwareBlockPool(4, streams=HB_STREAMS), HBModel(HB_STREAMS)
    (b,) = pool.get_new_blocks(1)
    load, f = pool.begin_load([b], "nic")
    hb.issue(load, f)
    hb.tag([1], load, W)
    f = pool.fence_for([b], "compute")
    hb.judge(f, [([1], W)], "compute")
    hb.stream_waits("compute", f)
    step = pool.issue("compute")
    hb.issue(step)
    pool.tag([b], step, W)
    hb.tag([1], step, W)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="recorded after compute:1"):
        pool.tag([b], load, W)  # nic:1 "writes b again": the step waited on it, so it ran before
    assert pool.snapshot() == before
    pool.fail(load)
    hb.report(load, True)
    fence = pool.fence_for([b], "h2d")
    hb.judge(fence, [([1], W)], "h2d")  # the model: the step's write is still in flight
    assert toks(fence) == {str(step)}
    pool.check()


def test_alternating_writes_of_two_tokens_undo_to_the_right_write_each_time() -> None:
    tr = HazardTracker()
    for name in ("compute", "h2d", "a", "b"):
        tr.add_stream(name, StreamKind.HOST if name in ("a", "b") else StreamKind.DEVICE)
    pw = PendingWrites()
    blk = KVCacheBlock(1)
    t, u = tr.issue("a"), tr.issue("b")
    for tok in (t, u, t, u):  # t, u, t, u write the block in turn
        pw.began(tok, write([blk], tok, None))
    assert pw.ended(t, True, tr.end(t, True), tr.is_ended) == []  # u wrote last: nothing restored now
    assert blk.writer is u
    assert [x.block_id for x in pw.ended(u, True, tr.end(u, True), tr.is_ended)] == [1]
    assert (blk.writer, blk.readers) == (None, None)  # neither write happened


def test_a_failed_write_handed_on_from_a_group_of_several_blocks_keeps_the_later_writes_order() -> None:
    pool = HazardAwareBlockPool(
        8,
        enable_kv_cache_events=True,
        streams={"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE, "rdma": StreamKind.HOST},
    )
    x, y, z = pool.get_new_blocks(3)
    load, _ = pool.begin_load([x, y, z], "h2d")
    pool.cache_full_blocks([x, y, z], ["kx", "ky", "kz"], 0, 3, 16)
    w2 = pool.issue("rdma")
    pool.tag([z, y, x], w2, W)  # one group of three: (load, None, [z, y, x])
    pool.fail(load)  # hands what the load replaced to w2, block by block
    assert [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)] == []
    pool.fail(w2)
    removed = [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [("kz",), ("ky",), ("kx",)]  # w2's block order
    assert all((blk.writer, blk.readers) == (None, None) for blk in (x, y, z))
    pool.check()


# -- a write recorded after accesses ordered after it --------------------------


def test_a_write_recorded_again_keeps_the_read_of_a_stream_that_waited_on_it() -> None:
    from tests.hb_model import HBModel

    streams = {"compute": StreamKind.DEVICE, "d2h": StreamKind.DEVICE, "h2d": StreamKind.DEVICE}
    pool, hb = HazardAwareBlockPool(4, streams=streams), HBModel(streams)
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    hb.issue(e1)
    pool.tag([b], e1, W)
    hb.tag([1], e1, W)
    store, f = pool.begin_store([b], "d2h")  # waits on e1, then reads b
    hb.stream_waits("d2h", f)
    hb.issue(store)
    hb.tag([1], store, R)
    pool.tag([b], e1, W)  # the same write recorded again
    hb.tag([1], e1, W)
    fence = pool.fence_for([b], "h2d")
    hb.judge(fence, [([1], W)], "h2d")
    assert toks(fence) == {str(store)}  # the store, which ends after e1
    pool.check()


@pytest.mark.parametrize("access", [R, W])
def test_a_write_by_an_older_token_of_a_stream_after_a_newer_tokens_access_is_refused(
    access: AccessKind,
) -> None:
    pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE})
    blocks = pool.get_new_blocks(2)
    e1, e2 = pool.issue("compute"), pool.issue("compute")
    pool.tag(blocks[1:], e2, access)  # step 2 (enqueued after step 1) is recorded first
    for call in (
        lambda: pool.tag(blocks, e1, W),  # step 1's write recorded after: refused, block 1 untouched too
        lambda: pool.free_blocks(blocks, token=e1, access=W),
    ):
        before = pool.snapshot()
        with pytest.raises(InvalidArgumentError, match="record accesses in the order they run"):
            call()
        assert pool.snapshot() == before
    pool.tag(blocks[:1], e1, W)  # a block step 2 never touched: fine
    assert toks(pool.fence_for(blocks, "h2d", W)) == {"compute:2"}
    pool.check()


def test_a_write_recorded_again_keeps_a_read_recorded_since_for_its_undo() -> None:
    from tests.hb_model import HBModel

    streams = {"compute": StreamKind.DEVICE, "d2h": StreamKind.DEVICE, "h2d": StreamKind.DEVICE}
    pool, hb = HazardAwareBlockPool(8, streams=streams), HBModel(streams)
    b, c = pool.get_new_blocks(2)
    x = pool.issue("d2h")  # an offload reads c
    hb.issue(x)
    pool.tag([c], x, R)
    hb.tag([c.block_id], x, R)
    f = pool.fence_for([b, c], "compute", W)  # step 1 waits on it
    hb.judge(f, [([b.block_id, c.block_id], W)], "compute")
    hb.stream_waits("compute", f)
    e1 = pool.issue("compute")
    hb.issue(e1)
    pool.tag([b], e1, W)
    hb.tag([b.block_id], e1, W)
    pool.tag([b], x, R)  # the offload read b too (recorded late: it ran before e1)
    hb.tag([b.block_id], x, R)
    pool.tag([b], e1, W)  # step 1's write recorded again: changes nothing
    hb.tag([b.block_id], e1, W)
    assert (b.writer, b.readers) == (e1, (x,))
    pool.fail(e1)  # the write never happened; the offload may still run
    hb.report(e1, True)
    fence = pool.fence_for([b], "h2d", W)
    hb.judge(fence, [([b.block_id], W)], "h2d")
    assert toks(fence) == {str(x)}
    pool.check()
