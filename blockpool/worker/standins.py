"""CPU stand-ins for device streams and events, with torch's interface.

:class:`StandInStream` and :class:`StandInEvent` implement the part of
``torch.cuda.Stream`` / ``torch.cuda.Event`` (and ``torch.Stream`` /
``torch.Event``) that the worker side uses: ``event.record(stream)``,
``event.query()``, ``event.synchronize()``, ``stream.wait_event(event)``,
``stream.wait_stream(other)``, ``stream.query()``, ``stream.synchronize()``.
They let :class:`~blockpool.worker.torch_events.EventLedger`, its tests and the
examples run on a machine without an accelerator, deterministically.

Model: a stream is an in-order queue of operations (Python callables that
stand for kernels, and waits). Nothing runs when it is enqueued; work runs
when someone drives the device (:meth:`StandInDevice.run`,
:meth:`StandInStream.run`) or blocks on it (``event.synchronize()`` runs
the queues until the event's point is reached). Recording an event captures
the point "after everything enqueued so far on the stream", exactly like
CUDA; a wait captures the event's most recent record at the time of the
call. As with CUDA events, an event never recorded reports complete
(``query()`` is true, ``synchronize()`` returns at once, a ``wait_event``
on it orders nothing) -- which is why waiting on a token that was never
recorded is a silent race and :class:`~blockpool.worker.torch_events.EventLedger`
refuses it.

Every ``record``, ``wait_event``, ``wait_stream`` and ``synchronize`` is
appended to :attr:`StandInDevice.log` as ``(op, by, what)``: ``by`` is the
stream name for enqueued operations and the calling thread's name for host
blocking calls, so tests can assert who waited on which event.

This module imports neither torch nor vLLM.

>>> dev = StandInDevice()
>>> compute = dev.new_stream("compute")
>>> out = []
>>> compute.enqueue(lambda: out.append("copy"))
>>> ev = dev.new_event()
>>> ev.record(compute)
>>> ev.query(), out
(False, [])
>>> ev.synchronize()
>>> ev.query(), out
(True, ['copy'])
>>> dev.log
[('record', 'compute', 'ev0'), ('synchronize', 'MainThread', 'ev0')]
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from blockpool.core.errors import BlockPoolError

__all__ = ["StandInDeadlock", "StandInDevice", "StandInEvent", "StandInStream"]

_Point = tuple["StandInStream", int]


class StandInDeadlock(BlockPoolError, RuntimeError):
    """A blocking call on a stand-in can never return: the work it waits on
    is behind a wait that nothing will satisfy. (On a real device the call
    would hang; the stand-ins can tell.) A :class:`~blockpool.BlockPoolError`
    and a ``RuntimeError``."""


class StandInDevice:
    """The shared state of a set of stand-in streams: one lock, a log, and
    the executor that drives the queues.

    Thread safety: every method may be called from any thread; operations
    run under one re-entrant lock, in the thread that drives the device.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.streams: list[StandInStream] = []
        self.log: list[tuple[str, str, str]] = []
        self._events = 0

    def new_stream(self, name: str) -> StandInStream:
        """A new, empty stream named ``name``. O(1)."""
        return StandInStream(self, name)

    def new_event(self) -> StandInEvent:
        """A new, never-recorded event (usable as an event factory). O(1)."""
        with self.lock:
            name = f"ev{self._events}"
            self._events += 1
        return StandInEvent(self, name)

    def run(self) -> int:
        """Run every operation that can run, on all streams, until none can.
        Returns the number of operations run. O(operations run + streams)."""
        with self.lock:
            total = 0
            while True:
                n = sum(s._run_ready(None) for s in self.streams)
                if not n:
                    return total
                total += n

    def pending(self) -> int:
        """Operations enqueued and not yet run, over all streams. O(streams)."""
        with self.lock:
            return sum(len(s._ops) - s._done for s in self.streams)

    def _run_until(self, done: Callable[[], bool], what: str) -> None:
        with self.lock:
            while not done():
                if not any(s._run_ready(None) for s in self.streams):
                    raise StandInDeadlock(f"{what} can never complete: every stream is blocked")

    def _log(self, op: str, by: str, what: str) -> None:
        with self.lock:
            self.log.append((op, by, what))


class StandInStream:
    """An in-order queue of stand-in work (see the module docstring).

    Args:
        device: The :class:`StandInDevice` it belongs to.
        name: A name for logs and errors.
    """

    def __init__(self, device: StandInDevice, name: str) -> None:
        self.device = device
        self.name = name
        # ("fn", callable, label) or ("wait", point-or-None, label)
        self._ops: list[tuple[str, object, str]] = []
        self._done = 0
        with device.lock:
            device.streams.append(self)

    def __repr__(self) -> str:
        return f"StandInStream({self.name!r}, done={self._done}/{len(self._ops)})"

    def enqueue(self, fn: Callable[[], object], label: str = "") -> None:
        """Enqueue ``fn`` (a stand-in kernel); it runs when the stream is
        driven and every earlier operation ran. O(1)."""
        with self.device.lock:
            self._ops.append(("fn", fn, label))

    def _end(self) -> _Point:
        return (self, len(self._ops))

    def wait_event(self, event: StandInEvent) -> None:
        """Order later work on this stream after ``event``'s most recent
        record (no host block). A never-recorded event orders nothing. O(1)."""
        with self.device.lock:
            self.device._log("wait_event", self.name, event.name)
            self._ops.append(("wait", event._point, event.name))

    def wait_stream(self, stream: StandInStream) -> None:
        """Order later work on this stream after everything enqueued so far
        on ``stream``. O(1)."""
        with self.device.lock:
            self.device._log("wait_stream", self.name, stream.name)
            self._ops.append(("wait", stream._end(), stream.name))

    def record_event(self, event: StandInEvent | None = None) -> StandInEvent:
        """Record ``event`` (a new one if ``None``) here and return it. O(1)."""
        ev = event if event is not None else self.device.new_event()
        ev.record(self)
        return ev

    def query(self) -> bool:
        """True when every enqueued operation ran. O(1)."""
        with self.device.lock:
            return self._done == len(self._ops)

    def synchronize(self) -> None:
        """Block the calling thread until every operation enqueued so far on
        this stream ran (drives the device).

        Raises:
            StandInDeadlock: the stream can never drain.
        """
        with self.device.lock:
            self.device._log("stream_synchronize", threading.current_thread().name, self.name)
            end = len(self._ops)
            self.device._run_until(lambda: self._done >= end, f"stream {self.name}")

    def run(self, max_ops: int | None = None) -> int:
        """Run this stream's ready operations in order (at most ``max_ops``),
        stopping at a wait that is not satisfied. Returns how many ran.
        O(operations run)."""
        with self.device.lock:
            return self._run_ready(max_ops)

    def _ready(self) -> bool:
        if self._done >= len(self._ops):
            return False
        kind, arg, _ = self._ops[self._done]
        if kind == "fn":
            return True
        if arg is None:
            return True
        point: _Point = arg  # type: ignore[assignment]
        return point[0]._done >= point[1]

    def _run_ready(self, max_ops: int | None) -> int:
        n = 0
        while (max_ops is None or n < max_ops) and self._ready():
            kind, arg, _ = self._ops[self._done]
            if kind == "fn":
                arg()  # type: ignore[operator]
            self._done += 1
            n += 1
        return n


class StandInEvent:
    """A stand-in for ``torch.cuda.Event`` (see the module docstring).

    Attributes:
        name: Unique per device (``"ev0"``, ``"ev1"``, ...), used in logs.
        records: How many times it was recorded (recycling shows here).
    """

    def __init__(self, device: StandInDevice, name: str) -> None:
        self.device = device
        self.name = name
        self.records = 0
        self._point: _Point | None = None

    def __repr__(self) -> str:
        where = "unrecorded" if self._point is None else f"on {self._point[0].name}@{self._point[1]}"
        return f"StandInEvent({self.name!r}, {where})"

    def record(self, stream: StandInStream | None = None) -> None:
        """Capture the point after everything enqueued so far on ``stream``.
        O(1).

        Raises:
            TypeError: ``stream`` is not given (stand-ins have no current
                stream).
        """
        if stream is None:
            raise TypeError("StandInEvent.record needs a stream (no current stream here)")
        with self.device.lock:
            self.device._log("record", stream.name, self.name)
            self._point = stream._end()
            self.records += 1

    def query(self) -> bool:
        """True when the recorded point was reached (or never recorded). O(1)."""
        with self.device.lock:
            p = self._point
            return p is None or p[0]._done >= p[1]

    def synchronize(self) -> None:
        """Block the calling thread until the recorded point is reached
        (drives the device); returns at once if never recorded.

        Raises:
            StandInDeadlock: the point can never be reached.
        """
        with self.device.lock:
            self.device._log("synchronize", threading.current_thread().name, self.name)
            self.device._run_until(self.query, f"event {self.name}")

    def wait(self, stream: StandInStream) -> None:
        """``stream.wait_event(self)``. O(1)."""
        stream.wait_event(self)
