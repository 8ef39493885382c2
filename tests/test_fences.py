"""Fences and tokens: value-type behaviour and the reduction rules."""

from __future__ import annotations

import pickle

import pytest

from blockpool import AccessKind, Fence, HazardAwareBlockPool, StreamKind, Token
from tests.conftest import make_pool, toks

R, W = AccessKind.READ, AccessKind.WRITE


def test_token_equality_ignores_kind_and_hashes_alike() -> None:
    a, b = Token("rdma", 3, StreamKind.HOST), Token("rdma", 3)
    assert a == b and hash(a) == hash(b)
    assert Token("rdma", 4) != a


@pytest.mark.parametrize("seq", [0, -1, 1.0, True])
def test_token_rejects_bad_seq(seq: object) -> None:
    with pytest.raises(ValueError):
        Token("compute", seq)  # type: ignore[arg-type]


def test_token_and_fence_survive_pickle_and_wire_round_trips() -> None:
    t = Token("rdma", 9, StreamKind.HOST)
    f = Fence([t, Token("compute", 2)], needs_host_wait=True)
    assert pickle.loads(pickle.dumps(f)) == f
    assert Fence.from_wire(f.to_wire()) == f
    assert Token.from_wire(t.to_wire()).kind is StreamKind.HOST


def test_fence_is_falsy_when_empty_and_iterates_sorted() -> None:
    f = Fence([Token("h2d", 1), Token("compute", 4)])
    assert not Fence() and f and len(f) == 2
    assert [str(t) for t in f] == ["compute:4", "h2d:1"]
    assert Token("h2d", 1) in f


def test_fence_merge_keeps_newest_device_token_and_every_host_token() -> None:
    a = Fence([Token("compute", 3), Token("rdma", 1, StreamKind.HOST)])
    b = Fence([Token("compute", 5), Token("rdma", 2, StreamKind.HOST)], needs_host_wait=True)
    m = a.merge(b)
    assert toks(m) == {"compute:5", "rdma:1", "rdma:2"}
    assert m.needs_host_wait


def test_fence_names_at_most_one_token_per_device_stream(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(3)
    for b in a:
        pool.free_blocks([b], token=pool.issue("compute"))
    _, fence = pool.allocate_for(3, "h2d")
    assert toks(fence) == {"compute:3"}


def test_tokens_on_consumer_device_stream_are_dropped(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.free_blocks(a, token=pool.issue("compute"))
    _, fence = pool.allocate_for(2, "compute")
    assert not fence


def test_host_engine_consumer_waits_on_its_own_engine(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    s, _ = pool.begin_store([b], "rdma")
    _t, fence = pool.begin_load([b], "rdma")
    assert list(fence) == [s] and fence.needs_host_wait


def test_read_waits_only_for_the_writer(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    _load, _ = pool.begin_load([b], "h2d")
    _store, _ = pool.begin_store([b], "d2h")
    assert toks(pool.fence_for([b], "compute", R)) == {"h2d:1"}


def test_write_waits_for_all_unordered_readers(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    _s1, _ = pool.begin_store([b], "d2h")
    _s2, _ = pool.begin_store([b], "rdma")
    e1 = pool.issue("compute")
    pool.tag([b], e1, R)
    assert toks(pool.fence_for([b], "h2d", W)) == {"d2h:1", "rdma:1", "compute:1"}


def test_token_covered_by_another_fence_token_is_dropped(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([b], e1, R)
    # the store waits on nothing about e1, but d2h is later ordered after e1:
    _s1, _ = pool.begin_store([b], "d2h")
    pool.fence_for([b], "d2h", W)  # d2h waits on e1 (WAR), clock now covers it
    _s2, _ = pool.begin_store([b], "d2h")
    assert toks(pool.fence_for([b], "h2d", W)) == {"d2h:2"}


def test_completion_of_a_token_ends_what_it_waited_on(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    pool.tag([b], e1, R)
    load, fence = pool.begin_load([b], "rdma")
    assert list(fence) == [e1]
    pool.complete(load)  # the load ran after its wait on e1, so e1 ended too
    assert pool.is_ended(e1)


def test_host_completion_out_of_order_advances_mark_only_when_contiguous() -> None:
    pool = make_pool()
    t1, t2, t3 = (pool.issue("rdma") for _ in range(3))
    pool.complete(t3)
    pool.complete(t1)
    assert pool.is_ended(t1) and not pool.is_ended(t2) and pool.is_ended(t3)
    assert pool.tracker.streams["rdma"].mark == 1
    pool.complete(t2)
    pool.poll()
    assert pool.tracker.streams["rdma"].mark == 3


def test_device_completion_ends_every_earlier_token(pool: HazardAwareBlockPool) -> None:
    e1, e2, e3 = (pool.issue("compute") for _ in range(3))
    pool.complete(e2)
    assert pool.is_ended(e1) and pool.is_ended(e2) and not pool.is_ended(e3)


def test_debug_fence_explains_each_token() -> None:
    pool = make_pool(debug=True)
    a = pool.get_new_blocks(2)
    e1 = pool.issue("compute")
    pool.tag([a[1]], e1, R)
    _load, _ = pool.begin_load([a[0]], "rdma")
    fence = pool.fence_for(a, "h2d", W)
    assert fence.explain().splitlines() == [
        "compute:1: block 2 reader (WAR)",
        "rdma:1: block 1 writer (WAW)",
    ]
    assert fence.needs_host_wait


def test_device_consumer_fence_with_host_token_needs_host_wait(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "rdma")
    pool.cache_full_blocks([b], ["h"], 0, 1)  # published for the content being loaded
    _, fence = pool.allocate_for(0, "compute", hits=[pool.get_cached_block("h")])
    assert list(fence) == [load] and fence.needs_host_wait


def test_plain_pool_hands_out_empty_fences_and_holds_nothing() -> None:
    pool = make_pool(track_hazards=False)
    a = pool.get_new_blocks(2)
    _load, fence = pool.begin_load(a, "rdma")
    pool.free_blocks(a, token=pool.issue("compute"))
    assert not fence and pool.held_block_ids() == []
    _, fence = pool.allocate_for(2, "h2d")
    assert not fence


def test_stats_count_fences_and_their_sizes(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    pool.free_blocks(a, token=pool.issue("compute"))
    pool.allocate_for(2, "rdma")
    pool.allocate_for(1, "h2d")
    s = pool.stats()
    assert (s.fences, s.empty_fences, s.fence_tokens, s.host_wait_fences, s.max_fence_size) == (2, 1, 1, 1, 1)
