"""Completion reports: worker -> scheduler, and the merge across ranks.

A worker's :class:`~blockpool.worker.torch_events.EventLedger` observes which tokens
ended (its events completed, its host engine called back) and hands out a
:class:`CompletionReport`: a small frozen value holding the tokens in their
wire form (``Token.to_wire()`` tuples), picklable and msgspec/JSON friendly,
so it rides the model-runner output to the scheduler process. The scheduler
applies it to the pool with :meth:`CompletionReport.apply`.

With tensor parallelism every rank records its own event for a token, and a
token has ended only when it ended on **every** rank (``docs/worker.md``,
"Completions back to the scheduler, and tensor parallelism"). :class:`RankMerger` turns per-rank reports
into one report that names a token only once all ranks reported it. The idea
is vLLM's ``KVOutputAggregator``
(``vllm/distributed/kv_transfer/kv_connector/utils.py``), which counts
finished-sending/receiving request ids until every rank reported them; here
the unit is a token, and a ``DEVICE`` stream is merged by its completion mark
(the minimum over ranks), not counted token by token.

This module imports neither torch nor vLLM: the scheduler uses it.

>>> a = CompletionReport.of(0, [Token("compute", 4)])
>>> b = CompletionReport.of(1, [Token("compute", 3)])
>>> m = RankMerger(world_size=2)
>>> m.add(a).tokens()
[]
>>> [str(t) for t in m.add(b).tokens()]
['compute:3']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import attr
import attrs

from blockpool.core.errors import InvalidArgumentError
from blockpool.core.hazards import StreamKind, Token

__all__ = ["CompletionReport", "CompletionSink", "RankMerger", "WireToken"]

WireToken = tuple  # (stream, seq, kind) or (stream, seq, kind, pool)
"""A token as :meth:`Token.to_wire` gives it: ``(stream, seq, kind, pool)``
(``(stream, seq, kind)`` for an unbound token)."""


class CompletionSink(Protocol):
    """What :meth:`CompletionReport.apply` needs of a pool: ``complete`` and
    ``fail`` (:class:`~blockpool.core.pool.HazardAwareBlockPool` has both)."""

    def complete(self, token: Token) -> None:
        """The work of ``token`` finished (see ``HazardAwareBlockPool.complete``)."""

    def fail(self, token: Token) -> None:
        """The work of ``token`` ended without doing its job (see ``HazardAwareBlockPool.fail``)."""


def _wire_tuple(items: Iterable[object]) -> tuple[WireToken, ...]:
    out: list[WireToken] = []
    for item in items:
        t = item if isinstance(item, Token) else Token.from_wire(item)  # type: ignore[arg-type]
        out.append(t.to_wire())
    return tuple(out)


def _check_rank(_: object, __: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"rank must be an int >= 0, got {value!r}")


@attrs.frozen(slots=True)
class CompletionReport:
    """Tokens one worker (rank) observed ending since its previous report.

    For a ``DEVICE`` stream a report names at most the newest ended token
    (ending it ends every earlier one); ``HOST`` tokens are named one by one.
    Construct with :meth:`of` from tokens, or directly from wire tuples
    (both are accepted and normalised to wire tuples).

    Attributes:
        rank: The tensor-parallel rank that observed the completions (``>= 0``).
        completed: Tokens that ended and did their job, as wire tuples.
        failed: ``HOST`` tokens whose transfer ended without doing its job.

    Raises:
        InvalidArgumentError: ``rank`` is not an int ``>= 0``, or a wire
            tuple is malformed (also a ``ValueError``).
    """

    rank: int = attr.ib(default=0, validator=_check_rank)
    completed: tuple[WireToken, ...] = attr.ib(default=(), converter=_wire_tuple)
    failed: tuple[WireToken, ...] = attr.ib(default=(), converter=_wire_tuple)

    @classmethod
    def of(cls, rank: int, completed: Iterable[Token] = (), failed: Iterable[Token] = ()) -> CompletionReport:
        """Build a report from tokens. O(number of tokens)."""
        return cls(rank, tuple(completed), tuple(failed))  # type: ignore[arg-type]

    def tokens(self) -> list[Token]:
        """The completed tokens, decoded. O(n)."""
        return [Token.from_wire(w) for w in self.completed]

    def failed_tokens(self) -> list[Token]:
        """The failed tokens, decoded. O(n)."""
        return [Token.from_wire(w) for w in self.failed]

    def __bool__(self) -> bool:
        return bool(self.completed or self.failed)

    def __len__(self) -> int:
        return len(self.completed) + len(self.failed)

    def to_wire(self) -> tuple[int, list[WireToken], list[WireToken]]:
        """Plain data for msgspec/JSON: ``(rank, completed, failed)``. O(n)."""
        return (self.rank, list(self.completed), list(self.failed))

    @classmethod
    def from_wire(cls, data: Sequence[object]) -> CompletionReport:
        """Inverse of :meth:`to_wire` (lists where tuples were are accepted).

        Raises:
            InvalidArgumentError: malformed data.
        """
        try:
            rank, completed, failed = data
            return cls(
                rank,  # type: ignore[arg-type]
                tuple(tuple(w) for w in completed),  # type: ignore[attr-defined, arg-type]
                tuple(tuple(w) for w in failed),  # type: ignore[attr-defined, arg-type]
            )
        except InvalidArgumentError:
            raise
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"malformed completion report {data!r}: {exc}") from None

    def apply(self, pool: CompletionSink) -> int:
        """Tell the pool: ``pool.complete(t)`` for each completed token,
        ``pool.fail(t)`` for each failed one. Returns the number of calls.
        O(n) (the pool applies them at the start of its next call).

        Raises:
            UnknownStreamError, UnknownTokenError: from the pool, when it
                never issued a token (the tokens before it are already
                queued; completions are idempotent, so re-applying is safe).
        """
        for t in self.tokens():
            pool.complete(t)
        for t in self.failed_tokens():
            pool.fail(t)
        return len(self)


class RankMerger:
    """Merge per-rank :class:`CompletionReport` s: a token ends when every
    rank reported it.

    ``DEVICE`` streams: each rank's report advances that rank's completion
    mark for the stream; the merged mark is the minimum over ranks, and a
    merged report names the new merged mark's token when it grows.
    ``HOST`` tokens: a token is named once all ``world_size`` ranks reported
    it (completed or failed); it is failed when any rank reported it failed.

    Memory: one mark per (rank, device stream), plus one entry per ``HOST``
    token some but not all ranks reported.

    Args:
        world_size: Number of ranks (``>= 1``).

    Raises:
        InvalidArgumentError: ``world_size`` is not an int ``>= 1``.
    """

    __slots__ = ("_host", "_marks", "_merged", "_pools", "world_size")

    def __init__(self, world_size: int) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise InvalidArgumentError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        # stream -> per-rank marks
        self._marks: dict[str, list[int]] = {}
        # stream -> merged mark already reported
        self._merged: dict[str, int] = {}
        # stream -> issuing pool of its tokens (Token.pool), kept on merged tokens
        self._pools: dict[str, int] = {}
        # host token -> (ranks that reported it, failed on some rank)
        self._host: dict[Token, tuple[set[int], bool]] = {}

    def add(self, report: CompletionReport) -> CompletionReport:
        """Take one rank's report; return what ended on every rank because of
        it (a report with ``rank`` 0; empty when nothing new). A rank
        repeating a token it already reported changes nothing until the
        token is merged (a ledger reports each token once).
        O(n + world_size) for n tokens in the report.

        Raises:
            InvalidArgumentError: ``report.rank >= world_size``, or a failed
                token of a ``DEVICE`` stream (device events never fail).
        """
        r = report.rank
        if r >= self.world_size:
            raise InvalidArgumentError(f"rank {r} is out of range for world_size {self.world_size}")
        failed = report.failed_tokens()
        for t in failed:
            if t.kind is not StreamKind.HOST:
                raise InvalidArgumentError(f"device token {t} cannot fail; only HOST tokens do")
        done: list[Token] = []
        bad: list[Token] = []
        touched: set[str] = set()
        for t in report.tokens():
            if t.kind is StreamKind.HOST:
                self._host_report(t, r, False, done, bad)
                continue
            if t.pool:
                self._pools[t.stream] = t.pool
            marks = self._marks.setdefault(t.stream, [0] * self.world_size)
            if marks[r] < t.seq:
                marks[r] = t.seq
                touched.add(t.stream)
        for t in failed:
            self._host_report(t, r, True, done, bad)
        for stream in sorted(touched):
            low = min(self._marks[stream])
            if low > self._merged.get(stream, 0):
                self._merged[stream] = low
                done.append(Token(stream, low, StreamKind.DEVICE, self._pools.get(stream, 0)))
        return CompletionReport.of(0, done, bad)

    def _host_report(self, t: Token, rank: int, failed: bool, done: list[Token], bad: list[Token]) -> None:
        ranks, any_failed = self._host.get(t, (set(), False))
        ranks.add(rank)
        any_failed = any_failed or failed
        if len(ranks) < self.world_size:
            self._host[t] = (ranks, any_failed)
            return
        self._host.pop(t, None)
        (bad if any_failed else done).append(t)

    def pending(self) -> int:
        """``HOST`` tokens some but not all ranks reported. O(1)."""
        return len(self._host)
