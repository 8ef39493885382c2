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
>>> print(h.explain(h.violations).splitlines()[1])  # the test's message: one entry per access pair
  WAW race on blocks 1-2: load (write) by h2d:1 is not ordered after forward (write) by compute:1
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from blockpool.checking.race_oracle import RaceOracle, RaceViolation, describe_group, group_by_access_pair
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
        record_sites: Record where each access and each fence was made (the
            first stack frame outside :mod:`blockpool`: the test's own
            ``file:line``, as the CUDA stream sanitizer keeps a stack per
            access), so a race names both accesses' lines and the fence
            that would fix it. An access is made where its work was
            issued: the :meth:`step`, :meth:`load`, :meth:`store` or
            :meth:`copy` call; the block-table read a :meth:`free` reports
            for a step is that step's, so it keeps the step's line (the
            free's own line only for a token the harness did not issue).
            On by default (one frame walk per call, in the harness only;
            the pool's own calls never pay it).

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
        record_sites: bool = True,
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
        self.record_sites = record_sites
        # (token, block id, access kind) -> "file:line" where the access was made
        self._sites: dict[tuple[Token, int, AccessKind], str] = {}
        # token -> "file:line" of the call that issued (or began) its work here
        self._issued_at: dict[Token, str] = {}
        # fences handed out, in order: (call, site, stream, fence, block ids, honoured)
        self._fences: list[tuple[str, str, str, Fence, frozenset[int], bool]] = []

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

    def _mark(self, token: Token, ids: Iterable[int], kind: AccessKind, site: str | None) -> None:
        """Remember where ``token``'s ``kind`` access to ``ids`` was made;
        a site already known for one of them stays (the first report of an
        access is where it was made). O(len(ids))."""
        if site is not None:
            sites = self._sites
            for bid in ids:
                sites.setdefault((token, bid, kind), site)

    def _issued(self, token: Token, site: str | None) -> None:
        """``token``'s work was issued (or begun) at ``site``. O(1)."""
        if site is not None:
            self._issued_at[token] = site

    def _fence_made(
        self, call: str, site: str | None, stream: str, fence: Fence, ids: Iterable[int], honoured: bool
    ) -> None:
        if site is not None and fence.tokens:
            self._fences.append((call, site, stream, fence, frozenset(ids), honoured))

    def _where(self) -> str | None:
        """``file:line`` of the first frame outside :mod:`blockpool` (the
        caller's), or ``None`` when sites are off. O(stack depth)."""
        if not self.record_sites:
            return None
        return call_site()

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
        new, fence = self.pool.allocate_for(n, stream, hits=hits, access=access)
        site = self._where()
        if site is not None:
            self._fence_made("allocate_for", site, stream, fence, self._ids([*hits, *new]), False)
        return new, fence

    def fence_for(self, blocks: Iterable[KVCacheBlock], stream: str, access: AccessKind = _WRITE) -> Fence:
        """:meth:`HazardAwareBlockPool.fence_for` (records that ``stream``
        waits on it in the pool only; pass it to :meth:`step`). O(len(blocks))."""
        blocks = list(blocks)
        fence = self.pool.fence_for(blocks, stream, access)
        site = self._where()
        if site is not None:
            self._fence_made("fence_for", site, stream, fence, self._ids(blocks), False)
        return fence

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
        site = self._where()
        self._issued(token, site)
        self._mark(token, rids, _READ, site)
        self._mark(token, wids, _WRITE, site)
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
        site = self._where()
        self._issued(token, site)
        self._mark(token, ids, _WRITE, site)
        self._fence_made("load", site, stream, fence, ids, honour_fence)
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
        site = self._where()
        self._issued(token, site)
        self._mark(token, ids, _READ, site)
        self._fence_made("store", site, stream, fence, ids, honour_fence)
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
        src_ids, dst_ids = self._ids(s for s, _ in pairs), self._ids(d for _, d in pairs)
        self.oracle.tag(token, src_ids, _READ, what)
        self.oracle.tag(token, dst_ids, _WRITE, what)
        site = self._where()
        self._issued(token, site)
        self._mark(token, src_ids, _READ, site)
        self._mark(token, dst_ids, _WRITE, site)
        self._fence_made("copy", site, stream, fence, [*src_ids, *dst_ids], honour_fence)
        return token

    def free(
        self, blocks: Iterable[KVCacheBlock], token: Token | None = None, *, what: str = "forward"
    ) -> None:
        """:meth:`HazardAwareBlockPool.free_blocks` with ``token`` = the last
        step that used the blocks, and the oracle's one read of the block
        table by that step (reported now, judged by happens-before). The
        read is the step's: a race on it names the line of the step that
        made it (:meth:`step`), or this call's line when the harness did not
        issue ``token``. O(len(blocks)).

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
            if self.record_sites:
                self._mark(token, ids, _READ, self._issued_at.get(token) or self._where())

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
            raise AssertionError(self.explain(self.violations))

    def check_new_races(self) -> None:
        """The automatic check (pytest plugin): unless :meth:`expect_races`
        was called, raise AssertionError listing the violations found since
        the last check. O(new violations)."""
        __tracebackhide__ = True
        new = self.take_unreported()
        if new and not self.expecting_races:
            raise AssertionError(self.explain(new))

    def site_of(self, token: Token, block_id: int, kind: AccessKind) -> str | None:
        """``file:line`` where ``token``'s ``kind`` access to ``block_id``
        was recorded through this harness (``None``: sites off, or recorded
        elsewhere). O(1)."""
        return self._sites.get((token, block_id, kind))

    def fix_for(self, v: RaceViolation) -> str:
        """The fence that would have ordered ``v``'s access after the prior
        one, in words: the racing transfer's own fence it did not honour, or
        the newest fence handed out for its stream over the block (from
        ``allocate_for`` / ``fence_for``, with its ``file:line``) naming the
        prior token or a later one of its DEVICE stream; else how to take
        one. O(fences handed out)."""
        prior, stream, bid = v.prior_token, v.token.stream, v.block_id

        def names(fence: Fence) -> bool:
            return any(
                t == prior
                or (t.stream == prior.stream and t.kind is StreamKind.DEVICE and t.seq >= prior.seq)
                for t in fence
            )

        best = None
        for call, site, s, fence, ids, honoured in reversed(self._fences):
            if s != stream or bid not in ids:
                continue
            if call in ("load", "store", "copy"):
                if not honoured and names(fence) and self._sites.get((v.token, bid, v.kind)) == site:
                    return f"honour the fence of `{call}` at {site} (drop honour_fence=False)"
                continue
            if names(fence):
                return f"pass `waits=fence` from `{call}` at {site}"
            best = best or (call, site)
        if best is not None:
            return f"pass `waits=fence` from `{best[0]}` at {best[1]}"
        return f"take `fence_for(blocks, {stream!r}, AccessKind.{v.kind.name})` before the access and pass it as `waits=`"

    def explain(self, violations: Sequence[RaceViolation]) -> str:
        """The message of :meth:`assert_no_races`: a header counting the
        violations (one per block), then one entry per access pair (the same
        hazard between the same two accesses, made at the same lines, with
        the same fix), naming its blocks as runs (``blocks 1-4``), in the
        order found; under it, where sites were recorded, the
        ``file:line`` of both accesses and the fix (:meth:`fix_for`).
        O(len(violations) x fences)."""
        out = [f"blockpool race oracle: {len(violations)} race(s)"]

        def where(v: RaceViolation) -> tuple[str | None, str | None, str | None]:
            here = self.site_of(v.token, v.block_id, v.kind)
            there = self.site_of(v.prior_token, v.block_id, v.prior_kind)
            if here is None and there is None:
                return None, None, None
            return here, there, self.fix_for(v)

        for v, ids in group_by_access_pair(violations, where):
            out.append(f"  {describe_group(v, ids)}")
            here, there, fix = where(v)
            if fix is None:
                continue
            out.append(
                f"    {v.what} by {v.token} at {here or '?'}; {v.prior_what} by {v.prior_token} at {there or '?'}"
            )
            out.append(f"    fix: {fix}")
        return "\n".join(out)

    def take_unreported(self) -> list[RaceViolation]:
        """The violations found since the last check, marked reported."""
        new = self.violations[self._reported :]
        self._reported = len(self.violations)
        return new


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_site() -> str:
    """``file:line`` of the innermost stack frame outside the
    :mod:`blockpool` package (the test that called the harness), the file
    relative to the working directory when it lies below it. O(stack depth
    inside blockpool)."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        f = f.f_back  # type: ignore[assignment]
    if f is None:  # pragma: no cover (a call from blockpool itself, with no outside caller)
        return "?"
    name = f.f_code.co_filename
    try:
        rel = os.path.relpath(name)
        name = rel if not rel.startswith("..") else name
    except ValueError:  # pragma: no cover (another drive, on Windows)
        pass
    return f"{name}:{f.f_lineno}"
