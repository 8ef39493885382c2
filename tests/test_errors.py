"""Every bad input raises a typed error and leaves the pool exactly as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import blockpool
from blockpool import (
    AccessKind,
    BlockNotAllocatedError,
    BlockPoolError,
    ForeignBlockError,
    HashConflictError,
    HazardAwareBlockPool,
    InvalidArgumentError,
    NoFreeBlocksError,
    NullBlockError,
    RefCountError,
    Token,
    UnknownStreamError,
    UnknownTokenError,
)
from tests.conftest import make_pool


def busy_pool() -> HazardAwareBlockPool:
    """A pool with used, cached, free-cached blocks, shadows and events."""
    pool = make_pool(10)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, ["h1", "h2", "h3", "h4"], 0, 2, block_size=16)
    e1 = pool.issue("compute")
    pool.free_blocks([a[1]], token=e1)
    pool.begin_store([a[0]], "d2h")
    pool.allocate_for(1, "h2d")
    return pool


def assert_rejected(
    pool: HazardAwareBlockPool, call: Callable[[], object], exc: type[BaseException], match: str
) -> None:
    pool.poll()
    before = pool.snapshot()
    with pytest.raises(exc, match=match):
        call()
    assert pool.snapshot() == before
    pool.check()


def test_every_error_derives_from_package_root_and_a_builtin() -> None:
    pairs = {
        InvalidArgumentError: ValueError,
        NoFreeBlocksError: ValueError,
        ForeignBlockError: ValueError,
        NullBlockError: ValueError,
        RefCountError: ValueError,
        BlockNotAllocatedError: ValueError,
        HashConflictError: ValueError,
        UnknownStreamError: LookupError,
        UnknownTokenError: LookupError,
        blockpool.InvariantError: AssertionError,
    }
    for cls, builtin in pairs.items():
        assert issubclass(cls, BlockPoolError) and issubclass(cls, builtin), cls


def test_free_below_zero_rejects_whole_call() -> None:
    pool = busy_pool()
    a = pool.blocks[3]
    assert a.ref_cnt == 1
    assert_rejected(pool, lambda: pool.free_blocks([pool.blocks[4], a, a]), RefCountError, "block 3")


def test_free_of_free_block_is_rejected() -> None:
    pool = busy_pool()
    free = next(iter(pool.free_block_queue))
    assert_rejected(pool, lambda: pool.free_blocks([free]), RefCountError, f"block {free.block_id}")


def test_free_of_foreign_block_is_rejected() -> None:
    pool, other = busy_pool(), make_pool(10)
    (theirs,) = other.get_new_blocks(1)
    assert_rejected(
        pool, lambda: pool.free_blocks([pool.blocks[3], theirs]), ForeignBlockError, "another|belong"
    )


def test_free_of_non_block_is_invalid_argument() -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.free_blocks([pool.blocks[3], 5]), InvalidArgumentError, "KVCacheBlock")


def test_free_with_unissued_token_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(
        pool, lambda: pool.free_blocks([pool.blocks[3]], token=Token("compute", 99)), UnknownTokenError, "99"
    )


def test_get_new_blocks_beyond_free_is_rejected() -> None:
    pool = busy_pool()
    n = pool.get_num_free_blocks() + 1
    assert_rejected(pool, lambda: pool.get_new_blocks(n), NoFreeBlocksError, f"Cannot get {n}")


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_get_new_blocks_bad_count_is_rejected(bad: object) -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.get_new_blocks(bad), InvalidArgumentError, "int >= 0")  # type: ignore[arg-type]


def test_allocate_for_unknown_stream_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.allocate_for(1, "nvlink"), UnknownStreamError, "nvlink")


def test_allocate_for_foreign_hit_is_rejected() -> None:
    pool, other = busy_pool(), make_pool(10)
    assert_rejected(
        pool, lambda: pool.allocate_for(1, "compute", hits=[other.blocks[1]]), ForeignBlockError, "belong"
    )


def test_issue_on_unknown_stream_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.issue("nope"), UnknownStreamError, "nope")


def test_complete_of_unissued_token_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.complete(Token("compute", 5)), UnknownTokenError, "compute:5")


def test_fail_on_unknown_stream_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.fail(Token("x", 1)), UnknownStreamError, "'x'")


def test_tag_with_unissued_token_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(
        pool,
        lambda: pool.tag([pool.blocks[3]], Token("h2d", 7), AccessKind.WRITE),
        UnknownTokenError,
        "h2d:7",
    )


def test_full_key_conflict_is_rejected() -> None:
    pool = busy_pool()
    a = pool.blocks[1]
    assert a.block_hash == "h1"
    assert_rejected(
        pool,
        lambda: pool.cache_full_blocks([a, pool.blocks[3]], ["other", "x"], 0, 2, block_size=16),
        HashConflictError,
        "block 1",
    )


def test_cache_full_blocks_with_too_few_hashes_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(
        pool,
        lambda: pool.cache_full_blocks(pool.blocks[3:5], ["x"], 0, 2),
        InvalidArgumentError,
        "1 block hashes",
    )


def test_copy_into_null_block_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(
        pool, lambda: pool.begin_copy([(pool.blocks[3], pool.null_block)]), NullBlockError, "null block"
    )


def test_load_into_unallocated_block_is_rejected() -> None:
    pool = busy_pool()
    free = next(iter(pool.free_block_queue))
    assert_rejected(
        pool, lambda: pool.begin_load([pool.blocks[3], free], "h2d"), BlockNotAllocatedError, "not allocated"
    )


def test_store_on_unknown_stream_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.begin_store([pool.blocks[3]], "tape"), UnknownStreamError, "tape")


def test_evict_blocks_out_of_range_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(pool, lambda: pool.evict_blocks([1, 10]), InvalidArgumentError, "invalid block_id 10")


def test_fence_for_bad_access_kind_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(
        pool,
        lambda: pool.fence_for([pool.blocks[3]], "compute", "write"),
        InvalidArgumentError,
        "AccessKind",  # type: ignore[arg-type]
    )


def test_move_block_hashes_onto_cached_block_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(
        pool,
        lambda: pool.move_block_hashes(pool.blocks[1], pool.blocks[2]),
        HashConflictError,
        "already holds",
    )


def test_constructor_rejects_bad_block_count() -> None:
    with pytest.raises(InvalidArgumentError, match="num_gpu_blocks"):
        HazardAwareBlockPool(0)


@pytest.mark.parametrize("size", [0, -16, 16.0, "16", None, True])
def test_constructor_rejects_a_hash_block_size_that_is_not_an_int_of_at_least_one(size: object) -> None:
    with pytest.raises(InvalidArgumentError, match="hash_block_size must be an int >= 1"):
        HazardAwareBlockPool(4, hash_block_size=size)  # type: ignore[arg-type]


def test_constructor_takes_an_int_like_hash_block_size_as_an_int() -> None:
    class Size(int):
        pass

    pool = HazardAwareBlockPool(4, hash_block_size=Size(32))
    assert pool.hash_block_size == 32 and type(pool.hash_block_size) is int


def test_constructor_reads_flags_by_their_truth_and_stores_bools() -> None:
    """Both builds: the compiled build's attributes take bools only."""
    pool = HazardAwareBlockPool(4, 0, 16, 1, track_hazards=None, debug=[1])  # type: ignore[arg-type]
    flags = (pool.enable_caching, pool.enable_kv_cache_events, pool.track_hazards, pool.debug)
    assert flags == (False, True, False, True) and all(type(f) is bool for f in flags)


def test_add_stream_with_other_kind_is_rejected() -> None:
    pool = busy_pool()
    assert_rejected(
        pool, lambda: pool.add_stream("rdma", blockpool.StreamKind.DEVICE), InvalidArgumentError, "already"
    )


def test_every_exception_class_of_the_package_is_rooted_in_block_pool_error() -> None:
    """One hierarchy: every exception (not warning) class any module of the
    package defines derives from BlockPoolError, found by walking the modules
    (the vLLM integration only where vLLM is installed)."""
    import importlib
    import importlib.util
    import inspect
    import pkgutil
    import warnings

    have_vllm = importlib.util.find_spec("vllm") is not None
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for info in pkgutil.walk_packages(blockpool.__path__, "blockpool."):
            if info.name.startswith("blockpool.integrations.vllm") and not have_vllm:
                continue
            if info.name == "blockpool.__main__":
                continue
            mod = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(mod, inspect.isclass):
                if (
                    cls.__module__ == info.name
                    and issubclass(cls, Exception)
                    and not issubclass(cls, Warning)
                ):
                    found.append(cls)
    assert len(found) > 20
    assert [c.__qualname__ for c in found if not issubclass(c, BlockPoolError)] == []


# A failed call applies the completions queued before it, and changes nothing else


def _pool_with_queued_completions() -> tuple[HazardAwareBlockPool, list[object]]:
    """busy_pool() plus a step, a store and a load whose completions (one a failure) are queued, not applied."""
    pool = busy_pool()
    blocks = pool.get_new_blocks(2)
    step = pool.issue("compute")
    store, _ = pool.begin_store(blocks[:1], "d2h")
    load, _ = pool.begin_load(blocks[1:], "h2d")
    pool.complete(step)
    pool.complete(store)
    pool.fail(load)
    return pool, blocks


def _failing_calls(
    pool: HazardAwareBlockPool, blocks: list[object]
) -> list[tuple[str, Callable[[], object]]]:
    other = make_pool(4)
    return [
        ("get_new_blocks", lambda: pool.get_new_blocks(10**6)),
        ("allocate_for", lambda: pool.allocate_for(10**6, "h2d")),
        ("free_blocks", lambda: pool.free_blocks([pool.blocks[9], pool.blocks[9]])),
        ("free_blocks foreign", lambda: pool.free_blocks(other.get_new_blocks(1))),
        ("tag", lambda: pool.tag(blocks, Token("compute", 99), AccessKind.READ)),
        ("begin_load", lambda: pool.begin_load(blocks, "nope")),
        ("begin_copy", lambda: pool.begin_copy([(blocks[0], pool.null_block)], "compute")),
        ("cache_full_blocks", lambda: pool.cache_full_blocks(blocks, ["x"], 0, 2, block_size=16)),
        ("fence_for", lambda: pool.fence_for(blocks, "compute", "write")),
        ("evict_blocks", lambda: pool.evict_blocks([10**6])),
        ("is_ended", lambda: pool.is_ended(Token("compute", 99))),
    ]


@pytest.mark.parametrize("i", range(11))
def test_a_failed_call_applies_the_queued_completions_and_changes_nothing_else(i: int) -> None:
    reference, _ = _pool_with_queued_completions()
    reference.poll()
    pool, blocks = _pool_with_queued_completions()
    before = pool.snapshot()
    name, call = _failing_calls(pool, blocks)[i]
    with pytest.raises(BlockPoolError):
        call()
    after = pool.snapshot()
    assert after == reference.snapshot(), name  # exactly what poll() would have done
    assert after.marks != before.marks  # ...which is not nothing: the completions were applied
    pool.check()


@pytest.mark.parametrize("call", ["complete", "fail"])
def test_a_refused_completion_report_applies_nothing_and_changes_nothing(call: str) -> None:
    pool, _ = _pool_with_queued_completions()
    before = pool.snapshot()
    with pytest.raises(UnknownTokenError):
        getattr(pool, call)(
            Token("compute", 99)
        )  # complete / fail only queue (any thread): nothing is applied
    assert pool.snapshot() == before
    pool.poll()
    reference, _ = _pool_with_queued_completions()
    reference.poll()
    assert pool.snapshot() == reference.snapshot()  # the queued reports are still there
