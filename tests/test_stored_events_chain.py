"""Stored events chain (vLLM #44451 / PR #44488, vllm-ascend
#12002): each ``BlockStored`` of ``cache_full_blocks`` covers one run of
consecutive newly published positions, and its parent is the key of the
position just before the run, so a router can rebuild the prefix tree."""

from __future__ import annotations

import random

import pytest

from blockpool import BlockStored
from tests.conftest import make_pool


def _stored(pool):  # type: ignore[no-untyped-def]
    return [e for e in pool.take_events() if type(e) is BlockStored]


def test_republishing_a_table_whose_first_block_holds_its_key_parents_the_event_on_that_key() -> None:
    pool = make_pool(8)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], ["h0"], 0, 1, 16)
    pool.take_events()
    pool.cache_full_blocks([a, b, c], ["h0", "h1", "h2"], 0, 3, 16)
    assert _stored(pool) == [BlockStored(("h1", "h2"), "h0", 16, (b.block_id, c.block_id), "GPU")]


def test_a_null_block_in_the_table_splits_the_stored_event() -> None:
    pool = make_pool(8)
    g0, g2, g3 = pool.get_new_blocks(3)
    pool.cache_full_blocks([g0, pool.null_block, g2, g3], ["g0", "g1", "g2", "g3"], 0, 4, 16)
    assert _stored(pool) == [
        BlockStored(("g0",), None, 16, (g0.block_id,), "GPU"),
        BlockStored(("g2", "g3"), "g1", 16, (g2.block_id, g3.block_id), "GPU"),
    ]


def test_a_masked_out_block_splits_the_stored_event() -> None:
    pool = make_pool(8)
    t = pool.get_new_blocks(4)
    pool.cache_full_blocks(t, ["m0", "m1", "m2", "m3"], 0, 4, 16, block_mask=[True, False, True, True])
    assert _stored(pool) == [
        BlockStored(("m0",), None, 16, (t[0].block_id,), "GPU"),
        BlockStored(("m2", "m3"), "m1", 16, (t[2].block_id, t[3].block_id), "GPU"),
    ]


def test_a_failed_load_in_the_table_splits_the_stored_event() -> None:
    pool = make_pool(8)
    t = pool.get_new_blocks(4)
    load, _ = pool.begin_load([t[1]], "h2d")
    pool.fail(load)
    pool.cache_full_blocks(t, ["n0", "n1", "n2", "n3"], 0, 4, 16)
    assert pool.get_cached_block("n1") is None
    assert _stored(pool) == [
        BlockStored(("n0",), None, 16, (t[0].block_id,), "GPU"),
        BlockStored(("n2", "n3"), "n1", 16, (t[2].block_id, t[3].block_id), "GPU"),
    ]


def test_a_contiguous_call_after_cached_blocks_is_one_event_parented_on_the_last_cached_key() -> None:
    pool = make_pool(8)
    t = pool.get_new_blocks(3)
    pool.cache_full_blocks(t, ["k0", "k1", "k2"], 0, 1, 16)
    pool.take_events()
    pool.cache_full_blocks(t, ["k0", "k1", "k2"], 1, 3, 16)
    assert _stored(pool) == [BlockStored(("k1", "k2"), "k0", 16, (t[1].block_id, t[2].block_id), "GPU")]


def test_nothing_newly_published_sends_no_stored_event() -> None:
    pool = make_pool(8)
    t = pool.get_new_blocks(2)
    pool.cache_full_blocks(t, ["k0", "k1"], 0, 2, 16)
    pool.take_events()
    pool.cache_full_blocks(t, ["k0", "k1"], 0, 2, 16)
    pool.cache_full_blocks([pool.null_block], ["z"], 0, 1, 16)
    assert pool.take_events() == []


@pytest.mark.parametrize("seed", range(40))
def test_every_stored_event_is_a_chain_of_its_table(seed: int) -> None:
    """Random tables with null blocks, masks and blocks already holding their
    key: rebuilding the prefix tree from the events gives, for every newly
    published block, the parent its position in the table implies."""
    rng = random.Random(seed)
    pool = make_pool(40)
    n = rng.randint(1, 12)
    table = [pool.null_block if rng.random() < 0.2 else b for b in pool.get_new_blocks(n)]
    keys = [f"s{seed}-{i}" for i in range(n)]
    if rng.random() < 0.5:  # some positions already published
        pre = rng.randint(0, n)
        pool.cache_full_blocks(table, keys, 0, pre, 16)
    pool.take_events()
    lo = rng.randint(0, n)
    mask = [rng.random() < 0.8 for _ in range(n - lo)] if rng.random() < 0.5 else None
    before = {i for i, b in enumerate(table) if b is not pool.null_block and b.block_hash == keys[i]}
    pool.cache_full_blocks(table, keys, lo, n, 16, block_mask=mask)
    events = _stored(pool)
    expected = [
        i for i in range(lo, n)
        if table[i] is not pool.null_block and (mask is None or mask[i - lo]) and i not in before
    ]  # fmt: skip
    got = []
    for ev in events:
        first = keys.index(ev.block_hashes[0])
        positions = list(range(first, first + len(ev.block_hashes)))
        assert list(ev.block_hashes) == [keys[i] for i in positions]  # consecutive positions
        assert ev.block_ids == tuple(table[i].block_id for i in positions)
        assert ev.parent_block_hash == (keys[first - 1] if first else None)
        got.extend(positions)
    assert got == expected
    runs_expected = sum(1 for j, i in enumerate(expected) if j == 0 or expected[j - 1] != i - 1)
    assert len(events) == runs_expected
    pool.check()


def test_the_vllm_event_shape_is_an_explicit_choice_and_the_adapters_default() -> None:
    """``stored_events="call"``: vLLM 0.33's one event per call, parented at
    ``num_cached_blocks - 1`` (the vLLM adapter's parity with vLLM's own
    events); it is the default with vLLM's removal events."""
    from blockpool import HazardAwareBlockPool, InvalidArgumentError

    for kw in ({"stored_events": "call"}, {"removal_events": "each"}):
        pool = make_pool(8, **kw)
        assert pool.stored_events == "call"
        g0, g2 = pool.get_new_blocks(2)
        pool.cache_full_blocks([g0, pool.null_block, g2], ["g0", "g1", "g2"], 0, 3, 16)
        assert _stored(pool) == [BlockStored(("g0", "g2"), None, 16, (g0.block_id, g2.block_id), "GPU")]
    assert make_pool(8).stored_events == "runs"
    assert make_pool(8, removal_events="each", stored_events="runs").stored_events == "runs"
    with pytest.raises(InvalidArgumentError, match="stored_events"):
        HazardAwareBlockPool(8, stored_events="vllm")
