"""The host-side page account beside SGLang's KV page allocator.

SGLang keeps its free KV pages in a device tensor (``free_pages`` of
``PagedTokenToKVPoolAllocator`` and ``TokenToKVPoolAllocator``). Reading the
page ids on the host would cost a device sync per free and per allocation,
so the account never reads them: it keeps a list of *runs* in the same order
as ``free_pages``, each run a page count and the token current when those
pages were freed. Counts are host metadata (tensor shapes, and the CPU-side
page counts SGLang computes itself), so the account follows the allocator
with no sync, and ``sum(run counts) == len(free_pages)`` is checked on every
call the caller passes the allocator's length to.

What it mirrors (``sglang/srt/mem_cache/allocator/paged.py`` and ``token.py``
of SGLang 0.5.23):

* ``PagedTokenToKVPoolAllocator._release_page_ids`` without ``need_sort``
  *prepends* the freed pages (``cat((*page_ids, free_pages))``): LIFO, the
  pages freed last are handed out first (``order="lifo"``).
* ``TokenToKVPoolAllocator.free`` without ``need_sort`` *appends* them:
  FIFO (``order="fifo"``).
* With ``need_sort`` both stage the freed pages (``staged_pages`` /
  ``release_pages``), out of the free list, until ``merge_and_sort_free``
  sorts free and staged pages together. A sort scrambles the order the runs
  describe, so the merged run's tag is :data:`UNKNOWN`.
* ``alloc``, ``alloc_extend`` and ``alloc_decode`` take pages from the
  front of ``free_pages`` (``free_pages[:k]``, then ``free_pages[k:]``).
* ``clear`` restores ``arange(1, num_pages + 1)``: one run.
* ``free_group_begin``/``end`` only delay frees; the delayed frees reach
  the list through the same release paths, so the caller records them
  there, tagged with the token current at release (a later token than the
  free's, which is never weaker).

The fence of an allocation is the set of tags of the runs it consumed:
exact for the runs (no tag of a run it did not touch) and never weaker than
the last use of any page it got, provided every release was recorded with a
token at or after that page's last use. The account answers ``None``
("unknown": keep SGLang's ``wait_stream``) when a consumed run is
:data:`UNKNOWN` or when the account is disarmed. A length mismatch disarms
it for good, with one log line.

Tags are any hashable value: in the plugin, tokens of blockpool's core
(:class:`~blockpool.core.hazards.Token`, one stream per engine stream,
mapped to device events by the caller); in tests, ints. :func:`as_fence`
turns a set of core tokens into the :class:`~blockpool.core.hazards.Fence`
a consumer waits on (newest token per device stream). This module imports
neither torch nor SGLang.

>>> acct = PageAccount(8)                       # after clear(): 8 pages, no access
>>> acct.release(2, "t1"); acct.release(3, "t2")  # prepended: t2's run first
True
True
>>> acct.runs()
[(3, 't2'), (2, 't1'), (8, None)]
>>> sorted(acct.take(4))                         # 3 pages of t2, 1 of t1
['t1', 't2']
>>> acct.take(1), acct.free_len                  # the rest of t1's run
(frozenset({'t1'}), 8)
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Final, Generic, Literal, TypeVar

from blockpool.core.errors import InvalidArgumentError, InvariantError
from blockpool.core.hazards import EMPTY_FENCE, Fence, Token

__all__ = ["UNKNOWN", "PageAccount", "TransferCounters", "as_fence", "classify"]

logger = logging.getLogger("blockpool.integrations.sglang")

T = TypeVar("T", bound=Hashable)


class _Unknown:
    """The type of :data:`UNKNOWN` (one instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()
"""The tag of a run whose pages' last use the account cannot name (a sorted
merge, or :meth:`PageAccount.forget`). Consuming any part of it makes the
fence unknown."""


def _count(n: object, what: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidArgumentError(f"{what} must be an int >= 0, got {n!r}")
    return n


def _hashable(token: object) -> None:
    try:
        hash(token)
    except TypeError:
        raise InvalidArgumentError(f"token must be hashable, got {token!r}") from None
    if token is UNKNOWN:
        raise InvalidArgumentError("UNKNOWN is not a token (use forget())")


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    if a is None or b is None or a is UNKNOWN or b is UNKNOWN:
        return False
    return bool(a == b)


class PageAccount(Generic[T]):
    """Runs of free pages in SGLang's free-list order, each tagged with the
    token of its release.

    Args:
        num_pages: Pages in the free list after the allocator's ``clear()``
            (``num_pages`` of the paged allocator, ``size`` of the token one).
        order: ``"lifo"`` for ``PagedTokenToKVPoolAllocator`` (frees are
            prepended), ``"fifo"`` for ``TokenToKVPoolAllocator`` (appended).
        need_sort: The allocator's ``need_sort``: frees are staged until a
            merge (:meth:`merge`).
        token: Tag of the initial run (``None``: no access recorded, as for a
            freshly built allocator).
        name: Names the allocator in the disarm log line.

    Raises:
        InvalidArgumentError: ``num_pages`` is not an int ``>= 0``, ``order``
            is neither ``"lifo"`` nor ``"fifo"``, or ``token`` is unhashable.

    Every method is O(1) amortized per run it creates or consumes; the run
    list has at most one run per recorded release (adjacent runs with the
    same tag coalesce).
    """

    __slots__ = ("_armed", "_free", "_lifo", "_name", "_need_sort", "_reason", "_runs", "_staged")

    def __init__(
        self,
        num_pages: int,
        *,
        order: Literal["lifo", "fifo"] = "lifo",
        need_sort: bool = False,
        token: T | None = None,
        name: str = "allocator",
    ) -> None:
        _count(num_pages, "num_pages")
        if order not in ("lifo", "fifo"):
            raise InvalidArgumentError(f"order must be 'lifo' or 'fifo', got {order!r}")
        if token is not None:
            _hashable(token)
        self._lifo = order == "lifo"
        self._need_sort = bool(need_sort)
        self._name = name
        self._armed = True
        self._reason: str | None = None
        self._runs: deque[list[object]] = deque()
        self._free = 0
        self._staged = 0
        self._reset(num_pages, token)

    # ------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        """False once a mismatch (or :meth:`disarm`) stopped the account; a
        disarmed account answers every fence with ``None``. O(1)."""
        return self._armed

    @property
    def disarm_reason(self) -> str | None:
        """Why the account was disarmed (``None`` while armed). O(1)."""
        return self._reason

    @property
    def free_len(self) -> int:
        """Pages in the free list as the account knows it (the allocator's
        ``len(free_pages)`` while in step). O(1)."""
        return self._free

    @property
    def staged_len(self) -> int:
        """Pages staged for the next merge (``need_sort`` only:
        ``num_staged_pages`` of the paged allocator, ``len(release_pages)``
        of the token one). O(1)."""
        return self._staged

    @property
    def need_sort(self) -> bool:
        """The mirrored allocator's ``need_sort``. O(1)."""
        return self._need_sort

    @property
    def order(self) -> Literal["lifo", "fifo"]:
        """Where releases go: ``"lifo"`` (front) or ``"fifo"`` (back). O(1)."""
        return "lifo" if self._lifo else "fifo"

    def runs(self) -> list[tuple[int, T | None | _Unknown]]:
        """The runs, front (next handed out) first: ``(pages, tag)`` with tag
        ``None`` for no recorded access and :data:`UNKNOWN` after a merge.
        O(#runs)."""
        return [(c, t) for c, t in self._runs]  # type: ignore[misc]

    # ------------------------------------------------------------------
    # checks
    # ------------------------------------------------------------------

    def check(self, free_len: int, staged_len: int | None = None) -> bool:
        """Compare with the allocator's lengths (host-side tensor shapes); on
        a mismatch disarm, logging one line. Returns :attr:`armed`. O(1).

        Args:
            free_len: ``len(allocator.free_pages)``.
            staged_len: the staged count (see :attr:`staged_len`), or ``None``
                to skip that comparison.

        Raises:
            InvalidArgumentError: a length is not an int ``>= 0``.
        """
        _count(free_len, "free_len")
        if staged_len is not None:
            _count(staged_len, "staged_len")
        if not self._armed:
            return False
        if free_len != self._free or (staged_len is not None and staged_len != self._staged):
            self.disarm(
                f"length mismatch: allocator free {free_len}, staged {staged_len}; "
                f"account free {self._free}, staged {self._staged}"
            )
        return self._armed

    def disarm(self, reason: str) -> None:
        """Stop answering fences (every later one is ``None``) and log
        ``reason`` once. Idempotent: a second call logs nothing. O(1)."""
        if not self._armed:
            return
        self._armed = False
        self._reason = reason
        self._runs.clear()
        logger.warning(
            "blockpool: the page account of SGLang's %s is disarmed (%s); its transfers keep SGLang's wait_stream",
            self._name,
            reason,
        )

    def check_invariants(self) -> None:
        """Assert the internal invariants (run counts positive and summing to
        :attr:`free_len`, no two adjacent runs with one tag). O(#runs).

        Raises:
            InvariantError: an invariant does not hold (a bug in the account).
        """
        if not self._armed:
            return
        total = 0
        prev: object = object()
        for count, tag in self._runs:
            if not isinstance(count, int) or count <= 0:
                raise InvariantError(f"run with {count!r} pages")
            if _same(tag, prev):
                raise InvariantError(f"adjacent runs share tag {tag!r}")
            prev = tag
            total += count
        if total != self._free:
            raise InvariantError(f"runs hold {total} pages, free_len is {self._free}")
        if self._staged < 0 or (self._staged and not self._need_sort):
            raise InvariantError(f"staged {self._staged} with need_sort={self._need_sort}")

    # ------------------------------------------------------------------
    # the allocator's operations
    # ------------------------------------------------------------------

    def clear(self, num_pages: int | None = None, token: T | None = None) -> bool:
        """Mirror ``clear()``: one run of ``num_pages`` (default: the current
        free plus staged count) tagged ``token``, nothing staged. Pass the
        token current at the clear when forwards may still touch the pages
        (``None`` records no access). Returns :attr:`armed`. O(#runs).

        Raises:
            InvalidArgumentError: ``num_pages`` is not an int ``>= 0`` or
                ``token`` is unhashable (nothing changed).
        """
        if num_pages is not None:
            _count(num_pages, "num_pages")
        if token is not None:
            _hashable(token)
        if self._armed:
            self._reset(self._free + self._staged if num_pages is None else num_pages, token)
        return self._armed

    def release(
        self, n: int, token: T | None, *, free_len: int | None = None, staged_len: int | None = None
    ) -> bool:
        """Mirror a release of ``n`` pages (``_release_page_ids`` of the paged
        allocator, ``free`` of the token one) whose last use is covered by
        ``token`` (``None``: no access recorded). Prepended (LIFO), appended
        (FIFO), or staged with ``need_sort``. Then, when given, the lengths
        are checked as :meth:`check` does. Returns :attr:`armed`. O(1).

        Raises:
            InvalidArgumentError: ``n`` or a length is not an int ``>= 0``,
                or ``token`` is unhashable (nothing changed).
        """
        _count(n, "n")
        if token is not None:
            _hashable(token)
        for v, what in ((free_len, "free_len"), (staged_len, "staged_len")):
            if v is not None:
                _count(v, what)
        if not self._armed:
            return False
        if n:
            if self._need_sort:
                self._staged += n
            else:
                self._push(n, token, front=self._lifo)
        return self._after(free_len, staged_len)

    def take(self, n: int, *, free_len: int | None = None) -> frozenset[T] | None:
        """Mirror an allocation of ``n`` pages from the front of the free list
        (``alloc``, or the ``num_new_pages`` of ``alloc_extend`` /
        ``alloc_decode``) and return its fence: the tags of the runs
        consumed (no-access runs add nothing; empty: nothing to wait on).

        Returns ``None`` (unknown: keep ``wait_stream``) when a consumed run
        is :data:`UNKNOWN`, when the account is disarmed, or when ``n``
        exceeds :attr:`free_len` (a mismatch: the account disarms). The
        pages are consumed either way. O(#runs consumed).

        Raises:
            InvalidArgumentError: ``n`` or ``free_len`` is not an int ``>= 0``
                (nothing changed).
        """
        _count(n, "n")
        if free_len is not None:
            _count(free_len, "free_len")
        if not self._armed:
            return None
        if n > self._free:
            self.disarm(f"an allocation of {n} pages from a free list of {self._free}")
            return None
        fence = self._pop(n, front=True)
        return fence if self._after(free_len, None) else None

    def take_to(self, free_len: int) -> frozenset[T] | None:
        """:meth:`take` of as many pages as leave ``free_len`` in the list: for
        a caller that reads ``len(free_pages)`` after the allocator's call
        (any merge inside it recorded by then). O(#runs consumed).

        Raises:
            InvalidArgumentError: ``free_len`` is not an int ``>= 0``.
        """
        _count(free_len, "free_len")
        if not self._armed:
            return None
        if free_len > self._free:
            self.disarm(f"the free list grew to {free_len} pages across an allocation from {self._free}")
            return None
        return self.take(self._free - free_len)

    def take_back(self, n: int) -> frozenset[T] | None:
        """Like :meth:`take`, but from the back of the list: the pages freed
        longest ago under LIFO ("cold-first" placement). SGLang's allocators
        never do this; it models a placement for loads. O(#runs consumed).

        Raises:
            InvalidArgumentError: ``n`` is not an int ``>= 0``.
        """
        _count(n, "n")
        if not self._armed:
            return None
        if n > self._free:
            self.disarm(f"an allocation of {n} pages from a free list of {self._free}")
            return None
        return self._pop(n, front=False)

    def peek(self, n: int, *, back: bool = False) -> frozenset[T] | None:
        """The fence :meth:`take` (or :meth:`take_back`) of ``n`` pages would
        return, consuming nothing; ``None`` also when ``n`` exceeds
        :attr:`free_len`. O(#runs read).

        Raises:
            InvalidArgumentError: ``n`` is not an int ``>= 0``.
        """
        _count(n, "n")
        if not self._armed or n > self._free:
            return None
        tags: set[object] = set()
        it = reversed(self._runs) if back else iter(self._runs)
        left = n
        for count, tag in it:
            if left <= 0:
                break
            if tag is UNKNOWN:
                return None
            if tag is not None:
                tags.add(tag)
            left -= count  # type: ignore[operator]
        return frozenset(tags)  # type: ignore[arg-type]

    def merge(self, *, free_len: int | None = None, staged_len: int | None = None) -> bool:
        """Mirror ``merge_and_sort_free``: with pages staged, free and staged
        pages become one sorted list, one :data:`UNKNOWN` run; with none
        staged it does nothing (as SGLang's). Returns :attr:`armed`.
        O(#runs).

        Raises:
            InvalidArgumentError: a length is not an int ``>= 0``.
        """
        for v, what in ((free_len, "free_len"), (staged_len, "staged_len")):
            if v is not None:
                _count(v, what)
        if not self._armed:
            return False
        if self._staged:
            total = self._free + self._staged
            self._runs.clear()
            self._runs.append([total, UNKNOWN])
            self._free, self._staged = total, 0
        return self._after(free_len, staged_len)

    def forget(self) -> None:
        """Mark every free page :data:`UNKNOWN` (the free list was changed by
        a path the caller does not mirror but whose lengths still agree).
        O(#runs)."""
        if self._armed:
            self._runs.clear()
            if self._free:
                self._runs.append([self._free, UNKNOWN])

    # ------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------

    def _reset(self, num_pages: int, token: object) -> None:
        self._runs.clear()
        self._free, self._staged = 0, 0
        if num_pages:
            self._push(num_pages, token, front=False)

    def _push(self, n: int, tag: object, *, front: bool) -> None:
        runs = self._runs
        if runs:
            end = runs[0] if front else runs[-1]
            if _same(end[1], tag):
                end[0] += n  # type: ignore[operator]
                self._free += n
                return
        if front:
            runs.appendleft([n, tag])
        else:
            runs.append([n, tag])
        self._free += n

    def _pop(self, n: int, *, front: bool) -> frozenset[T] | None:
        runs = self._runs
        tags: set[object] = set()
        unknown = False
        left = n
        while left:
            run = runs[0] if front else runs[-1]
            count: int = run[0]  # type: ignore[assignment]
            tag = run[1]
            if tag is UNKNOWN:
                unknown = True
            elif tag is not None:
                tags.add(tag)
            if count <= left:
                if front:
                    runs.popleft()
                else:
                    runs.pop()
                left -= count
            else:
                run[0] = count - left
                left = 0
        self._free -= n
        return None if unknown else frozenset(tags)  # type: ignore[arg-type]

    def _after(self, free_len: int | None, staged_len: int | None) -> bool:
        if free_len is None and staged_len is None:
            return self._armed
        return self.check(self._free if free_len is None else free_len, staged_len)


def classify(fence: frozenset[int] | None, tail: int) -> Literal["early", "tail", "unknown"]:
    """How a transfer's exact fence compares with the stream tail SGLang's
    ``wait_stream`` waits on, for integer tags that count forwards (the
    ``n``-th forward enqueued is tag ``n``; ``tail`` is the newest enqueued).

    ``"unknown"``: no fence (the transfer keeps ``wait_stream``);
    ``"early"``: the fence is empty or names only forwards before the tail,
    so the transfer may start before the tail forward ends; ``"tail"``: it
    names the tail itself (no gain). O(len(fence)).

    >>> classify(frozenset({3, 4}), 5), classify(frozenset({5}), 5), classify(None, 5)
    ('early', 'tail', 'unknown')
    """
    if fence is None:
        return "unknown"
    return "early" if not fence or max(fence) < tail else "tail"


class TransferCounters:
    """Counts of HiCache transfers by how their exact fence compares with
    the stream tail (:func:`classify`), for loads (host to device) and
    writes (device to host): what audit mode reports and what the SGLang
    replay (:mod:`blockpool.replay.sglang`) computes.

    Attributes (ints, each a count since construction): ``loads``,
    ``loads_early``, ``loads_unknown``, ``load_pages``,
    ``load_pages_early``, and the same five for ``writes``.
    """

    __slots__ = (
        "load_pages",
        "load_pages_early",
        "loads",
        "loads_early",
        "loads_unknown",
        "write_pages",
        "write_pages_early",
        "writes",
        "writes_early",
        "writes_unknown",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def record(
        self, kind: Literal["load", "write"], pages: int, verdict: Literal["early", "tail", "unknown"]
    ) -> None:
        """Count one transfer of ``pages`` pages with ``verdict`` (from
        :func:`classify`). O(1).

        Raises:
            InvalidArgumentError: ``kind`` or ``verdict`` is not one of
                the names above, or ``pages`` is not an int ``>= 0``
                (nothing counted).
        """
        _count(pages, "pages")
        if kind not in ("load", "write") or verdict not in ("early", "tail", "unknown"):
            raise InvalidArgumentError(f"unknown transfer kind {kind!r} or verdict {verdict!r}")
        p = kind + "s"
        setattr(self, p, getattr(self, p) + 1)
        setattr(self, kind + "_pages", getattr(self, kind + "_pages") + pages)
        if verdict == "early":
            setattr(self, p + "_early", getattr(self, p + "_early") + 1)
            setattr(self, kind + "_pages_early", getattr(self, kind + "_pages_early") + pages)
        elif verdict == "unknown":
            setattr(self, p + "_unknown", getattr(self, p + "_unknown") + 1)

    def as_dict(self) -> dict[str, int]:
        """The counts by name. O(1)."""
        return {name: getattr(self, name) for name in sorted(self.__slots__)}


def as_fence(tags: Iterable[Token]) -> Fence:
    """The :class:`~blockpool.core.hazards.Fence` of a set of core tokens:
    the newest token per ``DEVICE`` stream (an in-order stream's newest
    covers the older ones), every ``HOST`` token. O(k log k).

    >>> [str(t) for t in as_fence([Token("forward", 3), Token("forward", 5)])]
    ['forward:5']
    """
    return EMPTY_FENCE.merge(Fence(tuple(tags)))
