"""The race oracle: an independent happens-before checker over block accesses.

:class:`RaceOracle` keeps a vector clock per stream (what its work is ordered
after) and a *shadow* per block (the last write and the reads since), checks
every access against the shadow (RAW, WAR, WAW) and records it. The only
synchronisations are :meth:`~RaceOracle.record`'s waits (enqueued stream
waits on a ``DEVICE`` stream, host waits before one posting on a ``HOST``
engine), :meth:`~RaceOracle.stream_wait` and :meth:`~RaceOracle.complete`
(the host saw a token end). It shares no code with the pool's fence
computation, which it judges; see ``docs/race-oracle.md``.

Source: PyTorch's CUDA stream sanitizer (``torch/cuda/_sanitizer.py``:
``StreamSynchronizations``, ``_TensorsAccessed``, ``UnsynchronizedAccessError``),
adapted: block ids for data pointers, tokens for kernels and events; a host
engine's clock component is a set of seqs (interval with holes) as its work
completes out of order; host-observed completion orders later work; a write
is checked against the last write even when reads came since; and two
accesses race only when neither is ordered after the other, so an access
reported late (the block-table read made at free time) is judged by the
order of the work, not of the calls.

>>> from blockpool.core.hazards import AccessKind, StreamKind, Token
>>> oracle = RaceOracle({"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE})
>>> e1, load = Token("compute", 1), Token("h2d", 1)
>>> oracle.record(e1); oracle.tag(e1, [7], AccessKind.READ, "forward")
[]
>>> oracle.record(load)             # the load forgot to wait on compute:1
>>> [str(v) for v in oracle.tag(load, [7], AccessKind.WRITE, "load")]
['WAR race on block 7: load (write) by h2d:1 is not ordered after forward (read) by compute:1']
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping

import attrs

from blockpool.core.errors import BlockPoolError, InvalidArgumentError, UnknownStreamError, UnknownTokenError
from blockpool.core.hazards import AccessKind, StreamKind, Token

__all__ = [
    "RaceOracle",
    "RaceViolation",
    "RecordOrderError",
    "UnrecordedTokenError",
    "block_ranges",
    "describe_group",
    "group_by_access_pair",
]

_DEVICE, _HOST = StreamKind.DEVICE, StreamKind.HOST
_READ, _WRITE = AccessKind.READ, AccessKind.WRITE
_NONE: frozenset[int] = frozenset()


class UnrecordedTokenError(UnknownTokenError):
    """A token the oracle never saw recorded (or, for an access, one that
    ended so long ago that its clock was dropped: see ``retain``)."""


class RecordOrderError(BlockPoolError, ValueError):
    """A token recorded twice, or out of issue order on its stream."""


@attrs.frozen(slots=True)
class RaceViolation:
    """Two accesses to one block, at least one a write, neither ordered
    after the other. ``prior_*`` is the access found in the block's shadow,
    the rest the access being checked.

    Attributes:
        block_id: The block.
        hazard: ``"RAW"``, ``"WAR"`` or ``"WAW"`` (named current-after-prior).
        prior_token, prior_kind, prior_what: The earlier-recorded access.
        token, kind, what: The access that raced with it.
    """

    block_id: int
    hazard: str = attrs.field()
    prior_token: Token
    prior_kind: AccessKind
    prior_what: str
    token: Token
    kind: AccessKind
    what: str

    @hazard.validator
    def _check_hazard(self, _: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
        if value not in ("RAW", "WAR", "WAW"):
            raise InvalidArgumentError(f"hazard must be 'RAW', 'WAR' or 'WAW', got {value!r}")

    def __str__(self) -> str:
        return describe_group(self, (self.block_id,))

    @property
    def access_pair(self) -> tuple[str, Token, AccessKind, str, Token, AccessKind, str]:
        """What makes two violations the same race on different blocks: the
        hazard and both accesses (token, kind, agent), without the block.
        O(1)."""
        return (
            self.hazard,
            self.prior_token,
            self.prior_kind,
            self.prior_what,
            self.token,
            self.kind,
            self.what,
        )


def block_ranges(block_ids: Iterable[int]) -> str:
    """Block ids as sorted runs: ``"1-4, 7"`` (duplicates dropped).
    O(n log n).

    >>> block_ranges([4, 2, 3, 1, 7, 9, 10])
    '1-4, 7, 9-10'
    """
    ids = sorted(set(block_ids))
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


def describe_group(v: RaceViolation, block_ids: Iterable[int]) -> str:
    """The message of ``v``'s access pair (:attr:`RaceViolation.access_pair`)
    over ``block_ids``: ``"WAR race on blocks 1-4: load (write) by h2d:1 is
    not ordered after forward (read) by compute:1"`` (``block 1`` for one
    block). O(n log n).
    """
    ids = sorted(set(block_ids))
    where = f"block {ids[0]}" if len(ids) == 1 else f"blocks {block_ranges(ids)}"
    return (
        f"{v.hazard} race on {where}: {v.what} ({v.kind.value}) by {v.token} is not ordered after "
        f"{v.prior_what} ({v.prior_kind.value}) by {v.prior_token}"
    )


def group_by_access_pair(
    violations: Iterable[RaceViolation], key: Callable[[RaceViolation], object] | None = None
) -> list[tuple[RaceViolation, list[int]]]:
    """Violations of the same access pair (:attr:`RaceViolation.access_pair`,
    and ``key(v)`` when given: e.g. where each access was made) as one
    group: its first violation and the block ids of all of them, in the
    order found; the groups in the order their first violation was found.
    O(len(violations)).

    >>> from blockpool.core.hazards import AccessKind, Token
    >>> e1, load = Token("compute", 1), Token("h2d", 1)
    >>> vs = [RaceViolation(b, "WAR", e1, AccessKind.READ, "forward", load, AccessKind.WRITE, "load") for b in (1, 2, 3, 4)]
    >>> [describe_group(v, ids) for v, ids in group_by_access_pair(vs)]
    ['WAR race on blocks 1-4: load (write) by h2d:1 is not ordered after forward (read) by compute:1']
    """
    groups: dict[object, tuple[RaceViolation, list[int]]] = {}
    for v in violations:
        k = v.access_pair if key is None else (v.access_pair, key(v))
        g = groups.get(k)
        if g is None:
            groups[k] = (v, [v.block_id])
        else:
            g[1].append(v.block_id)
    return list(groups.values())


class _HostPart:
    """Immutable clock component of one host engine: covers every seq
    ``<= upto`` not in ``excl``, and every seq in ``extra`` (all ``> upto``)."""

    __slots__ = ("excl", "extra", "upto")

    def __init__(self, upto: int, excl: frozenset[int] = _NONE, extra: frozenset[int] = _NONE) -> None:
        self.upto, self.excl, self.extra = upto, excl, extra

    def covers(self, seq: int) -> bool:
        return (seq <= self.upto and seq not in self.excl) or seq in self.extra

    def join(self, other: _HostPart) -> _HostPart:
        """Union of the covered seqs. O(|excl| + |extra|) of both."""
        a, b = (self, other) if self.upto >= other.upto else (other, self)
        excl = frozenset(s for s in a.excl if not b.covers(s)) if a.excl else _NONE
        extra = frozenset(s for s in a.extra | b.extra if s > a.upto) if (a.extra or b.extra) else _NONE
        return _HostPart(a.upto, excl, extra)


class _Clock:
    """Vector clock: ``dev[s] = n`` covers device stream ``s`` up to ``n``;
    ``host[e]`` covers a set of seqs of host engine ``e``. Mutated only while
    being built (``merge``/``add``), then shared and never changed."""

    __slots__ = ("dev", "host")

    def __init__(self) -> None:
        self.dev: dict[str, int] = {}
        self.host: dict[str, _HostPart] = {}

    def covers(self, t: Token) -> bool:
        """Whether this clock is ordered after ``t``. O(1): a stream name is
        either a device stream or a host engine, never both."""
        n = self.dev.get(t.stream)
        if n is not None:
            return t.seq <= n
        part = self.host.get(t.stream)
        return part is not None and part.covers(t.seq)

    def merge(self, c: _Clock) -> None:
        dev, host = self.dev, self.host
        for s, n in c.dev.items():
            if dev.get(s, 0) < n:
                dev[s] = n
        for e, part in c.host.items():
            cur = host.get(e)
            host[e] = part if cur is None or cur is part else cur.join(part)

    def add(self, t: Token, kind: StreamKind) -> None:
        if kind is _DEVICE:
            if self.dev.get(t.stream, 0) < t.seq:
                self.dev[t.stream] = t.seq
        else:
            single = _HostPart(0, _NONE, frozenset((t.seq,)))
            cur = self.host.get(t.stream)
            self.host[t.stream] = single if cur is None else cur.join(single)


_EMPTY = _Clock()


class _Stream:
    __slots__ = ("clocks", "ended", "kind", "last", "live", "name", "standing")

    def __init__(self, name: str, kind: StreamKind) -> None:
        self.name, self.kind = name, kind
        self.last = 0  # newest recorded seq
        self.clocks: dict[int, _Clock] = {}  # recorded seq -> clock, in seq order
        self.standing = _EMPTY  # DEVICE: what the queue has waited on
        self.live: set[int] = set()  # HOST: recorded seqs not known to have ended
        self.ended: collections.deque[int] = collections.deque()  # HOST: eviction order


class _Shadow:
    __slots__ = ("others", "readers", "writer")

    def __init__(self) -> None:
        self.writer: tuple[Token, str] | None = None
        self.readers: dict[Token, str] = {}  # mutually unordered reads since the write
        # Earlier writes the current one raced with (not ordered before it):
        # a later access must still be checked against them.
        self.others: dict[Token, str] = {}


class RaceOracle:
    """Happens-before checker over block accesses (see the module docstring).

    Args:
        streams: ``{name: StreamKind}`` to register.
        retain: Clocks kept per stream for tokens known to have ended (an
            access by such a token, e.g. the block-table read made when a
            block is freed after its last step ended, needs its clock).
            Tokens not known to have ended always keep theirs.

    Raises:
        InvalidArgumentError: a bad stream spec or ``retain`` not an int ``>= 0``.

    Cost: ``record``, ``stream_wait``, ``complete``: O(#streams + in-flight
    host tokens). ``access``: that per block id (a shadow holds one write and
    a few mutually unordered reads). Memory: O(blocks touched + #streams *
    retain). Not thread-safe: feed it from one thread.
    """

    def __init__(self, streams: Mapping[str, StreamKind] | None = None, *, retain: int = 4096) -> None:
        if not isinstance(retain, int) or isinstance(retain, bool) or retain < 0:
            raise InvalidArgumentError(f"retain must be an int >= 0, got {retain!r}")
        self.retain = retain
        self._streams: dict[str, _Stream] = {}
        self._done: dict[str, int] = {}  # device stream -> highest seq known ended
        self._host_clock: _Clock | None = None  # cache: what the host knows ended
        self._shadows: dict[int, _Shadow] = {}
        self.violations: list[RaceViolation] = []
        self.num_accesses = 0
        for name, kind in dict(streams or {}).items():
            self.add_stream(name, kind)

    @property
    def streams(self) -> dict[str, StreamKind]:
        """Registered streams and their kinds. O(#streams)."""
        return {n: s.kind for n, s in self._streams.items()}

    def add_stream(self, name: str, kind: StreamKind) -> None:
        """Register a stream (idempotent for the same kind). O(1).

        Raises:
            InvalidArgumentError: empty name, bad kind, or the name is already
                registered with the other kind.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"stream name must be a non-empty str, got {name!r}")
        if not isinstance(kind, StreamKind):
            raise InvalidArgumentError(f"kind must be a StreamKind, got {kind!r}")
        cur = self._streams.setdefault(name, _Stream(name, kind))
        if cur.kind is not kind:
            raise InvalidArgumentError(f"stream {name!r} is already registered as {cur.kind.value}")

    # -- validation (raises before any change) -------------------------------

    def _stream(self, name: object) -> _Stream:
        st = self._streams.get(name) if isinstance(name, str) else None
        if st is None:
            raise UnknownStreamError(f"unknown stream {name!r}; registered: {sorted(self._streams)}")
        return st

    def _recorded(self, token: object, *, need_clock: bool = False) -> tuple[_Stream, _Clock | None]:
        """``token``'s stream and clock (``None``: ended, clock dropped)."""
        if not isinstance(token, Token):
            raise InvalidArgumentError(f"expected a Token, got {token!r}")
        st = self._stream(token.stream)
        c = st.clocks.get(token.seq)
        if c is None and (token.seq > st.last or need_clock or not self._ended(st, token.seq)):
            raise UnrecordedTokenError(
                f"token {token} was never recorded (last on {st.name!r}: {st.last})"
                + (f", or it ended and its clock was dropped (retain={self.retain})" if need_clock else "")
            )
        return st, c

    def _ended(self, st: _Stream, seq: int) -> bool:
        if st.kind is _DEVICE:
            return seq <= self._done.get(st.name, 0)
        return seq <= st.last and seq not in st.live  # a seq never recorded counts as ended

    # -- clocks ----------------------------------------------------------------

    def _host_knows(self) -> _Clock:
        """What the host knows ended (merged into every new record). Cached."""
        c = self._host_clock
        if c is None:
            c = self._host_clock = _Clock()
            c.dev = dict(self._done)
            for s in self._streams.values():
                if s.kind is _HOST and s.last:
                    c.host[s.name] = _HostPart(s.last, frozenset(s.live) if s.live else _NONE)
        return c

    def _new_clock(self, st: _Stream, token: Token, after: Iterable[Token]) -> _Clock:
        waits = [(u, *self._recorded(u)) for u in after]  # validate all first
        c = _Clock()
        c.merge(self._host_knows())
        c.merge(st.standing)
        for u, ust, uc in waits:
            if uc is not None:
                c.merge(uc)
            c.add(u, ust.kind)
        c.add(token, st.kind)
        return c

    def record(self, token: Token, after: Iterable[Token] = ()) -> None:
        """Record that the work of ``token`` is enqueued on ``token.stream``
        after waiting on ``after`` (enqueued stream waits on a ``DEVICE``
        stream, which persist; host waits before this posting only on a
        ``HOST`` engine). It also follows everything the host knew had ended.
        O(#streams + in-flight host tokens + len(after)).

        Raises:
            InvalidArgumentError: ``token`` or an ``after`` item is not a Token.
            UnknownStreamError: a stream that was never registered.
            RecordOrderError: ``token``, or a newer token of its stream, was
                recorded already.
            UnrecordedTokenError: an ``after`` token was never recorded.
        """
        if not isinstance(token, Token):
            raise InvalidArgumentError(f"expected a Token, got {token!r}")
        st = self._stream(token.stream)
        if token.seq <= st.last:
            raise RecordOrderError(
                f"cannot record {token}: {st.name}:{st.last} is recorded already "
                "(record each token once, in issue order)"
            )
        clock = self._new_clock(st, token, after)
        st.last = token.seq
        st.clocks[token.seq] = clock
        if st.kind is _DEVICE:
            st.standing = clock
        else:
            st.live.add(token.seq)
            self._host_clock = None
        self._evict(st)

    def stream_wait(self, stream: str, token: Token) -> None:
        """Enqueue a wait of ``DEVICE`` stream ``stream`` on ``token``: its
        later work is ordered after ``token`` and everything ``token`` is
        ordered after. O(#streams + in-flight host tokens).

        Raises:
            UnknownStreamError: ``stream`` (or ``token``'s stream) is unknown.
            InvalidArgumentError: ``stream`` is a ``HOST`` engine (its waits are
                host waits: ``record(token, after=...)``), or ``token`` is not a Token.
            UnrecordedTokenError: ``token`` was never recorded.
        """
        st = self._stream(stream)
        if st.kind is not _DEVICE:
            raise InvalidArgumentError(f"{stream!r} is a host engine: it cannot enqueue a stream wait")
        ust, uc = self._recorded(token)
        c = _Clock()
        c.merge(st.standing)
        if uc is not None:
            c.merge(uc)
        c.add(token, ust.kind)
        st.standing = c

    def complete(self, token: Token, failed: bool = False) -> None:
        """The host observed that ``token`` ended: work recorded afterwards,
        on any stream, is ordered after it and, when it completed, after
        everything it was ordered after. A *failed* token (``failed=True``:
        a failed or abandoned transfer) may have ended before its own waits,
        so only the token itself ends, plus, on a ``DEVICE`` stream, the
        earlier tokens (which completed normally, in order). On a ``HOST``
        engine only ``token`` ends. Idempotent.
        O(#streams + in-flight host tokens).

        Raises:
            InvalidArgumentError: ``token`` is not a Token.
            UnknownStreamError: its stream was never registered.
            UnrecordedTokenError: it was never recorded.
        """
        if not isinstance(token, Token):
            raise InvalidArgumentError(f"expected a Token, got {token!r}")
        st = self._stream(token.stream)
        if token.seq > st.last:
            raise UnrecordedTokenError(f"token {token} was never recorded (last on {st.name!r}: {st.last})")
        if self._ended(st, token.seq):
            return
        if st.kind is _DEVICE:  # a seq never recorded ends the ones before it
            upto = token.seq - 1 if failed else token.seq
            c = next((st.clocks[k] for k in reversed(st.clocks) if k <= upto), None)
            self._done[st.name] = token.seq
        else:
            c = None if failed else st.clocks.get(token.seq)
            st.live.discard(token.seq)
            st.ended.append(token.seq)
        if c is not None:
            for s, n in c.dev.items():
                if self._done.get(s, 0) < n:
                    self._done[s] = n
            for e, part in c.host.items():
                est = self._streams[e]
                for seq in [q for q in est.live if part.covers(q)]:
                    est.live.discard(seq)
                    est.ended.append(seq)
        self._host_clock = None

    def _evict(self, st: _Stream) -> None:
        clocks = st.clocks
        if st.kind is _DEVICE:
            mark = self._done.get(st.name, 0)
            while len(clocks) > self.retain and next(iter(clocks)) <= mark:
                del clocks[next(iter(clocks))]
        else:
            while len(clocks) > self.retain and st.ended:
                clocks.pop(st.ended.popleft(), None)

    # -- accesses ----------------------------------------------------------------

    def tag(self, token: Token, block_ids: Iterable[int], kind: AccessKind, what: str) -> list[RaceViolation]:
        """Check, then record, that the recorded work of ``token`` reads or
        writes ``block_ids``; ``what`` names the agent (``"forward"``,
        ``"cow-copy"``, ``"load"``, ``"store"``...). A read is checked against
        the block's last write (RAW), a write against it (WAW) and the reads
        since (WAR); two accesses race when neither is ordered after the
        other (so an access reported late is judged by the order of the
        work, not of the calls). Then a write replaces the shadow, a read
        joins it. New violations are returned and appended to
        :attr:`violations`. O(len(block_ids) * (#streams + in-flight host tokens)).

        Raises:
            InvalidArgumentError: not a Token / AccessKind / str, or a block
                id that is not an int ``>= 0``.
            UnknownStreamError: the token's stream was never registered.
            UnrecordedTokenError: ``token`` was never recorded (or ended more
                than ``retain`` tokens ago and its clock was dropped).
        """
        _, clock = self._recorded(token, need_clock=True)
        ids = _check_args(block_ids, kind, what)
        out: list[RaceViolation] = []
        for bid in ids:
            self._check_block(bid, token, clock, kind, what, out, True)  # type: ignore[arg-type]
        self.num_accesses += len(ids)
        self.violations.extend(out)
        return out

    def check_access(
        self,
        stream: str,
        block_ids: Iterable[int],
        kind: AccessKind,
        what: str = "access",
        after: Iterable[Token] = (),
    ) -> list[RaceViolation]:
        """Dry run: the violations that an access by new work on ``stream``
        (the stream's next seq), enqueued now after ``after``, would raise.
        Records nothing. Judges a fence: none with it, some without any one
        of its tokens. O(len(block_ids) * (#streams + in-flight host tokens)).

        Raises:
            The errors of :meth:`record` (for ``after``) and :meth:`access`.
        """
        st = self._stream(stream)
        token = Token(st.name, st.last + 1, st.kind)
        clock = self._new_clock(st, token, after)
        out: list[RaceViolation] = []
        for bid in _check_args(block_ids, kind, what):
            self._check_block(bid, token, clock, kind, what, out, False)
        return out

    def _before(self, t: Token, p: Token) -> bool:
        """Whether ``t`` happens before ``p`` (``p``'s clock covers ``t``)."""
        c = self._streams[p.stream].clocks.get(p.seq)
        return c is not None and c.covers(t)

    def _check_block(
        self, bid: int, t: Token, c: _Clock, kind: AccessKind, what: str, out: list[RaceViolation], rec: bool
    ) -> None:
        sh = self._shadows.get(bid)
        if sh is None:
            if not rec:
                return
            sh = self._shadows[bid] = _Shadow()
        write = kind is _WRITE
        late = False  # t happens before the shadow's write: an access reported late
        w = sh.writer
        if w is not None and w[0] != t and not c.covers(w[0]):
            late = self._before(t, w[0])
            if not late:
                out.append(RaceViolation(bid, "WAW" if write else "RAW", w[0], _WRITE, w[1], t, kind, what))
        others = sh.others
        for o, owhat in others.items():
            if o != t and not c.covers(o) and not self._before(t, o):
                out.append(RaceViolation(bid, "WAW" if write else "RAW", o, _WRITE, owhat, t, kind, what))
        readers = sh.readers
        if write:
            racy: dict[Token, str] = {}
            for r, rwhat in readers.items():
                if r != t and not c.covers(r) and not self._before(t, r):
                    out.append(RaceViolation(bid, "WAR", r, _READ, rwhat, t, kind, what))
                    racy[r] = rwhat
            if rec and not late:
                # Accesses the write raced with stay in the shadow: they are
                # not ordered before it, so a later access ordered after it
                # may still race with them, and must be reported too.
                prior = {
                    o: ow for o, ow in others.items() if o != t and not c.covers(o) and not self._before(t, o)
                }
                if w is not None and w[0] != t and not c.covers(w[0]):
                    prior[w[0]] = w[1]
                sh.writer, sh.readers, sh.others = (t, what), racy, prior
            return
        if not rec or late or t in readers or (w is not None and w[0] == t):
            return  # nothing to add: t's own write stands for this read
        for r in list(readers):
            if c.covers(r):
                del readers[r]  # whatever is ordered after t is ordered after r
            elif self._before(t, r):
                return  # whatever is ordered after r is ordered after t
        readers[t] = what

    def report(self) -> str:
        """Every violation found so far, one per line (empty when none). O(v)."""
        return "\n".join(map(str, self.violations))


def _check_args(block_ids: Iterable[int], kind: object, what: object) -> list[int]:
    if not isinstance(kind, AccessKind):
        raise InvalidArgumentError(f"kind must be an AccessKind, got {kind!r}")
    if not isinstance(what, str):
        raise InvalidArgumentError(f"what must be a str, got {what!r}")
    ids = list(block_ids)
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise InvalidArgumentError(f"block ids must be ints >= 0, got {b!r}")
    return ids
