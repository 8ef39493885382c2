"""The plugin's runtime: fence tokens on SGLang's forward stream, the page
accounts beside SGLang's allocators, the audit counters, and the AROUND
hooks on the allocators (the controllers' are in
:mod:`~blockpool.integrations.sglang.controllers`).

Tokens. A token is an int sequence number; the :class:`Runtime` keeps, for
each token not yet complete, the event it recorded on the tail of the
forward stream (``stream.record_event()``) and the number of forwards
launched by then. The forward stream is SGLang's ``load_fence_stream`` of
the HiCache controller, bound at the first hook that sees it (each
scheduler step's ``check_hicache_events`` does). Completion is polled with
``event.query()`` from the oldest token on, at each transfer: the stream is
in order, so the first incomplete event ends the poll. Token
:data:`UNBOUND` tags pages released before a forward stream was bound: a
fence that holds it is unknown (SGLang's ``wait_stream`` stays).

A token covers the forwards enqueued before it, but not a batch SGLang
built before it and launches after it: with overlap disabled for a batch
(``is_disable_overlap_for_batch``: a grammar under speculative decoding,
consecutive prefills with ``SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP``),
the scheduler builds batch N+1, processes batch N's results (the releases
of its finished requests), then launches N+1, whose rows may still include
those requests for one step. So a token stands for the *launch token*
recorded after the first forward launched after it (``Scheduler.run_batch``
returned): each of SGLang's loops that launch through ``run_batch`` builds
at most one batch ahead of its launch (the loops are declared in the
surface). Until that launch the token is provisional, and a fence holding
one keeps SGLang's ``wait_stream`` (:meth:`Runtime.effective`). Where
``run_batch`` is not wrapped, no token is ever promoted. A token that
cannot be recorded (``record_event`` raising) is :data:`UNBOUND`: its
fences keep ``wait_stream``.

Allocators. Only the exact classes ``PagedTokenToKVPoolAllocator`` (LIFO)
and ``TokenToKVPoolAllocator`` (FIFO) are shadowed, each by a
:class:`~blockpool.integrations.sglang.account.PageAccount` created when
the allocator's ``clear()`` runs (its constructor calls it): an allocator
built before the hooks were armed, or of any other class (SWA, unified,
interleave, NPU subclasses), has no account, and its loads keep SGLang's
``wait_stream``. Every hook compares the account with
``len(free_pages)`` and the staged count; a mismatch disarms that account
with one log line.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from blockpool.core.errors import InvalidArgumentError
from blockpool.integrations.sglang.account import PageAccount

logger = logging.getLogger("blockpool.integrations.sglang")

__all__ = [
    "ENV_MODE",
    "MODES",
    "PROVISIONAL",
    "UNBOUND",
    "Counters",
    "Runtime",
    "read_mode",
    "runtime",
]

ENV_MODE = "BLOCKPOOL_SGLANG"
"""The switch: ``0`` (also ``off``, ``false``, ``no``), ``audit`` (the
default) or ``on``."""

MODES = ("off", "audit", "on")

UNBOUND = -1
"""The tag of pages released before a forward stream was bound."""

PROVISIONAL = -2
"""What :meth:`Runtime.effective` answers for a token no forward has been
launched after yet."""

_OFF = {"0", "off", "false", "no"}


def read_mode(value: str | None = None) -> str:
    """The mode named by ``value`` (default: ``$BLOCKPOOL_SGLANG``; unset or
    empty means ``audit``): ``"off"``, ``"audit"`` or ``"on"``. O(1).

    Raises:
        InvalidArgumentError: the value names no mode.
    """
    raw = os.environ.get(ENV_MODE, "") if value is None else value
    v = raw.strip().lower()
    if v == "":
        return "audit"
    if v in _OFF:
        return "off"
    if v in ("audit", "on"):
        return v
    raise InvalidArgumentError(f"{ENV_MODE}={raw!r}: expected 0, audit or on")


@dataclass
class Counters:
    """What the plugin saw, per process (ints, counts of events).

    - ``loads`` / ``writes``: HiCache transfer batches submitted
      (``start_loading`` / ``start_writing`` calls with work queued).
    - ``exact``: batches whose fence the accounts could show exactly.
    - ``fallback``: batches left to SGLang's ``wait_stream`` (a fence the
      accounts cannot show: unshadowed allocator, sorted merge, caller-owned
      rows, side-pool transfers, a disarmed account, an unbound stream, a
      token no forward was launched after yet).
    - ``fence_empty``: exact batches with nothing to wait on.
    - ``fence_complete``: exact batches whose newest token had completed
      when the batch was submitted.
    - ``fence_behind_tail``: exact batches whose newest token was recorded
      before the last forward launch (a forward was enqueued after it:
      SGLang's ``wait_stream`` waits for that forward, the exact fence does
      not). Counted only where the scheduler's ``run_batch`` is wrapped.
    - ``waits_replaced``: batches submitted with ``wait_event`` instead of
      ``wait_stream`` (``on`` only); ``events_waited``: the ``wait_event``
      calls made.
    - ``races``: accesses SGLang's own waits leave unordered (retraction
      backups: ``UnifiedRadixCache.backup_kv_cache`` copies device pages to
      the host with no write fence).
    - ``disarmed``: page accounts disarmed by a length mismatch.
    - ``node_tagged``: evicted radix nodes whose freed pages were tagged
      with the node's last use instead of a token at the tail
      (:mod:`~blockpool.integrations.sglang.tree`).
    """

    loads: int = 0
    writes: int = 0
    exact: int = 0
    fallback: int = 0
    fence_empty: int = 0
    fence_complete: int = 0
    fence_behind_tail: int = 0
    waits_replaced: int = 0
    events_waited: int = 0
    races: int = 0
    disarmed: int = 0
    node_tagged: int = 0

    def gain(self) -> int:
        """Exact batches that ``on`` lets start before the stream tail
        (empty, complete or behind the tail). O(1)."""
        return self.fence_empty + self.fence_complete + self.fence_behind_tail

    def as_dict(self) -> dict[str, int]:
        """The counters by name, plus ``gain``. O(1)."""
        d = asdict(self)
        d["gain"] = self.gain()
        return d


class Runtime:
    """The plugin's state in one process: mode, armed flag, forward stream,
    tokens, page accounts, per-operation fences and counters.

    Args:
        mode: ``"audit"`` or ``"on"`` (``"off"`` installs nothing and never
            builds a runtime).

    Raises:
        InvalidArgumentError: ``mode`` is not ``"audit"`` or ``"on"``.
    """

    def __init__(self, mode: str = "audit") -> None:
        if mode not in ("audit", "on"):
            raise InvalidArgumentError(f"mode must be 'audit' or 'on', got {mode!r}")
        self.mode = mode
        self.armed: bool | None = None  # None: not yet checked against HookRegistry
        self.pending_write: int | None = None
        self.targets: tuple[str, ...] = ()
        self.stream: Any = None
        self.counters = Counters()
        self._lock = threading.RLock()
        self._seq = 0
        self._done = 0  # every token <= _done is complete
        self._pending: deque[tuple[int, Any, int]] = deque()  # (seq, event, launches)
        self._by_seq: dict[int, tuple[Any, int]] = {}
        self.launches = 0
        self.launch_hooked = False
        # Launch tokens: tokens recorded since the last launch wait for the
        # next one; each launch that has some records (highest, launch token).
        self._unpromoted: list[int] = []
        self._promoted: list[tuple[int, int]] = []
        self._promoted_head = 0
        self._promoted_done = 0  # every token <= this has a complete launch token
        self.accounts: weakref.WeakKeyDictionary[Any, PageAccount[int]] = weakref.WeakKeyDictionary()
        self.op_fences: weakref.WeakKeyDictionary[Any, frozenset[int] | None] = weakref.WeakKeyDictionary()
        self.last_take: frozenset[int] | None | _NotTaken = NOT_TAKEN
        self.loading = 0  # depth of controller ``load`` calls in progress
        self.race_logged = False
        self.record_failed = False
        # Radix-node tags (tree.py): per tree cache, node id -> the token of
        # its last use, or None where node tags are off for that cache.
        self.node_tags: weakref.WeakKeyDictionary[Any, dict[int, int] | None] = weakref.WeakKeyDictionary()
        # While a radix node's device pages are freed: (allocator, token, pages).
        self.free_ctx: tuple[Any, int, int] | None = None
        self._paged_cls: type | None = None
        self._token_cls: type | None = None

    # ------------------------------------------------------------------
    # arming
    # ------------------------------------------------------------------

    def arm(self, targets: Iterable[str], patched: Iterable[str], resolve: Callable[[str], Any]) -> bool:
        """Arm when every target is in ``patched`` (``HookRegistry._patched``)
        and resolves to a wrapper (an attribute with ``__wrapped__``); else
        log one line naming the targets that are not, and stay inert (every
        hook passes through). Returns :attr:`armed`. O(#targets)."""
        targets = tuple(targets)
        done = set(patched)
        if not targets:
            self.armed = False
            return False
        missing = [t for t in targets if t not in done or not hasattr(resolve(t), "__wrapped__")]
        self.targets = targets
        if missing:
            logger.warning(
                "blockpool: SGLang hooks not applied to %s; the plugin stays inert (SGLang's waits unchanged)",
                ", ".join(missing),
            )
            self.armed = False
            return False
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        self._paged_cls = PagedTokenToKVPoolAllocator
        self._token_cls = TokenToKVPoolAllocator
        self.armed = True
        logger.info("blockpool: SGLang plugin armed in %s mode (%d hooks)", self.mode, len(targets))
        return True

    # ------------------------------------------------------------------
    # tokens
    # ------------------------------------------------------------------

    def bind(self, stream: Any) -> None:
        """Take ``stream`` as the forward stream if none is bound yet. O(1)."""
        if self.stream is None and stream is not None:
            self.stream = stream

    def record(self) -> int:
        """A token at the forward stream's tail now (:data:`UNBOUND` when no
        stream is bound, or when recording the event raised: logged once,
        never raised into SGLang). O(1)."""
        if self.stream is None:
            return UNBOUND
        try:
            event = self.stream.record_event()
        except Exception as exc:  # noqa: BLE001  (never out of SGLang's loop: the fence keeps wait_stream)
            if not self.record_failed:
                self.record_failed = True
                logger.warning(
                    "blockpool: recording an event on the forward stream failed (%r); "
                    "the transfers it would fence keep SGLang's wait_stream",
                    exc,
                )
            return UNBOUND
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._pending.append((seq, event, self.launches))
            self._by_seq[seq] = (event, self.launches)
            self._unpromoted.append(seq)
        return seq

    def launched(self) -> None:
        """A forward was just enqueued (``Scheduler.run_batch`` returned): the
        tokens recorded since the previous launch are promoted to a launch
        token recorded now. O(1) amortized."""
        with self._lock:
            if not self._unpromoted or self.stream is None:
                return
            highest = self._unpromoted[-1]
            launch = self.record()  # recorded after the launch: itself final
            if launch == UNBOUND:
                return  # not recorded: they wait for a later launch
            self._unpromoted.clear()
            self._promoted.append((highest, launch))

    def effective(self, seq: int) -> int:
        """The launch token standing for token ``seq`` (see the module's
        docstring): ``0`` when complete, :data:`PROVISIONAL` when no forward
        was launched after it yet (or never will be known: ``run_batch`` not
        wrapped). O(log #launches not yet complete)."""
        if not self.launch_hooked:
            return PROVISIONAL
        with self._lock:
            if seq <= self._promoted_done:
                return 0
            lo, hi = self._promoted_head, len(self._promoted)
            if lo == hi or seq > self._promoted[hi - 1][0]:
                return PROVISIONAL
            while lo < hi:  # the first launch whose highest token is >= seq
                mid = (lo + hi) // 2
                if self._promoted[mid][0] < seq:
                    lo = mid + 1
                else:
                    hi = mid
            launch = self._promoted[lo][1]
        return 0 if launch <= self._done else launch

    def effective_fence(self, fence: frozenset[int]) -> frozenset[int] | None:
        """The launch tokens standing for ``fence``'s tokens, the complete
        ones left out; ``None`` when one is provisional. O(k log n)."""
        out: set[int] = set()
        for seq in fence:
            e = self.effective(seq)
            if e == PROVISIONAL:
                return None
            if e:
                out.add(e)
        return frozenset(out)

    def poll(self) -> None:
        """Mark complete the tokens whose events have completed, oldest
        first, stopping at the first that has not. O(#completed)."""
        with self._lock:
            while self._pending:
                seq, event, _ = self._pending[0]
                if not event.query():
                    break
                self._pending.popleft()
                del self._by_seq[seq]
                self._done = seq
            promoted = self._promoted
            while self._promoted_head < len(promoted) and promoted[self._promoted_head][1] <= self._done:
                self._promoted_done = promoted[self._promoted_head][0]
                self._promoted_head += 1
            if self._promoted_head > 1024 and self._promoted_head * 2 > len(promoted):
                del promoted[: self._promoted_head]
                self._promoted_head = 0

    def release_token(self, allocator: Any, n: int) -> int:
        """The tag of a release of ``n`` pages (tokens for the token
        allocator) by ``allocator``: the evicted radix node's last-use token
        when this is the first release of that node's eviction and frees
        exactly the node's own pages (:attr:`free_ctx`), else a token at the
        tail now. The node's context is spent by its allocator's first
        release either way. O(1)."""
        ctx = self.free_ctx
        if ctx is not None and ctx[0] is allocator:
            self.free_ctx = None
            if n == ctx[2]:
                self.counters.node_tagged += 1
                return ctx[1]
        return self.record()

    def newest(self, fence: frozenset[int]) -> int:
        """The newest token of ``fence`` (0 when empty). O(len(fence))."""
        return max(fence, default=0)

    def event_of(self, seq: int) -> Any:
        """The event of an incomplete token, ``None`` once complete. O(1)."""
        if seq <= self._done:
            return None
        entry = self._by_seq.get(seq)
        return None if entry is None else entry[0]

    def launched_after(self, seq: int) -> bool:
        """Whether a forward was launched after token ``seq`` was recorded
        (known only where ``run_batch`` is wrapped). O(1)."""
        entry = self._by_seq.get(seq)
        return self.launch_hooked and entry is not None and self.launches > entry[1]

    # ------------------------------------------------------------------
    # accounts
    # ------------------------------------------------------------------

    def account_of(self, allocator: Any) -> PageAccount[int] | None:
        """The armed account of ``allocator``, ``None`` when it has none or
        it was disarmed. O(1)."""
        acct = self.accounts.get(allocator)
        return acct if acct is not None and acct.armed else None

    def check(self, allocator: Any, acct: PageAccount[int]) -> bool:
        """Compare ``acct`` with the allocator's lengths; count a disarm.
        O(1)."""
        if not acct.check(len(allocator.free_pages), _staged(allocator)):
            self.counters.disarmed += 1
            return False
        return True


class _NotTaken:
    __slots__ = ()


NOT_TAKEN = _NotTaken()
"""No allocation was mirrored since the slot was reset."""


def _staged(allocator: Any) -> int:
    n = getattr(allocator, "num_staged_pages", None)
    if n is not None:
        return int(n)
    rel = getattr(allocator, "release_pages", None)
    return 0 if rel is None else len(rel)


def fence_known(fence: frozenset[int] | None) -> bool:
    """Whether ``fence`` names every token (not unknown, no :data:`UNBOUND`)."""
    return fence is not None and UNBOUND not in fence


_RUNTIME: Runtime | None = None


def runtime() -> Runtime | None:
    """The process's runtime (``None`` before :func:`register` installs one
    or when the plugin is off). O(1)."""
    return _RUNTIME


def set_runtime(rt: Runtime | None) -> None:
    """Install ``rt`` as the process's runtime (tests reset it). O(1)."""
    global _RUNTIME
    _RUNTIME = rt


def _armed() -> Runtime | None:
    rt = _RUNTIME
    if rt is None:
        return None
    if rt.armed is None:
        _decide(rt)
    return rt if rt.armed else None


def resolve_attr(target: str) -> Any:
    """The attribute HookRegistry set at ``target`` (``module.Class.method``),
    as stored on the class; ``None`` when missing. O(1) plus the import."""
    import inspect
    import pkgutil

    obj_path, attr = target.rsplit(".", 1)
    try:
        obj = pkgutil.resolve_name(obj_path)
    except (ImportError, AttributeError, ValueError):
        return None
    raw = inspect.getattr_static(obj, attr, None)
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _decide(rt: Runtime) -> None:
    # First hook call after SGLang's apply_hooks(): arm only if every target
    # was patched (apply_hooks logs and skips a target that fails).
    from sglang.srt.plugins.hook_registry import HookRegistry

    rt.arm(rt.targets, HookRegistry._patched, resolve_attr)


# ----------------------------------------------------------------------
# allocator hooks (AROUND: fn(original, self, *args, **kwargs))
# ----------------------------------------------------------------------


def _shadowed(rt: Runtime, allocator: Any) -> PageAccount[int] | None:
    if type(allocator) is not rt._paged_cls and type(allocator) is not rt._token_cls:
        return None
    return rt.account_of(allocator)


def hook_clear(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``clear()`` of both allocators: start the account, or restart it
    with every page tagged at the tail now."""
    result = original(self, *args, **kwargs)
    rt = _armed()
    if rt is None or (type(self) is not rt._paged_cls and type(self) is not rt._token_cls):
        return result
    n = len(self.free_pages)
    acct = rt.accounts.get(self)
    if acct is None:
        order = "lifo" if type(self) is rt._paged_cls else "fifo"
        rt.accounts[self] = PageAccount(
            n, order=order, need_sort=bool(self.need_sort), name=type(self).__name__
        )
    elif acct.armed:
        acct.clear(n, rt.record())
        rt.check(self, acct)
    return result


def hook_release(original: Callable[..., Any], self: Any, *page_ids: Any) -> Any:
    """``PagedTokenToKVPoolAllocator._release_page_ids``: the pages join the
    free list (or the staged pages) tagged with a token at the tail now, or
    with the evicted radix node's last use (:meth:`Runtime.release_token`)."""
    rt = _armed()
    acct = None if rt is None else _shadowed(rt, self)
    if acct is None:
        return original(self, *page_ids)
    n = sum(int(p.numel()) for p in page_ids)
    token = rt.release_token(self, n)  # type: ignore[union-attr]
    result = original(self, *page_ids)
    acct.release(n, token)
    rt.check(self, acct)  # type: ignore[union-attr]
    return result


def hook_token_free(
    original: Callable[..., Any], self: Any, free_index: Any, *args: Any, **kwargs: Any
) -> Any:
    """``TokenToKVPoolAllocator.free``: as :func:`hook_release` (a free
    deferred to a free group is recorded when ``free_group_end`` frees it)."""
    rt = _armed()
    acct = None if rt is None else _shadowed(rt, self)
    if acct is None or self.free_group is not None:
        if rt is not None and rt.free_ctx is not None and rt.free_ctx[0] is self:
            rt.free_ctx = None  # deferred: released later, outside the node's eviction
        return original(self, free_index, *args, **kwargs)
    n = int(free_index.numel())
    token = rt.release_token(self, n) if n else UNBOUND  # type: ignore[union-attr]
    result = original(self, free_index, *args, **kwargs)
    if n:
        acct.release(n, token)
    rt.check(self, acct)  # type: ignore[union-attr]
    return result


def hook_alloc(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``alloc``, ``alloc_extend``, ``alloc_decode``: the pages taken from the
    front of the free list (as many as the list shrank by, any merge inside
    already mirrored); their fence is left in ``Runtime.last_take`` for the
    controller's ``load`` hook, joined with the fences of the allocations
    made before it in the same ``load`` (unknown if any is)."""
    rt = _armed()
    if rt is None:
        return original(self, *args, **kwargs)
    acct = _shadowed(rt, self)
    if acct is None or not rt.check(self, acct):
        # No account, or the list changed behind it (checked before the
        # call: the take below is sized by the list's length afterwards).
        _take(rt, None)
        return original(self, *args, **kwargs)
    result = original(self, *args, **kwargs)
    if result is None:
        rt.check(self, acct)
        if not rt.loading:
            rt.last_take = NOT_TAKEN
        return result
    take = acct.take_to(len(self.free_pages))
    _take(rt, take if rt.check(self, acct) else None)
    return result


def _take(rt: Runtime, fence: frozenset[int] | None) -> None:
    # Inside a controller's load, every shadowed allocation adds to the
    # load's fence (SWATokenToKVPoolAllocator.alloc is two: its full and
    # its sliding-window allocator, and the copy writes the pages of both);
    # elsewhere the last allocation's fence replaces the previous one.
    prev = rt.last_take
    if not rt.loading or isinstance(prev, _NotTaken):
        rt.last_take = fence
    elif prev is None or fence is None:
        rt.last_take = None
    else:
        rt.last_take = prev | fence


def hook_merge(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``merge_and_sort_free``: a sort; the account's runs become unknown."""
    rt = _armed()
    acct = None if rt is None else _shadowed(rt, self)
    result = original(self, *args, **kwargs)
    if acct is not None:
        acct.merge()
        rt.check(self, acct)  # type: ignore[union-attr]
    return result


def hook_run_batch(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.run_batch``: one forward launched on the forward stream
    (a prebuilt batch, PD decode's placeholder, launches none: SGLang
    returns ``_run_batch_prebuilt`` for it before any forward); once it is
    enqueued, the tokens recorded before it are promoted
    (:meth:`Runtime.launched`)."""
    rt = _armed()
    if rt is None:
        return original(self, *args, **kwargs)
    batch = args[0] if args else kwargs.get("batch")
    mode = getattr(batch, "forward_mode", None)
    result = original(self, *args, **kwargs)  # raising: no launch counted, nothing promoted
    if not (mode is not None and mode.is_prebuilt()):
        rt.launches += 1
        rt.launched()
    return result
