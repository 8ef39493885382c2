"""Drive a :class:`~blockpool.HazardAwareBlockPool` and a
:class:`~blockpool.checking.race_oracle.RaceOracle` together, for tests.

A :class:`RaceHarness` turns an allocation sequence written against the pool
into the same sequence of synchronisations and block accesses in the oracle,
so a test that drops a fence fails with the race named. Importable without
pytest; :mod:`blockpool.checking.pytest_plugin` wraps it in fixtures.

>>> from blockpool.checking.harness import RaceHarness
>>> h = RaceHarness(num_gpu_blocks=8)
>>> blocks, fence = h.allocate_for(2, "compute")
>>> e1 = h.step(writes=blocks, waits=fence)        # prefill writes the blocks
>>> h.free(blocks, e1)                             # freed while step 1 may still run
>>> again, fence = h.allocate_for(2, "h2d")
>>> [str(t) for t in fence]
['compute:1']
>>> load = h.step(writes=again, stream="h2d", what="load")   # drops the fence
>>> print(h.report())
WAW race on block 1: load (write) by h2d:1 is not ordered after forward (write) by compute:1
WAW race on block 2: load (write) by h2d:1 is not ordered after forward (write) by compute:1
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from blockpool.checking.race_oracle import RaceOracle, RaceViolation
from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import ForeignBlockError, InvalidArgumentError
from blockpool.core.hazards import AccessKind, Fence, StreamKind, Token
from blockpool.core.pool import HazardAwareBlockPool

__all__ = ["DEFAULT_STREAMS", "RaceHarness"]

DEFAULT_STREAMS: Mapping[str, StreamKind] = {
    "compute": StreamKind.DEVICE,
    "h2d": StreamKind.DEVICE,
    "d2h": StreamKind.DEVICE,
    "rdma": StreamKind.HOST,
}
"""The streams of a typical deployment, ``{name: StreamKind}``: forward
pass, two DMA streams, one host-driven RDMA engine. The one meaning of
``DEFAULT_STREAMS`` in this package; the simulator's timing specs of the
same streams (plus ``xfer``) are ``blockpool.sim.costmodel.DEFAULT_STREAM_SPECS``."""

_READ, _WRITE = AccessKind.READ, AccessKind.WRITE


class RaceHarness:
    """A pool and an oracle fed the same sequence.

    Every method that begins an access issues (or takes from the pool) a
    token, records it in the oracle after the waits the caller says it
    honours, and records the accesses in both. Null blocks are skipped, as the
    pool skips them.

    Args:
        pool: The pool; default: a new debug pool of ``num_gpu_blocks`` blocks
            on ``streams``.
        oracle: The oracle; default: a new one. The pool's streams are
            registered in it either way.
        num_gpu_blocks: Size of the default pool (null block included).
        streams: Streams of the default pool; default :data:`DEFAULT_STREAMS`.

    Raises:
        InvalidArgumentError: a stream is registered with different kinds in
            the pool and the oracle.
    """

    def __init__(
        self,
        pool: HazardAwareBlockPool | None = None,
        oracle: RaceOracle | None = None,
        *,
        num_gpu_blocks: int = 64,
        streams: Mapping[str, StreamKind] | None = None,
    ) -> None:
        if pool is None:
            pool = HazardAwareBlockPool(num_gpu_blocks, streams=dict(streams or DEFAULT_STREAMS), debug=True)
        oracle = oracle if oracle is not None else RaceOracle()
        for name, kind in pool.streams.items():
            oracle.add_stream(name, kind)
        self.pool = pool
        self.oracle = oracle
        self.expecting_races = False
        self.last_fence = Fence()
        self._reported = 0

    # -- helpers -------------------------------------------------------------

    def _ids(self, blocks: Iterable[KVCacheBlock]) -> list[int]:
        own = self.pool.blocks
        ids = []
        for b in blocks:
            bid = getattr(b, "block_id", None)
            if not isinstance(b, KVCacheBlock) or not isinstance(bid, int):
                raise InvalidArgumentError(f"expected a KVCacheBlock, got {b!r}")
            if not 0 <= bid < len(own) or own[bid] is not b:
                raise ForeignBlockError(f"block {bid} does not belong to this harness's pool")
            if not b.is_null:
                ids.append(bid)
        return ids

    def _begun(self, token: Token, fence: Fence, honour_fence: bool, waits: list[Token]) -> None:
        self.last_fence = fence
        self.oracle.record(token, [*fence, *waits] if honour_fence else waits)

    # -- the sequence ----------------------------------------------------------

    def allocate_for(
        self,
        n: int,
        stream: str = "compute",
        hits: Sequence[KVCacheBlock] = (),
        access: AccessKind = _WRITE,
    ) -> tuple[list[KVCacheBlock], Fence]:
        """:meth:`HazardAwareBlockPool.allocate_for`; the consumer's access
        comes later (:meth:`step` with ``waits=fence``). O(n + len(hits)).

        Raises:
            The pool's errors (nothing changes).
        """
        return self.pool.allocate_for(n, stream, hits=hits, access=access)

    def fence_for(self, blocks: Iterable[KVCacheBlock], stream: str, access: AccessKind = _WRITE) -> Fence:
        """:meth:`HazardAwareBlockPool.fence_for` (records that ``stream``
        waits on it in the pool only; pass it to :meth:`step`). O(len(blocks))."""
        return self.pool.fence_for(blocks, stream, access)

    def step(
        self,
        reads: Iterable[KVCacheBlock] = (),
        writes: Iterable[KVCacheBlock] = (),
        *,
        waits: Iterable[Token] = (),
        stream: str = "compute",
        what: str = "forward",
    ) -> Token:
        """Issue a token on ``stream`` for work that waits on ``waits`` (a
        fence or tokens: stream waits on a device stream, host waits on a host
        engine), reads ``reads`` and writes ``writes``; tag both in the pool
        and check both in the oracle. Returns the token. (For a transfer on
        a host engine prefer :meth:`load`/:meth:`store`: the pool's token then
        carries its fence, so later fences stay minimal.)
        O(#streams + len(reads) + len(writes)).

        Raises:
            InvalidArgumentError, ForeignBlockError: a bad block (nothing changes).
            UnknownStreamError: ``stream`` is not registered (nothing changes).
            UnrecordedTokenError: a wait the oracle never saw (nothing changes).
        """
        reads, writes, waits = list(reads), list(writes), list(waits)
        rids, wids = self._ids(reads), self._ids(writes)
        self.oracle.check_access(stream, (), _READ, what, after=waits)  # validates, records nothing
        token = self.pool.issue(stream)
        self.oracle.record(token, waits)
        self.pool.tag(reads, token, _READ)
        self.pool.tag(writes, token, _WRITE)
        self.oracle.tag(token, rids, _READ, what)
        self.oracle.tag(token, wids, _WRITE, what)
        return token

    def load(
        self,
        blocks: Iterable[KVCacheBlock],
        stream: str = "h2d",
        *,
        waits: Iterable[Token] = (),
        honour_fence: bool = True,
        what: str = "load",
    ) -> Token:
        """:meth:`HazardAwareBlockPool.begin_load` (a write of ``blocks``).
        The load waits on ``waits`` (e.g. the fence :meth:`allocate_for`
        returned for these blocks: the pool counts that wait as done, so the
        load's own fence leaves it out) and on its own fence unless
        ``honour_fence`` is false; that fence is kept in :attr:`last_fence`.
        O(len(blocks) + #streams).

        Raises:
            The pool's errors; UnrecordedTokenError for a wait the oracle
            never saw (nothing changes either way).
        """
        blocks, waits = list(blocks), list(waits)
        ids = self._ids(blocks)
        self.oracle.check_access(stream, (), _WRITE, what, after=waits)  # validates, records nothing
        token, fence = self.pool.begin_load(blocks, stream)
        self._begun(token, fence, honour_fence, waits)
        self.oracle.tag(token, ids, _WRITE, what)
        return token

    def store(
        self,
        blocks: Iterable[KVCacheBlock],
        stream: str = "d2h",
        *,
        waits: Iterable[Token] = (),
        honour_fence: bool = True,
        what: str = "store",
    ) -> Token:
        """:meth:`HazardAwareBlockPool.begin_store` (a read of ``blocks``),
        like :meth:`load`. O(len(blocks) + #streams).

        Raises:
            As :meth:`load`.
        """
        blocks, waits = list(blocks), list(waits)
        ids = self._ids(blocks)
        self.oracle.check_access(stream, (), _READ, what, after=waits)  # validates, records nothing
        token, fence = self.pool.begin_store(blocks, stream)
        self._begun(token, fence, honour_fence, waits)
        self.oracle.tag(token, ids, _READ, what)
        return token

    def copy(
        self,
        pairs: Iterable[tuple[KVCacheBlock, KVCacheBlock]],
        stream: str = "compute",
        *,
        waits: Iterable[Token] = (),
        honour_fence: bool = True,
        what: str = "cow-copy",
    ) -> Token:
        """:meth:`HazardAwareBlockPool.begin_copy`: reads every source,
        writes every destination; waits like :meth:`load`. O(len(pairs) + #streams).

        Raises:
            As :meth:`load`.
        """
        pairs, waits = list(pairs), list(waits)
        self.oracle.check_access(stream, (), _WRITE, what, after=waits)  # validates, records nothing
        token, fence = self.pool.begin_copy(pairs, stream)
        self._begun(token, fence, honour_fence, waits)
        self.oracle.tag(token, self._ids(s for s, _ in pairs), _READ, what)
        self.oracle.tag(token, self._ids(d for _, d in pairs), _WRITE, what)
        return token

    def free(
        self, blocks: Iterable[KVCacheBlock], token: Token | None = None, *, what: str = "forward"
    ) -> None:
        """:meth:`HazardAwareBlockPool.free_blocks` with ``token`` = the last
        step that used the blocks, and the oracle's one read of the block
        table by that step (made now, judged by happens-before).
        O(len(blocks)).

        Raises:
            The pool's errors (nothing changes); UnrecordedTokenError when the
            oracle never saw ``token`` (checked first).
        """
        blocks = list(blocks)
        ids = self._ids(blocks)
        if token is not None:
            self.oracle.check_access(token.stream, (), _READ, what, after=(token,))
        self.pool.free_blocks(blocks, token=token)
        if token is not None:
            self.oracle.tag(token, ids, _READ, what)

    def complete(self, token: Token) -> None:
        """``token`` ended: tell the pool and the oracle. O(#streams).

        Raises:
            UnknownStreamError, UnknownTokenError: a token never issued/recorded.
        """
        self.pool.complete(token)
        self.oracle.complete(token)

    def fail(self, token: Token) -> None:
        """``token`` ended without doing its job: :meth:`HazardAwareBlockPool.fail`
        and, for the oracle, an ended token. O(#streams).

        Raises:
            UnknownStreamError, UnknownTokenError: a token never issued/recorded.
        """
        self.pool.fail(token)
        self.oracle.complete(token, failed=True)

    def abandon(self, token: Token) -> list[int]:
        """The engine behind ``token`` stopped: :meth:`HazardAwareBlockPool.abandon`
        (returns the released block ids) and an ended token in the oracle.

        Raises:
            UnknownStreamError, UnknownTokenError: a token never issued/recorded.
        """
        released = self.pool.abandon(token)
        self.oracle.complete(token, failed=True)
        return released

    def check(self) -> None:
        """:meth:`HazardAwareBlockPool.check`. Raises InvariantError."""
        self.pool.check()

    # -- verdicts ------------------------------------------------------------

    @property
    def violations(self) -> list[RaceViolation]:
        """Every race the oracle found so far."""
        return self.oracle.violations

    def report(self) -> str:
        """One line per violation (empty when none). O(v)."""
        return self.oracle.report()

    def expect_races(self) -> None:
        """This test provokes races on purpose: the pytest plugin's automatic
        check will not fail it (:meth:`assert_no_races` still does)."""
        self.expecting_races = True

    def assert_no_races(self) -> None:
        """Raise AssertionError listing every violation, if there is one. O(v)."""
        __tracebackhide__ = True  # pytest: point at the caller
        self._reported = len(self.violations)
        if self.violations:
            raise AssertionError(_message(self.violations))

    def check_new_races(self) -> None:
        """The automatic check (pytest plugin): unless :meth:`expect_races`
        was called, raise AssertionError listing the violations found since
        the last check. O(new violations)."""
        __tracebackhide__ = True
        new = self.take_unreported()
        if new and not self.expecting_races:
            raise AssertionError(_message(new))

    def take_unreported(self) -> list[RaceViolation]:
        """The violations found since the last check, marked reported."""
        new = self.violations[self._reported :]
        self._reported = len(self.violations)
        return new


def _message(violations: Sequence[RaceViolation]) -> str:
    lines = "\n".join(f"  {v}" for v in violations)
    return f"blockpool race oracle: {len(violations)} race(s)\n{lines}"
