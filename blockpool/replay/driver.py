"""The workload driver: a vLLM-like scheduler loop over a trace, on a pool,
a simulated machine and the race oracle, under one wait policy.

What one step does (continuous batching, chunked prefill, a token budget):
running requests first (one decode token, or the next prefill chunk; a
request that needs a block and finds none preempts the newest running
request, or itself), then requests whose host-engine load ended, then new
arrivals in order. A new request touches its prefix-cache hits
(``get_cached_block`` over its chain of block keys), loads the following
blocks that the external store holds (``begin_load`` on ``h2d``, or on the
``rdma`` engine, in which case it waits for the load before computing),
copies a shared partial tail block it can reuse (``begin_copy``), and
computes the rest. A finished request stores its new full blocks
(``begin_store`` on ``d2h`` or the ``xfer`` engine), publishes its partial
tail, and frees its block table in reverse order with the last enqueued
step's token. Async scheduling (on by default) enqueues step N+1 before step
N's output is seen, so a finishing request may run one step past its last
token, and its blocks are freed while that step still reads them.

Every access is reported to the race oracle with the waits actually honoured
(the plumbing is :class:`blockpool.replay.machine.Machine`); this module
keeps the configuration and the admission and step logic.
"""

from __future__ import annotations

import collections
import heapq
import random
import time
from collections.abc import Callable

import attrs

from blockpool.core.block import KVCacheBlock
from blockpool.core.hazards import Token
from blockpool.replay.config import ReplayConfig, ReplayError, request_blocks
from blockpool.replay.eventlog import EventLog
from blockpool.replay.machine import Machine
from blockpool.replay.report import PolicyResult, plural
from blockpool.replay.state import ExternalStore, Phase, Request
from blockpool.replay.steps import Entry, StepBuilder
from blockpool.replay.traces import TraceRequest
from blockpool.sim.simulator import Work

__all__ = ["run_policy"]


class _Scheduler(StepBuilder):
    """One policy's replay of one trace (see the module docstring)."""

    def __init__(
        self,
        requests: tuple[TraceRequest, ...],
        policy: str,
        cfg: ReplayConfig,
        events: EventLog | None,
        progress: Callable[[int], None] | None,
        label: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.bs = cfg.block_size
        self.m = Machine(
            policy, dict(cfg.streams), cfg.num_blocks, cfg.block_size, cfg.seed, events, cfg.timeline,
            eviction=cfg.eviction, placement=cfg.placement, label=label,
        )  # fmt: skip
        self.pool = self.m.pool
        self.block_bytes = cfg.cost.block_bytes(cfg.block_size)
        self.store = ExternalStore(cfg.store_capacity_blocks)
        self.storing: dict[Token, list[tuple[int, ...]]] = {}
        self.store_pending: set[tuple[int, ...]] = set()
        self.progress = progress
        rng = random.Random(cfg.seed)
        plans = []
        for tr in requests:  # file order: the same draws for every policy
            remote, aborted, kind, frac = rng.random(), rng.random(), rng.randrange(3), rng.random()
            plan = ("queue", "load", "decode")[kind] if aborted < cfg.abort_fraction else None
            plans.append(Request(tr, remote < cfg.remote_fraction, plan, frac))
        plans.sort(key=lambda r: (r.trace.arrival_s, r.trace.request_id))
        self.arrivals = collections.deque(plans)
        self.waiting: collections.deque[Request] = collections.deque()
        self.ready: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.loading: dict[Token, Request] = {}
        self.inflight: collections.deque[tuple[Token, list[Entry]]] = collections.deque()
        self.aborts: list[tuple[float, int, Request]] = []
        self.entries: list[Entry] = []
        self.written: list[KVCacheBlock] = []
        self.new_tokens = 0
        self.context = 0
        self.watermark = int(cfg.watermark * cfg.num_blocks)
        self.blocked: tuple[Request, int] | None = None
        self.c = collections.Counter()  # type: ignore[var-annotated]
        self.served = 0
        self.output_tokens = 0
        self.done = 0

    # -- the loop --------------------------------------------------------------

    def run(self) -> None:
        m, depth = self.m, 2 if self.cfg.async_scheduling else 1
        while True:
            while len(self.inflight) >= depth:
                m.advance(m.sim.end_of(self.inflight[0][0]), self._on_end)
            m.advance(m.now, self._on_end)
            self._arrive()
            self._abort_due()
            if self._step():
                m.now += self.cfg.sched_overhead_s
                continue
            t = self._next_event()
            if t is None:
                break
            m.advance(t, self._on_end)
        while (t := m.sim.next_time()) is not None:
            m.advance(t, self._on_end)
        stuck = [r for r in (*self.waiting, *self.ready, *self.running) if r.phase is not Phase.DONE]
        if stuck or self.loading:
            raise ReplayError(
                f"replay stalled with {plural(len(stuck), 'request')} unserved, e.g. {stuck[:3]}"
            )
        if self.progress is not None:
            self.progress(self.done)

    def _next_event(self) -> float | None:
        times = [self.arrivals[0].trace.arrival_s] if self.arrivals else []
        if self.aborts:
            times.append(self.aborts[0][0])
        nt = self.m.sim.next_time()
        if nt is not None:
            times.append(nt)
        if times:
            return min(times)
        if not self.running and any(r.phase is not Phase.DONE for r in (*self.ready, *self.waiting)):
            self._unstick()
            return self.m.now
        return None

    def _unstick(self) -> None:
        """Nothing runs and nothing will happen, but requests wait: the
        blocks are held by requests ready for compute; send all but the
        oldest back to the queue."""
        victims = [r for r in self.ready if r.phase is Phase.READY][1:]
        if not victims:
            raise ReplayError(
                f"replay stalled: {plural(len(self.waiting), 'request')} waiting and no event left"
            )
        for r in reversed(victims):
            self._release(r)
            self._reset(r)
            self.waiting.appendleft(r)
        self.c["unstuck"] += len(victims)
        self.ready = collections.deque(r for r in self.ready if r.phase is Phase.READY)
        self.blocked = None

    def _arrive(self) -> None:
        now, bs, cap = self.m.now, self.bs, self.cfg.num_blocks - 1
        while self.arrivals and self.arrivals[0].trace.arrival_s <= now:
            r = self.arrivals.popleft()
            tr = r.trace
            if request_blocks(tr.prompt_tokens, tr.output_tokens, bs) > cap:
                r.phase = Phase.DONE
                self.c["rejected"] += 1
                self._progress()
                continue
            self.waiting.append(r)
            if r.abort_plan == "queue":
                self._plan_abort(r, tr.arrival_s + 2.0 * r.abort_frac)

    def _plan_abort(self, r: Request, t: float) -> None:
        r.abort_at = t
        heapq.heappush(self.aborts, (t, r.trace.request_id, r))

    def _abort_due(self) -> None:
        while self.aborts and self.aborts[0][0] <= self.m.now:
            t, _, r = heapq.heappop(self.aborts)
            if r.abort_at == t and r.phase is not Phase.DONE:
                self._abort(r)

    def _progress(self) -> None:
        self.done += 1
        if self.progress is not None and self.done % 64 == 0:
            self.progress(self.done)

    # -- completions -------------------------------------------------------------

    def _on_end(self, w: Work) -> None:
        what = w.what
        if what == "forward":
            token, entries = self.inflight.popleft()
            assert token == w.token
            for r, epoch, produces, gen in entries:
                if (
                    produces
                    and r.phase is Phase.RUNNING
                    and r.epoch == epoch
                    and gen >= r.trace.output_tokens
                ):
                    self._finish(r)
        elif what == "load":
            lr = self.loading.pop(w.token, None)
            if lr is None:
                return
            r = lr
            if r.phase is not Phase.LOADING or r.load_token != w.token:
                return
            if w.failed:
                self.c["load_failures"] += 1
                r.num_computed = r.load_lo * self.bs
                r.refetch = r.blocks[r.load_lo : r.load_hi]
            else:
                assert r.keys is not None
                self.pool.cache_full_blocks(r.blocks, r.keys.full, r.num_cached, r.load_hi, self.bs)
                r.num_cached = r.load_hi
            r.phase = Phase.READY
            self.ready.append(r)
        elif what == "store":
            keys = self.storing.pop(w.token)
            self.store_pending.difference_update(keys)
            if w.failed:
                self.c["store_failures"] += 1
            else:
                for k in keys:
                    self.store.add(k)

    # -- request life -------------------------------------------------------------

    def _release(self, r: Request) -> None:
        self.m.free(r.blocks, r.last_step)
        r.blocks = []
        r.last_step = None

    def _reset(self, r: Request) -> None:
        r.phase = Phase.WAITING
        r.epoch += 1
        r.num_computed = r.num_cached = 0
        r.refetch = []
        r.load_token = None

    def _preempt(self, r: Request) -> None:
        if any(e[0] is r for e in self.entries):
            raise ReplayError(f"preempting {r}, which the step being built already scheduled")
        self._release(r)
        self._reset(r)
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.c["preemptions"] += 1

    def _abort(self, r: Request) -> None:
        phase = r.phase
        if phase is Phase.LOADING:
            assert r.load_token is not None
            self.c["aborts_during_load"] += 1
            if self.m.sim.cancel(r.load_token, self.m.now):
                self.c["loads_cancelled"] += 1
        elif phase is Phase.RUNNING:
            if r.load_token is not None and not self.m.sim.is_ended(r.load_token):
                self.c["aborts_during_load"] += 1
            self.running.remove(r)
        self._release(r)
        r.phase = Phase.DONE
        self.c["aborted"] += 1
        self._progress()

    def _finish(self, r: Request) -> None:
        keys, bs = r.keys, self.bs
        assert keys is not None
        done = r.num_computed
        # Partial tails, longest first (a shorter key then joins as an extra key).
        for ntok in dict.fromkeys((done, r.trace.prompt_tokens)):
            j, n = divmod(ntok, bs)
            if n and ntok <= keys.num_tokens and j < len(r.blocks):
                self.pool.cache_partial_block(r.blocks[j], keys.partial(j, n), ntok)
        full = min(done // bs, len(keys.full))
        idx = [
            i
            for i in range(full)
            if keys.full[i] not in self.store and keys.full[i] not in self.store_pending
        ]
        if idx:
            blocks = [r.blocks[i] for i in idx]
            w = self.m.store(blocks, self.cfg.store_streams[r.remote], self.block_bytes)
            ks = [keys.full[i] for i in idx]
            self.storing[w.token] = ks
            self.store_pending.update(ks)
            self.c["stores"] += 1
            self.c["stored_blocks"] += len(idx)
        self._release(r)
        self.running.remove(r)
        r.phase = Phase.DONE
        r.finished_at = self.m.now
        self.c["finished"] += 1
        self.served += r.trace.prompt_tokens + r.trace.output_tokens
        self.output_tokens += r.trace.output_tokens
        self._progress()

    # -- result ------------------------------------------------------------------

    def result(self, wall_s: float) -> PolicyResult:
        m = self.m
        stats = m.raw_pool.stats()
        leaked = stats.num_blocks - stats.free
        if leaked:
            raise ReplayError(f"{plural(leaked, 'block')} not returned to the pool ({stats})")
        violations = m.oracle.violations
        return PolicyResult(
            policy=m.policy_name,
            races=len(violations),
            races_by_hazard=dict(collections.Counter(v.hazard for v in violations)),
            race_examples=tuple(str(v) for v in violations[:5]),
            oracle_accesses=m.oracle.num_accesses,
            loads=m.loads,
            loads_empty_fence=m.loads_empty,
            load_delays_ms=tuple(m.load_delays),
            makespan_s=m.sim.last_end,
            tokens_served=self.served,
            output_tokens=self.output_tokens,
            counts=dict(sorted(self.c.items())),
            pool_ops={op: (m.pool.calls[op], m.pool.ns[op]) for op in m.pool.calls if m.pool.calls[op]},
            pool_stats=attrs.asdict(stats),
            oracle_ms=m.oracle_ns / 1e6,
            wall_s=wall_s,
            timeline=tuple(m.sim.timeline),
            timeline_at=m.sim.timeline_mark,
            load_runs=tuple(m.load_runs),
            store_runs=tuple(m.store_runs),
            load_min_runs=tuple(m.load_min_runs),
            loads_short_of_ready=m.loads_short_of_ready,
        )


def run_policy(
    requests: tuple[TraceRequest, ...],
    policy: str,
    config: ReplayConfig | None = None,
    *,
    events: EventLog | None = None,
    progress: Callable[[int], None] | None = None,
    label: str | None = None,
) -> PolicyResult:
    """Replay ``requests`` under ``policy`` and return its figures.

    Args:
        requests: The trace's requests (any order; replayed by arrival).
        policy: One of :data:`~blockpool.replay.policies.POLICIES`.
        config: The :class:`ReplayConfig` (default: defaults).
        events: Write every issue, wait, access and completion here.
        progress: Called with the number of requests done so far (finished,
            aborted or rejected), every 64 and at the end.
        label: The result's (and the events') policy name (default: ``policy``).

    Returns:
        The :class:`~blockpool.replay.report.PolicyResult`.

    Raises:
        UnknownPolicyError: an unknown policy.
        ReplayError: the replay stalled, or blocks leaked.

    Runtime complexity: O(block references + steps x running requests), each
    pool operation at its documented cost.
    """
    cfg = config if config is not None else ReplayConfig()
    t0 = time.perf_counter()
    sched = _Scheduler(tuple(requests), policy, cfg, events, progress, label)
    sched.run()
    return sched.result(time.perf_counter() - t0)
