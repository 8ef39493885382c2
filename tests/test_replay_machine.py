"""The replay machine's merged wait list is minimal."""

from __future__ import annotations

from blockpool import AccessKind, StreamKind, Token
from blockpool.replay.machine import Machine
from blockpool.sim.simulator import StreamSpec

DEV = StreamKind.DEVICE
READ, WRITE = AccessKind.READ, AccessKind.WRITE


def _machine() -> Machine:
    streams = {
        "compute": StreamSpec(DEV),
        "h2d": StreamSpec(DEV, bandwidth=1e9),
        "d2h": StreamSpec(DEV, bandwidth=1e9),
    }
    return Machine("exact", streams, num_blocks=8, block_size=16, seed=0)


def test_merged_wait_list_drops_a_token_another_one_covers() -> None:
    m = _machine()
    pool = m.raw_pool
    blocks, _ = pool.allocate_for(2, "compute")
    h, lf = pool.begin_load(blocks, "h2d")
    m.enqueue(h, "load", fence=lf, transfer=True, num_bytes=2)
    d, sf = pool.begin_store(blocks, "d2h")  # the store waits on the load
    assert list(sf) == [h]
    m.enqueue(d, "store", fence=sf, transfer=True, num_bytes=2)
    # a step reads the blocks (pending wait on the load), then writes them:
    # the write's fence names the store, whose issue-time clock covers the load
    m.device_fence(pool.fence_for(blocks, "compute", READ), "compute")
    assert m._pending["compute"] == [h]
    wf = pool.fence_for(blocks, "compute", WRITE)
    assert list(wf) == [d]
    c = pool.issue("compute")
    _, waits = m.enqueue(c, "step", fence=wf, duration=1e-3)
    assert waits == [d], waits  # h2d:1 is redundant: d2h:1 waited on it


def test_merged_wait_list_keeps_newest_per_stream_and_unrelated_tokens() -> None:
    m = _machine()
    pool = m.raw_pool
    h1, h2 = pool.issue("h2d"), pool.issue("h2d")
    d1 = pool.issue("d2h")
    m._pending["compute"] = [h1, d1]
    assert m._take("compute", [h2]) == [d1, h2]
    assert m._take("compute", [Token("compute", 1)]) == [Token("compute", 1)]
