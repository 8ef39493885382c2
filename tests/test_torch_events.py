"""The worker side (``blockpool.worker.torch_events``): one behaviour per test.

Streams and events are the CPU stand-ins of :mod:`blockpool.worker.standins`
(torch's interface); their log says who waited on which event: an enqueued
``wait_event`` names the consumer stream, a blocking ``synchronize`` the
calling thread. Every test runs with torch's device-wide synchronize calls
replaced by functions that fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from blockpool import BlockPoolError, Fence, InvalidArgumentError, StreamKind, Token
from blockpool.core.completions import CompletionReport, RankMerger
from blockpool.worker.standins import StandInDevice, StandInEvent, StandInStream
from blockpool.worker.torch_events import (
    BackendUnavailableError,
    EventLedger,
    EventNotRecordedError,
    FenceFailedError,
    FenceTimeoutError,
    HostWaitRequiredError,
    TokenOrderError,
    event_factory,
)

ROOT = Path(__file__).resolve().parents[1]
HOST = StreamKind.HOST


def c(seq: int) -> Token:
    return Token("compute", seq)


def d2h(seq: int) -> Token:
    return Token("d2h", seq)


def rdma(seq: int) -> Token:
    return Token("rdma", seq, HOST)


DEVICE_WIDE_CALLS: list[str] = []


@pytest.fixture(autouse=True)
def no_device_wide_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Replace every device-wide synchronize torch has with one that fails."""
    DEVICE_WIDE_CALLS.clear()

    def forbid(name: str):  # type: ignore[no-untyped-def]
        def fail(*_: object, **__: object) -> None:
            DEVICE_WIDE_CALLS.append(name)
            raise AssertionError(f"device-wide {name}() called")

        return fail

    monkeypatch.setattr(torch.cuda, "synchronize", forbid("torch.cuda.synchronize"))
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
        monkeypatch.setattr(torch.accelerator, "synchronize", forbid("torch.accelerator.synchronize"))
    if hasattr(torch, "cpu") and hasattr(torch.cpu, "synchronize"):
        monkeypatch.setattr(torch.cpu, "synchronize", forbid("torch.cpu.synchronize"))
    yield DEVICE_WIDE_CALLS


@pytest.fixture
def dev() -> StandInDevice:
    return StandInDevice()


@pytest.fixture
def compute(dev: StandInDevice) -> StandInStream:
    return dev.new_stream("compute")


@pytest.fixture
def h2d(dev: StandInDevice) -> StandInStream:
    return dev.new_stream("h2d")


@pytest.fixture
def d2h_stream(dev: StandInDevice) -> StandInStream:
    return dev.new_stream("d2h")


@pytest.fixture
def ledger(dev: StandInDevice, compute: StandInStream, d2h_stream: StandInStream) -> EventLedger:
    return EventLedger(dev.new_event, streams={"compute": compute, "d2h": d2h_stream})


def kernel(stream: StandInStream, out: list[str] | None = None, name: str = "k") -> None:
    stream.enqueue((lambda: out.append(name)) if out is not None else (lambda: None), name)


def waits(dev: StandInDevice) -> list[tuple[str, str, str]]:
    return [e for e in dev.log if e[0] in ("wait_event", "synchronize", "stream_synchronize")]


def ev(ledger: EventLedger, token: Token) -> str:
    event = ledger.event_of(token)
    assert isinstance(event, StandInEvent)
    return event.name


def in_thread(name: str, fn, *args, **kw):  # type: ignore[no-untyped-def]
    """Run ``fn`` in a thread called ``name``; return (thread, result box)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    th = threading.Thread(target=run, name=name, daemon=True)
    th.start()
    return th, box


# -- recording -------------------------------------------------------------------


def test_record_captures_the_point_after_the_work_enqueued_so_far(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    kernel(compute)
    event = ledger.record(c(1))
    assert not event.query()
    dev.run()
    assert event.query()


def test_record_uses_the_stream_registered_for_the_tokens_stream(
    ledger: EventLedger, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    assert dev.log == [("record", "compute", "ev0")]


def test_record_on_an_explicit_stream_overrides_the_registered_one(
    ledger: EventLedger, h2d: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1), h2d)
    assert dev.log == [("record", "h2d", "ev0")]


def test_record_without_a_stream_for_the_token_raises(dev: StandInDevice) -> None:
    ledger = EventLedger(dev.new_event)
    with pytest.raises(InvalidArgumentError):
        ledger.record(c(1))


def test_record_of_a_host_token_raises(ledger: EventLedger, compute: StandInStream) -> None:
    with pytest.raises(InvalidArgumentError):
        ledger.record(rdma(1), compute)


def test_record_of_the_same_token_twice_raises(ledger: EventLedger) -> None:
    ledger.record(c(1))
    with pytest.raises(TokenOrderError):
        ledger.record(c(1))


def test_record_of_an_older_token_after_a_newer_one_raises(ledger: EventLedger) -> None:
    ledger.record(c(2))
    with pytest.raises((TokenOrderError, ValueError)):
        ledger.record(c(1))


# -- polling and reports -------------------------------------------------------------


def test_poll_reports_the_newest_completed_token_per_device_stream(
    ledger: EventLedger, compute: StandInStream, d2h_stream: StandInStream, dev: StandInDevice
) -> None:
    for i in (1, 2, 3):
        kernel(compute)
        ledger.record(c(i))
    kernel(d2h_stream)
    ledger.record(d2h(1))
    dev.run()
    assert ledger.poll().tokens() == [c(3), d2h(1)]


def test_poll_reports_nothing_before_the_work_ran(ledger: EventLedger, compute: StandInStream) -> None:
    kernel(compute)
    ledger.record(c(1))
    assert not ledger.poll()


def test_poll_stops_at_the_first_incomplete_event_of_a_stream(
    ledger: EventLedger, compute: StandInStream
) -> None:
    for i in (1, 2, 3):
        kernel(compute)
        ledger.record(c(i))
    compute.run(max_ops=1)
    assert ledger.poll().tokens() == [c(1)]


class ScriptedEvent:
    """An event whose ``query`` answer is set by the test."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.queried = 0

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        self.queried += 1
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("poll must never block")


def test_poll_does_not_query_past_an_incomplete_event() -> None:
    events = iter([ScriptedEvent(False), ScriptedEvent(True)])
    ledger = EventLedger(lambda: next(events))
    first, second = ledger.record(c(1), "s"), ledger.record(c(2), "s")
    assert not ledger.poll()
    assert (first.queried, second.queried) == (1, 0)  # type: ignore[attr-defined]


def test_poll_never_synchronizes(ledger: EventLedger, compute: StandInStream) -> None:
    kernel(compute)
    ledger.record(c(1))
    ledger.poll()
    assert ledger.num_pending == 1


def test_poll_reports_each_completion_once(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    kernel(compute)
    ledger.record(c(1))
    dev.run()
    ledger.poll()
    assert not ledger.poll()


def test_poll_report_names_the_rank(dev: StandInDevice, compute: StandInStream) -> None:
    ledger = EventLedger(dev.new_event, rank=3, streams={"compute": compute})
    ledger.record(c(1))
    assert ledger.poll().rank == 3


def test_report_survives_pickling_for_the_scheduler_process(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    ledger.mark_host_complete(rdma(2), failed=True)
    dev.run()
    report = ledger.poll()
    back = pickle.loads(pickle.dumps(report))
    assert (back, back.tokens(), back.failed_tokens()) == (report, [c(1)], [rdma(2)])


def test_report_round_trips_through_plain_wire_data(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    dev.run()
    report = ledger.poll()
    assert CompletionReport.from_wire(report.to_wire()) == report


def test_is_complete_follows_the_observed_mark(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    dev.run()
    before = ledger.is_complete(c(1))
    ledger.poll()
    assert (before, ledger.is_complete(c(1))) == (False, True)


# -- bounded memory: event reuse ---------------------------------------------------------


def test_the_event_of_a_completed_token_is_reused(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    first = ledger.record(c(1))
    dev.run()
    ledger.poll()
    assert ledger.record(c(2)) is first


def test_the_event_of_an_incomplete_token_is_never_reused(
    ledger: EventLedger, compute: StandInStream
) -> None:
    kernel(compute)
    first = ledger.record(c(1))
    ledger.poll()
    assert ledger.record(c(2)) is not first


def test_completion_observed_drops_the_event_from_the_ledger(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    dev.run()
    ledger.poll()
    assert (ledger.num_pending, ledger.event_of(c(1)), ledger.num_free_events) == (0, None, 1)


def test_idle_events_beyond_max_free_events_are_dropped(dev: StandInDevice, compute: StandInStream) -> None:
    ledger = EventLedger(dev.new_event, streams={"compute": compute}, max_free_events=1)
    for i in (1, 2, 3):
        ledger.record(c(i))
    dev.run()
    ledger.poll()
    assert ledger.num_free_events == 1


class HookEvent(StandInEvent):
    """A stand-in event that runs ``hook`` once, right after a synchronize
    returns: i.e. while the ledger still has the event pinned."""

    def __init__(self, device: StandInDevice, name: str, hooks: list) -> None:  # type: ignore[type-arg]
        super().__init__(device, name)
        self.hooks = hooks

    def synchronize(self) -> None:
        super().synchronize()
        while self.hooks:
            self.hooks.pop()()


def hooked_ledger(dev: StandInDevice, hooks: list) -> EventLedger:  # type: ignore[type-arg]
    made = iter(range(100))
    compute = dev.new_stream("compute")
    return EventLedger(lambda: HookEvent(dev, f"h{next(made)}", hooks), streams={"compute": compute})


def test_an_event_a_host_thread_is_synchronizing_is_not_reused(dev: StandInDevice) -> None:
    hooks: list = []  # type: ignore[type-arg]
    ledger = hooked_ledger(dev, hooks)
    first = ledger.record(c(1))
    reused: list[object] = []

    def while_pinned() -> None:
        ledger.poll()  # observes c(1) complete while the host thread still uses its event
        reused.append(ledger.record(c(2)))

    hooks.append(while_pinned)
    ledger.wait_host(Fence([c(1)]))
    assert reused[0] is not first


def test_a_pinned_event_is_reused_once_released(dev: StandInDevice) -> None:
    hooks: list = []  # type: ignore[type-arg]
    ledger = hooked_ledger(dev, hooks)
    first = ledger.record(c(1))
    hooks.append(ledger.poll)
    ledger.wait_host(Fence([c(1)]))
    assert ledger.record(c(2)) is first


# -- device consumer -------------------------------------------------------------------------


def test_device_consumer_enqueues_wait_event_on_its_stream_for_each_token(
    ledger: EventLedger,
    compute: StandInStream,
    d2h_stream: StandInStream,
    h2d: StandInStream,
    dev: StandInDevice,
) -> None:
    kernel(compute)
    ledger.record(c(1))
    kernel(d2h_stream)
    ledger.record(d2h(1))
    names = [ev(ledger, c(1)), ev(ledger, d2h(1))]
    ledger.wait_device(Fence([c(1), d2h(1)]), h2d)
    assert waits(dev) == [("wait_event", "h2d", names[0]), ("wait_event", "h2d", names[1])]


def test_device_consumer_returns_the_tokens_it_waited_on(
    ledger: EventLedger, compute: StandInStream, h2d: StandInStream
) -> None:
    ledger.record(c(1))
    assert ledger.wait_device(Fence([c(1)]), h2d) == (c(1),)


def test_device_consumer_wait_does_not_block_the_host(
    ledger: EventLedger, compute: StandInStream, h2d: StandInStream, dev: StandInDevice
) -> None:
    kernel(compute)
    ledger.record(c(1))
    ledger.wait_device(Fence([c(1)]), h2d)
    assert (dev.pending(), [e for e in dev.log if e[0] == "synchronize"]) == (2, [])


def test_device_consumer_wait_orders_its_later_work_after_the_token(
    ledger: EventLedger, compute: StandInStream, h2d: StandInStream, dev: StandInDevice
) -> None:
    out: list[str] = []
    kernel(compute, out, "copy")
    ledger.record(c(1))
    ledger.wait_device(Fence([c(1)]), h2d)
    kernel(h2d, out, "load")
    h2d.run()
    before = list(out)
    dev.run()
    assert (before, out) == ([], ["copy", "load"])


def test_device_consumer_does_not_wait_on_a_token_known_complete(
    ledger: EventLedger, compute: StandInStream, h2d: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    dev.run()
    ledger.poll()
    assert (ledger.wait_device(Fence([c(1)]), h2d), waits(dev)) == ((), [])


def test_device_consumer_empty_fence_enqueues_nothing(
    ledger: EventLedger, h2d: StandInStream, dev: StandInDevice
) -> None:
    assert (ledger.wait_device(Fence(), h2d), dev.log) == ((), [])


def test_device_consumer_fence_with_an_unrecorded_token_raises(
    ledger: EventLedger, h2d: StandInStream
) -> None:
    with pytest.raises(EventNotRecordedError) as info:
        ledger.wait_device(Fence([c(1)]), h2d)
    assert isinstance(info.value, BlockPoolError) and isinstance(info.value, LookupError)


def test_device_consumer_fence_with_an_unrecorded_token_enqueues_nothing(
    ledger: EventLedger, d2h_stream: StandInStream, h2d: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(d2h(1))
    with pytest.raises(EventNotRecordedError):
        ledger.wait_device(Fence([c(1), d2h(1)]), h2d)
    assert waits(dev) == []


def test_device_consumer_token_skipped_by_the_recorder_waits_on_the_next_recorded_event(
    ledger: EventLedger, compute: StandInStream, h2d: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    ledger.record(c(3))
    ledger.wait_device(Fence([c(2)]), h2d)
    assert waits(dev) == [("wait_event", "h2d", ev(ledger, c(3)))]


def test_device_consumer_fence_with_a_host_token_raises_unless_host_wait_accepted(
    ledger: EventLedger, h2d: StandInStream, dev: StandInDevice
) -> None:
    with pytest.raises(HostWaitRequiredError):
        ledger.wait_device(Fence([rdma(1)], needs_host_wait=True), h2d)
    assert dev.log == []


def test_device_consumer_fence_with_a_completed_host_token_needs_no_host_wait(
    ledger: EventLedger, h2d: StandInStream
) -> None:
    ledger.mark_host_complete(rdma(1))
    assert ledger.wait_device(Fence([rdma(1)], needs_host_wait=True), h2d) == ()


def test_device_consumer_accepting_host_wait_enqueues_only_after_the_engine_completed(
    dev: StandInDevice, compute: StandInStream
) -> None:
    order: list[str] = []

    class LoggingStream(StandInStream):
        def wait_event(self, event: StandInEvent) -> None:
            order.append("wait_event")
            super().wait_event(event)

    h2d = LoggingStream(dev, "h2d")
    ledger = EventLedger(dev.new_event, streams={"compute": compute})
    ledger.record(c(1))
    th, box = in_thread(
        "worker", ledger.wait_device, Fence([c(1), rdma(1)], True), h2d, allow_host_wait=True, timeout=20
    )
    order.append("engine done")
    ledger.mark_host_complete(rdma(1))
    th.join(30)
    assert (order, "error" in box) == (["engine done", "wait_event"], False)


def test_device_consumer_host_wait_times_out_when_the_engine_never_completes(
    ledger: EventLedger, h2d: StandInStream, dev: StandInDevice
) -> None:
    with pytest.raises(FenceTimeoutError):
        ledger.wait_device(Fence([rdma(1)], True), h2d, allow_host_wait=True, timeout=0.01)
    assert dev.log == []


def test_device_consumer_rejects_a_fence_of_non_tokens(ledger: EventLedger, h2d: StandInStream) -> None:
    with pytest.raises(InvalidArgumentError):
        ledger.wait_device([("compute", 1, "device")], h2d)  # type: ignore[list-item]


# -- host consumer -------------------------------------------------------------------------------


def test_host_consumer_synchronizes_each_device_token_in_its_own_thread(
    ledger: EventLedger, compute: StandInStream, d2h_stream: StandInStream, dev: StandInDevice
) -> None:
    kernel(compute)
    ledger.record(c(1))
    kernel(d2h_stream)
    ledger.record(d2h(1))
    names = [ev(ledger, c(1)), ev(ledger, d2h(1))]
    th, box = in_thread("recv-thread", ledger.wait_host, Fence([c(1), d2h(1)]))
    th.join(30)
    assert (box["result"], waits(dev)) == (
        (c(1), d2h(1)),
        [("synchronize", "recv-thread", names[0]), ("synchronize", "recv-thread", names[1])],
    )


def test_host_consumer_returns_after_the_tokens_work_ran(ledger: EventLedger, compute: StandInStream) -> None:
    out: list[str] = []
    kernel(compute, out, "copy")
    ledger.record(c(1))
    ledger.wait_host(Fence([c(1)]))
    assert out == ["copy"]


def test_host_consumer_does_not_wait_on_a_token_known_complete(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    ledger.record(c(1))
    dev.run()
    ledger.poll()
    assert (ledger.wait_host(Fence([c(1)])), waits(dev)) == ((), [])


def test_host_consumer_waits_for_a_token_recorded_later_by_another_thread(
    ledger: EventLedger, compute: StandInStream, dev: StandInDevice
) -> None:
    th, box = in_thread("recv-thread", ledger.wait_host, Fence([c(1)]), timeout=20)
    kernel(compute)
    ledger.record(c(1))
    th.join(30)
    assert (box.get("result"), dev.log[0][0], dev.log[-1][:2]) == (
        (c(1),),
        "record",
        ("synchronize", "recv-thread"),
    )


def test_host_consumer_times_out_when_the_token_is_never_recorded(ledger: EventLedger) -> None:
    with pytest.raises(FenceTimeoutError) as info:
        ledger.wait_host(Fence([c(1)]), timeout=0.01)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, BlockPoolError)


def test_host_consumer_waits_for_the_engines_completion_of_a_host_token(
    ledger: EventLedger, dev: StandInDevice
) -> None:
    th, box = in_thread("send-thread", ledger.wait_host, Fence([rdma(1)], True), timeout=20)
    ledger.mark_host_complete(rdma(1))
    th.join(30)
    assert ("error" not in box, dev.log) == (True, [])


def test_host_consumer_learns_that_a_fence_token_failed(ledger: EventLedger) -> None:
    ledger.mark_host_complete(rdma(1), failed=True)
    with pytest.raises(FenceFailedError) as info:
        ledger.wait_host(Fence([rdma(1)], True))
    assert info.value.tokens == (rdma(1),) and isinstance(info.value, BlockPoolError)


def test_host_consumer_raises_for_a_failed_token_only_after_waiting_for_the_rest(
    ledger: EventLedger,
) -> None:
    ledger.mark_host_complete(rdma(1), failed=True)
    th, box = in_thread("send-thread", ledger.wait_host, Fence([rdma(1), rdma(2)], True), timeout=20)
    th.join(0.05)
    assert th.is_alive()  # still waiting for rdma:2
    ledger.mark_host_complete(rdma(2))
    th.join(30)
    err = box["error"]
    assert isinstance(err, FenceFailedError)
    assert (err.tokens, err.waited) == ((rdma(1),), (rdma(2),))


def test_device_consumer_learns_that_a_fence_token_failed_and_nothing_is_enqueued(
    ledger: EventLedger, compute: StandInStream, h2d: StandInStream, dev: StandInDevice
) -> None:
    kernel(compute)
    ledger.record(c(1))
    ledger.mark_host_complete(rdma(1), failed=True)
    for allow in (True, False):
        with pytest.raises(FenceFailedError) as info:
            ledger.wait_device(Fence([c(1), rdma(1)], True), h2d, allow_host_wait=allow)
        assert info.value.tokens == (rdma(1),)
    assert waits(dev) == []


def test_a_completed_host_token_still_passes_after_another_failed(ledger: EventLedger) -> None:
    ledger.mark_host_complete(rdma(1), failed=True)
    ledger.mark_host_complete(rdma(2))
    assert ledger.wait_host(Fence([rdma(2)], True)) == ()


def test_host_consumer_times_out_when_the_engine_never_completes(ledger: EventLedger) -> None:
    with pytest.raises(FenceTimeoutError):
        ledger.wait_host(Fence([rdma(1)], True), timeout=0.01)


def test_wait_rejects_a_non_positive_timeout(ledger: EventLedger) -> None:
    with pytest.raises(InvalidArgumentError):
        ledger.wait_host(Fence([c(1)]), timeout=0)


# -- host engines ----------------------------------------------------------------------------------


def test_host_completions_are_reported_one_by_one_in_arrival_order(ledger: EventLedger) -> None:
    ledger.mark_host_complete(rdma(2))
    ledger.mark_host_complete(rdma(1))
    assert ledger.poll().tokens() == [rdma(2), rdma(1)]


def test_a_failed_host_transfer_is_reported_as_failed(ledger: EventLedger) -> None:
    ledger.mark_host_complete(rdma(1), failed=True)
    report = ledger.poll()
    assert (report.tokens(), report.failed_tokens()) == ([], [rdma(1)])


def test_mark_host_complete_is_idempotent(ledger: EventLedger) -> None:
    ledger.mark_host_complete(rdma(1))
    ledger.mark_host_complete(rdma(1))
    assert ledger.poll().tokens() == [rdma(1)]


def test_host_completion_of_one_token_does_not_complete_earlier_ones(ledger: EventLedger) -> None:
    ledger.mark_host_complete(rdma(2))
    assert (ledger.is_complete(rdma(1)), ledger.is_complete(rdma(2))) == (False, True)


def test_mark_host_complete_rejects_a_device_token(ledger: EventLedger) -> None:
    with pytest.raises(InvalidArgumentError):
        ledger.mark_host_complete(c(1))


# -- nothing device-wide -------------------------------------------------------------------------------


def test_no_device_wide_synchronize_in_a_full_worker_cycle(
    ledger: EventLedger, compute: StandInStream, h2d: StandInStream, dev: StandInDevice
) -> None:
    kernel(compute)
    ledger.record(c(1))
    ledger.wait_device(Fence([c(1)]), h2d)
    ledger.wait_host(Fence([c(1)]))
    ledger.mark_host_complete(rdma(1))
    ledger.wait_host(Fence([rdma(1)], True))
    ledger.poll()
    assert DEVICE_WIDE_CALLS == []


# -- tensor parallelism ------------------------------------------------------------------------------------


def test_a_token_ends_for_the_scheduler_only_when_every_rank_reported_it() -> None:
    ranks = []
    for r in (0, 1):
        dev = StandInDevice()
        s = dev.new_stream("compute")
        ranks.append((dev, s, EventLedger(dev.new_event, rank=r, streams={"compute": s})))
    for _, s, led in ranks:
        kernel(s)
        led.record(c(1))
    merger = RankMerger(world_size=2)
    ranks[0][0].run()
    after_rank0 = merger.add(ranks[0][2].poll()).tokens()
    ranks[1][0].run()
    after_rank1 = merger.add(ranks[1][2].poll()).tokens()
    assert (after_rank0, after_rank1) == ([], [c(1)])


# -- event factory ------------------------------------------------------------------------------------------


def test_event_factory_refuses_cpu_which_has_no_events() -> None:
    with pytest.raises(BackendUnavailableError):
        event_factory("cpu")


def test_event_factory_refuses_an_unknown_device() -> None:
    with pytest.raises(InvalidArgumentError):
        event_factory("not-a-device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_event_factory_refuses_cuda_when_it_is_not_available() -> None:
    with pytest.raises(BackendUnavailableError):
        event_factory("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_event_factory_makes_cuda_events_on_cuda() -> None:
    assert isinstance(event_factory("cuda")(), torch.cuda.Event)


def test_event_factory_default_without_an_accelerator_raises() -> None:
    acc = getattr(torch, "accelerator", None)
    if torch.cuda.is_available() or (acc is not None and acc.current_accelerator() is not None):
        pytest.skip("an accelerator is available here")
    with pytest.raises(BackendUnavailableError):
        event_factory()


# -- the runnable example and the GPU check -----------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def _load(relpath: str):  # type: ignore[no-untyped-def]
    """Import a script by path (in this process: torch is already loaded)."""
    name = "_script_" + Path(relpath).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cow_then_load_example_runs_on_cpu_and_waits_on_the_copy(capsys: pytest.CaptureFixture[str]) -> None:
    code = _load("docs/examples/cow_then_load.py").main([])
    assert (code, "load thread waited on compute:1 before its GET" in capsys.readouterr().out) == (0, True)


def test_cow_then_load_example_without_the_fence_shows_the_race(capsys: pytest.CaptureFixture[str]) -> None:
    _load("docs/examples/cow_then_load.py").main(["--drop-fence"])
    assert "without the fences, corruption observed: True" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the check would run")
def test_gpu_check_skips_with_exit_0_without_a_gpu() -> None:
    proc = _run("benchmarks/gpu_hazard_check.py")
    assert (proc.returncode, proc.stdout.strip().splitlines()[-1]) == (
        0,
        "gpu_hazard_check: skipped: no CUDA GPU available",
    ), proc.stderr


def test_gpu_check_dry_run_on_stand_ins_keeps_data_with_fences(capsys: pytest.CaptureFixture[str]) -> None:
    code = _load("benchmarks/gpu_hazard_check.py").main(["--dry-run-cpu"])
    result = json.loads(capsys.readouterr().out)
    assert (code, result["errors"], result["summary"]["fenced_runs_kept_data"]) == (0, [], True)


def test_gpu_check_dry_run_observes_corruption_without_the_fences(capsys: pytest.CaptureFixture[str]) -> None:
    _load("benchmarks/gpu_hazard_check.py").main(["--dry-run-cpu"])
    result = json.loads(capsys.readouterr().out)
    assert result["summary"]["corruption_without_fence"] == {
        "war_free_then_reload": True,
        "cow_then_load": True,
        "offload_store_then_reload": True,
    }
    assert result["offload_store_then_reload"]["with_fence"]["fence"] == ["offload_d2h:1"]


def test_gpu_check_dry_run_counts_the_offload_race_in_audit_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """Audit mode adds no wait (the reuse corrupts, as without the fence)
    and counts the load that started while the store still read."""
    _load("benchmarks/gpu_hazard_check.py").main(["--dry-run-cpu"])
    result = json.loads(capsys.readouterr().out)
    audit = result["offload_store_then_reload"]["audit"]
    assert (audit["fenced_waits"], audit["corruption_observed"], audit["audit_would_have_raced"]) == (
        0,
        True,
        1,
    )
    assert result["summary"]["audit_would_have_raced"] == 1
    assert result["offload_store_then_reload"]["with_fence"]["corruption_observed"] is False
