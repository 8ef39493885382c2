"""A seeded fault harness: stock vLLM against the plugin on vLLM's real scheduler.

Per seed, :func:`make_schedule` draws a workload (requests sharing
prefixes, arriving over the first steps, each with ``max_tokens`` and no
EOS) and a fault schedule. :func:`run_schedule` serves it three times on
vLLM's real ``Scheduler`` with the real scheduler half of one KV connector:
**stock** (the plugin unregistered: vLLM's own ``BlockPool``), **on**
(hazard tracking on) and **audit** (``BLOCKPOOL_VLLM_HAZARDS=audit``). A
:class:`ConnectorSim` plays the connector's worker ranks: it reads each
step's connector metadata and reports completions as that connector's
worker does, bent by the faults. The model is a stand-in: the token sampled
for a request is a hash of its tokens so far (:func:`next_token`), so every
mode generates the same tokens for a request whatever the schedule.

Faults are keyed by ``(request id, transfer kind, ordinal)`` (the
``ordinal``-th load or store of that request), never by step, so every mode
meets the same ones; aborts and prefix-cache resets are keyed by a request's
progress (:class:`Event`). Fault kinds (:data:`FAULT_KINDS`): ``fail`` (the
whole transfer fails), ``fail_partial`` (some of its blocks), ``late``
(reported ``arg`` steps late), ``never`` (never reported), ``twice``
(reported again a step later), ``reorder`` (held back until a transfer
planned after it has been reported), ``skew`` (with two ranks, rank 1 reports ``arg`` steps
after rank 0; vLLM's ``KVOutputAggregator`` joins them).

The oracle (:func:`judge`), for ``on`` and ``audit`` each against stock:
every request stock finishes is finished with the same output tokens (an
aborted request's tokens aside: they depend on when the abort lands); no
exception; no stretch of steps without scheduled work while requests wait
(none of them for a load in flight) longer than :func:`stall_bound` beyond
stock's own longest; after the drain
(the plugin's lease clock moved past every give-up time) every block is
free with ref count 0; no more blocks handed out while a simulated transfer
could still touch them than stock handed out; every injected fault fired. A
schedule whose stock run itself crashes, stalls or leaks is reported apart
(a stock-only failure). A failing schedule prints its seed, connector and
the command that replays it.

A connector is added by subclassing :class:`ConnectorSim` and listing the
class in :data:`SIMS` (:func:`register_sim`). Run from the repository root
in vLLM's venv::

    python -m tests.vllm_faults --connector offloading --schedules 200 --seed 0
    python -m tests.vllm_faults --connector offloading --seed 17 --schedules 1 -v
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import re
import sys
import time
import traceback
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar
from unittest.mock import patch

BS = 16
"""Tokens per block of every schedule's model shape."""
VOCAB = 997
"""Size of the stand-in model's vocabulary (token ids 1..VOCAB)."""
MODES = ("stock", "on", "audit")
"""The three runs of a schedule: plugin off, hazards on, hazards in audit mode."""
FAULT_KINDS = ("fail", "fail_partial", "late", "never", "twice", "reorder", "skew")
"""Every fault kind a :class:`ConnectorSim` may support (the module docstring)."""
DEFAULT_STALL_BOUND = 16
"""Steps without scheduled work the plugin may add to stock's longest such
stretch, when the plugin declares no bound of its own (:func:`stall_bound`)."""
ENV_DEFER_STEPS = "BLOCKPOOL_VLLM_DEFER_STEPS"
"""The plugin's setting bounding its deferral of a preemption, in steps."""


def stall_bound() -> int:
    """The steps without scheduled work the plugin may add beyond stock's
    longest such stretch: ``BLOCKPOOL_VLLM_DEFER_STEPS`` (the plugin's
    default, ``hazards.DEFAULT_DEFER_STEPS``, where it declares one) or
    :data:`DEFAULT_STALL_BOUND`, plus two steps for the transfers' own
    reports. O(1)."""
    raw = os.environ.get(ENV_DEFER_STEPS)
    if raw is not None and raw.strip().isdigit():
        return int(raw) + 2
    try:
        from blockpool.integrations.vllm import hazards as vh

        declared = getattr(vh, "DEFAULT_DEFER_STEPS", None)
    except ImportError:  # pragma: no cover
        declared = None
    return (int(declared) if isinstance(declared, int) else DEFAULT_STALL_BOUND) + 2


def next_token(tokens: list[int]) -> int:
    """The stand-in model's next token after ``tokens``: a CRC of their ids
    mod :data:`VOCAB`, plus one. O(len(tokens))."""
    return 1 + zlib.crc32(array("i", tokens).tobytes()) % VOCAB


# ----------------------------------------------------------------------
# schedules: workload and faults from a seed
# ----------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One injected fault: the ``ordinal``-th (from 0) ``kind`` transfer
    (``"load"`` or ``"store"``) of request ``req_id`` (``"*"``: of the run,
    whichever request it serves) is bent by ``fault``
    (one of :data:`FAULT_KINDS`) with argument ``arg`` (steps for ``late``
    and ``skew``)."""

    req_id: str
    kind: str
    ordinal: int
    fault: str
    arg: int = 1

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.req_id, self.kind, self.ordinal)

    def __str__(self) -> str:
        return f"{self.fault}({self.arg}) on {self.req_id}/{self.kind}#{self.ordinal}"


@dataclass(frozen=True)
class Event:
    """An abort or a prefix-cache reset, keyed by a request's progress:
    ``what`` (``"abort"`` or ``"reset"``) happens before the step after
    request ``req_id`` has ``tokens`` output tokens (``tokens=-1``: after
    its first transfer began, i.e. while it is in flight)."""

    what: str
    req_id: str
    tokens: int

    def __str__(self) -> str:
        at = "its first transfer" if self.tokens < 0 else f"{self.tokens} tokens"
        return f"{self.what} at {self.req_id} {at}"


@dataclass(frozen=True)
class RequestSpec:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int  # the step before which it is added (1: before the first)


@dataclass
class Schedule:
    """Everything a seed decides. ``connector`` is a :data:`SIMS` key."""

    seed: int
    connector: str
    requests: list[RequestSpec]
    faults: list[Fault]
    events: list[Event]
    num_blocks: int
    max_num_batched_tokens: int
    ranks: int
    policy: str  # kv_load_failure_policy: "fail" or "recompute"
    options: dict[str, Any] = field(default_factory=dict)  # per-connector knobs, drawn by the sim
    async_scheduling: bool = False  # vLLM's AsyncScheduler

    def describe(self) -> str:
        reqs = ", ".join(f"{r.req_id}:{len(r.prompt)}+{r.max_tokens}@{r.arrival}" for r in self.requests)
        return (
            f"seed {self.seed} {self.connector}: {self.num_blocks} blocks, {self.ranks} rank(s), policy "
            f"{self.policy}, async scheduling {self.async_scheduling}, options {self.options}; requests {reqs}; "
            "faults "
            f"[{', '.join(map(str, self.faults))}]; events [{', '.join(map(str, self.events))}]"
        )


ASYNC_SHARE = 0.3
"""The share of schedules served by vLLM's ``AsyncScheduler`` (async
scheduling), each mode alike."""


def make_schedule(seed: int, connector: str) -> Schedule:
    """The schedule of ``seed`` for ``connector`` (a :data:`SIMS` key):
    deterministic in both. O(requests + faults)."""
    sim = SIMS[connector]
    rng = random.Random(f"{connector}:{seed}")
    nprefix = rng.randint(1, 3)
    prefixes = [[rng.randint(1, VOCAB) for _ in range(BS * rng.randint(1, 4) + rng.choice((0, 0, 5)))]
                for _ in range(nprefix)]  # fmt: skip
    requests = []
    n = rng.randint(2, 7)
    for i in range(n):
        prefix = prefixes[rng.randrange(nprefix)] if rng.random() < 0.8 else []
        suffix = [rng.randint(1, VOCAB) for _ in range(rng.randint(1, 40))]
        arrival = 1 if i == 0 else rng.choice((1, 1, 2, 3, 5, 8, 12))
        requests.append(RequestSpec(f"r{i}", tuple(prefix + suffix), rng.randint(1, 12), arrival))
    # Requests that repeat an earlier one late: its prefix has been stored and may be loaded back.
    for j in range(rng.randint(1, 3)):
        src = rng.choice(requests)
        extra = [rng.randint(1, VOCAB) for _ in range(rng.choice((0, 3, 20)))]
        requests.append(
            RequestSpec(f"r{n + j}", src.prompt + tuple(extra), rng.randint(1, 6), rng.randint(8, 30))
        )
    need = max(-(-(len(r.prompt) + r.max_tokens) // BS) for r in requests)
    num_blocks = rng.choice((need + 1, need + 2, need + 4, 2 * need, 64))
    kinds = [k for k in sim.fault_kinds]
    ranks = 2 if ("skew" in kinds and rng.random() < 0.4) else 1
    if ranks == 1:
        kinds = [k for k in kinds if k != "skew"]
    # Faults go where transfers are likely: stores of requests with a full
    # block, loads of requests arriving after another with the same first block.
    firsts: dict[tuple[int, ...], int] = {}
    for r in requests:
        firsts.setdefault(r.prompt[:BS], r.arrival)
    targets = {
        "store": [r for r in requests if len(r.prompt) >= BS],
        "load": [r for r in requests if len(r.prompt) >= BS and firsts[r.prompt[:BS]] < r.arrival],
    }
    faults: list[Fault] = []
    seen: set[tuple[str, str, int]] = set()
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(sim.transfer_kinds)
        pool = targets.get(kind) or requests
        r = rng.choice(pool)
        allowed = [k for k in sim.kinds_for(kind) if k in kinds]
        if not allowed:
            continue
        if rng.random() < 0.5:  # the ordinal-th such transfer of the run, whichever request it serves
            fault = Fault("*", kind, rng.choice((0, 0, 1, 2)), rng.choice(allowed), rng.randint(1, 4))
        else:
            fault = Fault(r.req_id, kind, rng.choice((0, 0, 0, 1)), rng.choice(allowed), rng.randint(1, 4))
        if fault.key not in seen:
            seen.add(fault.key)
            faults.append(fault)
    events: list[Event] = []
    if rng.random() < 0.3:
        events.append(Event("abort", rng.choice(requests).req_id, rng.choice((-1, 0, 1, 3))))
    if rng.random() < 0.2:
        events.append(Event("reset", rng.choice(requests).req_id, rng.choice((-1, 1, 2))))
    sched = Schedule(
        seed=seed,
        connector=connector,
        requests=requests,
        faults=faults,
        events=events,
        num_blocks=num_blocks,
        max_num_batched_tokens=rng.choice((64, 128, 256)),
        ranks=ranks,
        policy=rng.choice(("fail", "recompute")),
    )
    sched.options = sim.draw_options(rng, sched)
    # Drawn apart, so that the draws above stay what they were for a seed.
    sched.async_scheduling = (
        sim.async_scheduling and random.Random(f"{connector}:{seed}:async").random() < ASYNC_SHARE
    )
    return sched


# ----------------------------------------------------------------------
# the simulated worker
# ----------------------------------------------------------------------


@dataclass(eq=False)
class SimTransfer:
    """One transfer the connector planned, as the simulated worker runs it.

    ``due[rank]``: the step in whose output that rank reports it (``None``:
    never). ``guard``: its blocks must not be handed out while it is live
    (the oracle's "reused under a live transfer"). ``job``: the connector's
    own handle (a job id, a request id)."""

    req_id: str
    kind: str
    ordinal: int
    job: Any
    block_ids: tuple[int, ...]
    planned: int
    due: list[int | None]
    fault: Fault | None = None
    failed: bool = False
    failed_blocks: tuple[int, ...] = ()
    twice_at: int | None = None
    guard: bool = True
    flushed_at: int | None = None
    reported: list[bool] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return not all(self.reported)


class ConnectorSim:
    """The worker ranks of one connector, simulated; subclass per connector.

    A subclass sets :attr:`name` (the :data:`SIMS` key), :attr:`connector`
    (vLLM's connector class name), :attr:`fault_kinds` and
    :attr:`transfer_kinds`, and implements :meth:`plan` (read the step's
    metadata, :meth:`begin` each transfer) and :meth:`encode` (the reports
    due, as one ``KVConnectorOutput`` per rank). It may override
    :meth:`scheduler_kwargs` (``make_scheduler`` arguments),
    :meth:`prepare` (after the scheduler is built), :meth:`before_schedule`,
    :meth:`request_params` (a request's ``kv_transfer_params``),
    :meth:`draw_options` (knobs of its own in :attr:`Schedule.options`),
    :meth:`kinds_for` (the fault kinds a load or a store may meet),
    :meth:`may_reset` (whether vLLM itself could reset its prefix cache
    now) and :meth:`settle_never` (at the end of a run). The base class
    keeps the transfers in flight, applies the faults to their report steps
    (:meth:`begin`, :meth:`flush`, :meth:`report`), counts the faults that
    met a transfer (:attr:`met`) and those that fired (:attr:`fired`)."""

    name: ClassVar[str] = ""
    connector: ClassVar[str] = ""
    fault_kinds: ClassVar[tuple[str, ...]] = ()
    transfer_kinds: ClassVar[tuple[str, ...]] = ("load", "store")
    # Whether schedules of this connector may draw vLLM's AsyncScheduler
    # (ASYNC_SHARE of them).
    async_scheduling: ClassVar[bool] = True

    @classmethod
    def kinds_for(cls, transfer_kind: str) -> tuple[str, ...]:
        """The fault kinds a ``transfer_kind`` transfer may meet (default
        :attr:`fault_kinds`)."""
        return cls.fault_kinds

    def __init__(self, schedule: Schedule, scheduler: Any) -> None:
        self.schedule = schedule
        self.scheduler = scheduler
        self.ranks = schedule.ranks
        self.faults = {f.key: f for f in schedule.faults}
        self.fired: dict[Fault, int] = {}
        self.transfers: list[SimTransfer] = []
        self._ordinals: dict[tuple[str, str], int] = {}
        self._newest_reported = 0  # the latest plan step among transfers reported in earlier steps
        self.resolved: dict[Fault, Fault] = {}  # a "*" fault -> the transfer it met, as a request's fault
        self.met: set[Fault] = set()  # faults that met their transfer (fired or not)
        self.step = 0

    # -- hooks -------------------------------------------------------------

    @classmethod
    def draw_options(cls, rng: random.Random, schedule: Schedule) -> dict[str, Any]:
        return {}

    @classmethod
    def scheduler_kwargs(cls, schedule: Schedule) -> dict[str, Any]:
        """``make_scheduler`` keyword arguments besides the connector name."""
        return {}

    def prepare(self) -> None:
        """After the scheduler is built, before the first step."""

    def request_params(self, spec: RequestSpec) -> dict[str, Any] | None:
        return None

    def before_schedule(self, step: int) -> None:
        """Before ``schedule()`` of ``step``."""

    def may_reset(self) -> bool:
        """Whether a prefix-cache reset event may happen now. Default: no
        load is in flight (vLLM's own ``reset_prefix_cache`` raises while a
        request waits for its blocks, plugin or not); a connector whose
        scheduler holds its own block references for a store says no while
        one is in flight too."""
        from vllm.v1.request import RequestStatus

        if any(t.live and t.kind == "load" for t in self.transfers):
            return False
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        return not any(r.status == waiting for r in self.scheduler.requests.values())

    def plan(self, step: int, out: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, step: int, due: list[list[SimTransfer]], twice: list[list[SimTransfer]]) -> list[Any]:
        """One ``KVConnectorOutput`` (or ``None``) per rank for ``step``:
        ``due[rank]`` are the transfers that rank reports now (their
        :attr:`SimTransfer.failed` and ``failed_blocks`` say how), ``twice[rank]``
        those it reports a second time."""
        raise NotImplementedError  # pragma: no cover - abstract

    # -- the transfers -----------------------------------------------------

    def begin(
        self,
        req_id: str,
        kind: str,
        job: Any,
        block_ids: Any,
        step: int,
        delay: int = 1,
        *,
        guard: bool = True,
        faultable: bool = True,
    ) -> SimTransfer:
        """Record a transfer the connector planned at ``step``, reported
        ``delay`` steps later (0: in this step's output) unless a fault
        says otherwise; ``faultable=False`` keeps faults off it (a
        synchronous load the engine must have before its forward). O(1)."""
        n = self._ordinals.get((req_id, kind), 0)
        self._ordinals[(req_id, kind)] = n + 1
        g = self._ordinals.get(("*", kind), 0)
        self._ordinals[("*", kind)] = g + 1
        ids = tuple(int(b) for b in block_ids)
        t = SimTransfer(req_id, kind, n, job, ids, step, [step + delay] * self.ranks, guard=guard,
                        reported=[False] * self.ranks)  # fmt: skip
        fault = self.faults.get((req_id, kind, n)) if faultable else None
        if fault is None and faultable:
            fault = self.faults.get(("*", kind, g))
            if fault is not None:
                self.resolved[fault] = Fault(req_id, kind, n, fault.fault, fault.arg)
        if fault is not None and fault.fault in self.fault_kinds:
            self.met.add(fault)
            t.fault = fault
            f = fault.fault
            if f == "fail":
                t.failed = True
            elif f == "fail_partial" and ids:
                t.failed = True
                t.failed_blocks = ids[len(ids) // 2 :] if len(ids) > 1 else ids
            elif f == "late":
                t.due = [d + fault.arg for d in t.due]  # type: ignore[operator]
            elif f == "never":
                t.due = [None] * self.ranks
            elif f == "twice":
                t.twice_at = step + delay + 1
            elif f == "skew" and self.ranks > 1:
                t.due[1] = t.due[1] + fault.arg  # type: ignore[operator]
            elif f == "reorder":
                # Held back until a transfer planned after it has been
                # reported (at most ``arg + 8`` steps).
                t.due = [d + fault.arg + 8 for d in t.due]  # type: ignore[operator]
        self.transfers.append(t)
        return t

    def flush(self, job: Any, step: int) -> None:
        """The engine waits for transfer ``job`` in ``step`` (a flush): it is
        reported in this step's output by every rank. O(transfers)."""
        for t in self.transfers:
            if t.job == job and t.live:
                t.due = [step] * self.ranks
                t.flushed_at = step

    def live_guarded(self, step: int) -> dict[int, SimTransfer]:
        """Blocks a transfer in flight may still touch during ``step``'s
        forward: those of live guarded transfers planned before ``step``
        and not flushed in it. O(transfers)."""
        out: dict[int, SimTransfer] = {}
        for t in self.transfers:
            if t.live and t.guard and t.planned < step and t.flushed_at != step:
                for b in t.block_ids:
                    out[b] = t
        return out

    def busy(self) -> bool:
        """A transfer will still be reported."""
        return any(not r and d is not None for t in self.transfers for r, d in zip(t.reported, t.due)) or any(
            t.twice_at is not None for t in self.transfers
        )

    def never_live(self) -> list[SimTransfer]:
        """Transfers that will never be reported by some rank."""
        return [t for t in self.transfers if any(not r and d is None for r, d in zip(t.reported, t.due))]

    def report(self, step: int) -> list[Any]:
        """The step's ``KVConnectorOutput`` per rank (:meth:`encode`), the
        faults that fired counted. O(transfers)."""
        due: list[list[SimTransfer]] = [[] for _ in range(self.ranks)]
        twice: list[list[SimTransfer]] = [[] for _ in range(self.ranks)]
        for t in self.transfers:
            if t.fault is not None and t.fault.fault == "reorder" and self._newest_reported > t.planned:
                t.due = [None if d is None else min(d, step) for d in t.due]
        for t in self.transfers:
            for rank in range(self.ranks):
                d = t.due[rank]
                if not t.reported[rank] and d is not None and d <= step:
                    due[rank].append(t)
            if t.twice_at is not None and t.twice_at <= step and all(t.reported):
                twice[0].append(t)
        for rank, ts in enumerate(due):
            for t in ts:
                t.reported[rank] = True
                self._fired_on_report(t, rank, step)
        self._newest_reported = max([self._newest_reported, *(t.planned for t in due[0])])
        for t in twice[0]:
            t.twice_at = None
            self._fire(t.fault)
        self.transfers = [t for t in self.transfers if t.live or t.twice_at is not None]
        return self.encode(step, due, twice)

    def _fired_on_report(self, t: SimTransfer, rank: int, step: int) -> None:
        f = t.fault
        if f is None or t.flushed_at is not None and f.fault in ("late", "skew", "reorder"):
            return
        fired = {
            "fail": rank == 0,
            "fail_partial": rank == 0,
            "late": rank == 0 and step > t.planned + 1,
            "skew": rank == 1 and t.reported[0],
            # a transfer planned after it was reported in an earlier step
            "reorder": rank == 0 and self._newest_reported > t.planned,
        }
        if fired.get(f.fault, False):
            self._fire(f)

    def _fire(self, f: Fault | None) -> None:
        if f is not None:
            self.fired[f] = self.fired.get(f, 0) + 1

    def settle_never(self) -> None:
        """At the drain: a ``never`` transfer still unreported has fired."""
        for t in self.never_live():
            if t.fault is not None and t.fault.fault == "never":
                self._fire(t.fault)


SIMS: dict[str, type[ConnectorSim]] = {}
"""Connector name -> its simulated worker class."""


def register_sim(cls: type[ConnectorSim]) -> type[ConnectorSim]:
    """Class decorator: add ``cls`` to :data:`SIMS` under ``cls.name``."""
    SIMS[cls.name] = cls
    return cls


SIM_MODULES = ("tests.vllm_faults_nixl", "tests.vllm_faults_lmcache")
"""Modules beside this one whose import registers more simulated workers."""


def load_sims() -> dict[str, type[ConnectorSim]]:
    """Import :data:`SIM_MODULES` (those present in the checkout; each
    registers what its environment can run) and return :data:`SIMS`."""
    import importlib
    import importlib.util

    for name in SIM_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    return SIMS


# ----------------------------------------------------------------------
# Offloading
# ----------------------------------------------------------------------


@register_sim
class OffloadingSim(ConnectorSim):
    """vLLM's ``OffloadingConnector`` worker (``offloading/worker.py``): a
    store is submitted at the next step's start and reported in
    ``completed_jobs`` of the worker metadata; an asynchronous load is
    reported there and in ``finished_recving``; a synchronous load and a
    flushed job complete in their step. A failed job is named in
    ``failed_jobs`` (a failed load's request also in ``failed_recving``).
    Each rank reports ``{job: 1}``; the connector counts reports up to
    ``num_workers``."""

    name = "offloading"
    connector = "OffloadingConnector"
    # Not "twice": vLLM's own scheduler takes a job reported twice for a
    # KeyError (the job is gone), and a request's finished_recving twice
    # for an AssertionError, plugin or not.
    fault_kinds = ("fail", "late", "reorder", "skew")

    @classmethod
    def scheduler_kwargs(cls, schedule: Schedule) -> dict[str, Any]:
        return {"extra": {"cpu_bytes_to_use": 1 << 24, "block_size": BS}}

    @classmethod
    def draw_options(cls, rng: random.Random, schedule: Schedule) -> dict[str, Any]:
        return {"load_delay": rng.choice((0, 1, 1, 2))}

    def prepare(self) -> None:
        cs = self.scheduler.connector.connector_scheduler
        if self.ranks > 1:
            cs.config = cs.config._replace(num_workers=self.ranks)  # as vLLM sizes it for TP ranks

    def plan(self, step: int, out: Any) -> None:
        meta = out.kv_connector_metadata
        for job_id in meta.jobs_to_flush or ():
            self.flush(job_id, step)
        for job_id, job in meta.load_jobs.items():
            sync = bool(getattr(job, "sync", False))
            ids = _spec_ids(job.dst_spec)
            self.begin(job.req_id, "load", job_id, ids, step, 0 if sync else self.schedule.options["load_delay"],
                       faultable=not sync)  # fmt: skip
            if sync:
                self.transfers[-1].job = ("sync", job_id)
        for job_id, job in meta.store_jobs.items():
            self.begin(job.req_id, "store", job_id, _spec_ids(job.src_spec), step, 1)
        for job_id in meta.jobs_to_flush or ():
            self.flush(job_id, step)

    def encode(self, step: int, due: list[list[SimTransfer]], twice: list[list[SimTransfer]]) -> list[Any]:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        outs = []
        for rank in range(self.ranks):
            meta = OffloadingWorkerMetadata()
            recving: set[str] = set()
            failed_recving: set[str] = set()
            for t in due[rank] + twice[rank]:
                job = t.job[1] if isinstance(t.job, tuple) else t.job
                meta.mark_completed(job, success=not t.failed)
                if t.kind == "load" and not isinstance(t.job, tuple):
                    recving.add(t.req_id)
                    if t.failed:
                        failed_recving.add(t.req_id)
            outs.append(
                KVConnectorOutput(
                    finished_recving=recving or None,
                    failed_recving=failed_recving,
                    kv_connector_worker_meta=meta if meta.completed_jobs else None,
                )
            )
        return outs


# ----------------------------------------------------------------------
# MooncakeStore
# ----------------------------------------------------------------------


@register_sim
class MooncakeStoreSim(ConnectorSim):
    """vLLM's ``MooncakeStoreConnector`` worker (``mooncake/store/worker.py``)
    over a simulated store. A lookup (the scheduler's ``LookupKeyClient``)
    hits the longest run of the request's leading block hashes a finished
    PUT stored, below the request's last token. A GET (asynchronous) is
    reported in ``finished_recving``; its failed blocks in
    ``invalid_block_ids`` (the receive thread reports exactly the blocks
    whose keys failed). A PUT is reported in ``completed_saves`` of the
    worker metadata by each rank; the scheduler holds its own reference on
    the blocks until every rank did."""

    name = "mooncake_store"
    connector = "MooncakeStoreConnector"
    fault_kinds = ("fail", "fail_partial", "late", "never", "twice", "reorder", "skew")

    @classmethod
    def kinds_for(cls, transfer_kind: str) -> tuple[str, ...]:
        # A GET reported twice is an AssertionError in vLLM's own
        # scheduler (finished_recving of a running request), plugin or not;
        # a PUT has no blocks to fail in vLLM's view.
        if transfer_kind == "load":
            return tuple(k for k in cls.fault_kinds if k != "twice")
        return tuple(k for k in cls.fault_kinds if k not in ("fail", "fail_partial"))

    @classmethod
    def draw_options(cls, rng: random.Random, schedule: Schedule) -> dict[str, Any]:
        return {
            "load_delay": rng.choice((0, 1, 1, 2)),
            "put_delay": rng.choice((1, 1, 2)),
            "unpinned": rng.random() < 0.4,
        }

    def _unpin(self) -> None:
        """A PUT that holds no block reference of vLLM's (as LMCache MP's
        server copies): vLLM's scheduler drops the reference its PUT takes
        as soon as it takes it, and keeps the job with no blocks to free at
        its report. Stock then frees a finished request's blocks under its
        PUT; the plugin holds them for it."""
        cs = self.cs
        reference = cs._reference_save_blocks

        def _reference_save_blocks(requests: Any) -> None:
            before = set(cs._pinned_saves)
            reference(requests)
            pool = cs._gpu_block_pool
            for job in set(cs._pinned_saves) - before:
                blocks, ranks = cs._pinned_saves[job]
                pool.free_blocks(pool.blocks[b] for b in blocks)
                cs._pinned_saves[job] = ([], ranks)

        cs._reference_save_blocks = _reference_save_blocks

    def prepare(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult

        cs = self.scheduler.connector.connector_scheduler
        self.cs = cs
        self.stored: set[Any] = set()  # block hashes the simulated store holds
        self.put_hashes: dict[int, list[Any]] = {}  # store job -> hashes it stores
        if self.ranks > 1:
            cs._num_workers = self.ranks  # as vLLM sizes it for TP ranks
        if self.schedule.options.get("unpinned"):
            self._unpin()

        def lookup(req_id: str, num_tokens: int, block_hashes: Any, non_block: bool = False) -> Any:
            n = 0
            for h in block_hashes:
                if h not in self.stored:
                    break
                n += 1
            return MooncakeLookupResult(hit_length=min(n * BS, (num_tokens - 1) // BS * BS))

        cs.client.lookup.side_effect = lookup

    def may_reset(self) -> bool:
        # vLLM's own scheduler refuses a reset while a PUT pins blocks or a
        # GET's request waits for its blocks (RuntimeError), plugin or not;
        # a PUT that pins nothing does not stand in its way.
        # With a request running, vLLM 0.34's MooncakeStore scheduler fails
        # its own assertion (``request.req_id in self._unfinished_requests``)
        # when a request the reset preempted is scheduled again in the next
        # step, plugin or not: the reset waits for no request to run.
        pinned = any(blocks for blocks, _ in self.cs._pinned_saves.values())
        return not pinned and not self.scheduler.running and super().may_reset()

    def plan(self, step: int, out: Any) -> None:
        meta = out.kv_connector_metadata
        for rm in meta.requests:
            spec = rm.load_spec
            if spec is not None and spec.can_load:
                first = spec.vllm_cached_tokens // BS
                last = -(-spec.kvpool_cached_tokens // BS)
                blocks = rm.block_ids[0][first:last]
                self.begin(rm.req_id, "load", ("load", rm.req_id, step), blocks, step,
                           self.schedule.options["load_delay"])  # fmt: skip
            job = rm.store_job_id
            if rm.can_save and job is not None and job not in self.put_hashes:
                pinned = self.cs._pinned_saves.get(job)
                if pinned is None:
                    continue
                self.put_hashes[job] = list(rm.block_hashes[: rm.token_len_chunk // BS])
                # The send thread reads the whole chunks below the PUT's
                # token length (vLLM pins every allocated block, for retries).
                blocks = [b for b in rm.block_ids[0][: rm.token_len_chunk // BS]]
                blocks += [p.block_id for p in rm.boundary_puts or ()]
                self.begin(rm.req_id, "store", job, blocks, step, self.schedule.options["put_delay"])

    def encode(self, step: int, due: list[list[SimTransfer]], twice: list[list[SimTransfer]]) -> list[Any]:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeStoreWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        outs = []
        for rank in range(self.ranks):
            saves: dict[int, int] = {}
            recving: set[str] = set()
            invalid: set[int] = set()
            for t in due[rank] + twice[rank]:
                if t.kind == "store":
                    saves[t.job] = 1
                    if not t.failed and all(t.reported):
                        self.stored.update(self.put_hashes.get(t.job, ()))
                else:
                    recving.add(t.req_id)
                    if t.failed:
                        invalid.update(t.failed_blocks or t.block_ids)
            meta = MooncakeStoreWorkerMetadata(completed_saves=saves) if saves else None
            outs.append(KVConnectorOutput(finished_recving=recving or None, invalid_block_ids=invalid,
                                          kv_connector_worker_meta=meta))  # fmt: skip
        return outs


# ----------------------------------------------------------------------
# SimpleCPUOffload
# ----------------------------------------------------------------------


@register_sim
class SimpleCPUOffloadSim(ConnectorSim):
    """vLLM's ``SimpleCPUOffloadConnector`` worker (``simple_kv_offload/worker.py``):
    a step's load event is reported in ``finished_recving`` (every request
    of the event), a store event in ``completed_store_events`` of the
    worker metadata by each rank; a step with ``need_flush`` (a
    preemption) synchronizes every transfer in flight, so each is reported
    in it. Its worker reports no failed copy."""

    name = "simple_cpu_offload"
    connector = "SimpleCPUOffloadConnector"
    fault_kinds = ("late", "reorder", "skew")

    @classmethod
    def scheduler_kwargs(cls, schedule: Schedule) -> dict[str, Any]:
        import torch
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        n = schedule.num_blocks
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        page = spec.page_size_bytes
        kv = KVCacheConfig(
            num_blocks=n,
            kv_cache_tensors=[
                KVCacheTensor(size=page * n, layers=["layer"], layer_stride=page * n, block_stride=page)
            ],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        extra = {"cpu_bytes_to_use": page * 4 * n, "lazy_offload": schedule.options.get("lazy", False)}
        return {"extra": extra, "kv": kv}

    @classmethod
    def draw_options(cls, rng: random.Random, schedule: Schedule) -> dict[str, Any]:
        return {"load_delay": rng.choice((0, 1, 1, 2)), "lazy": rng.random() < 0.3}

    def may_reset(self) -> bool:
        # Its stores hold block references until every rank reported them.
        return not any(t.live for t in self.transfers) and super().may_reset()

    def prepare(self) -> None:
        self.manager = self.scheduler.connector.scheduler_manager
        if self.ranks > 1:
            self.manager._expected_worker_count = self.ranks  # as vLLM sizes it for TP ranks

    def plan(self, step: int, out: Any) -> None:
        meta = out.kv_connector_metadata
        if meta.need_flush:
            for t in self.transfers:
                if t.live:
                    t.due = [step] * self.ranks
                    t.flushed_at = step
        if meta.load_event >= 0:
            for req_id in meta.load_event_to_reqs.get(meta.load_event, ()):
                self.begin(req_id, "load", ("load", meta.load_event, req_id), meta.load_gpu_blocks, step,
                           self.schedule.options["load_delay"])  # fmt: skip
        if meta.store_event >= 0:
            reqs = self.manager._store_event_to_reqs.get(meta.store_event) or ["*"]
            self.begin(reqs[0], "store", meta.store_event, meta.store_gpu_blocks, step, 1)

    def encode(self, step: int, due: list[list[SimTransfer]], twice: list[list[SimTransfer]]) -> list[Any]:
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        outs = []
        for rank in range(self.ranks):
            events: dict[int, int] = {}
            recving: set[str] = set()
            for t in due[rank] + twice[rank]:
                if t.kind == "store":
                    events[t.job] = 1
                else:
                    recving.add(t.req_id)
            meta = SimpleCPUOffloadWorkerMetadata(completed_store_events=events) if events else None
            outs.append(KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta))
        return outs


def _spec_ids(spec: Any) -> list[int]:
    ids = getattr(spec, "block_ids", None)
    return [] if ids is None else [int(b) for b in ids]


# ----------------------------------------------------------------------
# one run of a schedule in one mode
# ----------------------------------------------------------------------


@dataclass
class RunResult:
    """What one mode's run of a schedule did."""

    mode: str
    steps: int = 0
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)  # request -> final RequestStatus name
    error: str | None = None
    longest_idle: int = 0  # steps without scheduled work while requests waited, none for a load in flight
    unfinished: list[str] = field(default_factory=list)
    leaked: list[int] = field(default_factory=list)  # blocks not free (or ref count > 0) after the drain
    reused_live: list[str] = field(default_factory=list)
    reused_given_up: int = 0  # blocks handed out after the plugin gave up the transfer on them
    fired: dict[Fault, int] = field(default_factory=dict)
    resolved: dict[Fault, Fault] = field(default_factory=dict)  # ConnectorSim.resolved
    met: set[Fault] = field(default_factory=set)  # ConnectorSim.met
    never: int = 0  # transfers left unreported by design (``never``)


@contextlib.contextmanager
def plugin_mode(mode: str) -> Iterator[None]:
    """The plugin registered as ``mode`` (:data:`MODES`) for the duration,
    unregistered afterwards."""
    from blockpool.integrations import vllm as plugin
    from blockpool.integrations.vllm import surface

    plugin.unregister()
    if mode == "stock":
        env = {plugin.ENV_PLUGIN: "0"}
    else:
        env = {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "audit" if mode == "audit" else "1"}
    with patch.dict(os.environ, env), patch.object(surface, "check", _checked_once(surface.check)):
        plugin.register()
        try:
            yield
        finally:
            plugin.unregister()


_CHECKED: dict[Any, Any] = {}


def _checked_once(check: Any) -> Any:
    """``surface.check`` remembered per surface for this process: the vLLM
    code it fingerprints does not change between schedules, and the check
    is most of a registration's time (0.4 s against a schedule's 0.05 s)."""

    def cached(chosen: Any, *a: Any, **k: Any) -> Any:
        key = (id(chosen), a, tuple(sorted(k.items())))
        if key not in _CHECKED:
            _CHECKED[key] = (chosen, check(chosen, *a, **k))
        return _CHECKED[key][1]

    return cached


def _make_request(spec: RequestSpec, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, None)
    req = Request(request_id=spec.req_id, prompt_token_ids=list(spec.prompt), sampling_params=sp,
                  pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(BS, sha256))  # fmt: skip
    req.kv_transfer_params = params
    return req


def _model_output(scheduler: Any, out: Any, connector_output: Any) -> Any:
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([next_token(list(req.all_token_ids))] if done else [])
    extra: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # vLLM 0.32, 0.33
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=None, kv_connector_output=connector_output, **extra)  # fmt: skip


def _watch_give_ups(pool: Any) -> set[int]:
    """The ids of the blocks of every transfer the plugin gives up (its
    bound on a held-up scheduler, or a lease: ``StepHazards._give_up_transfer``),
    collected in the set returned; empty for stock. The engine has given up
    on such a transfer too, and stock would already have reused its
    blocks. O(1) a call plus the blocks."""
    given_up: set[int] = set()
    hz = getattr(pool, "hazards", None)
    give_up = getattr(hz, "_give_up_transfer", None)
    if give_up is None:
        return given_up

    def watched(stream: str, entry: Any, why: str) -> int:
        given_up.update(entry[-1].block_ids)
        return give_up(stream, entry, why)

    hz._give_up_transfer = watched
    return given_up


def _watch_allocations(pool: Any) -> list[int]:
    """Record the ids of the blocks ``pool.get_new_blocks`` hands out (from
    the free queue: prefix hits are not handed out) in the list returned;
    the caller clears it each step. O(1) a call plus the blocks."""
    handed: list[int] = []
    get_new_blocks = pool.get_new_blocks

    def watched(num_blocks: int) -> list[Any]:
        blocks = get_new_blocks(num_blocks)
        handed.extend(b.block_id for b in blocks)
        return blocks

    pool.get_new_blocks = watched
    return handed


def _reported(scheduler: Any, sim: ConnectorSim, aggregator: Any, out: Any, step: int) -> Any:
    """The model output of ``step``: the stand-in model's tokens with what
    the simulated ranks report, joined by vLLM's ``KVOutputAggregator``
    where there are several."""
    rank_outputs = sim.report(step)
    if aggregator is None:
        return _model_output(scheduler, out, rank_outputs[0])
    return aggregator.aggregate([_model_output(scheduler, out, o) for o in rank_outputs], 0)


def serve(schedule: Schedule, mode: str, *, max_steps: int | None = None, hooks: Any = None) -> RunResult:
    """Serve ``schedule`` in ``mode`` (:data:`MODES`) and return what it
    did. Never raises for an exception of vLLM or the wiring: it is the
    result's ``error``. ``hooks(scheduler)`` runs once the scheduler is
    built (tests patch with it). O(steps * requests)."""
    from vllm.v1.request import RequestStatus

    from tests.test_vllm_connectors import make_scheduler

    res = RunResult(mode)
    sim_cls = SIMS[schedule.connector]
    limit = max_steps or 60 + 3 * sum(len(r.prompt) // 8 + r.max_tokens + 2 for r in schedule.requests)
    bound = stall_bound()
    with plugin_mode(mode):
        try:
            kwargs = dict(sim_cls.scheduler_kwargs(schedule))
            transfer_extra = kwargs.pop("extra", None)
            scheduler = make_scheduler(
                sim_cls.connector,
                transfer_extra,
                num_blocks=schedule.num_blocks,
                max_num_batched_tokens=schedule.max_num_batched_tokens,
                async_scheduling=schedule.async_scheduling,
                **kwargs,
            )
            # make_scheduler builds the transfer config with the default
            # policy; the scheduler reads it once, into this attribute.
            scheduler.vllm_config.kv_transfer_config.kv_load_failure_policy = schedule.policy
            scheduler.recompute_kv_load_failures = schedule.policy == "recompute"
            if hooks is not None:
                hooks(scheduler)
            sim = sim_cls(schedule, scheduler)
            sim.prepare()
            handed = _watch_allocations(scheduler.kv_cache_manager.block_pool)
            given_up = _watch_give_ups(scheduler.kv_cache_manager.block_pool)
        except Exception:  # noqa: BLE001
            res.error = "build: " + traceback.format_exc(limit=6)
            return res
        aggregator = None
        if schedule.ranks > 1:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            aggregator = KVOutputAggregator(schedule.ranks)
        reqs: dict[str, Any] = {}
        pending = sorted(schedule.requests, key=lambda r: r.arrival)
        events = list(schedule.events)
        started: set[str] = set()  # requests whose first transfer began
        idle = 0
        step = 0
        try:
            while True:
                step += 1
                if step > limit:
                    break
                while pending and pending[0].arrival <= step:
                    spec = pending.pop(0)
                    reqs[spec.req_id] = _make_request(spec, sim.request_params(spec))
                    scheduler.add_request(reqs[spec.req_id])
                for ev in list(events):
                    req = reqs.get(ev.req_id)
                    if req is None:
                        continue
                    ready = ev.req_id in started if ev.tokens < 0 else req.num_output_tokens >= ev.tokens
                    if not ready or (ev.what == "reset" and not sim.may_reset()):
                        continue
                    events.remove(ev)
                    if ev.what == "abort":
                        if not req.is_finished():
                            scheduler.finish_requests(ev.req_id, RequestStatus.FINISHED_ABORTED)
                    else:
                        scheduler.reset_prefix_cache(reset_running_requests=True)
                sim.step = step
                sim.before_schedule(step)
                handed.clear()
                out = scheduler.schedule()
                sim.plan(step, out)
                for t in sim.transfers:
                    if t.planned == step:
                        started.add(t.req_id)
                live = sim.live_guarded(step)
                for b in handed:
                    t = live.get(b)
                    if t is not None and b in given_up:
                        res.reused_given_up += 1  # the plugin gave its transfer up, as the engine does
                    elif t is not None:
                        res.reused_live.append(
                            f"step {step}: block {b} handed out while {t.req_id}'s {t.kind} #{t.ordinal} "
                            f"(planned step {t.planned}) could still touch it"
                        )
                scheduler.update_from_output(out, _reported(scheduler, sim, aggregator, out, step))
                waiting = scheduler.has_unfinished_requests()
                # a load the simulated worker has yet to report (vLLM's
                # WAITING_FOR_REMOTE_KVS alone is no excuse: the plugin may
                # be the one holding it)
                loading = any(t.kind == "load" and t.live for t in sim.transfers)
                if out.total_num_scheduled_tokens == 0 and waiting and not loading:
                    idle += 1
                    res.longest_idle = max(res.longest_idle, idle)
                else:
                    idle = 0
                if not pending and not waiting and not sim.busy():
                    break  # served; a transfer that never reports keeps vLLM stepping for it, not us
                if idle > 2 * bound + 20 and not sim.busy() and not (pending and pending[0].arrival > step):
                    break  # stalled: nothing left to report, nothing scheduled
        except Exception:  # noqa: BLE001
            res.error = f"step {step}: " + traceback.format_exc(limit=8)
        if res.error is None:
            try:
                step = _drain(scheduler, sim, aggregator, step)
            except Exception:  # noqa: BLE001
                res.error = "drain: " + traceback.format_exc(limit=8)
        res.steps = step
        sim.settle_never()
        res.fired = dict(sim.fired)
        res.resolved = dict(sim.resolved)
        res.met = set(sim.met)
        res.never = len(sim.never_live())
        for rid, req in reqs.items():
            res.outputs[rid] = tuple(req.output_token_ids)
            res.status[rid] = req.status.name
            if not req.is_finished():
                res.unfinished.append(rid)
        res.unfinished += [r.req_id for r in pending]
        if res.error is None and not res.unfinished:
            res.leaked = _leaked(scheduler)
    return res


DRAIN_STEPS = 3
"""Steps served after the workload, with the leases' clock past every give-up time."""


def _drain(scheduler: Any, sim: ConnectorSim, aggregator: Any, step: int) -> int:
    """After the workload: move the plugin's lease clock (``StepHazards.clock``)
    a day on, past every engine's give-up time, and serve at least
    :data:`DRAIN_STEPS` more steps, until the simulated worker has nothing
    left to report (each step gives up the transfers whose lease ended as
    it begins; the transfers planned in them are reported as usual); stock
    serves the same steps. Returns the last step."""
    hz = getattr(scheduler.kv_cache_manager.block_pool, "hazards", None)
    clock = getattr(hz, "clock", None)
    if clock is not None:
        hz.clock = lambda: clock() + 86400.0
    for i in range(DRAIN_STEPS + 40):
        if i >= DRAIN_STEPS and not sim.busy():
            break
        step += 1
        sim.step = step
        out = scheduler.schedule()
        sim.plan(step, out)
        scheduler.update_from_output(out, _reported(scheduler, sim, aggregator, out, step))
    return step


def _leaked(scheduler: Any) -> list[int]:
    """Blocks of the scheduler's pool not free, or with a reference, after
    the drain (the null block aside). O(blocks)."""
    pool = scheduler.kv_cache_manager.block_pool
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    null = pool.null_block.block_id
    return sorted(
        b.block_id for b in pool.blocks if b.block_id != null and (b.ref_cnt != 0 or b.block_id not in free)
    )


# ----------------------------------------------------------------------
# the oracle
# ----------------------------------------------------------------------


@dataclass
class Verdict:
    """A schedule's outcome: ``failures`` (the plugin did worse than stock:
    one line each), ``stock_only`` (stock itself crashed, stalled or
    leaked), ``unfired`` (faults that did not fire in the stock run),
    ``served_more`` (requests a plugin mode served where stock failed them:
    its prefix cache kept content stock had evicted, so the failing load
    never ran; better than stock, reported apart)."""

    schedule: Schedule
    results: dict[str, RunResult]
    failures: list[str] = field(default_factory=list)
    stock_only: list[str] = field(default_factory=list)
    unfired: list[Fault] = field(default_factory=list)
    served_more: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def replay(self) -> str:
        return f"python -m tests.vllm_faults --connector {self.schedule.connector} --seed {self.schedule.seed} --schedules 1 -v"


def judge(schedule: Schedule, results: dict[str, RunResult], bound: int | None = None) -> Verdict:
    """The oracle (module docstring) over the runs of ``schedule``:
    ``results["stock"]`` against every other mode. O(requests)."""
    bound = stall_bound() if bound is None else bound
    v = Verdict(schedule, results)
    stock = results["stock"]
    stock_bad = []
    if stock.error:
        stock_bad.append(f"stock raised: {stock.error.strip().splitlines()[-1]}")
    if stock.unfinished:
        stock_bad.append(f"stock left {stock.unfinished} unfinished")
    if stock.leaked:
        stock_bad.append(f"stock leaked blocks {stock.leaked}")
    v.stock_only = stock_bad
    v.unfired = [f for f in schedule.faults if f not in stock.fired]
    for mode, r in results.items():
        if mode == "stock":
            continue
        if r.error and not stock.error:
            v.failures.append(f"{mode}: raised where stock did not: {r.error.strip().splitlines()[-1]}")
        if r.error or stock.error:
            continue  # past stock's crash, stock serves nothing to compare with
        for rid, toks in stock.outputs.items():
            if rid in stock.unfinished:
                continue
            if rid in r.unfinished:
                v.failures.append(f"{mode}: {rid} never finished (stock: {stock.status[rid]})")
            elif stock.status[rid] != "FINISHED_ERROR" and r.status.get(rid) == "FINISHED_ERROR":
                v.failures.append(f"{mode}: {rid} failed (stock: {stock.status[rid]})")
            elif stock.status[rid] == "FINISHED_ERROR" and r.status.get(rid) != "FINISHED_ERROR":
                v.served_more.append(f"{mode}: {rid} served (stock: FINISHED_ERROR)")
            elif "FINISHED_ABORTED" in (stock.status[rid], r.status.get(rid)):
                continue  # the tokens before an abort depend on when it lands
            elif r.outputs.get(rid) != toks:
                v.failures.append(f"{mode}: {rid} output {r.outputs.get(rid)} != stock's {toks}")
        if r.longest_idle > max(stock.longest_idle, 0) + bound:
            v.failures.append(
                f"{mode}: stalled {r.longest_idle} steps without scheduled work (stock's longest "
                f"{stock.longest_idle}, bound {bound})"
            )
        if r.leaked and not stock.leaked:
            v.failures.append(f"{mode}: leaked blocks {r.leaked}")
        if len(r.reused_live) > len(stock.reused_live):
            v.failures.append(
                f"{mode}: {len(r.reused_live)} block(s) reused under a live transfer (stock: "
                f"{len(stock.reused_live)}): {r.reused_live[0]}"
            )
    return v


def resolved(schedule: Schedule, stock: RunResult) -> Schedule:
    """``schedule`` with the faults ``stock`` met only, each keyed by the
    run's n-th transfer (``"*"``) replaced by the request's transfer it met
    there: every mode meets the same faults on the same requests' transfers
    whatever order it plans them in, and none that stock did not meet (a
    transfer the plugin plans where stock planned none, e.g. a load of a
    prefix stock still held, meets no fault). O(faults)."""
    faults = [stock.resolved.get(f, f) for f in schedule.faults if f in stock.met]
    return dataclasses.replace(schedule, faults=faults)


def run_schedule(seed: int, connector: str, modes: tuple[str, ...] = MODES, **kw: Any) -> Verdict:
    """Draw, serve in every mode (stock first: the faults keyed by the
    run's n-th transfer are then those stock met, :func:`resolved`) and
    judge the schedule of ``seed``."""
    schedule = make_schedule(seed, connector)
    results = {"stock": serve(schedule, "stock", **kw)}
    fixed = resolved(schedule, results["stock"])
    for m in modes:
        if m != "stock":
            results[m] = serve(fixed, m, **kw)
    return judge(schedule, results)


# ----------------------------------------------------------------------
# totals and the CLI
# ----------------------------------------------------------------------


_REQUEST_FAILED = re.compile(r"\S+ (never finished|failed \(stock|output )")
"""A :func:`judge` line about a request stock served and a mode did not."""


@dataclass
class Totals:
    """Counts over many schedules of one connector."""

    connector: str
    schedules: int = 0
    failed: list[Verdict] = field(default_factory=list)
    stock_only: list[Verdict] = field(default_factory=list)
    requests_failed: int = 0  # requests stock served that a plugin mode did not
    stalls: int = 0
    crashes: int = 0
    leaked: int = 0
    reused_live: int = 0
    faults: dict[str, int] = field(default_factory=dict)  # kind -> injected
    fired: dict[str, int] = field(default_factory=dict)  # kind -> confirmed fired
    unfired_schedules: int = 0
    served_more: int = 0  # requests a plugin mode served where stock failed them
    seconds: float = 0.0

    def add(self, v: Verdict) -> None:
        self.schedules += 1
        for f in v.schedule.faults:
            self.faults[f.fault] = self.faults.get(f.fault, 0) + 1
            if f in v.results["stock"].fired:
                self.fired[f.fault] = self.fired.get(f.fault, 0) + 1
        self.unfired_schedules += bool(v.unfired)
        self.served_more += len(v.served_more)
        if v.stock_only:
            self.stock_only.append(v)
        if not v.ok:
            self.failed.append(v)
        for line in v.failures:
            what = line.split(": ", 1)[1]
            self.requests_failed += bool(_REQUEST_FAILED.match(what))
            self.stalls += what.startswith("stalled ")
            self.crashes += what.startswith("raised ")
            self.leaked += what.startswith("leaked ")
            self.reused_live += " reused under a live transfer" in what


def run_many(
    connector: str, seeds: Iterable[int], modes: tuple[str, ...] = MODES, verbose: bool = False
) -> Totals:
    """Run the schedules of ``seeds`` for ``connector``; print each failing
    one's seed, failures and replay command. O(schedules)."""
    totals = Totals(connector)
    t0 = time.perf_counter()
    for seed in seeds:
        v = run_schedule(seed, connector, modes)
        totals.add(v)
        if verbose:
            print(v.schedule.describe())
            for m, r in v.results.items():
                print(f"  {m}: {r.steps} steps, idle {r.longest_idle}, unfinished {r.unfinished}, leaked "
                      f"{len(r.leaked)}, reused {len(r.reused_live)}, error {bool(r.error)}")  # fmt: skip
                if r.error and verbose:
                    print("    " + r.error.replace("\n", "\n    "))
        if not v.ok:
            print(f"FAIL seed {seed} {connector}: " + "; ".join(v.failures))
            print(f"  replay: {v.replay()}")
    totals.seconds = time.perf_counter() - t0
    return totals


def format_totals(rows: list[Totals]) -> str:
    """The summary table (Markdown) of :func:`run_many` results."""
    lines = [
        (
            "| connector | schedules × modes | requests failed | stalls | crashes | leaked | reused live | "
            "stock-only | faults fired / injected |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in rows:
        fired = ", ".join(f"{k} {t.fired.get(k, 0)}/{n}" for k, n in sorted(t.faults.items()))
        lines.append(
            f"| {t.connector} | {t.schedules} × {len(MODES)} | {t.requests_failed} | {t.stalls} | {t.crashes} | "
            f"{t.leaked} | {t.reused_live} | {len(t.stock_only)} | {fired} |"
        )
    more = [f"{t.connector} {t.served_more}" for t in rows if t.served_more]
    if more:
        lines.append("")
        lines.append("Requests a plugin mode served where stock failed them: " + ", ".join(more))
    groups: dict[tuple[str, str], list[int]] = {}
    for t in rows:
        for v in t.stock_only:
            groups.setdefault((t.connector, _stock_failure_kind(v.stock_only)), []).append(v.schedule.seed)
    if groups:
        lines.append("")
        lines.append(
            "Stock-only failures (stock itself crashed, left a request unfinished or leaked blocks):"
        )
        for (connector, kind), seeds in sorted(groups.items()):
            shown = ", ".join(map(str, seeds[:5])) + (", ..." if len(seeds) > 5 else "")
            lines.append(f"- {connector}: {kind}: {len(seeds)} schedule(s) (seeds {shown})")
    return "\n".join(lines)


def _stock_failure_kind(lines: list[str]) -> str:
    """What a stock-only failure is, without its request and block ids: the
    exception (type and message), else an unfinished request, else a leak."""
    first = lines[0]
    if first.startswith("stock raised: "):
        return "raised " + first[len("stock raised: ") :][:160]
    if first.startswith("stock left "):
        return "left requests unfinished" + (" and leaked blocks" if len(lines) > 1 else "")
    return "leaked blocks"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--connector", action="append", help="a simulated connector's name (repeatable; default all)"
    )
    p.add_argument("--schedules", type=int, default=50, help="schedules per connector (default 50)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument(
        "--long", action="store_true", help="thousands of schedules: --schedules 2000 unless given"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="describe every schedule and run")
    args = p.parse_args(argv)
    load_sims()
    if args.long and "--schedules" not in (argv if argv is not None else sys.argv[1:]):
        args.schedules = 2000
    names = args.connector or sorted(SIMS)
    for n in names:
        if n not in SIMS:
            p.error(f"unknown connector {n!r} (known: {', '.join(sorted(SIMS))})")
    rows = []
    for n in names:
        t = run_many(n, range(args.seed, args.seed + args.schedules), verbose=args.verbose)
        print(f"{n}: {t.schedules} schedules in {t.seconds:.0f} s", file=sys.stderr)
        rows.append(t)
    print(format_totals(rows))
    return 1 if any(t.failed for t in rows) else 0


def _quiet_logs() -> None:
    """The CLI prints its own lines: vLLM's and the plugin's log records
    (errors included: a failed load is an ERROR line of vLLM's) are dropped."""
    import logging

    logging.disable(logging.ERROR)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, os.getcwd())
    import conftest  # noqa: F401  (the shape-only model configs, offline)

    _quiet_logs()
    # The simulated workers of SIM_MODULES register into tests.vllm_faults,
    # not into this __main__ copy of it.
    import importlib

    sys.exit(importlib.import_module("tests.vllm_faults").main())
