"""complete()/fail() from other threads while the scheduler thread allocates."""

from __future__ import annotations

import threading

from blockpool import AccessKind, StreamKind
from tests.conftest import make_pool


def test_completions_from_many_threads_are_never_lost() -> None:
    pool = make_pool(64, streams={"compute": StreamKind.DEVICE, "rdma": StreamKind.HOST})
    per_thread, threads_n = 200, 4
    tokens = [[pool.issue("rdma") for _ in range(per_thread)] for _ in range(threads_n)]
    start = threading.Barrier(threads_n + 1)

    def reporter(mine: list) -> None:
        start.wait()
        for t in reversed(mine):  # out of order, as host engines complete
            pool.complete(t)

    workers = [threading.Thread(target=reporter, args=(m,)) for m in tokens]
    for w in workers:
        w.start()
    start.wait()
    # The scheduler thread keeps allocating and freeing meanwhile.
    for _ in range(500):
        blocks, _ = pool.allocate_for(8, "compute")
        pool.free_blocks(blocks)
    for w in workers:
        w.join()
    pool.poll()
    assert all(pool.is_ended(t) for m in tokens for t in m)
    assert pool.tracker.streams["rdma"].mark == per_thread * threads_n
    pool.check()


def test_held_blocks_released_by_completions_from_other_threads() -> None:
    pool = make_pool(33, streams={"compute": StreamKind.DEVICE, "rdma": StreamKind.HOST})
    loads = []
    for _ in range(8):
        blocks, _ = pool.allocate_for(4, "rdma")
        token, _ = pool.begin_load(blocks, "rdma")
        pool.free_blocks(blocks)
        loads.append(token)
    assert len(pool.held_block_ids()) == 32 and pool.get_num_free_blocks() == 0
    threads = [threading.Thread(target=pool.complete, args=(t,)) for t in loads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.get_num_free_blocks() == 32
    assert pool.held_block_ids() == []
    pool.check()
    assert pool.fence_for(pool.blocks[1:], "compute", AccessKind.WRITE).tokens == ()
