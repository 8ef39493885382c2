"""``fail_blocks(token, blocks)``: a load or copy that wrote only some of its
destinations. The listed blocks are left as a failed load leaves them
(invalid, keys withdrawn); the others keep what it wrote; for ordering the
token completed."""

from __future__ import annotations

import pytest

from blockpool import (
    AccessKind,
    BlockRemoved,
    ForeignBlockError,
    ForeignTokenError,
    HazardAwareBlockPool,
    InvalidArgumentError,
    InvalidContentError,
    TokenStatus,
)
from tests.conftest import ids, make_pool

READ, WRITE = AccessKind.READ, AccessKind.WRITE


def _get_of_four(pool: HazardAwareBlockPool, stream: str = "rdma"):  # type: ignore[no-untyped-def]
    """A GET of four blocks on ``stream``, published after it began."""
    blocks = pool.get_new_blocks(4)
    token, _ = pool.begin_load(blocks, stream)
    pool.cache_full_blocks(blocks, ["k0", "k1", "k2", "k3"], 0, 4, 16)
    pool.take_events()
    return blocks, token


def test_a_partly_failed_load_keeps_the_valid_prefix_and_withdraws_only_the_failed_blocks() -> None:
    pool = make_pool()
    blocks, get = _get_of_four(pool)
    pool.fail_blocks(get, blocks[3:])
    assert [pool.get_cached_block(k) for k in ("k0", "k1", "k2")] == blocks[:3]
    assert pool.get_cached_block("k3") is None
    assert pool.invalid_block_ids(get) == [blocks[3].block_id]
    assert pool.invalid_block_ids() == [blocks[3].block_id]
    removed = [(e.block_hashes, e.reason) for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [(("k3",), "load_failed")]
    pool.check()


def test_a_partly_failed_load_counts_as_completed_for_ordering() -> None:
    pool = make_pool()
    (src,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([src], e1, WRITE)  # step 1 writes src; the GET below is not ordered after it
    blocks = pool.get_new_blocks(2)
    pool.tag(blocks, e1, READ)  # step 1 reads the GET's blocks: the GET waits on it (WAR)
    get, fence = pool.begin_load(blocks, "rdma")
    assert [str(t) for t in fence] == ["compute:1"]
    pool.fail_blocks(get, blocks[1:])
    assert pool.token_status(get) is TokenStatus.COMPLETED
    assert pool.is_ended(e1)  # the GET's wait had happened: what it waited on ended
    assert pool.fence_for(blocks[:1], "compute", READ).tokens == ()  # nothing left to wait on
    pool.check()


def test_a_partly_failed_load_releases_its_held_blocks() -> None:
    pool = make_pool(6)
    blocks, get = _get_of_four(pool)
    pool.free_blocks(blocks, token=None)  # the request went away while the GET was in flight
    assert sorted(pool.held_block_ids()) == ids(blocks)
    pool.fail_blocks(get, blocks[2:])
    assert pool.held_block_ids() == [] and pool.get_num_free_blocks() == 5
    pool.check()


def test_the_failed_blocks_of_a_partly_failed_load_are_not_stored_until_written_again() -> None:
    pool = make_pool()
    blocks, get = _get_of_four(pool)
    pool.fail_blocks(get, blocks[3:])
    pool.begin_store(blocks[:3], "d2h")  # the valid prefix can be stored
    with pytest.raises(InvalidContentError):
        pool.begin_store(blocks, "d2h")
    e = pool.issue("compute")
    pool.tag(blocks[3:], e, WRITE)  # recomputed
    pool.begin_store(blocks, "d2h")
    pool.check()


def test_a_partly_failed_load_leaves_the_parts_linked_with_it_alone() -> None:
    """Decision: a partial failure is not a failure of the part, only of
    the listed blocks; the other parts of a linked load keep their keys."""
    pool = make_pool()
    full, get = _get_of_four(pool)
    (window,) = pool.get_new_blocks(1)
    part, _ = pool.begin_load([window], "rdma")
    pool.cache_full_blocks([window], ["w0"], 0, 1, 16)
    pool.link_loads([get, part])
    pool.fail_blocks(get, full[3:])
    assert pool.get_cached_block("w0") is window
    assert pool.token_status(part) is TokenStatus.PENDING
    assert pool.invalid_block_ids() == [full[3].block_id]
    pool.check()


def test_a_failure_reported_after_a_partial_failure_withdraws_the_rest() -> None:
    pool = make_pool()
    blocks, get = _get_of_four(pool)
    pool.fail_blocks(get, blocks[3:])
    pool.fail(get)  # a late failure report of the whole load
    assert [pool.get_cached_block(k) for k in ("k0", "k1", "k2", "k3")] == [None] * 4
    assert pool.token_status(get) is TokenStatus.FAILED
    pool.check()


def test_a_partly_failed_copy_marks_only_the_listed_destination() -> None:
    pool = make_pool()
    src = pool.get_new_blocks(2)
    dst = pool.get_new_blocks(2)
    copy, _ = pool.begin_copy(list(zip(src, dst)), "compute")
    pool.cache_full_blocks(dst, ["d0", "d1"], 0, 2, 16)
    pool.fail_blocks(copy, dst[1:])
    assert (pool.get_cached_block("d0"), pool.get_cached_block("d1")) == (dst[0], None)
    assert pool.invalid_block_ids(copy) == [dst[1].block_id]
    pool.check()


def test_a_block_written_again_after_the_load_keeps_its_content() -> None:
    pool = make_pool()
    blocks, get = _get_of_four(pool, "h2d")
    e = pool.issue("compute")
    pool.fence_for(blocks[3:], "compute", WRITE, token=e)
    pool.tag(blocks[3:], e, WRITE)  # the step rewrites the last block after the GET
    pool.fail_blocks(get, blocks[2:])
    assert pool.invalid_block_ids(get) == [blocks[2].block_id]
    assert pool.get_cached_block("k3") is blocks[3]
    pool.check()


def test_an_empty_list_completes_the_load() -> None:
    pool = make_pool()
    blocks, get = _get_of_four(pool)
    pool.fail_blocks(get, [pool.null_block])
    assert pool.token_status(get) is TokenStatus.COMPLETED and pool.invalid_block_ids() == []
    assert pool.get_cached_block("k3") is blocks[3]


# -- bad input: typed errors, nothing changed ------------------------------------


def _refused(pool: HazardAwareBlockPool, call, exc: type[Exception]) -> Exception:  # type: ignore[no-untyped-def]
    pool.poll()
    before = pool.snapshot()
    events = list(pool.kv_event_queue)
    with pytest.raises(exc) as ei:
        call()
    assert pool.snapshot() == before and list(pool.kv_event_queue) == events
    pool.check()
    return ei.value


def test_a_token_of_another_pool_is_refused() -> None:
    pool, other = make_pool(), make_pool()
    blocks, _ = _get_of_four(pool)
    foreign, _ = other.begin_load(other.get_new_blocks(1), "rdma")
    _refused(pool, lambda: pool.fail_blocks(foreign, blocks[:1]), ForeignTokenError)


def test_a_token_that_is_not_a_load_or_copy_in_flight_is_refused() -> None:
    pool = make_pool()
    blocks, get = _get_of_four(pool)
    step = pool.issue("compute")
    pool.tag(blocks[:1], step, READ)
    store, _ = pool.begin_store(blocks, "d2h")
    for token in (step, store):  # a step, a store
        err = _refused(pool, lambda t=token: pool.fail_blocks(t, blocks[:1]), InvalidArgumentError)
        assert "not a load or copy in flight" in str(err)
    pool.complete(get)
    _refused(pool, lambda: pool.fail_blocks(get, blocks[:1]), InvalidArgumentError)  # ended
    _refused(pool, lambda: pool.fail_blocks("rdma:1", blocks[:1]), InvalidArgumentError)  # type: ignore[arg-type]  # not a Token


def test_blocks_that_are_not_the_tokens_destinations_are_refused() -> None:
    pool = make_pool()
    blocks, get = _get_of_four(pool)
    (other,) = pool.get_new_blocks(1)
    err = _refused(pool, lambda: pool.fail_blocks(get, [blocks[3], other]), InvalidArgumentError)
    assert f"block {other.block_id} is not a destination" in str(err)
    foreign = make_pool().get_new_blocks(1)
    _refused(pool, lambda: pool.fail_blocks(get, foreign), ForeignBlockError)
    _refused(pool, lambda: pool.fail_blocks(get, 3), InvalidArgumentError)  # type: ignore[arg-type]
    assert pool.token_status(get) is TokenStatus.PENDING
