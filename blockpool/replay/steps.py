"""Step building: what one scheduler step schedules, allocates and begins.

:class:`StepBuilder` is the half of the replay scheduler that builds a step:
running requests first (a decode token or the next prefill chunk, growing the
block table and preempting when the pool is full), then requests whose
host-engine load ended, then new arrivals (prefix-cache hits, loads from the
external store, copy-on-write of a shared partial tail, the first chunk). It
is mixed into :class:`blockpool.replay.driver._Scheduler`, which owns the
queues, the loop and the request life cycle.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import NoFreeBlocksError
from blockpool.core.hazards import AccessKind, StreamKind, Token
from blockpool.replay.keys import BlockKeys
from blockpool.replay.state import ExternalStore, Phase, Request

if TYPE_CHECKING:
    from blockpool.replay.config import ReplayConfig
    from blockpool.replay.machine import Machine
    from blockpool.replay.state import TimedPool

__all__ = ["Entry", "StepBuilder"]

_READ, _WRITE = AccessKind.READ, AccessKind.WRITE

Entry = tuple[Request, int, bool, int]
"""A request in a step: (request, its epoch, whether the step produces one of
its tokens, its generated count after the step)."""


class StepBuilder:
    """Builds and enqueues steps (see the module docstring)."""

    cfg: ReplayConfig
    bs: int
    m: Machine
    pool: TimedPool
    store: ExternalStore
    block_bytes: int
    waiting: collections.deque[Request]
    ready: collections.deque[Request]
    running: list[Request]
    loading: dict[Token, Request]
    inflight: collections.deque[tuple[Token, list[Entry]]]
    entries: list[Entry]
    written: list[KVCacheBlock]
    new_tokens: int
    context: int
    watermark: int
    blocked: tuple[Request, int] | None
    c: collections.Counter[str]

    def _preempt(self, r: Request) -> None:
        raise NotImplementedError

    def _plan_abort(self, r: Request, t: float) -> None:
        raise NotImplementedError

    # -- steps -------------------------------------------------------------------

    def _step(self) -> bool:
        """Build and enqueue one step; False when nothing could be scheduled."""
        cfg = self.cfg
        budget, seqs = cfg.max_batched_tokens, cfg.max_num_seqs
        self.entries, self.written = [], []
        self.new_tokens = self.context = 0
        for r in list(self.running):
            if budget <= 0 or seqs <= 0:
                break
            if r.phase is not Phase.RUNNING:
                continue  # preempted by an earlier request of this step
            n = min(r.num_tokens - r.num_computed, budget)
            if self._grow(r, r.num_computed + n):
                self._schedule(r, n)
                budget -= n
                seqs -= 1
        while budget > 0 and seqs > 0:
            head = self._candidate()
            if head is None:
                break
            got = self._resume(head, budget) if head.phase is Phase.READY else self._admit(head, budget)
            if got is None:
                break
            if got:
                budget -= got
                seqs -= 1
        if not self.entries:
            return False
        m = self.m
        token = self.pool.issue("compute")
        duration = self.cfg.cost.step_seconds(self.new_tokens, self.context)
        m.enqueue(token, "forward", duration=duration)
        if m.events is not None:
            # the block-table reads of the step: the context of every request
            # it computes (shared prefix blocks once); the oracle gets one
            # read per block, by the last step, at free (docs/race-oracle.md)
            bs = self.bs
            read: dict[int, None] = {}
            for r, _, _, _ in self.entries:
                for b in r.blocks[: -(-r.num_computed // bs)]:
                    if not b.is_null:
                        read[b.block_id] = None
            if read:
                m.events.table(m.policy_name, str(token), token.stream, list(read))
        if self.written:
            self.pool.tag(self.written, token, _WRITE)
            m.tag(token, self.written, _WRITE, "forward")
        for r, _, _, _ in self.entries:
            r.last_step = token
            self._publish(r)
        self.inflight.append((token, self.entries))
        self.c["steps"] += 1
        if cfg.check_every and self.c["steps"] % cfg.check_every == 0:
            m.raw_pool.check()
        return True

    def _candidate(self) -> Request | None:
        for q in (self.ready, self.waiting):
            while q and q[0].phase is Phase.DONE:
                q.popleft()
            if q:
                return q[0]
        return None

    def _grow(self, r: Request, upto: int) -> bool:
        """Give ``r`` blocks for ``upto`` tokens, preempting the newest running
        requests (or ``r`` itself) when the pool is full."""
        need = -(-upto // self.bs) - len(r.blocks)
        if need <= 0:
            return True
        while True:
            try:
                new, fence = self.pool.allocate_for(need, "compute")
                break
            except NoFreeBlocksError:
                # As vLLM: preempt the last running request. Requests are
                # scheduled in list order, so it is not in this step yet, or
                # it is ``r`` itself.
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    return False
        self.m.device_fence(fence, "compute")
        r.blocks.extend(new)
        return True

    def _schedule(self, r: Request, n: int) -> None:
        bs, start = self.bs, r.num_computed
        if r.refetch:  # rewrite blocks whose load failed
            self.m.device_fence(self.pool.fence_for(r.refetch, "compute", _WRITE), "compute")
            r.refetch = []
        self.written.extend(r.blocks[start // bs : (start + n - 1) // bs + 1])
        r.num_computed = start + n
        produces = r.num_computed == r.num_tokens
        if produces:
            r.generated += 1
        self.new_tokens += n
        self.context += r.num_computed
        self.entries.append((r, r.epoch, produces, r.generated))
        # A "decode" abort (and a "load" abort of a request that loads nothing)
        # comes once that fraction of the answer is scheduled.
        plan = r.abort_plan
        if (
            plan is not None
            and plan != "queue"
            and r.abort_at is None
            and r.generated >= max(1, int(r.abort_frac * r.trace.output_tokens))
        ):
            self._plan_abort(r, self.m.now)

    def _publish(self, r: Request) -> None:
        keys = r.keys
        assert keys is not None
        full = min(r.num_computed // self.bs, len(keys.full))
        if full > r.num_cached:
            self.pool.cache_full_blocks(r.blocks, keys.full, r.num_cached, full, self.bs)
            r.num_cached = full

    def _gate(self, r: Request, need: int, pinned: int) -> bool:
        """Whether ``need`` new blocks fit beside the watermark, counting hits
        that sit in the free queue (``pinned``) as taken."""
        free = self.pool.get_num_free_blocks()
        if free - pinned >= need + self.watermark:
            self.blocked = None
            return True
        self.blocked = (r, free)
        return False

    def _retry(self, r: Request) -> bool:
        b = self.blocked
        return b is None or b[0] is not r or self.pool.get_num_free_blocks() > b[1]

    def _admit(self, r: Request, budget: int) -> int | None:
        """Admit the waiting request at the head of the queue: tokens
        scheduled this step, 0 when its host-engine load started, ``None``
        when it does not fit (it stays at the head)."""
        if not self._retry(r):
            return None
        bs, pool = self.bs, self.pool
        if r.keys is None:
            r.keys = BlockKeys(r.trace.key_segments(), bs)
        keys, total = r.keys, r.num_tokens
        limit = min((total - 1) // bs, len(keys.full))
        self.c["prefix_query_blocks"] += limit
        hits: list[KVCacheBlock] = []
        for i in range(limit):
            b = pool.get_cached_block(keys.full[i])
            if b is None:
                break
            hits.append(b)
        h = j = len(hits)
        while j < limit and keys.full[j] in self.store:
            j += 1
        stream = self.cfg.load_streams[r.remote]
        host_load = j > h and self.m.kinds[stream] is StreamKind.HOST
        src, ncow = None, 0
        if not host_load and j * bs < total:
            for n in range(min(bs - 1, total - j * bs, keys.num_tokens - j * bs), 0, -1):
                src = pool.get_cached_block(keys.partial(j, n))
                if src is not None:
                    ncow = n
                    break
        computed = min(j * bs + ncow, total - 1) if ncow else j * bs
        n_tok = 0 if host_load else min(total - computed, budget)
        n_new = -(-(computed + n_tok) // bs) - j if n_tok else 0
        pins = [*hits, src] if src is not None else hits
        if not self._gate(r, (j - h) + n_new, sum(1 for b in pins if b.ref_cnt == 0)):
            return None
        new, fence = pool.allocate_for(n_new, "compute", hits=pins)
        self.m.device_fence(fence, "compute")
        ready_free = (
            self.m.raw_pool.num_ready_free_blocks(stream) if j > h else 0
        )  # not timed: replay bookkeeping
        if j > h and self.cfg.placement != "lru":
            # Placed for the load's stream (ready blocks first).
            loaded, lfence = pool.allocate_for(j - h, stream)
            self.m.alloc_fence(lfence, stream)
        else:
            loaded = pool.get_new_blocks(j - h) if j > h else []
        floor = self.m.runs_floor(loaded) if loaded else 0  # before the CoW source below is freed
        r.blocks = [*hits, *loaded, *new]
        r.num_cached = h
        self.waiting.popleft()
        if src is not None:
            self.m.copy(src, new[0], "compute", self.cfg.cost.copy_seconds(1, bs))
            pool.free_blocks([src])
            self.c["cow_copies"] += 1
        self.c["prefix_hit_blocks"] += h
        self.c["admissions"] += 1
        if loaded:
            self._load(r, loaded, stream, h, j, ready_free, floor)
            if host_load:
                r.phase = Phase.LOADING
                r.num_computed = j * bs
                return 0
            self.m.device_fence(pool.fence_for(loaded, "compute", _READ), "compute")
        r.num_computed = computed
        r.phase = Phase.RUNNING
        self.running.append(r)
        self._schedule(r, n_tok)
        return n_tok

    def _load(
        self,
        r: Request,
        loaded: list[KVCacheBlock],
        stream: str,
        lo: int,
        hi: int,
        ready_free: int,
        floor: int,
    ) -> None:
        assert r.keys is not None
        w = self.m.load(loaded, stream, self.block_bytes, ready_free=ready_free, floor=floor)
        for k in r.keys.full[lo:hi]:
            self.store.hit(k)
        r.load_token, r.load_lo, r.load_hi = w.token, lo, hi
        self.c["loaded_blocks"] += hi - lo
        if r.abort_plan == "load" and r.abort_at is None:
            self._plan_abort(r, self.m.now + r.abort_frac * (w.end - self.m.now))
        if self.m.kinds[stream] is StreamKind.HOST:
            self.loading[w.token] = r
        else:  # a DMA load: compute waits on it by a stream wait, so publish now
            self.pool.cache_full_blocks(r.blocks, r.keys.full, lo, hi, self.bs)
            r.num_cached = hi

    def _resume(self, r: Request, budget: int) -> int | None:
        """Schedule a request whose host-engine load ended (as :meth:`_admit`)."""
        if not self._retry(r):
            return None
        n_tok = min(r.num_tokens - r.num_computed, budget)
        need = max(0, -(-(r.num_computed + n_tok) // self.bs) - len(r.blocks))
        if not self._gate(r, need, 0):
            return None
        if need:
            new, fence = self.pool.allocate_for(need, "compute")
            self.m.device_fence(fence, "compute")
            r.blocks.extend(new)
        self.m.device_fence(self.pool.fence_for(r.blocks[: r.load_hi], "compute", _READ), "compute")
        self.ready.popleft()
        r.phase = Phase.RUNNING
        self.running.append(r)
        self._schedule(r, n_tok)
        return n_tok
