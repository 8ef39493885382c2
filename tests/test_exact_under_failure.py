"""Fences stay exact when transfers fail: each test pins one behaviour."""

from __future__ import annotations

import pytest

from blockpool import (
    AccessKind,
    BlockPoolError,
    ForeignTokenError,
    HazardAwareBlockPool,
    StreamKind,
    Token,
)
from blockpool.core.events import BlockRemoved
from tests.conftest import make_pool, toks

R, W = AccessKind.READ, AccessKind.WRITE


# -- 1. a failed write, however recorded, restores what it replaced ----------


def test_failed_tagged_write_restores_the_reads_it_replaced(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([b], e1, R)
    assert toks(pool.fence_for([b], "h2d")) == {"compute:1"}
    w = pool.issue("h2d")
    pool.tag([b], w, W)
    pool.fail(w)  # may have failed before its wait on compute:1
    assert not pool.is_ended(e1)
    assert toks(pool.fence_for([b], "rdma")) == {"compute:1"}


def test_failed_write_recorded_by_free_restores_the_reads_it_replaced(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([b], e1, R)
    assert toks(pool.fence_for([b], "h2d")) == {"compute:1"}
    w = pool.issue("h2d")
    pool.free_blocks([b], token=w, access=W)
    pool.fail(w)
    (again,) = pool.get_new_blocks(1)
    assert again is b
    assert toks(pool.fence_for([b], "rdma")) == {"compute:1"}


def test_failed_write_over_a_pending_host_load_holds_the_freed_block(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "rdma")
    fence = pool.fence_for([b], "h2d")
    assert list(fence) == [load] and fence.needs_host_wait
    w = pool.issue("h2d")
    pool.tag([b], w, W)
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 9  # h2d is a device writer: b is free
    pool.fail(w)  # rdma:1 may still be writing b
    assert pool.held_block_ids() == [b.block_id]
    assert pool.get_num_free_blocks() == 8
    pool.check()
    pool.complete(load)
    assert pool.held_block_ids() == []
    assert pool.get_num_free_blocks() == 9


# -- 2. a failed write leaves no key published on content it did not write ----


def test_failed_compute_write_withdraws_the_keys_published_for_it(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["h0", "h1"], 0, 2)
    pool.take_events()
    ew = pool.issue("compute")
    pool.tag(a, ew, W)
    pool.free_blocks(a)
    pool.fail(ew)
    assert pool.get_cached_block("h0") is None and pool.get_cached_block("h1") is None
    assert pool.take_events() == [BlockRemoved(("h0",), "GPU"), BlockRemoved(("h1",), "GPU")]
    # not published again until rewritten
    (b0,) = [b for b in pool.blocks if b is a[0]]
    pool.touch([b0])
    pool.cache_full_blocks([b0], ["h0"], 0, 1)
    assert pool.get_cached_block("h0") is None
    pool.check()


def test_write_tagged_after_its_token_failed_withdraws_the_keys(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], ["k"], 0, 1)
    ew = pool.issue("compute")
    pool.fail(ew)
    pool.tag([b], ew, W)  # the step's write is reported after its failure
    assert pool.get_cached_block("k") is None
    pool.cache_full_blocks([b], ["k"], 0, 1)
    assert pool.get_cached_block("k") is None


def test_write_freed_after_its_token_failed_withdraws_the_keys(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], ["k"], 0, 1)
    ew = pool.issue("compute")
    pool.fail(ew)
    pool.free_blocks([b], token=ew, access=W)
    assert pool.get_cached_block("k") is None
    pool.check()


def test_write_tagged_after_its_token_completed_keeps_the_keys(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], ["k"], 0, 1)
    ew = pool.issue("compute")
    pool.complete(ew)
    pool.tag([b], ew, W)
    assert pool.get_cached_block("k") is b


# -- 3. a failure reported after the token already ended still counts ---------


def test_late_failure_of_a_load_ended_by_a_later_load_withdraws_its_keys(pool: HazardAwareBlockPool) -> None:
    b, c = pool.get_new_blocks(2)
    l1, _ = pool.begin_load([b, c], "rdma")
    pool.cache_full_blocks([b, c], ["kb", "kc"], 0, 2)  # published while loading
    l2, fence = pool.begin_load([c], "rdma")
    assert list(fence) == [l1]
    pool.complete(l2)  # ends l1 too: l2 waited for it
    assert pool.is_ended(l1)
    pool.fail(l1)
    assert pool.get_cached_block("kb") is None
    pool.cache_full_blocks([b], ["kb"], 0, 1)
    assert pool.get_cached_block("kb") is None  # not published until rewritten
    pool.check()


def test_late_failure_of_a_load_ended_by_a_step_fenced_on_it(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "rdma")
    pool.cache_full_blocks([b], ["k"], 0, 1)
    fence = pool.fence_for([b], "compute", R)
    assert list(fence) == [load]
    step = pool.issue("compute")
    pool.tag([b], step, R)
    pool.complete(step)
    assert pool.is_ended(load)
    pool.fail(load)  # the connector's report comes later
    assert pool.get_cached_block("k") is None


def test_late_failure_of_a_device_write_ended_by_a_later_token_withdraws_its_keys(
    pool: HazardAwareBlockPool,
) -> None:
    (b,) = pool.get_new_blocks(1)
    l1, _ = pool.begin_load([b], "h2d")
    pool.cache_full_blocks([b], ["k"], 0, 1)
    pool.complete(pool.issue("h2d"))
    pool.fail(l1)
    assert pool.get_cached_block("k") is None


def test_late_failure_leaves_blocks_rewritten_since_alone(pool: HazardAwareBlockPool) -> None:
    b, c = pool.get_new_blocks(2)
    l1, _ = pool.begin_load([b, c], "rdma")
    l2, _ = pool.begin_load([c], "rdma")
    pool.complete(l2)
    pool.cache_full_blocks([b, c], ["kb", "kc"], 0, 2)
    pool.fail(l1)
    assert pool.get_cached_block("kb") is None
    assert pool.get_cached_block("kc") is c  # rewritten by l2, which completed


# -- 4. coverage through a token that later fails ------------------------------


def test_completion_after_a_covering_token_failed_ends_what_it_covered(pool: HazardAwareBlockPool) -> None:
    """The protocol (docs/hazard-model.md, "Failure and coverage"): a wait on a
    failed token raises on the worker (FenceFailedError), so work past a
    failed token never completes; a completion therefore vouches for the
    whole chain it waited through, and ends it."""
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([b], e1, R)
    r1, fence = pool.begin_load([b], "rdma")
    assert list(fence) == [e1]
    r2, fence = pool.begin_load([b], "rdma")
    assert list(fence) == [r1]  # compute:1 covered by rdma:1
    pool.fail(r1)
    assert not pool.is_ended(e1)  # a failure is not transitive
    pool.complete(r2)  # r2 got past r1 on the worker: r1 had done its waits
    assert pool.is_ended(e1)


# -- 6. a load into a keyed block withdraws its keys ----------------------------


def test_load_into_a_keyed_block_withdraws_its_keys(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], ["old"], 0, 1)
    pool.cache_partial_block(b, "old-partial", 4)
    pool.tag([b], pool.issue("compute"), AccessKind.WRITE)  # a step wrote the content the keys name
    pool.take_events()
    pool.begin_load([b], "rdma")
    assert pool.get_cached_block("old") is None
    assert pool.get_cached_block("old-partial") is None
    assert sorted(e.block_hashes for e in pool.take_events()) == [("old",), ("old-partial",)]
    pool.check()


def test_copy_keeps_the_key_published_for_the_content_it_writes(pool: HazardAwareBlockPool) -> None:
    # vLLM publishes a copy-on-write destination (a partial hit's private
    # copy) under the prefix the copy writes into it, before the copy runs.
    src, dst = pool.get_new_blocks(2)
    pool.cache_full_blocks([src, dst], ["ks", "kd"], 0, 2)
    copy, _ = pool.begin_copy([(src, dst)], "compute")
    assert pool.get_cached_block("kd") is dst
    assert pool.get_cached_block("ks") is src  # the source is only read
    pool.fail(copy)  # ... unless the copy fails
    pool.poll()
    assert pool.get_cached_block("kd") is None


def test_store_keeps_the_keys_of_its_source(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], ["k"], 0, 1)
    pool.begin_store([b], "rdma")
    assert pool.get_cached_block("k") is b


# -- 8. tokens are bound to their pool -----------------------------------------


def test_foreign_token_is_refused_and_changes_nothing(pool: HazardAwareBlockPool) -> None:
    other = make_pool()
    (b,) = pool.get_new_blocks(1)
    mine = pool.issue("compute")
    pool.tag([b], mine, R)
    theirs = other.issue("compute")
    assert theirs == mine  # same (stream, seq): equal as values
    before = pool.snapshot()
    for call in (
        lambda: pool.complete(theirs),
        lambda: pool.fail(theirs),
        lambda: pool.abandon(theirs),
        lambda: pool.is_ended(theirs),
        lambda: pool.tag([b], theirs, W),
        lambda: pool.free_blocks([b], token=theirs),
    ):
        with pytest.raises(ForeignTokenError):
            call()
        assert pool.snapshot() == before
    assert issubclass(ForeignTokenError, BlockPoolError)
    assert not pool.is_ended(mine)


def test_token_wire_form_carries_its_pool(pool: HazardAwareBlockPool) -> None:
    t = pool.issue("rdma")
    wire = t.to_wire()
    assert wire == ("rdma", 1, "host", pool.pool_id)
    back = Token.from_wire(list(wire))
    assert back == t and back.pool == pool.pool_id and back.kind is StreamKind.HOST
    other = make_pool()
    other.issue("rdma")
    with pytest.raises(ForeignTokenError):
        other.complete(back)


def test_old_wire_form_decodes_to_an_unbound_token_any_pool_accepts(pool: HazardAwareBlockPool) -> None:
    t = pool.issue("compute")
    old = Token.from_wire(("compute", 1, "device"))
    assert old == t and old.pool == 0
    assert old.to_wire() == ("compute", 1, "device")
    pool.complete(old)
    assert pool.is_ended(t)


@pytest.mark.parametrize(
    "bad", [("c", 1, "device", -1), ("c", 1, "device", True), ("c", 1), ("c", 1, "device", 1, 2)]
)
def test_malformed_wire_token_is_refused(bad: tuple) -> None:  # type: ignore[type-arg]
    with pytest.raises((ValueError, TypeError)):
        Token.from_wire(bad)


def test_last_token_is_bound_to_its_pool(pool: HazardAwareBlockPool) -> None:
    pool.issue("compute")
    last = pool.last_token("compute")
    assert last is not None and last.pool == pool.pool_id


# -- check() covers the hazard half --------------------------------------------


def test_check_catches_a_held_block_whose_token_ended(pool: HazardAwareBlockPool) -> None:
    from blockpool import InvariantError

    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "rdma")
    pool.free_blocks([b])
    assert pool.held_block_ids() == [b.block_id]
    pool.check()
    pool.tracker.end(load)  # behind the pool's back: the hold is now stale
    with pytest.raises(InvariantError, match="has ended"):
        pool.check()


def test_check_catches_a_held_entry_that_is_not_the_pools_block_of_its_id(pool: HazardAwareBlockPool) -> None:
    from blockpool import InvariantError
    from blockpool.core.block import KVCacheBlock

    (b,) = pool.get_new_blocks(1)
    pool.begin_load([b], "rdma")
    pool.free_blocks([b])
    pool.check()
    other = KVCacheBlock(b.block_id)  # corrupt: the same id, another record, held in its place
    other.next_free_block, b.next_free_block = b.next_free_block, None
    for listed in pool.holdback._held_by.values():
        listed[:] = [other if x is b else x for x in listed]
    with pytest.raises(InvariantError, match="not the pool's block"):
        pool.check()


def test_check_catches_a_held_null_block(pool: HazardAwareBlockPool) -> None:
    from blockpool import InvariantError

    load, _ = pool.begin_load(pool.get_new_blocks(1), "rdma")
    pool.check()
    from blockpool.core.holdback import HoldMark

    pool.null_block.next_free_block = HoldMark(frozenset({load}))  # corrupt the hold-back part directly
    with pytest.raises(InvariantError, match="null block is free, held"):
        pool.check()


def test_check_catches_a_lease_on_a_block_that_is_not_held() -> None:
    from blockpool import InvariantError

    pool = make_pool(lease_timeout=5.0, clock=lambda: 0.0)
    pool.check()
    pool.holdback._deadline[3] = (5.0, pool.blocks[3])  # corrupt the hold-back part directly
    with pytest.raises(InvariantError, match="lease"):
        pool.check()


def test_check_catches_saved_shadows_of_an_ended_write(pool: HazardAwareBlockPool) -> None:
    from blockpool import InvariantError

    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "h2d")
    pool.check()
    pool.tracker.end(load)
    with pytest.raises(InvariantError, match="ended"):
        pool.check()


# -- writes recorded after their token ended ------------------------------------


@pytest.mark.parametrize("how", ["tag", "free"])
def test_late_failure_withdraws_keys_of_a_write_recorded_after_its_token_ended(how: str) -> None:
    pool = make_pool(4, streams={"compute": StreamKind.DEVICE})
    _, b = pool.get_new_blocks(2)
    e1 = pool.issue("compute")
    pool.complete(e1)
    pool.poll()
    if how == "tag":
        pool.tag([b], e1, W)  # its write to b recorded late
    else:
        pool.touch([b])
        pool.free_blocks([b], token=e1, access=W)
    pool.cache_full_blocks([b], ["k"], 0, 1, 16)
    pool.take_events()
    pool.fail(e1)  # a late failure report: b's content is not what "k" names
    assert pool.get_cached_block("k") is None
    assert pool.take_events() == [BlockRemoved(("k",), "GPU", "load_failed")]
    pool.check()


def test_write_recorded_after_its_token_ended_keeps_a_pending_write_and_a_running_read() -> None:
    pool = make_pool(4)
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.complete(e1)
    load, _ = pool.begin_load([b], "h2d")  # a write still running
    store, _ = pool.begin_store([b], "d2h")  # and a read
    pool.tag([b], e1, W)  # e1's write recorded late: the load's lands after it
    assert b.writer == load
    assert toks(pool.fence_for([b], "rdma", R)) == {str(load)}
    assert toks(pool.fence_for([b], "rdma", W)) == {str(store)}  # the store's clock covers the load
    pool.check()


@pytest.mark.parametrize("how", ["tag", "free"])
def test_write_by_an_ended_token_keeps_a_failed_loads_invalid_mark_either_way(how: str) -> None:
    # Which ran last, the failed load or the ended write, is not known:
    # the mark stays (it only withholds publication), whichever call records it.
    pool = make_pool(4)
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.complete(e1)
    load, _ = pool.begin_load([b], "h2d")
    pool.fail(load)
    pool.poll()
    if how == "tag":
        pool.tag([b], e1, W)
    else:
        pool.touch([b])
        pool.free_blocks([b], token=e1, access=W)
    assert pool.writes.is_invalid(b.block_id)
    pool.cache_full_blocks([b], ["k"], 0, 1, 16)
    assert pool.get_cached_block("k") is None
    pool.check()


def test_a_late_recorded_ended_write_does_not_displace_a_later_write_of_its_stream() -> None:
    pool = make_pool(4)
    (b,) = pool.get_new_blocks(1)
    e1, e2 = pool.issue("compute"), pool.issue("compute")
    pool.tag([b], e2, W)  # step 2 writes b
    pool.cache_full_blocks([b], ["k"], 0, 1, 16)
    pool.complete(e2)  # steps 1 and 2 ended
    pool.tag([b], e1, W)  # step 1's write recorded late: step 2's content stays b's
    assert b.writer == e2
    pool.fail(e2)  # a late failure of step 2: b's key goes
    pool.poll()
    assert pool.get_cached_block("k") is None
    pool.check()
