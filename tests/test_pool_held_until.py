"""Blocks on their way back: ``reclaimable_after`` and ``held_until``
(``blockpool/core/_introspection.py``, ``blockpool/core/holdback.py``).

A block freed while a host engine may still touch it is held until every
such access has ended. A scheduler that sees only ``get_num_free_blocks()``
preempts to make room that is already coming back (vLLM #49674); these
queries say how much comes back when which token ends. The property at the
end replays random sequences and checks the answer against what completing
the tokens really frees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockpool import HazardAwareBlockPool, StreamKind, Token
from blockpool.core.errors import (
    BlockPoolError,
    ForeignTokenError,
    InvalidArgumentError,
    UnknownStreamError,
    UnknownTokenError,
)
from blockpool.core.hazards import AccessKind

STREAMS = {
    "compute": StreamKind.DEVICE,
    "h2d": StreamKind.DEVICE,
    "rdma": StreamKind.HOST,
    "nic": StreamKind.HOST,
}


def make_pool(n: int = 10, **kw: object) -> HazardAwareBlockPool:
    return HazardAwareBlockPool(n, streams=STREAMS, **kw)  # type: ignore[arg-type]


@pytest.fixture
def pool() -> HazardAwareBlockPool:
    return make_pool()


def freed_under_store(pool: HazardAwareBlockPool, n: int, stream: str = "rdma") -> tuple[list, Token]:
    """``n`` blocks a host store still reads when their request frees them."""
    blocks = pool.get_new_blocks(n)
    store, _ = pool.begin_store(blocks, stream)
    pool.free_blocks(blocks)
    return blocks, store


# -- reclaimable_after ------------------------------------------------------------


def test_reclaimable_after_a_store_is_what_its_completion_frees(pool: HazardAwareBlockPool) -> None:
    _, store = freed_under_store(pool, 3)
    free = pool.get_num_free_blocks()
    assert pool.reclaimable_after(store) == 3
    pool.complete(store)
    assert pool.get_num_free_blocks() == free + 3


def test_reclaimable_after_counts_only_the_blocks_of_that_token(pool: HazardAwareBlockPool) -> None:
    _, s1 = freed_under_store(pool, 2)
    _, s2 = freed_under_store(pool, 3)
    assert (pool.reclaimable_after(s1), pool.reclaimable_after(s2)) == (2, 3)


def test_a_block_two_transfers_hold_comes_back_only_when_both_end(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(1)
    s1, _ = pool.begin_store(blocks, "rdma")
    s2, _ = pool.begin_store(blocks, "nic")
    pool.free_blocks(blocks)
    assert pool.reclaimable_after(s1) == 0 and pool.reclaimable_after(s2) == 0
    assert pool.reclaimable_after([s1, s2]) == 1
    pool.complete(s1)
    assert pool.held_block_ids() == [blocks[0].block_id] and pool.reclaimable_after(s2) == 1


def test_a_load_also_brings_back_the_blocks_of_the_load_it_waited_on(pool: HazardAwareBlockPool) -> None:
    a, b = pool.get_new_blocks(2)
    l1, _ = pool.begin_load([a, b], "rdma")
    l2, fence = pool.begin_load([b], "rdma")  # waits on l1 (host wait): completing l2 ends l1
    assert list(fence) == [l1]
    pool.free_blocks([a, b])
    assert pool.reclaimable_after(l1) == 1  # a; b is held on l2
    assert pool.reclaimable_after(l2) == 2
    free = pool.get_num_free_blocks()
    pool.complete(l2)
    assert pool.get_num_free_blocks() == free + 2


def test_a_step_that_waited_on_a_load_brings_back_the_loads_blocks(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    load, _ = pool.begin_load(blocks, "rdma")
    step = pool.issue("compute")
    fence = pool.fence_for(
        blocks, "compute", AccessKind.READ, token=step
    )  # the forward host-waits on the load
    assert list(fence) == [load]
    pool.tag(blocks, step, AccessKind.READ)
    pool.free_blocks(blocks)
    assert pool.reclaimable_after(step) == 2
    pool.complete(step)
    assert pool.held_block_ids() == []


def test_a_step_that_did_not_wait_on_the_transfer_brings_back_nothing(pool: HazardAwareBlockPool) -> None:
    freed_under_store(pool, 2)
    step = pool.issue("compute")
    assert pool.reclaimable_after(step) == 0


def test_a_token_that_ended_brings_back_nothing_more(pool: HazardAwareBlockPool) -> None:
    _, store = freed_under_store(pool, 2)
    pool.complete(store)
    assert pool.reclaimable_after(store) == 0


def test_a_block_another_host_access_touched_since_it_was_held_is_not_counted(
    pool: HazardAwareBlockPool,
) -> None:
    blocks, store = freed_under_store(pool, 1)
    later = pool.issue("nic")
    pool.tag(blocks, later, AccessKind.READ)  # freeing the block would hold it again on nic:1
    free = pool.get_num_free_blocks()
    assert pool.reclaimable_after(store) == 0
    pool.complete(store)
    assert pool.get_num_free_blocks() == free and pool.held_block_ids() == [blocks[0].block_id]


def test_reclaimable_after_takes_a_fence(pool: HazardAwareBlockPool) -> None:
    freed_under_store(pool, 2)
    freed_under_store(pool, 1, "nic")
    fence = pool.fence_for(pool.blocks[1:4], "h2d")  # the held blocks' host stores
    assert fence.needs_host_wait and pool.reclaimable_after(fence) == 3


def test_reclaimable_after_applies_a_completion_reported_since_the_last_call(
    pool: HazardAwareBlockPool,
) -> None:
    _, s1 = freed_under_store(pool, 2)
    pool.complete(s1)  # queued, not applied yet
    assert pool.reclaimable_after(s1) == 0


def test_with_hazards_off_nothing_is_held_or_reclaimable() -> None:
    pool = make_pool(track_hazards=False)
    _, store = freed_under_store(pool, 2)
    assert pool.reclaimable_after(store) == 0 and pool.held_until() == {}


# -- held_until -------------------------------------------------------------------


def test_held_until_maps_each_pending_token_to_the_blocks_it_brings_back(pool: HazardAwareBlockPool) -> None:
    _, s1 = freed_under_store(pool, 2)
    _, s2 = freed_under_store(pool, 1, "nic")
    _, s3 = freed_under_store(pool, 3)
    assert pool.held_until() == {s2: 1, s1: 2, s3: 3}
    assert list(pool.held_until()) == [s2, s1, s3]  # by stream, then seq


def test_held_until_maps_tokens_that_share_every_block_to_zero(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    s1, _ = pool.begin_store(blocks, "rdma")
    s2, _ = pool.begin_store(blocks, "nic")
    pool.free_blocks(blocks)
    assert pool.held_until() == {s2: 0, s1: 0}
    assert pool.stats().held == 2


def test_held_until_counts_a_block_under_every_token_whose_completion_frees_it(
    pool: HazardAwareBlockPool,
) -> None:
    a, b = pool.get_new_blocks(2)
    l1, _ = pool.begin_load([a, b], "rdma")
    l2, _ = pool.begin_load([b], "rdma")
    pool.free_blocks([a, b])
    assert pool.held_until() == {l1: 1, l2: 2}  # adds up to 3: two blocks are held


def test_held_until_is_empty_when_nothing_is_held(pool: HazardAwareBlockPool) -> None:
    pool.begin_store(pool.get_new_blocks(2), "rdma")  # in flight, but the blocks are still in use
    assert pool.held_until() == {}


def test_held_until_drops_a_token_once_it_ended(pool: HazardAwareBlockPool) -> None:
    _, s1 = freed_under_store(pool, 2)
    _, s2 = freed_under_store(pool, 1)
    pool.complete(s1)
    assert pool.held_until() == {s2: 1}


def test_held_until_drops_a_token_whose_blocks_a_prefix_hit_took_back(pool: HazardAwareBlockPool) -> None:
    blocks, store = freed_under_store(pool, 2)
    pool.touch(blocks)  # taken back by a new request: in use, not held
    assert pool.held_until() == {} and pool.reclaimable_after(store) == 0


# -- they change nothing; bad input ---------------------------------------------------


def test_the_queries_change_nothing(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(3)
    s1, _ = pool.begin_store(blocks[:2], "rdma")
    l1, _ = pool.begin_load(blocks[2:], "nic")
    pool.free_blocks(blocks)
    pool.poll()
    before = pool.snapshot()
    pool.reclaimable_after(s1)
    pool.reclaimable_after([s1, l1])
    pool.held_until()
    assert pool.snapshot() == before
    pool.check()


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (42, InvalidArgumentError),
        ("rdma:1", InvalidArgumentError),  # an iterable, of characters
        ([Token("rdma", 1, StreamKind.HOST), None], InvalidArgumentError),
        (Token("rdma", 9, StreamKind.HOST), UnknownTokenError),
        (Token("nvme", 1, StreamKind.HOST), UnknownStreamError),
        (Token("rdma", 1, StreamKind.DEVICE), InvalidArgumentError),  # kind is not the stream's
    ],
)
def test_reclaimable_after_refuses_bad_input_and_changes_nothing(
    pool: HazardAwareBlockPool, bad: object, error: type[Exception]
) -> None:
    freed_under_store(pool, 2)
    pool.poll()
    before = pool.snapshot()
    with pytest.raises(error):
        pool.reclaimable_after(bad)  # type: ignore[arg-type]
    assert pool.snapshot() == before


def test_reclaimable_after_refuses_another_pools_token_and_changes_nothing(
    pool: HazardAwareBlockPool,
) -> None:
    _, theirs = freed_under_store(make_pool(), 1)
    freed_under_store(pool, 1)
    before = pool.snapshot()
    with pytest.raises(ForeignTokenError):
        pool.reclaimable_after(theirs)
    assert pool.snapshot() == before


# -- property: the answer is what completing the tokens frees ---------------------------

_HOSTS = ("rdma", "nic")
Op = tuple


def _ops() -> st.SearchStrategy[list[Op]]:
    req = st.integers(0, 5)
    return st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(1, 2)),
            st.tuples(st.sampled_from(("load", "load_first")), req, st.sampled_from((*_HOSTS, "h2d"))),
            st.tuples(st.just("store"), req, st.sampled_from((*_HOSTS, "h2d"))),
            st.tuples(st.just("step"), req, st.booleans()),
            st.tuples(st.just("free"), req),
            st.tuples(st.just("touch"), req),
            st.tuples(st.sampled_from(("complete", "fail")), st.integers(0, 30)),
        ),
        max_size=30,
    )


def _run(ops: Sequence[Op]) -> tuple[HazardAwareBlockPool, list[Token]]:
    """Replay ``ops`` on a fresh pool (deterministic), then free every
    request left: the pool and every token issued."""
    pool = make_pool(10)
    reqs: list[list] = [pool.get_new_blocks(2), pool.get_new_blocks(2), pool.get_new_blocks(1)]
    issued: list[Token] = []
    for op in ops:
        kind = op[0]
        try:
            if kind == "alloc":
                reqs.append(pool.get_new_blocks(op[1]))
            elif kind in ("complete", "fail"):
                if issued:
                    t = issued[op[1] % len(issued)]
                    (pool.complete if kind == "complete" else pool.fail)(t)
            elif reqs:
                blocks = reqs[op[1] % len(reqs)]
                if kind == "load":
                    issued.append(pool.begin_load(blocks, op[2])[0])
                elif kind == "load_first":  # a load of the first block alone
                    issued.append(pool.begin_load(blocks[:1], op[2])[0])
                elif kind == "store":
                    issued.append(pool.begin_store(blocks, op[2])[0])
                elif kind == "step":  # a forward reading the blocks, host-waiting on loads if fenced
                    e = pool.issue("compute")
                    if op[2]:
                        pool.fence_for(blocks, "compute", AccessKind.READ, token=e)
                    pool.tag(blocks, e, AccessKind.READ)
                    issued.append(e)
                elif kind == "free":
                    pool.free_blocks(reqs.pop(op[1] % len(reqs)))
                elif kind == "touch":
                    held = [pool.blocks[i] for i in pool.held_block_ids()]
                    if held:
                        pool.touch(held[:2])
                        reqs.append(held[:2])
        except BlockPoolError:
            pass  # refused, nothing changed: the replay refuses it the same way
    for blocks in reqs:  # the requests end: what a transfer still touches is held
        pool.free_blocks(blocks)
    pool.poll()
    return pool, issued


def _freed_by(
    ops: Sequence[Op], which: Sequence[int], end: Callable[[HazardAwareBlockPool, Token], None]
) -> int:
    """Blocks the free queue gains when the tokens ``which`` (indices into
    the issued tokens) end, on a replay of ``ops``."""
    pool, issued = _run(ops)
    free = pool.get_num_free_blocks()
    for i in which:
        end(pool, issued[i])
    return pool.get_num_free_blocks() - free


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops(), st.data())
def test_reclaimable_after_is_exactly_what_completing_the_tokens_frees(
    ops: list[Op], data: st.DataObject
) -> None:
    pool, issued = _run(ops)
    if not issued:
        return
    before = pool.snapshot()
    complete = HazardAwareBlockPool.complete
    for i, t in enumerate(issued):
        assert pool.reclaimable_after(t) == _freed_by(ops, [i], complete), t
    some = data.draw(st.lists(st.integers(0, len(issued) - 1), max_size=3))
    assert pool.reclaimable_after([issued[i] for i in some]) == _freed_by(ops, some, complete)
    until = pool.held_until()
    assert until == {t: pool.reclaimable_after(t) for t in until}
    pending = {t for _, toks in pool.snapshot().held for t in toks}
    assert {str(t) for t in until} == pending
    assert pool.snapshot() == before
    pool.check()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops())
def test_a_failure_frees_at_most_what_reclaimable_after_counts(ops: list[Op]) -> None:
    pool, issued = _run(ops)
    for i, t in enumerate(issued):
        assert _freed_by(ops, [i], HazardAwareBlockPool.fail) <= pool.reclaimable_after(t)
