"""Failed and abandoned transfers, and bad input found by review: each pins
one behaviour."""

from __future__ import annotations

import pytest

from blockpool import (
    AccessKind,
    BlockPoolError,
    HazardAwareBlockPool,
    InvalidArgumentError,
    InvalidTokenError,
    NullBlockError,
    StreamKind,
    Token,
)
from tests.conftest import make_pool, toks

R, W = AccessKind.READ, AccessKind.WRITE


def test_abandoned_transfer_does_not_end_the_step_it_was_waiting_for(pool: HazardAwareBlockPool) -> None:
    (a,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([a], e1, R)
    load, fence = pool.begin_load([a], "rdma")
    assert list(fence) == [e1]
    pool.abandon(load)  # the engine stopped, perhaps before its host wait
    assert not pool.is_ended(e1)
    pool.free_blocks([a])
    _, fence = pool.allocate_for(1, "h2d")
    assert list(fence) == [e1]


def test_failed_transfer_does_not_end_what_it_waited_for(pool: HazardAwareBlockPool) -> None:
    (a,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([a], e1, R)
    load, _ = pool.begin_load([a], "rdma")
    pool.fail(load)
    assert pool.is_ended(load) and not pool.is_ended(e1)


def test_completed_transfer_ends_what_it_waited_for(pool: HazardAwareBlockPool) -> None:
    (a,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([a], e1, R)
    load, _ = pool.begin_load([a], "rdma")
    assert not pool.is_ended(e1)
    pool.complete(load)
    assert pool.is_ended(e1)


def test_failed_load_restores_the_accesses_it_replaced(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    s1, _ = pool.begin_store([b], "d2h")  # still reading b
    load, fence = pool.begin_load([b], "rdma")
    assert list(fence) == [s1]
    pool.fail(load)  # may have failed before its wait on s1
    _, fence = pool.begin_load([b], "h2d")
    assert toks(fence) == {"d2h:1"}


def test_failed_load_over_a_pending_host_write_holds_the_freed_block_again(
    pool: HazardAwareBlockPool,
) -> None:
    (b,) = pool.get_new_blocks(1)
    l1, _ = pool.begin_load([b], "rdma")
    l2, fence = pool.begin_load([b], "h2d")  # ordered after l1 by a host wait
    assert list(fence) == [l1] and fence.needs_host_wait
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 9
    pool.fail(l2)
    assert pool.held_block_ids() == [b.block_id]
    assert pool.get_num_free_blocks() == 8
    pool.complete(l1)
    assert pool.get_num_free_blocks() == 9
    pool.check()


def test_failure_on_device_stream_means_the_token_before_it_completed(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([b], e1, R)
    l1, _ = pool.begin_load([b], "h2d")  # waits on e1
    l2, _ = pool.begin_load([b], "h2d")
    assert not (pool.is_ended(l1) or pool.is_ended(e1))
    pool.fail(l2)
    assert pool.is_ended(l1) and pool.is_ended(e1)


def test_token_with_the_wrong_kind_is_rejected(pool: HazardAwareBlockPool) -> None:
    (a,) = pool.get_new_blocks(1)
    load = pool.issue("rdma")
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="HOST|host"):
        pool.tag([a], Token("rdma", load.seq), W)  # kind defaulted to DEVICE
    assert pool.snapshot() == before


def test_move_block_hashes_onto_the_null_block_is_rejected(pool: HazardAwareBlockPool) -> None:
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], ["k"], 0, 1, block_size=16)
    before = pool.snapshot()
    with pytest.raises(NullBlockError):
        pool.move_block_hashes(a, pool.null_block)
    assert pool.snapshot() == before
    pool.check()


@pytest.mark.parametrize("key", [None, ["unhashable"]])
def test_bad_key_is_rejected_before_any_block_is_published(pool: HazardAwareBlockPool, key: object) -> None:
    blocks = pool.get_new_blocks(3)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="block hash"):
        pool.cache_full_blocks(blocks, ["a", "b", key], 0, 3, block_size=16)
    assert pool.snapshot() == before
    with pytest.raises(InvalidArgumentError, match="block hash"):
        pool.cache_partial_block(blocks[0], key, 8)
    assert pool.snapshot() == before


def test_bad_block_size_is_rejected_before_any_block_is_published(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="block_size"):
        pool.cache_full_blocks(blocks, ["x", "y"], 0, 2, object())  # type: ignore[arg-type]
    assert pool.snapshot() == before


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.free_blocks(None),
        lambda p: p.touch(None),
        lambda p: p.evict_blocks(None),
        lambda p: p.allocate_for(1, "compute", hits=1),
        lambda p: p.issue(["compute"]),
        lambda p: p.fence_for([], ["compute"]),
        lambda p: p.get_cached_block([1]),
        lambda p: p.is_block_writable(None),
        lambda p: p.cache_full_blocks(p.blocks[1:3], ["a", "b"], 0, 2, block_mask=1),
    ],
)
def test_non_iterables_and_unhashables_raise_typed_errors(call: object) -> None:
    pool = make_pool()
    pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError):
        call(pool)  # type: ignore[operator]
    assert pool.snapshot() == before


def test_prefix_lookup_applies_a_queued_failed_load_first(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "rdma")
    pool.cache_full_blocks([b], ["k"], 0, 1, block_size=16)
    pool.fail(load)
    assert pool.get_cached_block("k") is None


def test_abandon_of_an_ended_token_is_not_counted() -> None:
    pool = make_pool(streams={"compute": StreamKind.DEVICE, "rdma": StreamKind.HOST})
    t = pool.issue("rdma")
    pool.complete(t)
    pool.poll()
    assert pool.abandon(t) == []
    assert pool.stats().abandoned == 0


def test_two_failed_writes_in_a_row_restore_the_access_before_both(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    l0, _ = pool.begin_load([b], "rdma")
    l1, _ = pool.begin_load([b], "h2d")
    l2, _ = pool.begin_load([b], "h2d")
    pool.fail(l1)  # b was rewritten by l2 since: l2 now stands on l0
    pool.free_blocks([b])
    assert pool.held_block_ids() == []
    pool.fail(l2)
    assert pool.held_block_ids() == [b.block_id]  # l0 may still be writing
    pool.complete(l0)
    assert pool.held_block_ids() == [] and pool.get_num_free_blocks() == 9
    pool.check()


@pytest.mark.parametrize(
    "kw", [{"token": None, "access": "WRITE"}, {"access": 42}, {"token": None, "access": None}]
)
def test_free_blocks_checks_access_even_when_no_token_is_recorded(kw: dict) -> None:  # type: ignore[type-arg]
    pool = make_pool(4)
    blocks = pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="access"):
        pool.free_blocks(blocks, **kw)
    assert pool.snapshot() == before


def test_evict_blocks_refuses_a_bool_block_id() -> None:
    pool = make_pool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], ["k"], 0, 1, 16)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError):
        pool.evict_blocks([True])
    assert pool.snapshot() == before and pool.get_cached_block("k") is b


@pytest.mark.parametrize(
    "fields",
    [
        ("compute", 0),
        ("compute", True),
        ("compute", 1.0),
        ("", 1),
        (None, 1),
        (3, 1),
        ("compute", 1, "device"),  # a kind is a StreamKind, not its value
        ("compute", 1, StreamKind.DEVICE, -1),
        ("compute", 1, StreamKind.DEVICE, True),
    ],
)
def test_bad_token_fields_raise_the_packages_error(fields: tuple) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidTokenError) as info:
        Token(*fields)
    assert isinstance(info.value, BlockPoolError) and isinstance(info.value, (ValueError, TypeError))


@pytest.mark.parametrize("pool_id", [-1, True, 1.5, "1", None])
def test_a_tracker_refuses_a_pool_id_that_no_token_could_carry(pool_id: object) -> None:
    from blockpool.core.tracker import HazardTracker

    with pytest.raises(InvalidArgumentError):
        HazardTracker(pool_id)  # type: ignore[arg-type]


def test_malformed_wire_token_raises_invalid_token_error() -> None:
    for bad in [("c", 1, "nope"), ("c",), ("c", 1, "device", -1), 5]:
        with pytest.raises(InvalidTokenError):
            Token.from_wire(bad)  # type: ignore[arg-type]
