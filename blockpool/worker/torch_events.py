"""Worker side: a real event for every token, fences resolved to stream waits.

The pool (scheduler process) speaks tokens only. On each worker (each
tensor-parallel rank) an :class:`EventLedger`

- records a real event at the point each ``DEVICE`` token names
  (:meth:`EventLedger.record`: ``event.record(stream)`` right after the
  token's work was enqueued), taking events from a pool of reusable ones;
- keeps each event until its completion is observed, and observes it by
  polling ``event.query()`` in order per stream (:meth:`EventLedger.poll`:
  cheap, never blocking; it stops at the first incomplete event of a
  stream, since a later point of an in-order stream cannot be done before
  an earlier one); only then is the event recycled;
- holds ``HOST`` tokens (a transfer engine: RDMA NIC, transfer threads),
  which complete one by one when the engine says so
  (:meth:`EventLedger.mark_host_complete`);
- resolves a fence for a **device consumer** to ``stream.wait_event(event)``
  per token (:meth:`EventLedger.wait_device`, no host block) and for a
  **host consumer** (a transfer thread about to post) to
  ``event.synchronize()`` per token, or the engine's completion for a
  ``HOST`` token (:meth:`EventLedger.wait_host`). Nothing here ever calls a
  device-wide synchronize.
- reports what it saw end as a picklable
  :class:`~blockpool.core.completions.CompletionReport` for the scheduler, where
  :class:`~blockpool.core.completions.RankMerger` ends a token only once every
  rank reported it.

The rules are ``docs/hazard-model.md`` ("Who waits how"); the account for
users is ``docs/worker.md``. Borrowed: polling events in order per stream
and stopping at the first one not ready, then recycling them, is how
PyTorch's CUDA caching allocator processes the events of cross-stream frees
(``c10/cuda/CUDACachingAllocator.cpp``, ``process_events`` and its event
pool). Events come from a factory
(:func:`event_factory`: ``torch.cuda.Event`` for CUDA, ``torch.Event`` for
another accelerator backend torch supports, or any stand-in such as
:meth:`blockpool.worker.standins.StandInDevice.new_event`).

This is the only module of the package that imports torch;
``import blockpool`` never imports it.

Example with the CPU stand-ins (the same calls work with CUDA streams)::

    >>> from blockpool.core.hazards import Fence, Token
    >>> from blockpool.worker.standins import StandInDevice
    >>> dev = StandInDevice()
    >>> compute, h2d = dev.new_stream("compute"), dev.new_stream("h2d")
    >>> ledger = EventLedger(dev.new_event, streams={"compute": compute})
    >>> compute.enqueue(lambda: None)             # step 1's kernels
    >>> e1 = Token("compute", 1)                  # issued by the pool
    >>> _ = ledger.record(e1)                     # event at e1's point
    >>> [str(t) for t in ledger.wait_device(Fence([e1]), h2d)]
    ['compute:1']
    >>> ledger.poll().tokens()                    # not run yet
    []
    >>> _ = dev.run()
    >>> [str(t) for t in ledger.poll().tokens()]
    ['compute:1']
    >>> ledger.wait_device(Fence([e1]), h2d)      # known complete: no wait
    ()
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from blockpool.core.completions import CompletionReport
from blockpool.core.errors import BlockPoolError, FenceFailedError, InvalidArgumentError
from blockpool.core.hazards import StreamKind, Token

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

__all__ = [
    "BackendUnavailableError",
    "EventFactory",
    "EventLedger",
    "EventLike",
    "EventNotRecordedError",
    "FenceFailedError",
    "FenceTimeoutError",
    "HostWaitRequiredError",
    "StreamLike",
    "TokenOrderError",
    "event_factory",
]

_DEVICE = StreamKind.DEVICE
_HOST = StreamKind.HOST


class EventLike(Protocol):
    """The part of ``torch.cuda.Event`` / ``torch.Event`` the ledger uses."""

    def record(self, stream: Any = ...) -> None:
        """Record the event on ``stream`` (the current stream by default)."""

    def query(self) -> bool:
        """Whether the work recorded before the event has finished (non-blocking)."""

    def synchronize(self) -> None:
        """Block the calling host thread until the event has happened."""


class StreamLike(Protocol):
    """The part of ``torch.cuda.Stream`` / ``torch.Stream`` the ledger uses."""

    def wait_event(self, event: Any) -> None:
        """Make work enqueued on this stream from now on wait for ``event`` (no host block)."""


EventFactory = Callable[[], EventLike]
"""Makes a new, unrecorded event (no arguments)."""


# ----------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------


class EventNotRecordedError(BlockPoolError, LookupError):
    """A device consumer's fence names a ``DEVICE`` token this ledger has no
    event for (never recorded, not known complete). A stream wait on an
    unrecorded event orders nothing, so enqueuing it would race: this is a
    caller bug (record every token before its fences reach a device
    consumer)."""


class FenceTimeoutError(BlockPoolError, TimeoutError):
    """A host consumer waited longer than its timeout for a fence token to be
    recorded (``DEVICE``) or completed by its engine (``HOST``)."""


class HostWaitRequiredError(BlockPoolError, ValueError):
    """A device consumer's fence names ``HOST`` tokens, which no stream wait
    can cover; the caller did not accept waiting on the host first
    (``allow_host_wait=True``)."""


class TokenOrderError(BlockPoolError, ValueError):
    """A ``DEVICE`` token was recorded twice, or after a later token of its
    stream: a stream's points are recorded in issue order."""


class BackendUnavailableError(BlockPoolError, RuntimeError):
    """The requested device type has no events in this torch build (CPU, or
    an accelerator that is not available)."""


# ----------------------------------------------------------------------------
# event factory
# ----------------------------------------------------------------------------


def _default_device_type() -> str:
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        cur = acc.current_accelerator()
        if cur is not None:
            return str(cur.type)
    if torch.cuda.is_available():
        return "cuda"
    raise BackendUnavailableError(
        "no accelerator is available; use blockpool.worker.standins.StandInDevice.new_event "
        "as the event factory on a machine without one"
    )


def event_factory(device: str | torch.device | None = None, *, enable_timing: bool = False) -> EventFactory:
    """A factory of events for ``device``'s backend.

    ``cuda`` (also ROCm builds): ``torch.cuda.Event``; any other accelerator
    type torch supports (``xpu``, ``mps``, ``hpu``...): ``torch.Event(device)``.
    ``None``: the current accelerator (``torch.accelerator``), else CUDA. For
    tests or a machine without an accelerator pass a stand-in factory
    (:meth:`blockpool.worker.standins.StandInDevice.new_event`) to
    :class:`EventLedger` instead. O(1); each call of the factory makes one
    event.

    Args:
        device: A device or device type, e.g. ``"cuda"``, ``"cuda:1"``, ``"xpu"``.
        enable_timing: Events can measure ``elapsed_time`` (slower to record).

    Raises:
        InvalidArgumentError: ``device`` is not a device torch knows.
        BackendUnavailableError: the device type is ``cpu``/``meta`` (no
            events), not available in this build or machine, or torch is too
            old to have ``torch.Event``.
    """
    import torch

    if device is None:
        device = _default_device_type()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"not a torch device: {device!r} ({exc})") from None
    if dev.type in ("cpu", "meta"):
        raise BackendUnavailableError(
            f"device type {dev.type!r} has no events; use blockpool.worker.standins stand-ins"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError("CUDA is not available in this torch build or machine")

        def make_cuda() -> EventLike:
            return torch.cuda.Event(enable_timing=enable_timing)  # type: ignore[no-any-return]

        return make_cuda
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        raise BackendUnavailableError(f"device type {dev.type!r} is not available")
    ev_cls = getattr(torch, "Event", None)
    if ev_cls is None:
        raise BackendUnavailableError(f"torch {torch.__version__} has no torch.Event for {dev.type!r}")

    def make() -> EventLike:
        return ev_cls(dev, enable_timing=enable_timing)  # type: ignore[no-any-return]

    return make


# ----------------------------------------------------------------------------
# the ledger
# ----------------------------------------------------------------------------


class _Entry:
    """One recorded ``DEVICE`` token: its event, host threads using the
    event right now (``pins``), and whether its completion was observed."""

    __slots__ = ("done", "event", "pins", "token")

    def __init__(self, token: Token, event: EventLike) -> None:
        self.token = token
        self.event = event
        self.pins = 0
        self.done = False


def _tokens(fence: Iterable[Token]) -> list[Token]:
    out = list(fence)
    for t in out:
        if not isinstance(t, Token):
            raise InvalidArgumentError(f"a fence holds Tokens, got {t!r}")
    return out


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


class EventLedger:
    """Real events for tokens on one worker (one rank), and fence resolution.

    Thread safety: every method may be called from any thread. The usual
    split: the worker's main thread calls :meth:`record`, :meth:`wait_device`
    and :meth:`poll`; transfer threads call :meth:`wait_host`; engine
    callbacks call :meth:`mark_host_complete`. One lock (a
    ``threading.Condition``) guards the tables; ``event.synchronize()`` runs
    outside it, with the event pinned so it is not recycled meanwhile.

    Memory: one entry per recorded token whose completion was not yet
    observed, plus at most ``max_free_events`` idle events; per ``HOST``
    engine, the completed seqs above its mark (the highest seq below which
    every token completed).

    Args:
        event_factory: Makes a new unrecorded event (:func:`event_factory`,
            or a stand-in's ``new_event``).
        rank: This worker's tensor-parallel rank, put in its reports.
        streams: ``{stream name: stream}`` used by :meth:`record` when no
            stream is passed (e.g. ``{"compute": torch.cuda.current_stream()}``).
        max_free_events: Idle events kept for reuse; beyond it they are dropped.

    Raises:
        InvalidArgumentError: a bad ``rank`` or ``max_free_events``.
    """

    def __init__(
        self,
        event_factory: EventFactory,
        *,
        rank: int = 0,
        streams: Mapping[str, Any] | None = None,
        max_free_events: int = 1024,
    ) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}")
        if not isinstance(max_free_events, int) or max_free_events < 0:
            raise InvalidArgumentError(f"max_free_events must be an int >= 0, got {max_free_events!r}")
        self.rank = rank
        self.max_free_events = max_free_events
        self._factory = event_factory
        self._streams: dict[str, Any] = dict(streams or {})
        self._cond = threading.Condition(threading.Lock())
        # DEVICE streams: recorded entries in seq order, lookup, marks.
        self._pending: dict[str, collections.deque[_Entry]] = {}
        self._by_token: dict[Token, _Entry] = {}
        self._last: dict[str, int] = {}
        self._mark: dict[str, int] = {}
        # HOST engines: every seq <= mark ended; ended seqs above it.
        self._host_mark: dict[str, int] = {}
        self._host_done: dict[str, set[int]] = {}
        # HOST engines: seqs that ended failed (kept: a later wait must
        # still learn it; one entry per failure).
        self._host_failed: dict[str, set[int]] = {}
        self._free: list[EventLike] = []
        # Completions observed and not yet reported.
        self._new_dev: dict[str, Token] = {}
        self._new_host: list[Token] = []
        self._new_failed: list[Token] = []

    # -- recording -----------------------------------------------------------

    def record(self, token: Token, stream: Any = None) -> EventLike:
        """Record ``token``'s event on ``stream`` now, i.e. at the point after
        everything enqueued on ``stream`` so far (call it right after
        enqueuing the token's work). ``stream`` defaults to the one given
        for ``token.stream`` at construction. Takes an idle event when one
        is free, else makes one. Returns the event (owned by the ledger:
        do not record it again). O(1).

        Raises:
            InvalidArgumentError: ``token`` is not a Token, is a ``HOST``
                token (those end by :meth:`mark_host_complete`), or no stream
                is known for it.
            TokenOrderError: ``token`` or a later token of its stream was
                already recorded.
        """
        if not isinstance(token, Token):
            raise InvalidArgumentError(f"expected a Token, got {token!r}")
        if token.kind is not _DEVICE:
            raise InvalidArgumentError(
                f"{token} is a HOST token: it has no event; the engine ends it with mark_host_complete"
            )
        if stream is None:
            stream = self._streams.get(token.stream)
            if stream is None:
                raise InvalidArgumentError(
                    f"no stream given for {token} and none registered for {token.stream!r}"
                )
        with self._cond:
            last = self._last.get(token.stream, 0)
            if token.seq <= last:
                raise TokenOrderError(
                    f"cannot record {token}: {token.stream}:{last} is already recorded "
                    "(a stream's tokens are recorded once, in issue order)"
                )
            event = self._free.pop() if self._free else self._factory()
            event.record(stream)
            entry = _Entry(token, event)
            self._pending.setdefault(token.stream, collections.deque()).append(entry)
            self._by_token[token] = entry
            self._last[token.stream] = token.seq
            self._cond.notify_all()
            return event

    # -- completion ------------------------------------------------------------

    def mark_host_complete(self, token: Token, *, failed: bool = False) -> None:
        """A ``HOST`` engine's completion callback: ``token``'s transfer ended
        (``failed``: without doing its job). Wakes host threads waiting on
        it, and the next :meth:`poll` reports it. Idempotent.
        O(k) for k completions above the engine's mark.

        Raises:
            InvalidArgumentError: ``token`` is not a ``HOST`` Token.
        """
        if not isinstance(token, Token) or token.kind is not _HOST:
            raise InvalidArgumentError(f"mark_host_complete takes a HOST token, got {token!r}")
        with self._cond:
            if self._host_ended(token):
                return
            done = self._host_done.setdefault(token.stream, set())
            done.add(token.seq)
            mark = self._host_mark.get(token.stream, 0)
            while mark + 1 in done:
                mark += 1
                done.discard(mark)
            self._host_mark[token.stream] = mark
            if failed:
                self._host_failed.setdefault(token.stream, set()).add(token.seq)
            (self._new_failed if failed else self._new_host).append(token)
            self._cond.notify_all()

    def poll(self) -> CompletionReport:
        """Observe completions: per ``DEVICE`` stream, ``query()`` recorded
        events in order and stop at the first incomplete one; recycle the
        events of completed tokens; return every completion observed since
        the last poll (newest token per ``DEVICE`` stream, each ``HOST``
        token) as a picklable report. Never blocks on the device.
        O(streams + completed events).
        """
        with self._cond:
            for stream, q in self._pending.items():
                newest: Token | None = None
                while q and q[0].event.query():
                    entry = q.popleft()
                    entry.done = True
                    del self._by_token[entry.token]
                    newest = entry.token  # the recorded token: keeps its pool id
                    if entry.pins == 0:
                        self._recycle(entry.event)
                if newest is not None:
                    self._mark[stream] = newest.seq
                    self._new_dev[stream] = newest
            completed = [t for _, t in sorted(self._new_dev.items())]
            completed += self._new_host
            report = CompletionReport.of(self.rank, completed, self._new_failed)
            self._new_dev = {}
            self._new_host = []
            self._new_failed = []
            if report:
                self._cond.notify_all()
            return report

    def is_complete(self, token: Token) -> bool:
        """Whether ``token`` is known complete here (observed by :meth:`poll`
        or :meth:`mark_host_complete`). O(1).

        Raises:
            InvalidArgumentError: ``token`` is not a Token.
        """
        if not isinstance(token, Token):
            raise InvalidArgumentError(f"expected a Token, got {token!r}")
        with self._cond:
            return self._known_complete(token)

    def event_of(self, token: Token) -> EventLike | None:
        """The event recorded for ``token`` while its completion is not yet
        observed, else ``None`` (e.g. to read timings). O(1)."""
        with self._cond:
            entry = self._by_token.get(token)
            return entry.event if entry is not None else None

    @property
    def num_pending(self) -> int:
        """Recorded events whose completion was not yet observed. O(1)."""
        with self._cond:
            return len(self._by_token)

    @property
    def num_free_events(self) -> int:
        """Idle events kept for reuse. O(1)."""
        with self._cond:
            return len(self._free)

    # -- fence resolution --------------------------------------------------------

    def wait_device(
        self,
        fence: Iterable[Token],
        stream: StreamLike,
        *,
        allow_host_wait: bool = False,
        timeout: float = 30.0,
    ) -> tuple[Token, ...]:
        """Order ``stream`` (a device consumer) after ``fence``: enqueue
        ``stream.wait_event(event)`` for each ``DEVICE`` token not known
        complete. No host block. A fence that names ``HOST`` tokens cannot be
        enqueued; with ``allow_host_wait=True`` the calling thread first
        waits for their engine's completion (as :meth:`wait_host`, bounded
        by ``timeout``). Returns the tokens waited on, in fence order.
        O(k) for k fence tokens (plus a scan of the stream's pending
        events for a token skipped by the recorder, covered by the next
        recorded event of its stream).

        Raises:
            InvalidArgumentError: the fence holds a non-Token, or a bad timeout.
            HostWaitRequiredError: ``HOST`` tokens not known complete and
                ``allow_host_wait`` is false (nothing was enqueued).
            FenceFailedError: a ``HOST`` token of the fence failed
                (:meth:`mark_host_complete` with ``failed=True``); raised
                after the host wait, with nothing enqueued. The consumer
                must not run: it reports its own work failed.
            EventNotRecordedError: a ``DEVICE`` token has no event here yet
                (nothing was enqueued).
            FenceTimeoutError: the host wait ran past ``timeout`` (nothing
                was enqueued).
        """
        tokens = _tokens(fence)
        timeout = _check_timeout(timeout)
        host = [t for t in tokens if t.kind is _HOST]
        waited: set[Token] = set()
        if host:
            with self._cond:
                open_host = [t for t in host if not self._host_ended(t)]
                if open_host and not allow_host_wait:
                    self._raise_failed(tokens, ())  # a known failure says more
                    raise HostWaitRequiredError(
                        f"fence names HOST tokens {[str(t) for t in open_host]}: no stream wait "
                        "covers them; wait on the host first (allow_host_wait=True) or hold the blocks"
                    )
                self._resolve(tokens)  # fail early, before a long host wait
            deadline = time.monotonic() + timeout
            for t in host:
                if self._wait_host_token(t, deadline):
                    waited.add(t)
        with self._cond:
            # A failed token: raise before anything is enqueued.
            self._raise_failed(tokens, tuple(t for t in tokens if t in waited))
            for t, entry in self._resolve(tokens):
                stream.wait_event(entry.event)
                waited.add(t)
        return tuple(t for t in tokens if t in waited)

    def wait_host(self, fence: Iterable[Token], *, timeout: float = 30.0) -> tuple[Token, ...]:
        """Block the calling thread (a host consumer: a transfer thread about
        to post an RDMA read/write, a store thread about to read) until
        every token of ``fence`` ended: ``event.synchronize()`` for a
        ``DEVICE`` token (first waiting, bounded, until the recording
        thread has recorded it: this thread may race it), the engine's
        completion (:meth:`mark_host_complete`) for a ``HOST`` token. Tokens
        known complete are not waited on. Returns the tokens waited on, in
        fence order. O(k) for k fence tokens, plus the waits.

        ``timeout`` bounds the waits for recording and for host-engine
        completion, over the whole fence; ``event.synchronize()`` itself
        returns when the device reaches the event.

        Raises:
            InvalidArgumentError: the fence holds a non-Token, or a bad timeout.
            FenceTimeoutError: a token was not recorded (``DEVICE``) or not
                completed (``HOST``) within ``timeout``.
            FenceFailedError: a ``HOST`` token of the fence ended failed
                (:meth:`mark_host_complete` with ``failed=True``); raised
                after waiting for every token of the fence. The consumer
                must not post: it reports its own work failed.
        """
        tokens = _tokens(fence)
        deadline = time.monotonic() + _check_timeout(timeout)
        waited: list[Token] = []
        for t in tokens:
            if t.kind is _HOST:
                if self._wait_host_token(t, deadline):
                    waited.append(t)
                continue
            with self._cond:
                ok = self._cond.wait_for(
                    lambda t=t: self._known_complete(t) or t.seq <= self._last.get(t.stream, 0),  # type: ignore[misc]
                    max(0.0, deadline - time.monotonic()),
                )
                if not ok:
                    raise FenceTimeoutError(
                        f"{t} was not recorded within {timeout:g}s on rank {self.rank} "
                        f"(last recorded on {t.stream!r}: {self._last.get(t.stream, 0)})"
                    )
                if self._known_complete(t):
                    continue
                entry = self._entry_for(t)
                assert entry is not None  # recorded and not complete
                entry.pins += 1
            try:
                entry.event.synchronize()
            finally:
                with self._cond:
                    entry.pins -= 1
                    if entry.pins == 0 and entry.done:
                        self._recycle(entry.event)
            waited.append(t)
        with self._cond:
            self._raise_failed(tokens, tuple(waited))
        return tuple(waited)

    def _raise_failed(self, tokens: list[Token], waited: tuple[Token, ...]) -> None:
        """Raise :class:`FenceFailedError` if a token of the fence is known
        to have failed (lock held)."""
        failed = self._host_failed
        if not failed:
            return
        bad = tuple(t for t in tokens if t.kind is _HOST and t.seq in failed.get(t.stream, ()))
        if bad:
            raise FenceFailedError(
                f"fence tokens {[str(t) for t in bad]} failed on rank {self.rank}: the data they "
                "were to write never arrived, and they may have failed before their own waits; "
                "do not run the consumer (report its token failed)",
                bad,
                waited,
            )

    # -- internals ---------------------------------------------------------------

    def _host_ended(self, t: Token) -> bool:
        return t.seq <= self._host_mark.get(t.stream, 0) or t.seq in self._host_done.get(t.stream, ())

    def _known_complete(self, t: Token) -> bool:
        if t.kind is _HOST:
            return self._host_ended(t)
        return t.seq <= self._mark.get(t.stream, 0)

    def _entry_for(self, t: Token) -> _Entry | None:
        entry = self._by_token.get(t)
        if entry is not None:
            return entry
        if t.seq > self._last.get(t.stream, 0):
            return None
        # Skipped by the recorder: the next recorded point of the stream covers it.
        for e in self._pending.get(t.stream, ()):
            if e.token.seq > t.seq:
                return e
        return None

    def _resolve(self, tokens: list[Token]) -> list[tuple[Token, _Entry]]:
        out = []
        for t in tokens:
            if t.kind is _HOST or self._known_complete(t):
                continue
            entry = self._entry_for(t)
            if entry is None:
                raise EventNotRecordedError(
                    f"fence token {t} has no event on rank {self.rank}: last recorded on "
                    f"{t.stream!r} is seq {self._last.get(t.stream, 0)}, known complete up to "
                    f"{self._mark.get(t.stream, 0)}. A stream wait on an unrecorded event orders "
                    "nothing; record the token before its fence reaches a device consumer"
                )
            out.append((t, entry))
        return out

    def _wait_host_token(self, t: Token, deadline: float) -> bool:
        """Wait for a HOST token's completion; True if it had to wait."""
        with self._cond:
            if self._host_ended(t):
                return False
            ok = self._cond.wait_for(lambda: self._host_ended(t), max(0.0, deadline - time.monotonic()))
            if not ok:
                raise FenceTimeoutError(
                    f"host engine {t.stream!r} did not complete {t} in time on rank {self.rank}"
                )
            return True

    def _recycle(self, event: EventLike) -> None:
        if len(self._free) < self.max_free_events:
            self._free.append(event)
