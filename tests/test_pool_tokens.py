"""Completions, failures, leases and abandon (``blockpool/core/_tokens.py``):
blocks of an aborted load are held until their transfer ends and released
exactly once; a failed load publishes nothing. One test per behaviour.
"""

from __future__ import annotations

import warnings

import pytest

from blockpool import (
    BlockRemoved,
    ForeignTokenError,
    HazardAwareBlockPool,
    LeaseExpiredWarning,
    NoFreeBlocksError,
    StreamKind,
    Token,
)
from tests.conftest import ids, make_pool

# 4. Aborted load: hold, then release exactly once -----------------------------


def aborted_load(pool: HazardAwareBlockPool) -> tuple[list, Token, Token]:
    blocks, _ = pool.allocate_for(4, "rdma")
    l1, _ = pool.begin_load(blocks[:2], "rdma")
    l2, _ = pool.begin_load(blocks[2:], "rdma")
    return blocks, l1, l2


def test_aborted_load_holds_blocks_until_their_transfer_ends(pool: HazardAwareBlockPool) -> None:
    blocks, l1, l2 = aborted_load(pool)
    pool.fail(l1)
    pool.free_blocks(list(reversed(blocks)))
    assert pool.held_block_ids() == ids(blocks[2:])
    assert pool.get_num_free_blocks() == 9 - 2
    with pytest.raises(NoFreeBlocksError):  # the held blocks are not free
        pool.get_new_blocks(8)
    assert pool.get_num_free_blocks() == 9 - 2 and pool.held_block_ids() == ids(blocks[2:])
    pool.complete(l2)
    assert pool.held_block_ids() == []
    assert pool.get_num_free_blocks() == 9
    pool.check()


def test_aborted_load_releases_at_once_when_transfers_already_ended(pool: HazardAwareBlockPool) -> None:
    blocks, l1, l2 = aborted_load(pool)
    pool.fail(l1)
    pool.complete(l2)
    pool.free_blocks(blocks)
    assert pool.held_block_ids() == []
    assert pool.get_num_free_blocks() == 9


def test_held_block_is_released_exactly_once(pool: HazardAwareBlockPool) -> None:
    blocks, l1, l2 = aborted_load(pool)
    pool.free_blocks(blocks)
    pool.complete(l2)
    pool.complete(l2)
    pool.complete(l1)
    assert pool.get_num_free_blocks() == 9
    assert sorted(ids(pool.free_block_queue)) == list(range(1, 10))
    pool.check()


def test_expired_lease_is_reported_but_blocks_stay_quarantined() -> None:
    now = [0.0]
    pool = make_pool(lease_timeout=5.0, clock=lambda: now[0])
    blocks, _l1, _l2 = aborted_load(pool)
    pool.free_blocks(blocks)
    now[0] = 4.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.poll()
    now[0] = 5.0
    with pytest.warns(LeaseExpiredWarning, match=r"\[1, 2, 3, 4\]"):
        pool.poll()
    assert pool.stats().leases_expired == 4
    assert pool.expired_leases() == [1, 2, 3, 4]
    assert pool.held_block_ids() == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.poll()  # reported once, not again


def test_abandon_releases_quarantined_blocks() -> None:
    now = [0.0]
    pool = make_pool(lease_timeout=1.0, clock=lambda: now[0])
    blocks, l1, l2 = aborted_load(pool)
    pool.free_blocks(blocks)
    now[0] = 2.0
    with pytest.warns(LeaseExpiredWarning):
        pool.poll()
    assert pool.abandon(l1) == [1, 2]
    assert pool.abandon(l2) == [3, 4]
    assert pool.get_num_free_blocks() == 9
    assert pool.stats().abandoned == 2 and pool.stats().leases_expired == 4
    pool.check()


def test_failed_load_never_publishes_block_hashes(pool: HazardAwareBlockPool) -> None:
    blocks, l1, _l2 = aborted_load(pool)
    pool.cache_full_blocks(blocks, ["k1", "k2", "k3", "k4"], 0, 2, block_size=16)
    pool.take_events()
    pool.fail(l1)
    pool.poll()
    assert pool.get_cached_block("k1") is None and pool.get_cached_block("k2") is None
    assert pool.take_events() == [BlockRemoved(("k1",)), BlockRemoved(("k2",))]
    pool.cache_full_blocks(blocks, ["k1", "k2", "k3", "k4"], 0, 4, block_size=16)
    assert pool.get_cached_block("k1") is None
    assert pool.get_cached_block("k3") is blocks[2]
    assert pool.stats().unpublished_failed_loads == 2


def test_a_touched_held_block_leaves_no_list_behind_when_its_token_ends() -> None:
    """A held block a prefix hit takes back stays listed under its pending
    host token until the token ends; the end must drop the list even when
    nothing is held any more (else one entry would stay for ever per
    offloaded block hit again)."""
    from blockpool import HazardAwareBlockPool, StreamKind

    p = HazardAwareBlockPool(8, streams={"compute": StreamKind.DEVICE, "rdma": StreamKind.HOST})
    for _ in range(50):
        b = p.get_new_blocks(1)
        t = p.issue("rdma")
        p.free_blocks(b, token=t)  # a host read pending: held
        assert len(p.holdback) == 1
        p.touch(b)  # a prefix hit takes it back
        assert len(p.holdback) == 0
        p.complete(t)
        p.poll()
        p.free_blocks(b, token=None)
        p.check()  # a block listed under an ended token is an InvariantError
    assert not p.holdback.tracking


def test_default_free_tag_carries_the_pools_identity() -> None:
    pool, other = make_pool(), make_pool()
    blocks = pool.get_new_blocks(1)
    e1 = pool.issue("compute")
    other.issue("compute")
    pool.free_blocks(blocks)  # tagged with the newest compute token: e1
    _, fence = pool.allocate_for(1, "h2d")
    (t,) = fence
    assert t == e1 and t.pool == pool.pool_id
    with pytest.raises(ForeignTokenError):
        other.complete(t)  # the other pool's compute:1 is not this one


# The token path a real engine runs once a step (docs/performance.md,
# "A real vLLM engine"): tokens built without attrs' __init__, the newest kept.


def test_issued_tokens_are_tokens_like_any_other() -> None:
    import copy
    import pickle

    pool = HazardAwareBlockPool(4)
    pool.add_stream("nic", StreamKind.HOST)
    t = pool.issue("compute")
    made = Token("compute", 1, t.kind, pool.pool_id)
    assert type(t) is Token and t == made and hash(t) == hash(made) and repr(t) == repr(made)
    assert (t.stream, t.seq, t.kind, t.pool) == (made.stream, made.seq, made.kind, made.pool)
    assert pickle.loads(pickle.dumps(t)) == t and Token.from_wire(t.to_wire()).pool == pool.pool_id
    h = pool.issue("nic")
    for back in (pickle.loads(pickle.dumps(h)), copy.copy(h), copy.deepcopy(h)):
        assert (back.stream, back.seq, back.kind, back.pool) == ("nic", 1, StreamKind.HOST, pool.pool_id)
    assert t != h and t != ("compute", 1) and (t == ("compute", 1)) is False  # NotImplemented both ways
    with pytest.raises(AttributeError):  # frozen: a token is a dict key throughout
        t.seq = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del t.stream  # type: ignore[misc]
    with pytest.raises(AttributeError):
        t.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        t < made  # type: ignore[operator]  # noqa: B015  (unordered: order=False)
    match t:
        case Token(stream, seq, kind, owner):
            assert (stream, seq, kind, owner) == ("compute", 1, StreamKind.DEVICE, pool.pool_id)
        case _:
            pytest.fail("a token matches by position")
    with pytest.raises(AttributeError):
        t.__match_args__ = ()  # type: ignore[misc]  # a class attribute, not a field
    with pytest.raises(TypeError):  # final: the pure build at class creation, the compiled one when made

        class Sub(Token):  # type: ignore[misc]
            pass

        Sub("compute", 1)
    assert (t.stream, t.seq, t.kind, t.pool) == ("compute", 1, StreamKind.DEVICE, pool.pool_id)


def test_last_token_is_the_newest_issued_and_none_before_the_first() -> None:
    pool = HazardAwareBlockPool(4)
    assert pool.last_token("compute") is None
    t1 = pool.issue("compute")
    assert pool.last_token("compute") == t1
    t2 = pool.issue("compute")
    pool.complete(t2)
    assert pool.last_token("compute") == t2 and pool.is_ended(t2)


def test_free_count_and_events_apply_queued_completions_first(pool: HazardAwareBlockPool) -> None:
    # get_num_free_blocks and take_events test the inbox before applying it
    # (hoisted): a completion queued since the last call still releases the
    # blocks it held and sends a failed load's removals.
    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "rdma")
    pool.cache_full_blocks([b], ["k"], 0, 1, 16)
    pool.free_blocks([b])
    free = pool.get_num_free_blocks()
    assert pool.held_block_ids() == [b.block_id]
    pool.take_events()
    pool.fail(load)
    assert [type(e) for e in pool.take_events()] == [BlockRemoved]  # take_events applied it
    assert pool.held_block_ids() == [] and pool.get_num_free_blocks() == free + 1


def test_free_count_applies_a_queued_completion_first(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    load, _ = pool.begin_load([b], "rdma")
    pool.free_blocks([b])
    free = pool.get_num_free_blocks()
    pool.complete(load)  # queued: applied by the next call
    assert pool.get_num_free_blocks() == free + 1 and pool.held_block_ids() == []
