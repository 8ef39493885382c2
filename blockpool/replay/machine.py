"""The plumbing of one policy's replay: pool, simulated machine, race oracle
and event log, kept in step with each other.

:class:`Machine` owns the order of things. Every token the pool issues is
recorded in the oracle with the waits the policy honours, submitted to the
simulator, and its block accesses are reported; every completion the
simulator reports goes to the pool (by the simulator) and to the oracle
before anything else is recorded, so the oracle knows exactly what the
scheduler knew. Fences for a ``DEVICE`` stream whose work is enqueued later
(a step's allocations) collect as *pending waits* and are enqueued before the
stream's next token, which is what the pool assumed when it recorded the
stream as waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from blockpool.checking.race_oracle import RaceOracle
from blockpool.core.block import KVCacheBlock
from blockpool.core.hazards import AccessKind, Fence, StreamKind, Token
from blockpool.core.placement import run_spans
from blockpool.core.pool import HazardAwareBlockPool
from blockpool.replay.eventlog import EventLog
from blockpool.replay.policies import WaitPolicy
from blockpool.replay.state import TimedPool
from blockpool.sim.simulator import StreamSimulator, StreamSpec, Work

__all__ = ["Machine", "min_runs", "runs"]

_READ, _WRITE = AccessKind.READ, AccessKind.WRITE
_HOST = StreamKind.HOST
_FENCE_CALLS = ("allocate_for", "fence_for", "begin_load", "begin_store", "begin_copy")


def runs(blocks: Sequence[KVCacheBlock]) -> int:
    """Runs of consecutive block ids in ``blocks``, in their order (null
    blocks skipped): the descriptors a transfer of them posts when each run
    is one (NIXL, Mooncake, a ``cudaMemcpy`` batch). ``[4, 5, 6, 9]`` is 2
    runs; ``[6, 5, 4]`` is 3 (a descriptor covers ascending addresses).
    0 for no blocks. O(len(blocks)).

    >>> from blockpool.core.block import KVCacheBlock
    >>> runs([KVCacheBlock(i) for i in (4, 5, 6, 9)])
    2
    """
    n = 0
    prev = -2
    for b in blocks:
        if b.is_null:
            continue
        i = b.block_id
        if i != prev + 1:
            n += 1
        prev = i
    return n


def min_runs(ids: Iterable[int], n: int) -> int:
    """The fewest runs of consecutive ids that ``n`` of the distinct
    ``ids`` can form: the longest runs first until they hold ``n`` (no
    ``k`` runs hold more than the ``k`` longest). The floor for any
    allocator choosing ``n`` blocks from that free set. 0 for ``n <= 0``.
    O(m log m), m = number of ids.

    Raises:
        ValueError: fewer than ``n`` ids.

    >>> min_runs([1, 2, 3, 7, 8, 20], 4)
    2
    """
    if n <= 0:
        return 0
    s = sorted(ids)
    if len(s) < n:
        raise ValueError(f"{n} blocks wanted from {len(s)} ids")
    lengths = sorted((length for length, _ in run_spans(s)), reverse=True)
    got = k = 0
    while got < n:
        got += lengths[k]
        k += 1
    return k


class Machine:
    """Pool + simulator + oracle (+ event log) for one policy.

    Args:
        policy: A policy name (:data:`~blockpool.replay.policies.POLICIES`).
        streams: The simulated machine (``{name: StreamSpec}``).
        num_blocks, block_size: The pool.
        seed: Simulator seed.
        events: Event log, or ``None``.
        timeline: Works kept per stream for plots.

    Attributes:
        pool: The pool's timed operations (:class:`TimedPool`).
        raw_pool: The pool itself (for ``check``/``stats``).
        sim: The :class:`~blockpool.sim.simulator.StreamSimulator`.
        oracle: The :class:`~blockpool.checking.race_oracle.RaceOracle`.
        now: Scheduler time (simulated seconds).
    """

    def __init__(
        self,
        policy: str,
        streams: Mapping[str, StreamSpec],
        num_blocks: int,
        block_size: int,
        seed: int,
        events: EventLog | None = None,
        timeline: int = 0,
        *,
        eviction: str = "lru",
        placement: str = "lru",
        label: str | None = None,
    ) -> None:
        kinds = {n: s.kind for n, s in streams.items()}
        self.kinds = kinds
        self.policy_name = label if label is not None else policy
        self.newest: dict[str, Token] = {}
        self.now = 0.0
        self.raw_pool = HazardAwareBlockPool(
            num_blocks,
            enable_caching=True,
            hash_block_size=block_size,
            track_hazards=policy != "blind",
            streams=kinds,
            clock=lambda: self.now,
            eviction=eviction,
            placement=placement,
        )
        self.pool = TimedPool(self.raw_pool)
        if events is not None:
            for call in _FENCE_CALLS:
                setattr(self.pool, call, self._logged(call, getattr(self.pool, call)))
        self.sim = StreamSimulator(streams, seed=seed, pool=self.pool, timeline=timeline)
        self.policy = WaitPolicy(policy, kinds, self.newest, self.sim.is_ended)
        self.oracle = RaceOracle(kinds)
        self.events = events
        self._pending: dict[str, list[Token]] = {n: [] for n, k in kinds.items() if k is StreamKind.DEVICE}
        self.oracle_ns = 0
        self.loads = 0
        self.loads_empty = 0
        self.loads_short_of_ready = 0  # waited, and fewer ready free blocks than needed existed
        self.load_delays: list[float] = []
        self.load_runs: list[int] = []  # runs of consecutive block ids, per load
        self.load_min_runs: list[int] = []  # the fewest its block count allowed (min_runs)
        self.store_runs: list[int] = []  # the same, per store

    def _logged(self, call: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a pool call that hands out a fence), writing a ``fence``
        event for each fence it returns."""

        def logged(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            stream = args[1] if len(args) > 1 else kwargs["stream"]
            if call == "fence_for":
                fence, ids = out, [b.block_id for b in args[0]]
            elif call == "allocate_for":
                fence = out[1]
                ids = [b.block_id for b in (*kwargs.get("hits", ()), *out[0])]
            elif call == "begin_copy":
                fence, ids = out[1], [b.block_id for pair in args[0] for b in pair]
            else:
                fence, ids = out[1], [b.block_id for b in args[0]]
            assert self.events is not None
            self.events.fence(
                self.policy_name,
                call,
                stream,
                [i for i in ids if i],
                [str(t) for t in fence],
                fence.needs_host_wait,
            )
            return out

        return logged

    # -- waits ---------------------------------------------------------------

    def device_fence(self, fence: Fence, stream: str) -> None:
        """A fence for ``stream`` (DEVICE) whose work is enqueued later: its
        policy waits go before the stream's next token. O(len(fence))."""
        if fence or self.policy.name in ("step-event", "device-sync"):
            ws = self.policy.waits(fence, stream)
            if ws:
                self._pending[stream].extend(ws)

    def alloc_fence(self, fence: Fence, stream: str) -> None:
        """The fence of an allocation for ``stream`` whose access begins
        later: a ``DEVICE`` stream waits on it before its next token (as
        :meth:`device_fence`); a ``HOST`` engine keeps no standing order, so
        the fence of the access itself names the same tokens again. O(len(fence))."""
        if self.kinds[stream] is StreamKind.DEVICE:
            self.device_fence(fence, stream)

    def _take(self, stream: str, extra: Iterable[Token] = ()) -> list[Token]:
        """Pending waits of ``stream`` plus ``extra`` merged into one minimal
        wait list: the newest token per in-order DEVICE stream, and no token
        that another token of the list already covers through its issue-time
        clock (what its stream had waited on before it;
        :meth:`~blockpool.core.tracker.HazardTracker.drop_covered`, the rule the
        pool's fences follow)."""
        pend = self._pending.get(stream)
        toks = [*pend, *extra] if pend else list(extra)
        if pend:
            pend.clear()
        if len(toks) < 2:
            return toks
        newest: dict[object, Token] = {}
        for t in toks:
            k: object = t if t.kind is _HOST else t.stream
            cur = newest.get(k)
            if cur is None or cur.seq < t.seq:
                newest[k] = t
        merged = sorted(newest.values(), key=lambda t: (t.stream, t.seq))
        return self.raw_pool.tracker.drop_covered(merged)

    # -- tokens ----------------------------------------------------------------

    def enqueue(
        self,
        token: Token,
        what: str,
        *,
        fence: Fence | None = None,
        transfer: bool = False,
        duration: float | None = None,
        num_bytes: int | None = None,
    ) -> tuple[Work, list[Token]]:
        """Record and submit the work of a freshly issued ``token`` after the
        policy's waits for ``fence`` (plus the stream's pending waits).
        Returns the work and the waits honoured. O(#waits)."""
        self.newest[token.stream] = token
        extra = self.policy.waits(fence, token.stream, transfer=transfer) if fence is not None else ()
        waits = self._take(token.stream, extra)
        t0 = time.perf_counter_ns()
        self.oracle.record(token, waits)
        self.oracle_ns += time.perf_counter_ns() - t0
        w = self.sim.submit(
            token, ready=self.now, duration=duration, num_bytes=num_bytes, waits=waits, what=what
        )
        ev = self.events
        if ev is not None:
            name = self.policy_name
            ev.issue(
                name,
                str(token),
                token.stream,
                token.seq,
                token.kind.value,
                what,
                self.now,
                w.start,
                w.end,
                w.failed,
            )
            if waits:
                host = token.kind is _HOST or any(t.kind is _HOST for t in waits)
                ev.wait(name, str(token), [str(t) for t in waits], host)
        return w, waits

    def tag(self, token: Token, blocks: Sequence[KVCacheBlock], kind: AccessKind, what: str) -> None:
        """Report that ``token``'s work reads or writes ``blocks`` (null
        blocks skipped). O(len(blocks))."""
        ids = [b.block_id for b in blocks if not b.is_null]
        if not ids:
            return
        t0 = time.perf_counter_ns()
        self.oracle.tag(token, ids, kind, what)
        self.oracle_ns += time.perf_counter_ns() - t0
        if self.events is not None:
            self.events.access(self.policy_name, str(token), token.stream, ids, kind.value, what)

    def runs_floor(self, blocks: Sequence[KVCacheBlock]) -> int:
        """The fewest runs ``blocks`` (just placed) could have had: from
        them and the blocks still free (:func:`min_runs`). Call it right
        after the allocation, before anything else is freed. O(free log free)."""
        ids = [b.block_id for b in blocks if not b.is_null]
        return min_runs(
            [*ids, *(f.block_id for f in self.raw_pool.free_block_queue if f.block_id > 0)], len(ids)
        )

    def load(
        self,
        blocks: list[KVCacheBlock],
        stream: str,
        block_bytes: int,
        *,
        ready_free: int | None = None,
        floor: int | None = None,
    ) -> Work:
        """Begin a load into ``blocks`` on ``stream``; returns its work and
        records the load-start delay, whether it waited on nothing, its
        runs, and, given ``ready_free`` (the pool's
        :meth:`~blockpool.core.pool.HazardAwareBlockPool.num_ready_free_blocks`
        for ``stream`` just before the blocks were placed), whether it
        waited because the free queue held fewer ready blocks than it
        needed (no placement could have given it an empty fence).
        ``floor``: :meth:`runs_floor` taken when the blocks were placed
        (else taken now)."""
        token, fence = self.pool.begin_load(blocks, stream)
        w, waits = self.enqueue(
            token, "load", fence=fence, transfer=True, num_bytes=len(blocks) * block_bytes
        )
        self.tag(token, blocks, _WRITE, "load")
        self.loads += 1
        if self.loads == 1:
            self.sim.mark_timeline(self.now)
        self.loads_empty += not waits
        if waits and ready_free is not None and ready_free < len(blocks):
            self.loads_short_of_ready += 1
        self.load_delays.append((w.start - self.now) * 1e3)
        self.load_runs.append(runs(blocks))
        self.load_min_runs.append(self.runs_floor(blocks) if floor is None else floor)
        return w

    def store(self, blocks: list[KVCacheBlock], stream: str, block_bytes: int) -> Work:
        """Begin a store from ``blocks`` on ``stream``; returns its work."""
        token, fence = self.pool.begin_store(blocks, stream)
        w, _ = self.enqueue(token, "store", fence=fence, transfer=True, num_bytes=len(blocks) * block_bytes)
        self.tag(token, blocks, _READ, "store")
        self.store_runs.append(runs(blocks))
        return w

    def copy(self, src: KVCacheBlock, dst: KVCacheBlock, stream: str, seconds: float) -> Work:
        """Begin a copy-on-write ``src -> dst`` on ``stream``; returns its work."""
        token, fence = self.pool.begin_copy([(src, dst)], stream)
        w, _ = self.enqueue(token, "cow-copy", fence=fence, duration=seconds)
        self.tag(token, [src], _READ, "cow-copy")
        self.tag(token, [dst], _WRITE, "cow-copy")
        return w

    def free(self, blocks: list[KVCacheBlock], last_step: Token | None) -> None:
        """Free a block table in reverse order: the block-table read by the
        last enqueued step is reported, then ``free_blocks`` tags it."""
        if not blocks:
            return
        if last_step is not None:
            self.tag(last_step, blocks, _READ, "forward")
        self.pool.free_blocks(blocks[::-1], token=last_step)

    # -- time ------------------------------------------------------------------

    def advance(self, t: float, on_end: Callable[[Work], None]) -> None:
        """Move scheduler time to ``t`` (never back) and deliver the
        completions: to the pool (the simulator does), to the oracle, to
        the event log, then to ``on_end`` one by one."""
        self.now = max(self.now, t)
        done = self.sim.advance(self.now)
        if not done:
            return
        oracle = self.oracle
        ev = self.events
        t0 = time.perf_counter_ns()
        for w in done:
            oracle.complete(w.token, failed=w.failed)
        self.oracle_ns += time.perf_counter_ns() - t0
        if ev is not None:
            for w in done:
                ev.end(self.policy_name, str(w.token), self.now, w.failed)
        for w in done:
            on_end(w)
