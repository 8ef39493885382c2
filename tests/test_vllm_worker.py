"""The worker half of the connector wiring (blockpool.integrations.vllm.worker)
on CPU stand-in streams and events: no vLLM, no GPU needed."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from blockpool.core.hazards import EMPTY_FENCE, Fence, StreamKind, Token
from blockpool.integrations.vllm import worker as vw
from blockpool.integrations.vllm.connectors import META_STEP
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.worker.standins import StandInDevice
from blockpool.worker.torch_events import EventLedger


@pytest.fixture
def dev() -> StandInDevice:
    return StandInDevice()


@pytest.fixture
def wh(dev: StandInDevice) -> Iterator[vw.WorkerHazards]:
    compute = dev.new_stream("compute")
    hazards = vw.WorkerHazards(
        EventLedger(dev.new_event, streams={"compute": compute}), lambda: compute, timeout=5.0
    )
    vw.install(hazards)
    yield hazards
    vw.install(None)


def step_meta(index: int, forward: int, copies: int | None, forward_fence: Fence = EMPTY_FENCE) -> Any:
    rec = StepRecord(index, Token("compute", forward), None if copies is None else Token("compute", copies))
    meta = SimpleNamespace()
    setattr(meta, META_STEP, (rec.to_wire(), forward_fence.to_wire()))
    return meta


def test_bind_records_the_copy_token_and_forward_done_the_step_token(
    dev: StandInDevice, wh: vw.WorkerHazards
) -> None:
    meta = step_meta(1, forward=2, copies=1)
    wh.on_bind(meta)
    wh.forward_done(meta)
    assert [op for op in dev.log if op[0] == "record"] == [
        ("record", "compute", "ev0"),
        ("record", "compute", "ev1"),
    ]
    assert [wh.ledger.event_of(Token("compute", i)).name for i in (1, 2)] == ["ev0", "ev1"]  # type: ignore[union-attr]


def test_a_step_carried_by_two_connectors_is_recorded_once(dev: StandInDevice, wh: vw.WorkerHazards) -> None:
    meta = step_meta(1, forward=1, copies=None)
    for _ in range(2):  # MultiConnector: each sub-connector carries the step
        wh.on_bind(meta)
        wh.forward_done(meta)
    assert [op[0] for op in dev.log].count("record") == 1


def test_bind_orders_the_compute_stream_after_the_forwards_fence(
    dev: StandInDevice, wh: vw.WorkerHazards
) -> None:
    d2h = dev.new_stream("d2h")
    store = Token("d2h", 1)
    d2h.enqueue(lambda: None, "store reads a block the step appends to")
    wh.record(store, d2h)
    wh.on_bind(step_meta(1, forward=1, copies=None, forward_fence=Fence([store])))
    assert ("wait_event", "compute", "ev0") in dev.log


def test_metadata_without_a_step_changes_nothing(dev: StandInDevice, wh: vw.WorkerHazards) -> None:
    assert wh.on_bind(SimpleNamespace()) is None and wh.forward_done(SimpleNamespace()) is None
    assert dev.log == []


def test_fence_wait_synchronizes_exactly_the_stores_fence(dev: StandInDevice, wh: vw.WorkerHazards) -> None:
    compute = wh.current_stream()
    done: list[str] = []
    compute.enqueue(lambda: done.append("step 1"), "step 1")
    wh.record(Token("compute", 1))
    compute.enqueue(lambda: done.append("step 2"), "step 2")
    wh.record(Token("compute", 2))
    t = Transfer(
        "A", "store", Token("mooncake_store", 1, StreamKind.HOST), Fence([Token("compute", 1)]), (1,)
    )
    vw.FenceWait(wh, t).synchronize()
    # Synchronized on step 1's event, not on an event after all compute has queued.
    assert [op for op in dev.log if op[0] == "synchronize"] == [("synchronize", "MainThread", "ev0")]
    assert done[0] == "step 1"
    assert wh.tokens_waited == 1


def test_host_engine_end_wakes_a_waiter(dev: StandInDevice, wh: vw.WorkerHazards) -> None:
    load = Transfer("B", "load", Token("mooncake_store", 1, StreamKind.HOST), Fence(), (2,))
    wh.ended(load)
    later = Transfer("B", "load", Token("mooncake_store", 2, StreamKind.HOST), Fence([load.token]), (2,))
    assert wh.wait(later) == ()  # already ended: no wait


def test_offload_copy_stream_waits_on_exactly_the_jobs_fence_then_records_the_job(
    dev: StandInDevice, wh: vw.WorkerHazards
) -> None:
    compute = wh.current_stream()
    copy_stream = dev.new_stream("copy")
    e1 = Token("compute", 1)
    compute.enqueue(lambda: None, "step 1 forward")
    wh.record(e1)
    wh.jobs[("offloading", 0)] = Transfer("A", "store", Token("offload_d2h", 1), Fence([e1]), (1, 2))
    ran: list[str] = []

    class Handler:  # the part of vLLM's SingleDirectionOffloadingHandler the wrapper touches
        def __init__(self) -> None:
            self._transfers: list[Any] = []
            self._swap_blocks_batch = lambda *a: copy_stream.enqueue(lambda: ran.append("d2h copy"), "swap")

    def transfer_async(self: Any, job_id: int, src: Any, dst: Any) -> bool:
        wh.current_stream = lambda: copy_stream  # vLLM runs the swap with the copy stream current
        self._swap_blocks_batch(src, dst)
        self._transfers.append(SimpleNamespace(stream=copy_stream))
        wh.current_stream = lambda: compute
        return True

    assert vw.offload_transfer_async(transfer_async)(Handler(), 0, None, None) is True
    assert [op for op in dev.log if op[0] == "wait_event"] == [("wait_event", "copy", "ev0")]
    assert wh.ledger.event_of(Token("offload_d2h", 1)) is not None  # the job's point is recorded
    copy_stream.run()
    assert ran == []  # behind step 1's forward
    dev.run()
    assert ran == ["d2h copy"]


def test_offload_job_without_a_transfer_runs_vllms_code_unchanged(
    dev: StandInDevice, wh: vw.WorkerHazards
) -> None:
    calls: list[int] = []
    assert vw.offload_transfer_async(lambda self, job_id: calls.append(job_id) or True)(SimpleNamespace(), 7)
    assert calls == [7] and dev.log == []
