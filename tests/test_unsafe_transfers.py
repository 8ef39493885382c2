"""Transfers no fence can make safe are refused, nothing changed: a write into a block another holder still reads (LMCache #2206 /
PRs #2207, #2263), a read that would carry content known bad to another
tier (vLLM PR #35092 / #34526)."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest

from blockpool import (
    AccessKind,
    BlockPoolError,
    BlockRemoved,
    HazardAwareBlockPool,
    InvalidContentError,
    SharedBlockError,
    TokenStatus,
    UnsafeTransferError,
)
from tests.conftest import ids, make_pool

READ, WRITE = AccessKind.READ, AccessKind.WRITE


def assert_refused(pool: HazardAwareBlockPool, call: Callable[[], object], exc: type[UnsafeTransferError]):  # type: ignore[no-untyped-def]
    pool.poll()
    before = pool.snapshot()
    with pytest.raises(exc) as ei:
        call()
    assert isinstance(ei.value, UnsafeTransferError) and isinstance(ei.value, BlockPoolError)
    assert isinstance(ei.value, ValueError)
    assert pool.snapshot() == before
    pool.check()
    return ei.value


def _shared_prefix(pool: HazardAwareBlockPool):  # type: ignore[no-untyped-def]
    """Request A runs on two cached blocks (its step wrote them); request B
    took them as a prefix hit (ref count 2)."""
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["p0", "p1"], 0, 2, 16)
    pool.tag(a, pool.issue("compute"), WRITE)  # A's step writes them
    new, _ = pool.allocate_for(1, "h2d", hits=a)  # B: the hits plus one new block
    assert [b.ref_cnt for b in a] == [2, 2]
    return a, new


# -- a write into a block someone else holds -----------------------------------


def test_a_load_into_a_prefix_hit_block_a_running_request_holds_is_refused() -> None:
    pool = make_pool()
    a, new = _shared_prefix(pool)
    err = assert_refused(pool, lambda: pool.begin_load([*a, *new], "h2d"), SharedBlockError)
    assert (err.block_id, err.ref_cnt) == (a[0].block_id, 2)
    assert pool.get_cached_block("p0") is a[0]  # the running request's prefix keeps its key


def test_a_load_with_generations_into_a_shared_block_is_refused() -> None:
    pool = make_pool()
    a, new = _shared_prefix(pool)
    table = [*a, *new]
    gens = pool.generations(table)
    assert_refused(pool, lambda: pool.begin_load(table, "rdma", generations=gens), SharedBlockError)


def test_a_load_into_blocks_only_this_request_holds_is_accepted() -> None:
    pool = make_pool()
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["p0", "p1"], 0, 2, 16)
    pool.tag(a, pool.issue("compute"), WRITE)  # A's step wrote them
    pool.free_blocks(a, token=None)  # A finished: cached and free
    _, _ = pool.allocate_for(0, "h2d", hits=a)  # B's hit: ref count 1, B alone
    _, fence = pool.begin_load(a, "h2d")
    assert fence.tokens == () and pool.get_cached_block("p0") is None  # the load withdrew the keys


def test_a_load_into_an_unpublished_block_its_request_also_pinned_is_accepted() -> None:
    """A block with no key can only be shared by its own request's holders
    (MooncakeStore pins every allocated block for a store's retries): no
    other request can have taken it as a prefix hit."""
    pool = make_pool()
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks)  # the connector's pin: ref count 2, no key
    token, fence = pool.begin_load(blocks, "rdma")
    assert fence.tokens == () and blocks[0].writer == token


def test_a_copy_into_a_shared_destination_is_refused_and_from_a_shared_source_accepted() -> None:
    pool = make_pool()
    a, new = _shared_prefix(pool)
    err = assert_refused(pool, lambda: pool.begin_copy([(new[0], a[1])], "compute"), SharedBlockError)
    assert err.block_id == a[1].block_id
    token, _ = pool.begin_copy([(a[1], new[0])], "compute")  # copy-on-write out of a shared block
    assert pool.token_status(token) is TokenStatus.PENDING


def test_a_copy_recorded_without_refusals_is_begun_into_a_shared_destination() -> None:
    """vLLM's copy-on-write runs whatever the pool says, into a destination
    the scheduler retains until the copy ran (ref count 2, its key maybe
    published already): the vLLM wiring records it with ``refusals=False``
    instead of raising out of vLLM's scheduler (vLLM's own
    test_partial_prefix_cache_hits.py tests, in the parity run)."""
    pool = make_pool()
    a, new = _shared_prefix(pool)
    token, _ = pool.begin_copy([(new[0], a[1])], "compute", refusals=False)
    assert a[1].writer == token and pool.token_status(token) is TokenStatus.PENDING


def test_a_step_write_to_a_shared_block_is_recorded() -> None:
    """Decision: ``tag(..., WRITE)`` on a shared block is accepted. A step's
    writes run on the compute stream in order with the other holder's
    reads, and a step appending to the tail of a partially cached block
    another request hit (it reads only the cached prefix) is how partial
    prefix caching works; the pool cannot see which slots a step writes."""
    pool = make_pool()
    a, _ = _shared_prefix(pool)
    e2 = pool.issue("compute")
    pool.tag([a[1]], e2, WRITE)
    assert a[1].writer == e2


# -- the fill a key announces (a load into blocks published before any write) ----


def _announced_prefix(pool: HazardAwareBlockPool):  # type: ignore[no-untyped-def]
    """Request A's external prefix: two blocks allocated and published at
    once (vLLM publishes a sync load's keys when it allocates the blocks);
    request B hit them in the same schedule, before A's load began."""
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["p0", "p1"], 0, 2, 16)
    new, _ = pool.allocate_for(1, "compute", hits=a)  # B: the hits plus one new block
    assert [b.ref_cnt for b in a] == [2, 2]
    return a, new


@pytest.mark.parametrize("stream", ["h2d", "rdma"])
def test_a_fill_load_into_a_block_another_request_hit_is_not_refused(stream: str) -> None:
    pool = make_pool()
    a, _ = _announced_prefix(pool)
    pool.take_events()
    load, _ = pool.begin_load(a, stream)
    assert [b.writer for b in a] == [load, load]
    assert [pool.get_cached_block(k) for k in ("p0", "p1")] == a  # the keys announce what it loads
    assert not [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    pool.check()


def test_every_holders_later_access_to_a_fill_is_fenced_after_the_load() -> None:
    pool = make_pool()
    a, new = _announced_prefix(pool)
    load, _ = pool.begin_load(a, "h2d")
    assert pool.fence_for([*a, *new], "compute", READ).tokens == (load,)  # B's forward: RAW on the load
    assert pool.fence_for(a, "d2h", READ).tokens == (load,)  # a store of them
    _, fence = pool.allocate_for(0, "rdma", hits=a)  # a third request's hit, read by a host engine
    assert fence.tokens == (load,) and fence.needs_host_wait
    pool.check()


def test_a_failed_fill_withdraws_the_keys_from_every_holder() -> None:
    pool = make_pool()
    a, _ = _announced_prefix(pool)
    load, _ = pool.begin_load(a, "rdma")
    pool.take_events()
    pool.fail(load)
    assert [pool.get_cached_block(k) for k in ("p0", "p1")] == [None, None]
    assert pool.invalid_block_ids(load) == ids(a) and [b.ref_cnt for b in a] == [2, 2]
    removed = [(e.block_hashes, e.reason) for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [(("p0",), "load_failed"), (("p1",), "load_failed")]
    pool.check()


def test_a_fill_into_blocks_only_its_request_holds_keeps_the_keys() -> None:
    pool = make_pool()
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["p0", "p1"], 0, 2, 16)
    pool.begin_load(a, "h2d")
    assert [pool.get_cached_block(k) for k in ("p0", "p1")] == a


def _written_step(pool: HazardAwareBlockPool, blocks: list) -> None:  # type: ignore[type-arg]
    pool.tag(blocks, pool.issue("compute"), WRITE)


def _written_copy(pool: HazardAwareBlockPool, blocks: list) -> None:  # type: ignore[type-arg]
    (src,) = pool.get_new_blocks(1)
    pool.begin_copy([(src, b) for b in blocks], "compute")


def _written_load(pool: HazardAwareBlockPool, blocks: list) -> None:  # type: ignore[type-arg]
    load, _ = pool.begin_load(blocks, "rdma")
    pool.complete(load)


@pytest.mark.parametrize("write", [_written_step, _written_copy, _written_load], ids=["step", "copy", "load"])
@pytest.mark.parametrize("when", ["before_publish", "after_publish"])
def test_a_load_into_a_shared_block_written_since_its_allocation_is_refused(write, when: str) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    a = pool.get_new_blocks(2)
    if when == "before_publish":  # e.g. an asynchronous load, published once it ended
        write(pool, a)
    pool.cache_full_blocks(a, ["p0", "p1"], 0, 2, 16)
    if when == "after_publish":  # e.g. the step that computes the published blocks
        write(pool, a)
    pool.allocate_for(0, "compute", hits=a)
    err = assert_refused(pool, lambda: pool.begin_load(a, "h2d"), SharedBlockError)
    assert (err.block_id, err.ref_cnt) == (a[0].block_id, 2)


def test_a_second_load_into_a_shared_announced_block_is_refused() -> None:
    pool = make_pool()
    a, _ = _announced_prefix(pool)
    pool.begin_load(a, "h2d")  # the fill
    assert_refused(pool, lambda: pool.begin_load(a, "rdma"), SharedBlockError)


def test_a_copy_into_a_shared_announced_block_is_refused() -> None:
    pool = make_pool()
    a, new = _announced_prefix(pool)
    assert_refused(pool, lambda: pool.begin_copy([(new[0], a[0])], "compute"), SharedBlockError)


def test_a_block_handed_out_again_announces_only_what_its_new_owner_publishes() -> None:
    pool = make_pool(4)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, ["p0", "p1", "p2"], 0, 3, 16)
    pool.free_blocks(a, token=None)  # cached, free, never written
    b = pool.get_new_blocks(3)  # handed out again: the old keys are evicted
    assert sorted(ids(b)) == sorted(ids(a))
    _written_step(pool, b)
    pool.cache_full_blocks(b, ["q0", "q1", "q2"], 0, 3, 16)
    pool.allocate_for(0, "compute", hits=b)
    assert_refused(pool, lambda: pool.begin_load(b, "h2d"), SharedBlockError)


def test_unsafe_transfer_errors_pickle_with_their_attributes() -> None:
    e = pickle.loads(pickle.dumps(SharedBlockError("m", 3, 2)))
    assert (type(e), str(e), e.block_id, e.ref_cnt) == (SharedBlockError, "m", 3, 2)
    e2 = pickle.loads(pickle.dumps(InvalidContentError("n", 5)))
    assert (type(e2), str(e2), e2.block_id) == (InvalidContentError, "n", 5)


# -- a store of blocks whose content is known bad ------------------------------


def test_a_store_of_blocks_whose_load_failed_is_refused_until_they_are_written_again() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3)
    load, _ = pool.begin_load(blocks[1:2], "rdma")
    pool.fail(load)
    err = assert_refused(pool, lambda: pool.begin_store(blocks, "d2h"), InvalidContentError)
    assert err.block_id == blocks[1].block_id
    gens = pool.generations(blocks)
    assert_refused(pool, lambda: pool.begin_store(blocks, "rdma", generations=gens), InvalidContentError)
    pool.begin_store([blocks[0], blocks[2]], "d2h")  # the good blocks can be stored
    step = pool.issue("compute")
    pool.tag(blocks[1:2], step, WRITE)  # recomputed: written again
    _, fence = pool.begin_store(blocks, "d2h")
    assert list(fence) == [step]


def test_a_store_begun_before_the_load_failed_waits_on_the_failed_load() -> None:
    """Already covered: its fence names the load (RAW), and the worker never
    runs a transfer past a failed fence token (``FenceFailedError``)."""
    pool = make_pool()
    blocks = pool.get_new_blocks(2)
    load, _ = pool.begin_load(blocks, "rdma")
    _, fence = pool.begin_store(blocks, "d2h")
    assert list(fence) == [load]
    pool.fail(load)
    assert pool.token_status(load) is TokenStatus.FAILED


def test_a_late_failure_also_refuses_the_store() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(1)
    load, _ = pool.begin_load(blocks, "rdma")
    pool.complete(load)
    pool.begin_store(blocks, "d2h")  # the content was believed good
    pool.fail(load)  # the connector found it bad afterwards
    assert_refused(pool, lambda: pool.begin_store(blocks, "d2h"), InvalidContentError)


def test_a_copy_from_a_block_whose_load_failed_is_refused() -> None:
    pool = make_pool()
    src, dst = pool.get_new_blocks(2)
    load, _ = pool.begin_load([src], "h2d")
    pool.fail(load)
    assert_refused(pool, lambda: pool.begin_copy([(src, dst)], "compute"), InvalidContentError)
