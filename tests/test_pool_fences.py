"""The fences the pool computes (``blockpool/core/_fences.py``): loads wait on
the readers of the blocks they overwrite (WAR), stores on the last writer
(RAW), and frees under async scheduling are tagged with the last enqueued
step. Faults reported from the field (issue #4): one test per behaviour.

``eN`` is the token of step N on ``compute``; ``h2d``/``d2h`` are DMA
streams, ``rdma`` a host-driven engine.
"""

from __future__ import annotations

from blockpool import (
    AccessKind,
    HazardAwareBlockPool,
    Token,
)
from tests.conftest import ids, toks


def steps(pool: HazardAwareBlockPool, n: int) -> list[Token]:
    return [pool.issue("compute") for _ in range(n)]


# 1. Load into a block compute may still be reading (WAR) -------------------


def test_load_into_blocks_freed_mid_step_waits_exactly_on_that_step(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    e1, e2, e3 = steps(pool, 3)
    pool.complete(e2)
    pool.free_blocks(list(reversed(a)), token=e3)
    blocks, fence = pool.allocate_for(2, "h2d")
    assert sorted(ids(blocks)) == sorted(ids(a))
    assert toks(fence) == {"compute:3"}
    assert not fence.needs_host_wait


def test_load_into_blocks_last_read_by_completed_step_gets_empty_fence(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    (e3,) = steps(pool, 1)
    pool.free_blocks(a, token=e3)
    pool.complete(e3)
    blocks, fence = pool.allocate_for(2, "h2d")
    assert ids(blocks) == ids(a) and not fence
    token, load_fence = pool.begin_load(blocks, "h2d")
    assert not load_fence


def test_load_fence_after_device_consumer_already_waited_is_empty(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(2)
    (e3,) = steps(pool, 1)
    pool.free_blocks(a, token=e3)
    blocks, fence = pool.allocate_for(2, "h2d")
    assert toks(fence) == {"compute:1"}
    _, load_fence = pool.begin_load(blocks, "h2d")
    assert not load_fence  # h2d is already ordered after e3


# 2. Store waits for the last writer; a block freed mid-store carries the store


def test_store_waits_for_last_writer(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    *_, e5 = steps(pool, 5)
    pool.tag([b], e5, AccessKind.WRITE)
    s1, fence = pool.begin_store([b], "d2h")
    assert toks(fence) == {"compute:5"}
    assert str(s1) == "d2h:1"


def test_block_freed_mid_store_is_fenced_on_the_store_for_compute(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    *_, e5 = steps(pool, 5)
    pool.tag([b], e5, AccessKind.WRITE)
    s1, _ = pool.begin_store([b], "d2h")
    e6 = pool.issue("compute")
    pool.free_blocks([b], token=e6)
    again, fence = pool.allocate_for(1, "compute")
    assert again == [b]
    assert toks(fence) == {"d2h:1"}


# 3. Async scheduling: tag with the last enqueued step ------------------------


def test_free_tags_last_enqueued_step_not_the_deciding_one(pool: HazardAwareBlockPool) -> None:
    (b,) = pool.get_new_blocks(1)
    e7 = pool.issue("compute")
    e8 = pool.issue("compute")  # enqueued before step 7 completes
    pool.tag([b], e8, AccessKind.WRITE)
    # step 7's output arrives: the request finished, free its block.
    pool.complete(e7)
    assert pool.last_token("compute") == e8
    pool.free_blocks([b], token=pool.last_token("compute"))
    again, fence = pool.allocate_for(1, "rdma")
    assert again == [b]
    assert toks(fence) == {"compute:2"}
    assert fence.needs_host_wait  # an RDMA engine must event.synchronize() first


def test_host_engine_never_gets_a_block_with_pending_step_and_empty_fence(pool: HazardAwareBlockPool) -> None:
    a = pool.get_new_blocks(3)
    e1 = pool.issue("compute")
    pool.free_blocks(a, token=e1)
    blocks, fence = pool.allocate_for(3, "rdma")
    assert set(ids(blocks)) == set(ids(a))
    assert list(fence) == [e1] and fence.needs_host_wait
