"""The fences the pool computes (``blockpool/core/_fences.py``): loads wait on
the readers of the blocks they overwrite (WAR), stores on the last writer
(RAW), and frees under async scheduling are tagged with the last enqueued
step. One test per behaviour.

``eN`` is the token of step N on ``compute``; ``h2d``/``d2h`` are DMA
streams, ``rdma`` a host-driven engine.
"""

from __future__ import annotations

import pytest

from blockpool import (
    AccessKind,
    HazardAwareBlockPool,
    InvalidArgumentError,
    InvariantError,
    Token,
)
from tests.conftest import ids, make_pool, toks


def steps(pool: HazardAwareBlockPool, n: int) -> list[Token]:
    return [pool.issue("compute") for _ in range(n)]


# 1. Load into a block compute may still be reading (WAR) -------------------


def test_load_into_blocks_freed_mid_step_waits_exactly_on_that_step(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    _e1, e2, e3 = steps(pool, 3)
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
    _token, load_fence = pool.begin_load(blocks, "h2d")
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
    _s1, _ = pool.begin_store([b], "d2h")
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


# 5. The fast path: streams with nothing in flight are not scanned -----------
# (fence_of skips a group when no other stream has a token that may still run
# and is not ordered before the consumer; reads only need live *writes*.)


def test_read_fence_waits_on_a_live_load_though_its_stream_since_only_read(
    pool: HazardAwareBlockPool,
) -> None:
    loaded, other = pool.get_new_blocks(1), pool.get_new_blocks(1)
    load, _ = pool.begin_load(loaded, "h2d")  # h2d:1 writes
    pool.tag(other, pool.issue("h2d"), AccessKind.READ)  # h2d:2 only reads
    assert toks(pool.fence_for(loaded, "compute", AccessKind.READ)) == {str(load)}
    assert not pool.fence_for(other, "compute", AccessKind.READ)  # RAW: no writer
    assert toks(pool.fence_for(other, "compute")) == {"h2d:2"}  # WAR on the reader
    pool.check()


def test_read_fence_is_empty_when_other_streams_only_read_and_write_fence_is_not(
    pool: HazardAwareBlockPool,
) -> None:
    blocks = pool.get_new_blocks(2)
    load, _ = pool.begin_load(blocks, "h2d")
    pool.complete(load)  # the only write of h2d ended
    store, _ = pool.begin_store(blocks, "d2h")  # a read still running on d2h
    read = pool.issue("h2d")
    pool.tag(blocks, read, AccessKind.READ)  # and one on h2d
    assert pool.tracker.busy == {"d2h", "h2d"}
    assert not pool.fence_for(blocks, "compute", AccessKind.READ)
    assert toks(pool.fence_for(blocks, "compute", AccessKind.WRITE)) == {str(store), str(read)}
    pool.complete(store)
    pool.complete(read)
    assert not pool.fence_for(blocks, "compute", AccessKind.WRITE)
    assert pool.tracker.busy == set()
    pool.check()


def test_fence_skips_writes_the_consumer_is_already_ordered_after(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(1)
    load, _ = pool.begin_load(blocks, "h2d")
    assert toks(pool.fence_for(blocks, "compute", AccessKind.READ)) == {str(load)}  # compute now waits on it
    later = pool.issue("h2d")  # still running, but wrote nothing
    pool.tag(blocks, later, AccessKind.READ)
    assert not pool.fence_for(blocks, "compute", AccessKind.READ)
    assert toks(pool.fence_for(blocks, "compute", AccessKind.WRITE)) == {str(later)}


def test_check_reports_a_busy_set_out_of_step_with_the_tokens(pool: HazardAwareBlockPool) -> None:
    pool.issue("h2d")
    pool.tracker.busy.discard("h2d")  # a fence would skip h2d's tokens
    with pytest.raises(InvariantError, match="busy streams"):
        pool.check()


def test_check_reports_a_writer_above_its_streams_last_write(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(1)
    pool.begin_load(blocks, "h2d")
    pool.tracker.streams["h2d"].last_write = 0  # reads would skip the load
    with pytest.raises(InvariantError, match="not a recorded write"):
        pool.check()


# 6. A fence for the work of a token issued before the wait -------------------


def test_step_token_issued_before_its_fence_ends_the_fence_when_it_completes(
    pool: HazardAwareBlockPool,
) -> None:
    b, c = pool.get_new_blocks(2)
    store, _ = pool.begin_store([b, c], "rdma")  # a host store reads b and c
    step = pool.issue("compute")  # step N scheduled: eN issued before its forward's fence
    fence = pool.fence_for([b], "compute", AccessKind.WRITE, token=step)
    assert list(fence) == [store]  # the forward waits on the store, then writes b
    pool.tag([b], step, AccessKind.WRITE)
    pool.complete(step)  # eN's event is recorded after that wait: the store ended too
    assert pool.is_ended(store)
    pool.free_blocks([c])
    assert pool.holdback.held_ids() == [] and not pool.fence_for([c], "h2d")
    pool.check()


def test_fence_for_refuses_a_token_of_another_stream_and_changes_nothing(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    pool.begin_store([b], "rdma")
    load = pool.issue("h2d")
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="not a token of stream"):
        pool.fence_for([b], "compute", AccessKind.WRITE, token=load)
    assert pool.snapshot() == before


@pytest.mark.parametrize("case", ["not newest", "host", "cycle", "waited on"])
def test_fence_for_refuses_a_token_it_cannot_order_exactly_and_changes_nothing(case: str) -> None:
    pool = make_pool(8)
    a, b = pool.get_new_blocks(2)
    if case == "not newest":
        token = pool.issue("compute")
        pool.issue("compute")  # step 2 is ordered after step 1 already
        stream = "compute"
    elif case == "host":
        token, _ = pool.begin_load([a], "rdma")  # a host engine's token would wait on itself
        stream = "rdma"
    else:
        token = pool.issue("compute")
        stream = "compute"
        pool.tag([a], token, AccessKind.WRITE)
        if case == "cycle":
            pool.begin_store([a, b], "d2h")  # the store waited on the step
        else:
            pool.fence_for([a], "h2d")  # h2d waited on the step
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="cannot order"):
        pool.fence_for([a, b], stream, AccessKind.WRITE, token=token)
    assert pool.snapshot() == before


def test_a_load_write_recorded_again_after_the_forward_ordered_after_it_is_refused() -> None:
    # fence_for(token=e1) orders e1 after the load; a later check of the
    # write order must see it (HazardTracker.later_than, not just the issue order).
    pool = make_pool(8)
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    load, _ = pool.begin_load([b], "h2d")
    assert list(pool.fence_for([b], "compute", AccessKind.WRITE, token=e1)) == [load]
    pool.tag([b], e1, AccessKind.WRITE)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="order they run"):
        pool.tag([b], load, AccessKind.WRITE)
    assert pool.snapshot() == before
    pool.complete(load)
    assert toks(pool.fence_for([b], "d2h", AccessKind.READ)) == {"compute:1"}


def test_a_token_ordered_after_its_fence_is_also_after_the_streams_earlier_waits() -> None:
    # The stream had waited on the store after
    # e1 was issued, so e1's own fence is empty; e1 still runs after that wait.
    pool = make_pool(8)
    (a,) = pool.get_new_blocks(1)
    store, _ = pool.begin_store([a], "d2h")
    e1 = pool.issue("compute")
    assert list(pool.fence_for([a], "compute", AccessKind.WRITE)) == [store]  # another access of the step
    assert not pool.fence_for([a], "compute", AccessKind.WRITE, token=e1)  # covered by that wait
    pool.tag([a], e1, AccessKind.WRITE)
    pool.complete(e1)
    assert pool.is_ended(store)  # e1 ran after the stream's wait on the store
    pool.check()


def test_a_host_engine_token_may_write_a_block_it_read_though_tokens_were_issued_since() -> None:
    # A host token's own clock covers itself; its own read is not
    # an access ordered after it.
    pool = make_pool(8)
    (b,) = pool.get_new_blocks(1)
    h = pool.issue("rdma")
    pool.tag([b], h, AccessKind.READ)
    pool.issue("compute")  # an unrelated token issued since
    pool.tag([b], h, AccessKind.WRITE)
    assert (b.writer, b.readers) == (h, None)
    pool.touch([b])
    pool.free_blocks([b], token=h, access=AccessKind.WRITE)  # again: nothing changes
    assert toks(pool.fence_for([b], "h2d", AccessKind.READ)) == {"rdma:1"}
    pool.check()
