"""The CPU stand-ins (``blockpool.worker.standins``) behave like CUDA streams
and events in what the worker side relies on. One behaviour per test."""

from __future__ import annotations

import threading

import pytest

from blockpool.worker.standins import StandInDevice


def test_enqueued_work_runs_only_when_the_device_is_driven() -> None:
    dev = StandInDevice()
    s = dev.new_stream("s")
    out: list[int] = []
    s.enqueue(lambda: out.append(1))
    before = list(out)
    dev.run()
    assert (before, out) == ([], [1])


def test_an_event_is_complete_once_its_recorded_point_ran() -> None:
    dev = StandInDevice()
    s = dev.new_stream("s")
    s.enqueue(lambda: None)
    ev = s.record_event()
    s.enqueue(lambda: None)
    before = ev.query()
    s.run(max_ops=1)
    assert (before, ev.query(), s.query()) == (False, True, False)


def test_an_event_never_recorded_reports_complete_like_cuda() -> None:
    assert StandInDevice().new_event().query()


def test_wait_event_on_a_never_recorded_event_orders_nothing_like_cuda() -> None:
    dev = StandInDevice()
    a = dev.new_stream("a")
    a.wait_event(dev.new_event())
    a.enqueue(lambda: None)
    assert a.run() == 2


def test_wait_event_holds_later_work_until_the_event_point_ran() -> None:
    dev = StandInDevice()
    a, b = dev.new_stream("a"), dev.new_stream("b")
    out: list[str] = []
    a.enqueue(lambda: out.append("a"))
    ev = a.record_event()
    b.wait_event(ev)
    b.enqueue(lambda: out.append("b"))
    b.run()
    held = list(out)
    dev.run()
    assert (held, out) == ([], ["a", "b"])


def test_wait_captures_the_record_current_at_the_call() -> None:
    dev = StandInDevice()
    a, b = dev.new_stream("a"), dev.new_stream("b")
    ev = a.record_event()  # at a's start: already reached
    b.wait_event(ev)
    a.enqueue(lambda: None)
    ev.record(a)  # re-recorded later: b's wait is not affected
    assert b.run() == 1


def test_wait_stream_orders_after_everything_enqueued_on_the_other_stream() -> None:
    dev = StandInDevice()
    a, b = dev.new_stream("a"), dev.new_stream("b")
    a.enqueue(lambda: None)
    b.wait_stream(a)
    assert (b.run(), a.run(), b.run()) == (0, 1, 1)


def test_synchronize_runs_the_work_up_to_the_event_and_logs_the_thread() -> None:
    dev = StandInDevice()
    s = dev.new_stream("s")
    out: list[int] = []
    s.enqueue(lambda: out.append(1))
    ev = s.record_event()
    th = threading.Thread(target=ev.synchronize, name="worker-7")
    th.start()
    th.join(30)
    assert (out, dev.log[-1]) == ([1], ("synchronize", "worker-7", ev.name))


def test_record_without_a_stream_raises() -> None:
    with pytest.raises(TypeError):
        StandInDevice().new_event().record()
