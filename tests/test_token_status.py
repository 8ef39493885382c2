"""``token_status``: a consumer can tell a failed token from a completed one
``is_ended`` is true for both."""

from __future__ import annotations

import pytest

from blockpool import (
    AccessKind,
    BlockPoolError,
    ForeignTokenError,
    InvalidArgumentError,
    Token,
    TokenStatus,
    UnknownStreamError,
    UnknownTokenError,
)
from tests.conftest import make_pool

PENDING, COMPLETED, FAILED = TokenStatus.PENDING, TokenStatus.COMPLETED, TokenStatus.FAILED


def test_token_status_is_pending_until_the_token_ends_then_completed() -> None:
    pool = make_pool()
    e1 = pool.issue("compute")
    assert pool.token_status(e1) is PENDING
    pool.complete(e1)  # queued: applied by token_status itself
    assert pool.token_status(e1) is COMPLETED


def test_a_failed_load_is_ended_and_failed_not_completed() -> None:
    pool = make_pool()
    load, _ = pool.begin_load(pool.get_new_blocks(2), "rdma")
    pool.fail(load)
    assert pool.is_ended(load) is True
    assert pool.token_status(load) is FAILED


def test_a_prefix_hit_in_the_early_ready_window_can_tell_the_load_failed() -> None:
    """LMCache / vLLM publish a load's blocks while it runs; a request that
    hits them gets the load in its fence. After the load fails, the pool
    withdraws the keys, and the consumer can ask whether its fence token
    completed."""
    pool = make_pool()
    dst = pool.get_new_blocks(2)
    load, _ = pool.begin_load(dst, "h2d")
    pool.cache_full_blocks(dst, ["p0", "p1"], 0, 2, 16)  # early-ready: published while the load runs
    _, fence = pool.allocate_for(1, "compute", hits=dst)
    assert list(fence) == [load]
    pool.fail(load)
    assert [pool.token_status(t) for t in fence] == [FAILED]
    assert pool.get_cached_block("p0") is None


def test_a_failure_reported_after_completion_makes_the_token_failed() -> None:
    pool = make_pool()
    load, _ = pool.begin_load(pool.get_new_blocks(1), "rdma")
    pool.complete(load)
    assert pool.token_status(load) is COMPLETED
    pool.fail(load)  # late: the connector found the content bad
    assert pool.token_status(load) is FAILED


def test_tokens_before_a_failed_device_token_are_completed() -> None:
    pool = make_pool()
    e1, e2, e3 = (pool.issue("compute") for _ in range(3))
    pool.fail(e2)
    assert [pool.token_status(t) for t in (e1, e2, e3)] == [COMPLETED, FAILED, PENDING]
    pool.complete(e3)
    assert [pool.token_status(t) for t in (e1, e2, e3)] == [COMPLETED, FAILED, COMPLETED]


def test_a_token_ended_by_a_completion_ordered_after_it_is_completed() -> None:
    pool = make_pool()
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([b], e1, AccessKind.READ)
    load, fence = pool.begin_load([b], "rdma")
    assert list(fence) == [e1]
    pool.complete(load)  # the load waited on e1: e1 has ended too
    assert pool.token_status(e1) is COMPLETED


def test_an_abandoned_token_is_failed() -> None:
    pool = make_pool()
    store, _ = pool.begin_store(pool.get_new_blocks(1), "rdma")
    pool.abandon(store)
    assert pool.token_status(store) is FAILED


@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        (Token("compute", 99), UnknownTokenError),
        (Token("nope", 1), UnknownStreamError),
        (Token("compute", 1, pool=123456789), ForeignTokenError),
        ("compute:1", InvalidArgumentError),
    ],
)
def test_token_status_of_a_bad_token_is_a_typed_error_and_changes_nothing(bad: object, exc: type) -> None:
    pool = make_pool()
    pool.issue("compute")
    pool.poll()
    before = pool.snapshot()
    with pytest.raises(exc) as ei:
        pool.token_status(bad)  # type: ignore[arg-type]
    assert isinstance(ei.value, BlockPoolError)
    assert pool.snapshot() == before
