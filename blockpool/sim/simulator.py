"""A deterministic discrete-event timeline of device streams and host engines.

:class:`StreamSimulator` plays the GPU and the transfer engines for a replay:
work is submitted when the scheduler enqueues it (a token issued by the
pool), its start and end times follow from a small cost model
(:class:`CostModel`) and from the waits it honours, and
:meth:`StreamSimulator.advance` reports every completion whose time has
passed to the pool (``pool.complete`` / ``pool.fail``), in time order.
Simulated time only, in seconds: no threads, no sleeping. Seeded: the same
seed and the same submissions give the same timeline.

Timing rules:

- ``DEVICE`` stream (in order): work starts at
  ``max(ready, end of the stream's previous work, end of each waited token)``.
  A waited ``HOST`` token is a host wait before enqueuing; it is modelled
  the same way.
- ``HOST`` engine (out of order, ``lanes`` postings in flight): a posting
  starts at ``max(ready, end of each waited token, earliest free lane)``; its
  duration carries a seeded jitter, and it may fail (``failure_rate``).
  Completion order is by end time, so tokens complete out of order.

Because every waited token was submitted before the work that waits on it,
end times are known at submission (no later work can change them). The cost
model and the stream specs live in :mod:`blockpool.sim.costmodel` and are
re-exported here.

>>> from blockpool.core.hazards import StreamKind, Token
>>> sim = StreamSimulator({"compute": StreamSpec(StreamKind.DEVICE),
...                        "h2d": StreamSpec(StreamKind.DEVICE, bandwidth=1e9)})
>>> e1, l1 = Token("compute", 1), Token("h2d", 1)
>>> sim.submit(e1, ready=0.0, duration=0.010).end
0.01
>>> w = sim.submit(l1, ready=0.001, num_bytes=10**6, waits=[e1])
>>> (w.start, w.end)
(0.01, 0.011)
>>> [str(x.token) for x in sim.advance(0.0105)], sim.is_ended(e1), sim.is_ended(l1)
(['compute:1'], True, False)
"""

from __future__ import annotations

import collections
import heapq
import random
from collections.abc import Iterable, Mapping
from typing import Protocol

import attrs

from blockpool.core.errors import BlockPoolError, InvalidArgumentError, UnknownStreamError, UnknownTokenError
from blockpool.core.hazards import StreamKind, Token
from blockpool.sim.costmodel import DEFAULT_STREAM_SPECS, CostModel, StreamSpec

__all__ = [
    "DEFAULT_STREAM_SPECS",
    "CostModel",
    "SimulationError",
    "StreamSimulator",
    "StreamSpec",
    "Work",
]


class SimulationError(BlockPoolError, ValueError):
    """Work submitted out of order (a token twice, or a seq skipped)."""


@attrs.frozen(slots=True)
class Work:
    """One submitted piece of work (a value object).

    Attributes:
        token: Its token.
        what: A label (``"forward"``, ``"load"``...).
        ready: When the scheduler enqueued it (s).
        start: When it starts, after its waits and its stream (s).
        end: When it ends (s).
        failed: Whether it ends failed.
        lane: The ``HOST`` lane it ran on (0 on a ``DEVICE`` stream).
    """

    token: Token
    what: str
    ready: float
    start: float
    end: float
    failed: bool = False
    lane: int = 0


class _Reporter(Protocol):
    def complete(self, token: Token) -> None: ...
    def fail(self, token: Token) -> None: ...


class StreamSimulator:
    """The simulated machine (see the module docstring).

    Args:
        streams: ``{name: StreamSpec}``.
        seed: Seed of the jitter and failure draws.
        pool: Where completions are reported (``complete``/``fail``), e.g. a
            :class:`~blockpool.HazardAwareBlockPool`; ``None``: nobody.
        timeline: Works of each stream kept for :attr:`timeline` (for plots):
            the last ``timeline`` before :meth:`mark_timeline`, and the next
            ``timeline`` after it.

    Raises:
        InvalidArgumentError: a stream spec that is not a :class:`StreamSpec`.

    Memory: O(works not yet ended + timeline).
    """

    def __init__(
        self,
        streams: Mapping[str, StreamSpec],
        *,
        seed: int = 0,
        pool: _Reporter | None = None,
        timeline: int = 0,
    ) -> None:
        for name, spec in streams.items():
            if not isinstance(spec, StreamSpec) or not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"stream {name!r}: expected a StreamSpec, got {spec!r}")
        self.specs: dict[str, StreamSpec] = dict(streams)
        self.now = 0.0
        self.last_end = 0.0
        self._rng = random.Random(seed)
        self._pool = pool
        self._free_at = dict.fromkeys(self.specs, 0.0)
        self._lanes = {n: [0.0] * s.lanes for n, s in self.specs.items() if s.kind is StreamKind.HOST}
        self._last_seq = dict.fromkeys(self.specs, 0)
        self._live: dict[Token, Work] = {}
        self._heap: list[tuple[float, int, Token]] = []
        self._n = 0
        if not isinstance(timeline, int) or timeline < 0:
            raise InvalidArgumentError(f"timeline must be an int >= 0, got {timeline!r}")
        self._timeline_cap = timeline
        self._ring: dict[str, collections.deque[Work]] = {
            n: collections.deque(maxlen=timeline) for n in self.specs
        }
        self._frozen: list[Work] | None = None
        self._after = dict.fromkeys(self.specs, 0)
        self.timeline_mark: float | None = None

    def _spec(self, stream: str) -> StreamSpec:
        spec = self.specs.get(stream)
        if spec is None:
            raise UnknownStreamError(f"unknown stream {stream!r}; simulated: {sorted(self.specs)}")
        return spec

    def end_of(self, token: Token) -> float:
        """When ``token``'s work ends (0.0 for one already reported ended). O(1).

        Raises:
            UnknownStreamError: an unknown stream.
            UnknownTokenError: a token never submitted.
        """
        w = self._live.get(token)
        if w is not None:
            return w.end
        self._spec(token.stream)
        if token.seq > self._last_seq[token.stream]:
            raise UnknownTokenError(f"token {token} was never submitted to the simulator")
        return 0.0

    def is_ended(self, token: Token) -> bool:
        """Whether ``token``'s completion has been reported by :meth:`advance`. O(1).

        Raises:
            UnknownStreamError, UnknownTokenError: as for :meth:`end_of`.
        """
        if token in self._live:
            return False
        self.end_of(token)
        return True

    def submit(
        self,
        token: Token,
        *,
        ready: float,
        duration: float | None = None,
        num_bytes: int | None = None,
        waits: Iterable[Token] = (),
        what: str = "",
    ) -> Work:
        """Enqueue the work of ``token`` at time ``ready`` after ``waits``.
        Give ``duration`` (s) or, on a transfer stream, ``num_bytes``.
        Returns the :class:`Work` with its start and end. O(#waits + lanes).

        Raises:
            UnknownStreamError: the token's stream (or a waited one) is not simulated.
            UnknownTokenError: a waited token was never submitted.
            SimulationError: ``token`` is not the next seq of its stream.
            InvalidArgumentError: neither or both of ``duration`` and
                ``num_bytes``, a negative one, or ``num_bytes`` on a stream
                without bandwidth.
        """
        spec = self._spec(token.stream)
        if token.seq != self._last_seq[token.stream] + 1:
            raise SimulationError(
                f"cannot submit {token}: next on {token.stream!r} is seq {self._last_seq[token.stream] + 1}"
            )
        if (duration is None) == (num_bytes is None):
            raise InvalidArgumentError("give exactly one of duration and num_bytes")
        if duration is None:
            if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
                raise InvalidArgumentError(f"num_bytes must be an int >= 0, got {num_bytes!r}")
            duration = spec.transfer_seconds(num_bytes)
        elif not duration >= 0:
            raise InvalidArgumentError(f"duration must be >= 0, got {duration!r}")
        start = ready
        for t in waits:
            e = self.end_of(t)
            start = max(start, e)
        failed = False
        lane = 0
        if spec.kind is StreamKind.DEVICE:
            start = max(start, self._free_at[token.stream])
        else:
            lanes = self._lanes[token.stream]
            lane = min(range(len(lanes)), key=lanes.__getitem__)
            start = max(start, lanes[lane])
            if spec.jitter:
                duration *= 1.0 + self._rng.uniform(-spec.jitter, spec.jitter)
            if spec.failure_rate:
                failed = self._rng.random() < spec.failure_rate
        end = start + duration
        if spec.kind is StreamKind.DEVICE:
            self._free_at[token.stream] = end
        else:
            self._lanes[token.stream][lane] = end
        self._last_seq[token.stream] = token.seq
        w = Work(token, what, ready, start, end, failed, lane)
        self._live[token] = w
        self._n += 1
        heapq.heappush(self._heap, (end, self._n, token))
        if self._timeline_cap:
            if self._frozen is None:
                self._ring[token.stream].append(w)
            elif self._after[token.stream] < self._timeline_cap:
                self._after[token.stream] += 1
                self._frozen.append(w)
        return w

    def mark_timeline(self, t: float) -> None:
        """Centre :attr:`timeline` on time ``t`` (e.g. the first load): keep
        the works kept so far and the next ``timeline`` of each stream. Only
        the first call counts. O(timeline x #streams)."""
        if self._frozen is None:
            self._frozen = [w for ring in self._ring.values() for w in ring]
            self.timeline_mark = t

    @property
    def timeline(self) -> list[Work]:
        """The works kept for plots, by start time (see ``timeline`` in the
        constructor). O(k log k)."""
        works = self._frozen if self._frozen is not None else [w for r in self._ring.values() for w in r]
        return sorted(works, key=lambda w: (w.start, w.token.stream, w.token.seq))

    def cancel(self, token: Token, now: float) -> bool:
        """The consumer gave up on ``token`` (its request was aborted). A
        ``HOST`` posting that has not started by ``now`` is dropped: it ends,
        failed, at ``now``. Anything else runs to its end as planned (a DMA
        or a started RDMA read cannot be recalled). Returns whether it was
        dropped. O(log n).

        Raises:
            UnknownStreamError, UnknownTokenError: as for :meth:`end_of`.
        """
        w = self._live.get(token)
        if w is None:
            self.end_of(token)
            return False
        if self.specs[token.stream].kind is not StreamKind.HOST or w.start <= now:
            return False
        nw = attrs.evolve(w, start=now, end=now, failed=True)
        self._live[token] = nw
        self._n += 1
        heapq.heappush(self._heap, (now, self._n, token))
        return True

    def next_time(self) -> float | None:
        """End time of the earliest work not yet reported, or ``None``. O(1) amortised."""
        heap = self._heap
        while heap and (heap[0][2] not in self._live or self._live[heap[0][2]].end != heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def advance(self, now: float) -> list[Work]:
        """Move simulated time to ``now`` (never backwards) and report every
        work that ended by then, in end-time order (ties: submission order),
        to the pool (``fail`` for failed work, else ``complete``). Returns
        those works. O(k log n) for k completions.
        """
        self.now = max(self.now, now)
        out: list[Work] = []
        heap = self._heap
        live = self._live
        pool = self._pool
        while heap and heap[0][0] <= self.now:
            end, _, token = heapq.heappop(heap)
            w = live.get(token)
            if w is None or w.end != end:
                continue  # superseded by a cancel
            del live[token]
            self.last_end = max(self.last_end, end)
            if pool is not None:
                (pool.fail if w.failed else pool.complete)(token)
            out.append(w)
        return out

    @property
    def pending(self) -> int:
        """Works submitted and not yet reported ended. O(1)."""
        return len(self._live)
