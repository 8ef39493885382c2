"""Hazard vocabulary: stream kinds, access kinds, tokens and fences.

These are frozen value types: compared by value, hashable, picklable,
and free of any reference to a pool, so they can cross process boundaries
(scheduler -> workers) as plain data. See ``docs/hazard-model.md``.

>>> t = Token("compute", 7)
>>> t == Token("compute", 7, StreamKind.DEVICE)
True
>>> f = Fence((Token("compute", 7), Token("h2d", 2)))
>>> [str(x) for x in f], bool(f), bool(Fence())
(['compute:7', 'h2d:2'], True, False)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, final

import attr
import attrs

from blockpool.core.errors import InvalidTokenError

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgInt, ArgStr, ArgStreamKind

__all__ = ["EMPTY_FENCE", "LAST_STEP", "AccessKind", "Fence", "FreeTag", "StreamKind", "Token", "TokenStatus"]


class StreamKind(enum.Enum):
    """How a stream orders its work and how others can wait on it.

    ``DEVICE``: an in-order device queue (CUDA stream). Completing ``seq``
    completes everything before it; a device consumer waits with an enqueued
    ``wait_event`` (no host block).

    ``HOST``: a host-driven engine (RDMA NIC queue, transfer-thread pool).
    Its tokens may complete out of order, one by one, and a device queue
    cannot wait on them.
    """

    DEVICE = "device"
    HOST = "host"


class AccessKind(enum.Enum):
    """Whether an access reads or writes the blocks it touches."""

    READ = "read"
    WRITE = "write"


class TokenStatus(enum.Enum):
    """What the pool knows of a token (:meth:`HazardAwareBlockPool.token_status`).

    ``PENDING``: not known to have ended. ``COMPLETED``: ended, and no
    failure was ever reported for it (reported complete, or ended because
    a token ordered after it completed, or an in-order DEVICE stream got
    past it). ``FAILED``: a failure was reported for it (``fail``,
    ``abandon``), before or after it ended: its writes did not happen or
    their content is bad, and a consumer must not proceed past it (the
    worker ledger's ``FenceFailedError``).
    """

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


def _check_token(stream: object, seq: object, kind: object, pool: object) -> None:
    """Raise :class:`InvalidTokenError` for a bad ``stream`` (not a
    non-empty str), ``seq`` (not an int ``>= 1``; a bool is not one),
    ``kind`` (not a :class:`StreamKind`) or ``pool`` (not an int ``>= 0``).
    O(1)."""
    plain = type(stream) is str and type(seq) is int and type(kind) is StreamKind and type(pool) is int
    if plain and stream and seq >= 1 and pool >= 0:  # type: ignore[operator]  # the common case
        return
    if not isinstance(stream, str) or not stream:
        raise InvalidTokenError(f"stream must be a non-empty str, got {stream!r}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise InvalidTokenError(f"seq must be an int >= 1, got {seq!r}")
    if not isinstance(kind, StreamKind):
        raise InvalidTokenError(f"kind must be a StreamKind, got {kind!r}")
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 0:
        raise InvalidTokenError(f"pool must be an int >= 0, got {pool!r}")


@final
class Token:
    """A logical event: the point in ``stream`` after its ``seq``-th issued work.

    Tokens are issued by :meth:`HazardAwareBlockPool.issue` (never made up by
    callers); ``seq`` starts at 1 and only grows per stream. Two tokens are
    equal, and hash alike, when ``stream`` and ``seq`` are; ``kind`` rides
    along (it is fixed per stream) so a worker can tell how to wait on it.

    A token also carries the identity of the pool that issued it
    (``pool``, not part of equality): a pool refuses another pool's token
    (:class:`~blockpool.core.errors.ForeignTokenError`). ``pool=0`` is an
    *unbound* token (made by hand, or decoded from the old three-field wire
    form), which any pool accepts.

    Frozen (assigning or deleting a field raises ``AttributeError``),
    picklable, not subclassable. The compiled build makes it a native
    class (its fields read as C struct members, its ``__eq__`` and
    ``__hash__`` native code: the core reads tokens on every fence, tag and
    completion); the pure build, a slotted class.

    Attributes:
        stream: Name of the stream or engine.
        seq: Per-stream sequence number, ``>= 1``.
        kind: :class:`StreamKind` of the stream (not part of equality).
        pool: Identity of the issuing pool (``0``: unbound; not part of
            equality).

    Raises:
        InvalidTokenError: ``stream`` is not a non-empty str, ``seq`` is
            not an int ``>= 1`` (a bool is not an int here), ``kind`` is not
            a :class:`StreamKind` or ``pool`` is not an int ``>= 0``.
    """

    __slots__ = ("kind", "pool", "seq", "stream")
    __match_args__: ClassVar[tuple[str, ...]] = ("stream", "seq", "kind", "pool")

    stream: Final[str]
    seq: Final[int]
    kind: Final[StreamKind]
    pool: Final[int]

    def __init__(
        self, stream: ArgStr, seq: ArgInt, kind: ArgStreamKind = StreamKind.DEVICE, pool: ArgInt = 0
    ) -> None:
        _check_token(stream, seq, kind, pool)
        self.stream = stream
        self.seq = seq
        self.kind = kind
        self.pool = pool

    def __eq__(self, other: object) -> bool:
        if type(other) is not Token:
            return NotImplemented
        return self.seq == other.seq and self.stream == other.stream

    def __hash__(self) -> int:
        return hash((self.stream, self.seq))

    def __repr__(self) -> str:
        return f"Token(stream={self.stream!r}, seq={self.seq!r})"

    def __reduce__(self) -> tuple[Any, tuple[str, int, StreamKind, int]]:
        return (Token, (self.stream, self.seq, self.kind, self.pool))

    def __str__(self) -> str:
        return f"{self.stream}:{self.seq}"

    def to_wire(self) -> tuple[str, int, str] | tuple[str, int, str, int]:
        """A plain tuple for msgspec/JSON: ``(stream, seq, kind, pool)``, or
        the old ``(stream, seq, kind)`` for an unbound token (``pool == 0``).
        O(1)."""
        if self.pool:
            return (self.stream, self.seq, self.kind.value, self.pool)
        return (self.stream, self.seq, self.kind.value)

    @classmethod
    def from_wire(cls, data: Iterable[object]) -> Token:
        """Inverse of :meth:`to_wire`; also decodes the old three-field form
        (an unbound token). O(1).

        Raises:
            InvalidTokenError: malformed data (not 3 or 4 fields, an
                unknown kind, a bad stream, seq or pool).
        """
        try:
            fields = tuple(data)
            if len(fields) == 3:
                stream, seq, kind = fields
                pool: object = 0
            else:
                stream, seq, kind, pool = fields  # ValueError on any other length
            stream_kind = StreamKind(kind)
        except (TypeError, ValueError) as exc:
            raise InvalidTokenError(f"malformed wire token {data!r}: {exc}") from None
        return cls(stream, seq, stream_kind, pool)  # type: ignore[arg-type]  # checked there


def _frozen(self: Token, name: str, value: object = None) -> None:
    raise AttributeError(f"Token is frozen: cannot assign or delete {name!r}")


def _init_frozen(
    self: Token, stream: str, seq: int, kind: StreamKind = StreamKind.DEVICE, pool: int = 0
) -> None:
    """``Token.__init__`` of the pure build, where ``__setattr__`` refuses. O(1)."""
    _check_token(stream, seq, kind, pool)
    _set = object.__setattr__
    _set(self, "stream", stream)
    _set(self, "seq", seq)
    _set(self, "kind", kind)
    _set(self, "pool", pool)


def _native(cls: object) -> bool:
    """Whether ``cls`` is a native class of the compiled build (mypyc). O(1)."""
    return hasattr(cls, "__mypyc_attrs__")


def _no_subclass(cls: type) -> None:
    raise TypeError(f"Token cannot be subclassed (by {cls.__qualname__})")


if not _native(Token):  # the pure build: a slotted class, frozen and final here
    _init_frozen.__name__, _init_frozen.__qualname__ = "__init__", "Token.__init__"
    setattr(Token, "__init__", _init_frozen)  # noqa: B010  (assigning a method: mypy refuses the attribute form)
    setattr(Token, "__setattr__", _frozen)  # noqa: B010
    setattr(Token, "__delattr__", _frozen)  # noqa: B010
    setattr(Token, "__init_subclass__", classmethod(_no_subclass))  # noqa: B010


@attrs.frozen(slots=True)
class FenceReason:
    """Why a fence names a token (debug mode only): the first block found
    whose shadow required it and the role the token had there."""

    token: Token
    block_id: int
    role: str  # "writer" or "reader"
    access: AccessKind  # the access that began

    def __str__(self) -> str:
        hazard = {
            ("writer", AccessKind.READ): "RAW",
            ("writer", AccessKind.WRITE): "WAW",
            ("reader", AccessKind.WRITE): "WAR",
        }.get((self.role, self.access), "?")
        return f"{self.token}: block {self.block_id} {self.role} ({hazard})"


def _tokens_converter(tokens: Iterable[Token]) -> tuple[Token, ...]:
    return tuple(sorted(tokens, key=lambda t: (t.stream, t.seq)))


@attrs.frozen(slots=True)
class Fence:
    """The exact set of tokens an access must wait on before it starts.

    At most one token per ``DEVICE`` stream (the newest covers the older
    ones). ``HOST`` engines complete out of order, so a fence may name several
    tokens of one host engine (see ``docs/hazard-model.md``, "Vocabulary"). Iterable, sized, falsy when empty; equality ignores
    :attr:`reasons`.

    Attributes:
        tokens: The tokens, sorted by ``(stream, seq)``.
        needs_host_wait: The consumer must wait on the host (``event.synchronize()``
            or the engine's completion) before it posts or enqueues: true when
            the consumer is a ``HOST`` engine, or when a ``DEVICE`` consumer's
            fence names a ``HOST`` token (which no stream wait can cover).
        reasons: In debug mode, one :class:`FenceReason` per token.
    """

    tokens: tuple[Token, ...] = attr.ib(default=(), converter=_tokens_converter)
    needs_host_wait: bool = False
    reasons: tuple[FenceReason, ...] = attr.ib(default=(), eq=False, repr=False)

    def __iter__(self) -> Iterator[Token]:
        return iter(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def __contains__(self, token: object) -> bool:
        return token in self.tokens

    def merge(self, other: Fence) -> Fence:
        """Union of two fences, newest token per ``DEVICE`` stream, every
        ``HOST`` token kept. ``needs_host_wait`` is or-ed. O(k log k) in the
        number of tokens.

        >>> a = Fence((Token("compute", 3),)); b = Fence((Token("compute", 5),))
        >>> [str(t) for t in a.merge(b)]
        ['compute:5']
        """
        newest: dict[object, Token] = {}
        for t in (*self.tokens, *other.tokens):
            key: object = t if t.kind is StreamKind.HOST else t.stream
            cur = newest.get(key)
            if cur is None or cur.seq < t.seq:
                newest[key] = t
        return Fence(
            newest.values(),
            self.needs_host_wait or other.needs_host_wait,
            self.reasons + other.reasons,
        )

    def explain(self) -> str:
        """Human-readable account of each token (debug mode fills reasons).
        O(len(tokens) + len(reasons))."""
        if not self.tokens:
            return "empty fence: nothing to wait on"
        if not self.reasons:
            return "fence " + ", ".join(map(str, self.tokens)) + " (no reasons: debug off)"
        return "\n".join(str(r) for r in self.reasons)

    def to_wire(self) -> tuple[list[tuple[str, int, str] | tuple[str, int, str, int]], bool]:
        """A plain structure for msgspec/JSON. O(k)."""
        return ([t.to_wire() for t in self.tokens], self.needs_host_wait)

    @classmethod
    def from_wire(cls, data: Sequence[Any]) -> Fence:
        """Inverse of :meth:`to_wire` (``[tokens, needs_host_wait]``, a tuple or,
        through JSON, a list). O(len(tokens)).

        Raises:
            InvalidTokenError: a malformed token.
        """
        tokens, host = data
        return cls([Token.from_wire(t) for t in tokens], bool(host))


EMPTY_FENCE = Fence()
"""The empty fence (shared instance)."""


class FreeTag(enum.Enum):
    """Default of ``free_blocks(token=...)``; its one member is :data:`LAST_STEP`."""

    LAST_STEP = "last_step"

    def __repr__(self) -> str:
        return "LAST_STEP"


LAST_STEP = FreeTag.LAST_STEP
"""``free_blocks``'s default ``token``: tag the freed blocks with the newest
token issued on the pool's ``compute`` stream (the last enqueued step), as if
it still reads them. Pass ``token=None`` to record no access (the caller
knows nothing in flight touches the blocks)."""
