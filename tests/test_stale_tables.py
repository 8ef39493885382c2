"""Stale block tables: a table kept past the scheduler's frees
names blocks that were freed and allocated again; with the table's
``generations`` the transfer and publishing calls refuse it
(:class:`StaleBlockError`) and change nothing."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from blockpool import (
    AccessKind,
    BlockNotAllocatedError,
    BlockPoolError,
    ForeignBlockError,
    HazardAwareBlockPool,
    InvalidArgumentError,
    InvariantError,
    StaleBlockError,
)
from tests.conftest import ids, make_pool

KEYS = [f"k{i}" for i in range(6)]


def window_freed_and_reused(pool: HazardAwareBlockPool | None = None):  # type: ignore[no-untyped-def]
    """The scenario: a request's table ``t`` of 6 blocks, its
    generations taken when it was built; the scheduler frees the sliding
    window's middle ``t[3:5]`` and another request gets those blocks (``y``)."""
    pool = pool or make_pool(16)
    t = pool.get_new_blocks(6)
    gens = pool.generations(t)
    pool.free_blocks(t[3:5])
    y = pool.get_new_blocks(2)
    assert set(ids(y)) == set(ids(t[3:5]))  # the same blocks, another request's now
    return pool, t, gens, y


def assert_refused(pool: HazardAwareBlockPool, call: Callable[[], object], block_id: int) -> StaleBlockError:
    pool.poll()
    before = pool.snapshot()
    gens_before = pool.generations(pool.blocks)
    with pytest.raises(StaleBlockError, match=f"block {block_id} was freed and allocated again") as info:
        call()
    assert pool.snapshot() == before
    assert pool.generations(pool.blocks) == gens_before
    pool.check()
    return info.value


# -- the scenario --------------------------------------------------------------


def test_a_kept_copy_of_a_table_whose_window_middle_was_reallocated_cannot_store_or_publish() -> None:
    pool, t, gens, y = window_freed_and_reused()
    err = assert_refused(pool, lambda: pool.begin_store(t, "d2h", generations=gens), t[3].block_id)
    assert (err.block_id, err.table_generation) == (t[3].block_id, gens[3])
    assert err.generation == pool.generations([y[0]])[0] != gens[3]
    assert f"generation {err.generation} now, the table has {gens[3]}" in str(err)
    assert_refused(pool, lambda: pool.cache_full_blocks(t, KEYS, 0, 6, 16, generations=gens), t[3].block_id)
    assert pool.get_cached_block("k3") is None and all(b.block_hash is None for b in y)


def test_without_generations_the_stale_table_is_accepted_as_before() -> None:
    """vLLM's own calls and the adapter pass no generations: unchanged behaviour
    (this is the bug the generations exist to catch)."""
    pool, t, _gens, y = window_freed_and_reused()
    pool.begin_store(t, "d2h")
    pool.cache_full_blocks(t, KEYS, 0, 6, 16)
    assert pool.get_cached_block("k3") is y[0] or pool.get_cached_block("k3") is y[1]
    pool.check()


@pytest.mark.parametrize(
    "name",
    [
        "begin_store",
        "begin_load",
        "begin_copy_src",
        "begin_copy_dst",
        "cache_full_blocks",
        "cache_partial_block",
    ],
)
def test_every_transfer_and_publish_refuses_a_stale_table_and_changes_nothing(name: str) -> None:
    pool, t, gens, y = window_freed_and_reused()
    fresh = pool.get_new_blocks(1)
    g_fresh = pool.generations(fresh)[0]
    pool.cache_full_blocks(t, KEYS, 0, 2, 16)  # some keys and events, so "nothing changed" means something
    e = pool.issue("compute")
    pool.tag(y, e, AccessKind.WRITE)
    calls: dict[str, Callable[[], object]] = {
        "begin_store": lambda: pool.begin_store(t, "d2h", generations=gens),
        "begin_load": lambda: pool.begin_load(t, "h2d", generations=gens),
        "begin_copy_src": lambda: pool.begin_copy(
            [(t[0], fresh[0]), (t[4], fresh[0])], generations=[(gens[0], g_fresh), (gens[4], g_fresh)]
        ),
        "begin_copy_dst": lambda: pool.begin_copy(
            [(fresh[0], t[3])], "compute", generations=[(g_fresh, gens[3])]
        ),
        "cache_full_blocks": lambda: pool.cache_full_blocks(t, KEYS, 2, 6, 16, generations=gens),
        "cache_partial_block": lambda: pool.cache_partial_block(t[4], "p", 3, generation=gens[4]),
    }
    stale = t[4] if name in ("begin_copy_src", "cache_partial_block") else t[3]
    assert_refused(pool, calls[name], stale.block_id)


@pytest.mark.parametrize(
    "name", ["begin_store", "begin_load", "cache_full_blocks", "cache_partial_block", "begin_copy"]
)
def test_a_fresh_table_with_generations_does_what_it_does_without(name: str) -> None:
    def run(with_gens: bool) -> object:
        pool = make_pool(16)
        t = pool.get_new_blocks(6)
        g = pool.generations(t) if with_gens else None
        pool.free_blocks(t[5:])
        pool.get_new_blocks(1)  # takes t[5] again: t[:5] stays fresh
        table, gg = t[:5], (g[:5] if g is not None else None)
        out: object = None
        if name == "begin_store":
            out = pool.begin_store(table, "d2h", generations=gg)
        elif name == "begin_load":
            out = pool.begin_load(table, "h2d", generations=gg)
        elif name == "cache_full_blocks":
            pool.cache_full_blocks(table, KEYS, 1, 4, 16, generations=gg)
        elif name == "cache_partial_block":
            out = pool.cache_partial_block(table[4], "p", 3, generation=None if gg is None else gg[4])
        else:
            pairs = [(table[0], table[1]), (table[2], table[3])]
            pg = None if gg is None else [(gg[0], gg[1]), (gg[2], gg[3])]
            out = pool.begin_copy(pairs, generations=pg)
        pool.check()
        snap = pool.snapshot()
        return out, snap

    assert run(True) == run(False)


def test_null_placeholders_in_a_table_are_skipped() -> None:
    pool = make_pool(16)
    t = pool.get_new_blocks(4)
    gens = pool.generations(t)
    pool.free_blocks(t[1:3])
    pool.get_new_blocks(2)
    table = [t[0], pool.null_block, pool.null_block, t[3]]  # what vLLM's own table holds now
    assert pool.generations(table)[1:3] == (0, 0)
    pool.begin_store(table, "d2h", generations=gens)  # whatever the table recorded for them
    pool.cache_full_blocks(table, KEYS, 0, 4, 16, generations=gens)
    assert pool.get_cached_block("k0") is t[0] and pool.get_cached_block("k3") is t[3]
    pool.check()


def test_masked_out_and_already_cached_blocks_are_not_checked() -> None:
    pool, t, gens, _y = window_freed_and_reused()
    mask = [True, True, False, False, True]
    pool.cache_full_blocks(t, KEYS, 1, 6, 16, block_mask=mask, generations=gens)  # skips t[3], t[4]
    pool.cache_full_blocks(t, KEYS, 5, 6, 16, generations=gens)
    assert pool.get_cached_block("k1") is t[1] and pool.get_cached_block("k3") is None
    pool.check()


def test_a_block_freed_and_taken_back_as_a_prefix_hit_keeps_its_generation() -> None:
    """Same content: a prefix hit (touch, allocate_for(hits=)) is no re-allocation."""
    pool = make_pool(16)
    t = pool.get_new_blocks(3)
    gens = pool.generations(t)
    pool.cache_full_blocks(t, KEYS, 0, 3, 16)
    pool.free_blocks(t)
    pool.touch([t[0]])
    pool.allocate_for(1, "compute", hits=[t[1], t[2]])
    assert pool.generations(t) == gens
    pool.begin_store(t, "d2h", generations=gens)
    pool.check()


@pytest.mark.parametrize("placement", ["lru", "ready_first"])
@pytest.mark.parametrize("eviction", ["lru", "s3fifo", "2q"])
def test_every_allocation_path_gives_a_new_generation(placement: str, eviction: str) -> None:
    pool = make_pool(8, placement=placement, eviction=eviction)
    a = pool.get_new_blocks(7)
    before = pool.generations(a)
    pool.free_blocks(a)
    b, _ = pool.allocate_for(3, "h2d")
    c = pool.get_new_blocks(4)
    after = dict(zip(ids(a), pool.generations(a)))
    for blk in b + c:
        assert after[blk.block_id] != before[ids(a).index(blk.block_id)]
    assert len(set(pool.generations(b)) | set(pool.generations(c))) == 2  # one per allocation
    pool.check()


def test_generations_cost_nothing_until_first_asked_for() -> None:
    pool = make_pool(16)
    pool.free_blocks(pool.get_new_blocks(5))
    assert pool._gens is None  # no per-block word, no stamping
    t = pool.get_new_blocks(2)
    assert pool.generations(t) == (0, 0)  # allocated before generations were on
    assert pool._gens is not None and pool._gens._gens.itemsize == 8 and len(pool._gens._gens) == 16
    pool.free_blocks(t)
    assert pool.generations(pool.get_new_blocks(2)) == (1, 1)


def test_generations_of_another_pools_block_or_a_non_block_are_typed_errors() -> None:
    pool, other = make_pool(8), make_pool(8)
    with pytest.raises(ForeignBlockError):
        pool.generations(other.get_new_blocks(1))
    with pytest.raises(InvalidArgumentError):
        pool.generations([3])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        pool.generations(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        lambda g: g[:-1],  # one short
        lambda g: g + (0,),  # one long
        lambda g: [str(x) for x in g],  # not ints
        lambda g: [float(x) for x in g],
        lambda g: 7,  # not iterable
    ],
)
@pytest.mark.parametrize("call", ["begin_store", "begin_load", "cache_full_blocks", "begin_copy"])
def test_malformed_generations_are_invalid_arguments_and_change_nothing(bad: Callable, call: str) -> None:  # type: ignore[type-arg]
    pool = make_pool(16)
    t = pool.get_new_blocks(4)
    g = bad(pool.generations(t))
    calls: dict[str, Callable[[], object]] = {
        "begin_store": lambda: pool.begin_store(t, "d2h", generations=g),
        "begin_load": lambda: pool.begin_load(t, "h2d", generations=g),
        "cache_full_blocks": lambda: pool.cache_full_blocks(t, KEYS, 0, 4, 16, generations=g),
        "begin_copy": lambda: pool.begin_copy(
            [(t[0], t[1]), (t[2], t[3])],
            generations=g
            if not isinstance(g, (list, tuple))
            else [tuple(g[i : i + 2]) for i in range(0, len(g), 2)],  # type: ignore[arg-type,misc]
        ),
    }
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="generation"):
        calls[call]()
    assert pool.snapshot() == before
    pool.check()


def test_begin_copy_generations_must_be_pairs() -> None:
    pool = make_pool(16)
    t = pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="pairs"):
        pool.begin_copy([(t[0], t[1])], generations=[0])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="generation"):
        pool.cache_partial_block(t[0], "p", 3, generation="0")  # type: ignore[arg-type]
    assert pool.snapshot() == before


def test_a_foreign_block_is_reported_before_staleness_and_staleness_before_ref_count() -> None:
    pool, t, gens, _y = window_freed_and_reused()
    other = make_pool(16).get_new_blocks(1)
    with pytest.raises(ForeignBlockError):
        pool.begin_store(t[:5] + other, "d2h", generations=gens)
    pool.free_blocks(pool.blocks[t[3].block_id : t[3].block_id + 1])  # y's block freed again: ref count 0
    assert_refused(pool, lambda: pool.begin_store(t, "d2h", generations=gens), t[3].block_id)
    with pytest.raises(BlockNotAllocatedError):
        pool.begin_store(t, "d2h")  # without generations: the ref count error, as before


def test_stale_block_error_is_a_value_error_of_the_package_and_pickles_with_its_fields() -> None:
    assert issubclass(StaleBlockError, BlockPoolError) and issubclass(StaleBlockError, ValueError)
    err = StaleBlockError("msg", 4, 9, 2)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.block_id, back.generation, back.table_generation) == ("msg", 4, 9, 2)


def test_check_catches_a_corrupted_generation_array() -> None:
    pool = make_pool(8)
    pool.generations([])
    pool._gens._gens[0] = 1  # type: ignore[union-attr]
    with pytest.raises(InvariantError, match="generation"):
        pool.check()


# -- the property ------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("aaffggsscct"), st.integers(0, 64), st.integers(1, 6)),
        min_size=8,
        max_size=60,
    )
)
def test_a_tables_generations_stay_valid_exactly_while_none_of_its_blocks_was_reallocated(
    ops: list[tuple[str, int, int]],
) -> None:
    """Random allocations, frees, prefix hits and re-allocations; tables are
    taken along the way. A model counts each block's allocations: a table is
    fresh iff none of its blocks was allocated since it was taken. Then
    ``generations()`` equals what was taken iff the table is fresh, and a
    store / publish with the generations is refused (nothing changed) iff
    it is stale."""
    pool = make_pool(12, placement="ready_first" if len(ops) % 2 else "lru")
    allocs = [0] * pool.num_gpu_blocks  # model: allocations of each block so far
    held: list = []  # type: ignore[type-arg]  # one entry per reference we hold
    tables: list[tuple[list, tuple[int, ...], list[int]]] = []  # type: ignore[type-arg]

    def allocated(blocks: list) -> None:  # type: ignore[type-arg]
        for b in blocks:
            allocs[b.block_id] += 1
        held.extend(blocks)

    for op, i, n in ops:
        if op == "a" and n <= pool.get_num_free_blocks():
            allocated(pool.get_new_blocks(n))
        elif op == "f" and held:
            b = held.pop(i % len(held))
            pool.free_blocks([b])
        elif op == "t" and held:
            # a prefix hit / pin: a free block taken back (or a held one shared) is no allocation
            b = pool.blocks[1 + i % (pool.num_gpu_blocks - 1)]
            if b.ref_cnt > 0 or b.prev_free_block is not None:
                pool.touch([b])
                held.append(b)
        elif op == "g" and n <= pool.get_num_free_blocks():
            new, _ = pool.allocate_for(n, "compute")
            allocated(new)
        elif op == "s" and held:
            k = i % len(held)
            table = held[k : k + n]
            tables.append((table, pool.generations(table), [allocs[b.block_id] for b in table]))
        elif op == "c" and tables:
            table, gens, counts = tables[i % len(tables)]
            fresh = all(allocs[b.block_id] == c for b, c in zip(table, counts))
            if all(b.ref_cnt > 0 for b in table):
                before = pool.snapshot()
                try:
                    pool.begin_store(table, "d2h", generations=gens)
                except StaleBlockError:
                    assert not fresh
                    assert pool.snapshot() == before
                    event("store of a stale table refused")
                else:
                    assert fresh
                    event("store of a fresh table accepted")
        for table, gens, counts in tables:
            fresh = all(allocs[b.block_id] == c for b, c in zip(table, counts))
            assert (pool.generations(table) == gens) == fresh
            if not fresh:
                event("a stale table")
                before = pool.snapshot()
                with pytest.raises(StaleBlockError):
                    pool.cache_full_blocks(table, KEYS, 0, len(table), 16, generations=gens)
                assert pool.snapshot() == before
    pool.check()
