"""Streams, token issue, completion marks and vector clocks.

:class:`HazardTracker` is the part of the pool that knows about time: which
tokens exist, which have ended, and what each stream is already ordered
after. It knows nothing about blocks; the pool feeds it candidate tokens read
from block shadows and gets back the reduced fence.

Clocks follow the vector-clock construction of PyTorch's CUDA stream
sanitizer (``torch/cuda/_sanitizer.py``, ``StreamSynchronizations``), with one
change for host engines: a ``DEVICE`` stream component is a high-water mark
(in-order queue), while ``HOST`` tokens are kept as a set, because waiting on
``(rdma, 7)`` says nothing about ``(rdma, 6)``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sortedcontainers import SortedSet

from blockpool.core.errors import (
    ForeignTokenError,
    InvalidArgumentError,
    InvariantError,
    UnknownStreamError,
    UnknownTokenError,
)
from blockpool.core.hazards import StreamKind, Token

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgInt, ArgStr, ArgStreamKind

__all__ = ["HazardTracker", "StreamState", "VectorClock"]

_DEVICE = StreamKind.DEVICE
_HOST = StreamKind.HOST


class VectorClock:
    """What a stream (or a token's issue point) is ordered after.

    ``dev[s] = n`` means ordered after every token of device stream ``s`` up
    to ``n``; ``host`` holds individual host-engine tokens.
    """

    __slots__ = ("dev", "host", "serial")

    def __init__(self, dev: dict[str, int] | None = None, host: set[Token] | None = None):
        self.dev: dict[str, int] = dev if dev is not None else {}
        self.host: set[Token] = host if host is not None else set()
        # A token's clock: its place in the tracker's issue order
        # (HazardTracker.issued); 0 for a stream's standing clock.
        self.serial = 0

    def covers(self, t: Token) -> bool:
        """True when this clock is ordered after ``t``. O(1)."""
        if t.kind is _HOST:
            return t in self.host
        return self.dev.get(t.stream, 0) >= t.seq

    def add(self, t: Token) -> None:
        """Order this clock after ``t`` (only ``t``). O(1)."""
        if t.kind is _HOST:
            self.host.add(t)
        elif self.dev.get(t.stream, 0) < t.seq:
            self.dev[t.stream] = t.seq

    def join(self, other: VectorClock) -> None:
        """``self := self ⊔ other``. O(len(other))."""
        dev = self.dev
        for s, n in other.dev.items():
            if dev.get(s, 0) < n:
                dev[s] = n
        if other.host:
            self.host |= other.host

    def copy(self) -> VectorClock:
        """An independent copy (its own dict and set). O(len(self))."""
        return VectorClock(dict(self.dev), set(self.host))

    def __repr__(self) -> str:
        return f"VectorClock(dev={self.dev!r}, host={sorted(map(str, self.host))!r})"


class StreamState:
    """Per-stream bookkeeping: counter, completion mark, clocks."""

    __slots__ = (
        "clock",
        "done",
        "failed",
        "failed_seqs",
        "kind",
        "last_seq",
        "last_token",
        "last_write",
        "mark",
        "name",
        "token_clocks",
    )

    def __init__(self, name: str, kind: StreamKind):
        self.name = name
        self.kind = kind
        self.last_seq = 0
        # The token of last_seq (None before the first): a free is tagged
        # with it, once per free call, so it is kept rather than rebuilt.
        self.last_token: Token | None = None
        # The newest seq recorded as a write (HazardTracker.wrote): no token
        # above it wrote, so a read waits on nothing of this stream once
        # every token up to it has ended or is ordered before the reader.
        self.last_write = 0
        # Every token with seq <= mark has ended.
        self.mark = 0
        # HOST only: ended seqs above the mark (out-of-order completions).
        self.done: SortedSet = SortedSet()
        # DEVICE: the standing clock (what this queue has been ordered after).
        # HOST: stays empty; each posting carries its own wait in its token.
        self.clock = VectorClock()
        # Issue-time clock of every token not yet known to have ended.
        self.token_clocks: dict[int, VectorClock] = {}
        # Failed seqs not yet forgotten (for stats and explain()).
        self.failed = 0
        # Seqs reported failed (one entry per failure report; failures are
        # rare): a write recorded after its token failed did not happen.
        self.failed_seqs: set[int] = set()

    def is_ended(self, seq: int) -> bool:
        """Whether this stream's token ``seq`` has ended (completed or failed). O(log n)."""
        return seq <= self.mark or (self.kind is _HOST and seq in self.done)

    def end(self, seq: int) -> list[int]:
        """Mark ``seq`` ended; returns the seqs that newly ended. O(k log n)."""
        if self.is_ended(seq):
            return []
        if self.kind is _DEVICE:
            newly = list(range(self.mark + 1, seq + 1))
            self.mark = seq
        else:
            newly = [seq]
            self.done.add(seq)
            done = self.done
            while done and done[0] == self.mark + 1:
                self.mark = done.pop(0)
        clocks = self.token_clocks
        for s in newly:
            clocks.pop(s, None)
        return newly


class HazardTracker:
    """Token issue, completion and fence reduction for one pool.

    ``busy`` is the set of stream names with a token issued above the
    stream's mark (one that may still run), kept by :meth:`issue` and
    :meth:`end`; with each stream's ``last_write``
    (:meth:`wrote`) it lets a fence skip its scan when nothing in flight
    could be in it (:func:`blockpool.core.shadows.fence_of`).

    Thread safety: :meth:`submit` may be called from any thread (it appends
    to a ``collections.deque``, atomic in CPython); everything else runs on
    the pool's (scheduler's) thread, and completions are applied by
    :meth:`drain`.
    """

    __slots__ = ("_hosts", "_inbox", "busy", "issued", "pool_id", "streams")

    def __init__(self, pool_id: ArgInt = 0) -> None:
        """A tracker with no stream, stamping ``pool_id`` on its tokens.

        Raises:
            InvalidArgumentError: ``pool_id`` is not an int ``>= 0``.
        """
        if not isinstance(pool_id, int) or isinstance(pool_id, bool) or pool_id < 0:
            raise InvalidArgumentError(f"pool_id must be an int >= 0, got {pool_id!r}")
        # Identity stamped on every token issued here (Token.pool); 0: unbound.
        self.pool_id: int = pool_id
        self.streams: dict[str, StreamState] = {}
        self._inbox: collections.deque[tuple[Token, bool]] = collections.deque()
        self._hosts: list[StreamState] = []  # the HOST engines, for host_pending()
        # Names of the streams with a token that may not have ended (issued
        # above the stream's mark): a fence has nothing to wait on from any
        # other stream (fence_of's fast path). Kept by issue and end.
        self.busy: set[str] = set()
        self.issued = 0  # tokens issued so far, all streams: the issue order

    # -- streams and tokens ------------------------------------------------

    def add_stream(self, name: ArgStr, kind: ArgStreamKind) -> None:
        """Register stream ``name`` of ``kind`` (again with the same kind: nothing). O(1).

        Raises:
            InvalidArgumentError: ``name`` is not a non-empty str, ``kind``
                is not a :class:`StreamKind`, or ``name`` is registered with
                another kind.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"stream name must be a non-empty str, got {name!r}")
        if not isinstance(kind, StreamKind):
            raise InvalidArgumentError(f"kind must be a StreamKind, got {kind!r}")
        cur = self.streams.get(name)
        if cur is not None:
            if cur.kind is not kind:
                raise InvalidArgumentError(f"stream {name!r} is already registered as {cur.kind.value}")
            return
        self.streams[name] = st = StreamState(name, kind)
        if kind is _HOST:
            self._hosts.append(st)

    def state(self, stream: ArgStr) -> StreamState:
        """The state of the stream named ``stream``. O(1).

        Raises:
            InvalidArgumentError: ``stream`` is not hashable.
            UnknownStreamError: no stream of that name is registered.
        """
        try:
            st = self.streams.get(stream)  # type: ignore[call-overload]
        except TypeError:
            raise InvalidArgumentError(f"a stream is named by a str, got {stream!r}") from None
        if st is None:
            raise UnknownStreamError(f"unknown stream {stream!r}; registered: {sorted(self.streams)}")
        return st

    def issue(self, stream: ArgStr, after: Iterable[Token] = ()) -> Token:
        """Issue the next token of ``stream``, ordered after the stream's
        standing clock and after ``after`` (the fence the access waited on).
        O(#streams + len(after))."""
        st = self.state(stream)
        tok = Token(st.name, st.last_seq + 1, st.kind, self.pool_id)  # checked before any state changes
        st.last_seq = tok.seq
        st.last_token = tok
        self.busy.add(st.name)
        clock = st.clock.copy()
        for t in after:
            tc = self.streams[t.stream].token_clocks.get(t.seq)
            if tc is not None:
                clock.join(tc)
            clock.add(t)
        clock.add(tok)
        self.issued += 1
        clock.serial = self.issued
        if st.kind is _DEVICE:
            st.clock.dev[st.name] = tok.seq
        st.token_clocks[tok.seq] = clock
        return tok

    def unorderable(self, token: Token) -> str | None:
        """Why :meth:`order_after` cannot order ``token`` after more
        tokens exactly, or ``None`` when it can: ``token`` must be a
        ``DEVICE`` token that has not ended, the newest of its stream, and
        nothing may be ordered after it yet (no stream or token clock
        covers it). Otherwise the tokens already ordered after it would
        have to learn the new order too (and a token that waited on it
        would make a cycle). O(#streams + tokens not ended)."""
        st = self.streams[token.stream]
        if token.kind is not _DEVICE:
            return f"{token} is not a token of a DEVICE stream"
        tc = st.token_clocks.get(token.seq)
        if tc is None:
            return f"{token} has ended"
        if token.seq != st.last_seq:
            return f"{st.name}:{st.last_seq} was issued after {token}"
        for other in self.streams.values():
            if other is not st and other.clock.covers(token):
                return f"stream {other.name!r} already waited on {token}"
            for seq, c in other.token_clocks.items():
                if c is not tc and c.covers(token):
                    return f"{other.name}:{seq} is already ordered after {token}"
        return None

    def order_after(self, token: Token) -> None:
        """``token`` (issued on a DEVICE stream, its event not recorded
        yet) is ordered after everything its stream has waited on so far
        (:meth:`wait`, the waits recorded since its issue included): its
        issue-time clock joins the stream's standing clock, as if it were
        issued now (its work runs after every wait enqueued on the stream
        before it). The caller checked :meth:`unorderable` is ``None``.
        Counts as an issue for :meth:`later_than`. O(#streams + host
        tokens in the clock)."""
        st = self.streams[token.stream]
        st.token_clocks[token.seq].join(st.clock)
        self.issued += 1

    def later_than(self, token: Token) -> Callable[[Token], bool] | None:
        """A test ``later(t)``: whether token ``t`` is known to be ordered
        after ``token``: a later token of ``token``'s own device stream, or
        one whose issue-time clock covers ``token`` (it waited on it; a
        token of another stream that has ended is not known to be, its clock
        is gone). ``None`` when no token was issued (nor ordered anew,
        :meth:`order_after`) since ``token``: nothing can be ordered after
        it, the usual case, O(1). The pool refuses a write recorded after
        an access ordered after it (``PoolBase._check_write_order``).
        O(1) per test."""
        tc = self.streams[token.stream].token_clocks.get(token.seq)
        if tc is None or tc.serial == self.issued:
            return None
        streams = self.streams
        own = token.stream if token.kind is _DEVICE else None
        seq = token.seq

        def later(t: Token) -> bool:
            if t.stream == own:
                return t.seq > seq
            if t.seq == seq and t.stream == token.stream:
                return False  # the token itself (a host engine's: its clock covers itself)
            c = streams[t.stream].token_clocks.get(t.seq)
            return c is not None and c.covers(token)

        return later

    def wrote(self, token: Token) -> None:
        """Note that ``token`` (issued here) was recorded as a write: its
        stream's ``last_write`` (a fence's fast path for reads). O(1)."""
        st = self.streams[token.stream]
        st.last_write = max(st.last_write, token.seq)

    def validate(self, token: object) -> StreamState:
        """The state of ``token``'s stream; raises if the pool never issued it
        (another pool's token: :class:`ForeignTokenError`)."""
        if not isinstance(token, Token):
            raise InvalidArgumentError(f"expected a Token, got {token!r}")
        if token.pool and token.pool != self.pool_id:
            raise ForeignTokenError(
                f"token {token} was issued by another pool (pool id {token.pool}, "
                f"this pool's is {self.pool_id})"
            )
        st = self.state(token.stream)
        if token.kind is not st.kind:
            raise InvalidArgumentError(
                f"token {token} is marked {token.kind.value} but stream {st.name!r} is a "
                f"{st.kind.value} stream (rebuild tokens with their kind: Token.from_wire)"
            )
        if token.seq > st.last_seq:
            raise UnknownTokenError(
                f"token {token} was never issued (last issued on {st.name!r}: {st.last_seq})"
            )
        return st

    def is_ended(self, token: Token) -> bool:
        """Whether ``token`` (of a registered stream) has ended. O(log n)."""
        st = self.streams[token.stream]
        return token.seq <= st.mark or (st.kind is _HOST and token.seq in st.done)

    def has_failed(self, token: Token) -> bool:
        """Whether a failure (``fail``, ``abandon``) was applied for ``token``. O(1)."""
        return token.seq in self.streams[token.stream].failed_seqs

    def completion_ends(self, token: Token) -> set[Token]:
        """The HOST-engine tokens, not ended yet, that ``token``'s
        completion would end (as :meth:`end` with ``failed=False`` would):
        ``token`` itself when it is a host engine's, and the host tokens of
        its issue-time clock (what it waited on). Empty when ``token`` has
        ended. Changes nothing. O(host tokens in its clock)."""
        st = self.streams[token.stream]
        if st.is_ended(token.seq):
            return set()
        out: set[Token] = set()
        if st.kind is _HOST:
            out.add(token)
        clock = st.token_clocks.get(token.seq)
        if clock is not None:
            for h in clock.host:
                if not self.is_ended(h):
                    out.add(h)
        return out

    def host_pending(self) -> bool:
        """Whether some HOST-engine token may not have ended (one was issued
        above its engine's mark). False lets the pool skip looking for host
        accesses in shadows altogether. O(#host engines)."""
        for st in self._hosts:
            if st.last_seq > st.mark:
                return True
        return False

    def _check(self, writers: Iterable[Token | None]) -> None:
        """Assert: ``busy`` names exactly the streams with a token issued
        above the mark; marks and ``last_write`` never pass ``last_seq``;
        every writer in ``writers`` (the blocks' shadows and the pending
        writes' saved ones) is a token at or below its stream's
        ``last_write`` (``fence_of``'s fast path relies on it). O(#streams
        + len(writers)).

        Raises:
            InvariantError: the first broken invariant.
        """
        busy = {n for n, s in self.streams.items() if s.last_seq > s.mark}
        if busy != self.busy:
            raise InvariantError(f"busy streams {sorted(self.busy)}, expected {sorted(busy)}")
        for n, s in self.streams.items():
            if not s.mark <= s.last_seq or not s.last_write <= s.last_seq:
                raise InvariantError(
                    f"stream {n!r}: mark {s.mark} or last write {s.last_write} past {s.last_seq}"
                )
        for w in writers:
            if w is not None:
                st = self.streams.get(w.stream)
                if st is None or w.seq > st.last_write:
                    raise InvariantError(f"writer {w} is not a recorded write of its stream")

    # -- completions -------------------------------------------------------

    def submit(self, token: Token, failed: bool) -> None:
        """Queue a completion (any thread). Validates first."""
        self.validate(token)
        self._inbox.append((token, failed))

    def drain(self) -> list[tuple[Token, bool, list[tuple[StreamState, list[int]]]]]:
        """Apply queued completions in arrival order. Returns, per applied
        completion, ``(token, failed, ended)`` with ``ended`` as in :meth:`end`."""
        out = []
        inbox = self._inbox
        while inbox:
            token, failed = inbox.popleft()
            out.append((token, failed, self.end(token, failed)))
        return out

    def end(self, token: Token, failed: bool = False) -> list[tuple[StreamState, list[int]]]:
        """Mark ``token`` ended. A *completed* token also ends everything it
        was ordered after (its issue-time clock: a work that finished had
        finished its waits first). A *failed* one (``fail``, ``abandon``)
        ends only itself: a transfer may fail, or its engine stop, before it
        waited. On a DEVICE stream the tokens before a failed one completed
        normally (the in-order stream got past them), so theirs propagate.
        Returns ``[(stream_state, newly_ended_seqs), ...]``, the token's own
        stream first; empty if it had already ended. O(#streams + host
        tokens in its clock + newly ended seqs)."""
        st = self.streams[token.stream]
        if failed:
            st.failed_seqs.add(token.seq)
        if st.is_ended(token.seq):
            return []
        # A failed DEVICE token still means its in-order stream got past the
        # token before it, which completed normally (after its waits).
        seq = token.seq - 1 if failed and st.kind is _DEVICE else token.seq
        clock = st.token_clocks.get(seq) if not failed or seq != token.seq else None
        out = [(st, st.end(token.seq))]
        if failed:
            st.failed += 1
        if clock is not None:
            streams = self.streams
            for name, n in clock.dev.items():
                other = streams[name]
                if other is not st and n > other.mark:
                    out.append((other, other.end(n)))
            for h in clock.host:
                other = streams[h.stream]
                if h != token and not other.is_ended(h.seq):
                    out.append((other, other.end(h.seq)))
        busy = self.busy
        for s, _ in out:
            if s.mark >= s.last_seq:
                busy.discard(s.name)
        return out

    # -- fences --------------------------------------------------------------

    def reduce(self, candidates: Iterable[Token], consumer: StreamState) -> list[Token]:
        """Drop from ``candidates`` (already newest-per-device-stream) every
        token that has ended, that is on the consumer itself when the consumer
        is an in-order device stream, that the consumer's clock covers, or
        that another remaining candidate's issue-time clock covers.
        O(k^2) in the number of candidates k (k <= #streams + #host tokens)."""
        streams = self.streams
        cc = consumer.clock
        own = consumer.name if consumer.kind is _DEVICE else None
        live: list[Token] = []
        for t in candidates:
            st = streams[t.stream]
            if t.seq <= st.mark or t.stream == own:
                continue
            if t.kind is _HOST:
                if t.seq in st.done or t in cc.host:
                    continue
            elif cc.dev.get(t.stream, 0) >= t.seq:
                continue
            live.append(t)
        return self.drop_covered(live)

    def drop_covered(self, tokens: list[Token]) -> list[Token]:
        """Drop from ``tokens`` (already newest-per-device-stream) every
        token that another token's issue-time clock covers (the other was
        issued after it on an in-order stream, or on a stream that had
        waited on it): waiting on the other waits on it too. A token known
        to have ended has no clock and covers nothing (conservative).
        O(k^2) in the number of tokens."""
        if len(tokens) < 2:
            return tokens
        streams = self.streams
        clocks = [streams[u.stream].token_clocks.get(u.seq) for u in tokens]
        kept = []
        for i, t in enumerate(tokens):
            for j, c in enumerate(clocks):
                if j != i and c is not None and c.covers(t):
                    break
            else:
                kept.append(t)
        return kept

    def wait(self, consumer: StreamState, tokens: Iterable[Token]) -> None:
        """Record that a ``DEVICE`` consumer enqueued waits on ``tokens``:
        ``clock[S] := clock[S] ⊔ clock(t) ⊔ {t}``. A ``HOST`` engine keeps no
        standing clock (its postings are not ordered among themselves), so
        its wait is carried by the token of the access instead (:meth:`issue`)."""
        if consumer.kind is not _DEVICE:
            return
        cc = consumer.clock
        streams = self.streams
        for t in tokens:
            tc = streams[t.stream].token_clocks.get(t.seq)
            if tc is not None:
                cc.join(tc)
            cc.add(t)
        if cc.host:
            # Forget host tokens that ended: they can never be candidates again.
            cc.host = {t for t in cc.host if not self.is_ended(t)}
