"""Blocks whose content is bad are findable: ``invalid_block_ids``
(``blockpool/core/_introspection.py``, ``blockpool/core/pending_writes.py``).

After a failed load or copy the pool refuses to carry the blocks' content
elsewhere (``InvalidContentError``); an engine that must rewrite or zero
them (vLLM's ``invalid_block_ids`` recovery, vLLM PR #48481) asks which they
are. The list empties as the blocks are written again. The property at the
end checks, on random sequences, that the list is exactly what a store
refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockpool import HazardAwareBlockPool, StreamKind, Token
from blockpool.core.errors import (
    BlockPoolError,
    ForeignTokenError,
    InvalidArgumentError,
    InvalidContentError,
    UnknownStreamError,
    UnknownTokenError,
)
from blockpool.core.hazards import AccessKind

STREAMS = {
    "compute": StreamKind.DEVICE,
    "h2d": StreamKind.DEVICE,
    "d2h": StreamKind.DEVICE,
    "rdma": StreamKind.HOST,
}
R, W = AccessKind.READ, AccessKind.WRITE


def make_pool(n: int = 10) -> HazardAwareBlockPool:
    return HazardAwareBlockPool(n, streams=STREAMS, enable_kv_cache_events=True)


@pytest.fixture
def pool() -> HazardAwareBlockPool:
    return make_pool()


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def failed_load(pool: HazardAwareBlockPool, n: int = 2, stream: str = "h2d") -> tuple[list, Token]:
    blocks = pool.get_new_blocks(n)
    load, _ = pool.begin_load(blocks, stream)
    pool.fail(load)
    return blocks, load


# -- listed after a failure --------------------------------------------------------


def test_a_failed_loads_blocks_are_listed(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 3)
    assert pool.invalid_block_ids() == ids(blocks)


def test_a_failed_host_loads_blocks_are_listed(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2, "rdma")
    assert pool.invalid_block_ids() == ids(blocks)


def test_the_list_is_sorted(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(3)
    load, _ = pool.begin_load(list(reversed(blocks)), "h2d")
    pool.fail(load)
    assert pool.invalid_block_ids() == sorted(ids(blocks))


def test_a_failed_copy_lists_its_destination_not_its_source(pool: HazardAwareBlockPool) -> None:
    src, dst = pool.get_new_blocks(2)
    copy, _ = pool.begin_copy([(src, dst)])
    pool.fail(copy)
    assert pool.invalid_block_ids() == [dst.block_id]


def test_a_failed_step_write_lists_its_blocks(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    step = pool.issue("compute")
    pool.tag(blocks, step, W)
    pool.fail(step)
    assert pool.invalid_block_ids() == ids(blocks)


def test_a_failure_reported_after_the_load_ended_lists_its_blocks(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    load, _ = pool.begin_load(blocks, "rdma")
    step = pool.issue("compute")
    pool.fence_for(blocks, "compute", R, token=step)  # the step waited on the load...
    pool.tag(blocks, step, R)
    pool.complete(step)  # ...so its completion ended the load
    assert pool.is_ended(load) and pool.invalid_block_ids() == []
    pool.fail(load)  # the connector's error report comes late
    assert pool.invalid_block_ids() == ids(blocks)


def test_a_write_recorded_after_its_token_failed_lists_its_blocks(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(2)
    step = pool.issue("compute")
    pool.fail(step)
    pool.tag(blocks, step, W)  # never happened
    assert pool.invalid_block_ids() == ids(blocks)


def test_free_blocks_stay_listed_until_handed_out(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool)
    pool.free_blocks(blocks)
    assert pool.invalid_block_ids() == ids(blocks)


def test_the_listed_blocks_are_the_ones_a_store_refuses(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool)
    (good,) = pool.get_new_blocks(1)
    assert pool.invalid_block_ids() == ids(blocks)
    for bid in pool.invalid_block_ids():
        with pytest.raises(InvalidContentError):
            pool.begin_store([pool.blocks[bid]], "d2h")
    pool.begin_store([good], "d2h")


# -- per token -----------------------------------------------------------------------


def test_by_token_lists_only_the_blocks_that_tokens_failure_marked(pool: HazardAwareBlockPool) -> None:
    a, la = failed_load(pool, 2)
    b, lb = failed_load(pool, 1, "rdma")
    assert pool.invalid_block_ids(la) == ids(a) and pool.invalid_block_ids(lb) == ids(b)
    assert pool.invalid_block_ids() == sorted(ids(a) + ids(b))


def test_by_token_is_empty_for_a_token_that_did_not_fail(pool: HazardAwareBlockPool) -> None:
    failed_load(pool)
    blocks = pool.get_new_blocks(1)
    ok, _ = pool.begin_load(blocks, "h2d")
    pool.complete(ok)
    assert pool.invalid_block_ids(ok) == [] and pool.invalid_block_ids(pool.issue("compute")) == []


def test_a_block_failed_twice_carries_the_latest_failure(pool: HazardAwareBlockPool) -> None:
    blocks, first = failed_load(pool, 1)
    again, _ = pool.begin_load(blocks, "h2d")
    pool.fail(again)
    assert pool.invalid_block_ids(first) == [] and pool.invalid_block_ids(again) == ids(blocks)


# -- cleared when written again ----------------------------------------------------------


def test_a_new_load_clears_the_blocks_it_rewrites(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2)
    pool.begin_load(blocks[:1], "h2d")
    assert pool.invalid_block_ids() == ids(blocks[1:])


def test_a_new_load_that_completes_leaves_them_cleared(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2)
    load, _ = pool.begin_load(blocks, "h2d")
    pool.complete(load)
    assert pool.invalid_block_ids() == []
    pool.begin_store(blocks, "d2h")  # the content is good again


def test_a_new_load_that_fails_lists_them_again(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2)
    load, _ = pool.begin_load(blocks, "h2d")
    pool.fail(load)
    assert pool.invalid_block_ids(load) == ids(blocks)


def test_a_step_write_clears_the_blocks_it_writes(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2)
    step = pool.issue("compute")
    pool.tag(blocks[1:], step, W)  # recompute the second block's tokens
    assert pool.invalid_block_ids() == ids(blocks[:1])


def test_a_free_with_write_clears_the_blocks(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2)
    step = pool.issue("compute")
    pool.free_blocks(blocks, token=step, access=W)
    assert pool.invalid_block_ids() == []


def test_a_copy_into_a_block_clears_it(pool: HazardAwareBlockPool) -> None:
    (dst,), _ = failed_load(pool, 1)
    (src,) = pool.get_new_blocks(1)
    pool.begin_copy([(src, dst)])
    assert pool.invalid_block_ids() == []


def test_an_allocation_that_hands_a_block_out_again_clears_it(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2)
    pool.free_blocks(blocks)
    again = pool.get_new_blocks(1)  # unkeyed freed blocks are reused first
    assert set(ids(again)) < set(ids(blocks))
    assert pool.invalid_block_ids() == sorted(set(ids(blocks)) - set(ids(again)))


def test_a_reset_with_every_block_free_clears_them(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 2)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.invalid_block_ids() == []


def test_a_write_recorded_after_its_token_completed_leaves_the_mark(pool: HazardAwareBlockPool) -> None:
    blocks, _ = failed_load(pool, 1)
    step = pool.issue("compute")
    pool.complete(step)
    pool.poll()
    pool.tag(blocks, step, W)  # ran before or after the failed load? unknown: keep it unpublishable
    assert pool.invalid_block_ids() == ids(blocks)


def test_a_store_begun_before_the_failure_leaves_the_mark(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(1)
    load, _ = pool.begin_load(blocks, "h2d")
    store, fence = pool.begin_store(blocks, "d2h")  # waits on the load
    assert list(fence) == [load]
    pool.fail(load)
    pool.complete(store)  # a read: it rewrites nothing
    assert pool.invalid_block_ids() == ids(blocks)


# -- it changes nothing; bad input -------------------------------------------------------


def test_the_query_changes_nothing(pool: HazardAwareBlockPool) -> None:
    blocks, load = failed_load(pool, 2)
    pool.poll()
    before = pool.snapshot()
    first = pool.invalid_block_ids()
    assert pool.invalid_block_ids() == first and pool.invalid_block_ids(load) == first
    assert pool.snapshot() == before
    with pytest.raises(InvalidContentError):
        pool.begin_store(blocks, "d2h")  # still refused
    pool.check()


def test_the_query_applies_a_failure_reported_since_the_last_call(pool: HazardAwareBlockPool) -> None:
    blocks = pool.get_new_blocks(1)
    load, _ = pool.begin_load(blocks, "h2d")
    pool.fail(load)  # queued
    assert pool.invalid_block_ids() == ids(blocks)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("h2d:1", InvalidArgumentError),
        (("h2d", 1), InvalidArgumentError),
        (Token("h2d", 9), UnknownTokenError),
        (Token("nvme", 1), UnknownStreamError),
        (Token("h2d", 1, StreamKind.HOST), InvalidArgumentError),  # kind is not the stream's
    ],
)
def test_a_bad_token_is_refused_and_changes_nothing(
    pool: HazardAwareBlockPool, bad: object, error: type[Exception]
) -> None:
    failed_load(pool)
    pool.poll()
    before = pool.snapshot()
    with pytest.raises(error):
        pool.invalid_block_ids(bad)  # type: ignore[arg-type]
    assert pool.snapshot() == before and pool.invalid_block_ids() == [1, 2]


def test_another_pools_token_is_refused_and_changes_nothing(pool: HazardAwareBlockPool) -> None:
    _, theirs = failed_load(make_pool())
    failed_load(pool)
    pool.poll()
    before = pool.snapshot()
    with pytest.raises(ForeignTokenError):
        pool.invalid_block_ids(theirs)
    assert pool.snapshot() == before


# -- property: the list is what a store refuses ---------------------------------------------

Op = tuple


def _ops() -> st.SearchStrategy[list[Op]]:
    req = st.integers(0, 5)
    return st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(1, 2)),
            st.tuples(st.just("load"), req, st.sampled_from(("h2d", "rdma")), st.booleans()),
            st.tuples(st.just("copy"), req, req),
            st.tuples(st.just("step"), req, st.sampled_from((R, W)), st.booleans()),
            st.tuples(st.just("free"), req),
            st.tuples(st.just("complete"), st.integers(0, 30)),
            st.tuples(st.just("fail"), st.integers(0, 30)),
            st.tuples(st.just("fail"), st.integers(0, 30)),
            st.tuples(st.just("reset"), st.booleans()),
        ),
        max_size=30,
    )


def _run(ops: Sequence[Op]) -> tuple[HazardAwareBlockPool, list[Token], set[Token]]:
    """Replay ``ops`` on a fresh pool: the pool, every token issued, the ones failed."""
    pool = make_pool(10)
    reqs: list[list] = [pool.get_new_blocks(2), pool.get_new_blocks(2), pool.get_new_blocks(1)]
    issued: list[Token] = []
    failed: set[Token] = set()
    for op in ops:
        kind = op[0]
        try:
            if kind == "alloc":
                reqs.append(pool.get_new_blocks(op[1]))
            elif kind in ("complete", "fail"):
                if issued:
                    t = issued[op[1] % len(issued)]
                    if kind == "fail":
                        pool.fail(t)
                        failed.add(t)
                    else:
                        pool.complete(t)
            elif kind == "reset":
                pool.reset_prefix_cache(while_running=op[1])
            elif reqs:
                blocks = reqs[op[1] % len(reqs)]
                if kind == "load":
                    issued.append(pool.begin_load(blocks[:1] if op[3] else blocks, op[2])[0])
                elif kind == "copy":
                    dst = reqs[op[2] % len(reqs)]
                    issued.append(pool.begin_copy([(blocks[0], dst[-1])])[0])
                elif kind == "step":
                    e = pool.issue("compute")
                    if op[3]:
                        pool.fence_for(blocks, "compute", op[2], token=e)
                    pool.tag(blocks, e, op[2])
                    issued.append(e)
                elif kind == "free":
                    pool.free_blocks(reqs.pop(op[1] % len(reqs)))
        except BlockPoolError:
            pass  # refused, nothing changed
    pool.poll()
    return pool, issued, failed


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops())
def test_the_list_is_exactly_the_allocated_blocks_a_store_refuses_plus_free_ones(ops: list[Op]) -> None:
    pool, issued, failed = _run(ops)
    before = pool.snapshot()
    listed = pool.invalid_block_ids()
    by_token = [pool.invalid_block_ids(t) for t in issued]
    assert pool.snapshot() == before
    assert sorted(b for part in by_token for b in set(part)) == sorted(set().union(*map(set, by_token)))
    assert set().union(*map(set, by_token)) == set(listed)  # every mark is some issued token's
    assert all(not part or t in failed for t, part in zip(issued, by_token))
    pool.check()
    for b in pool.blocks[1:]:
        if b.ref_cnt == 0:
            continue  # a free block: listed or not, it is rewritten before it is handed out
        try:
            pool.begin_store([b], "d2h")
            refused = False
        except InvalidContentError:
            refused = True
        assert refused == (b.block_id in listed), b.block_id
