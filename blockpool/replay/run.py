"""Replay one trace under several policies and gather the report.

Policies are independent runs over the same trace and seed; with ``jobs >
1`` they run in that many worker processes (``fork``), which changes
nothing in the figures but the wall times. The event log of each policy is
written to a part file beside the output and the parts are joined, in policy
order, under one header line (into a temporary file renamed at the end).

Interrupts: workers ignore SIGINT (the parent handles Ctrl-C for them) and
die on SIGTERM; whatever ends a replay early (an exception, Ctrl-C, SIGTERM
turned into an exception by the caller) stops the workers and removes the
part files, so nothing partial is left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from blockpool.core.errors import InvalidArgumentError
from blockpool.replay.config import ReplayConfig
from blockpool.replay.driver import run_policy
from blockpool.replay.eventlog import EventLog
from blockpool.replay.policies import POLICIES, parse_policies
from blockpool.replay.report import PolicyResult, ReplayReport
from blockpool.replay.traces import Trace, TraceRequest

__all__ = ["replay", "write_atomic"]

_counts: Any = None  # the workers' shared progress counters (set by _init)


def _init(counts: Any) -> None:
    global _counts
    _counts = counts
    # Ctrl-C reaches the whole process group: the parent handles it and
    # stops the workers (SIGTERM, default action: exit at once).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _one(
    requests: tuple[TraceRequest, ...],
    unit: tuple[str, str, str, str],
    index: int,
    config: ReplayConfig,
    part: str | None,
    progress: Callable[[int], None] | None,
) -> PolicyResult:
    label, policy, eviction, placement = unit
    config = attrs.evolve(config, eviction=eviction, placement=placement)
    if progress is None and _counts is not None:

        def progress(n: int) -> None:
            _counts[index] = n

    if part is None:
        return run_policy(requests, policy, config, progress=progress, label=label)
    with open(part, "w", encoding="utf-8") as f:
        return run_policy(
            requests, policy, config, events=EventLog(f, {"part": label}), progress=progress, label=label
        )


def units(
    names: Sequence[str], evictions: Sequence[str] | None, placements: Sequence[str] | None, config: ReplayConfig
) -> list[tuple[str, str, str, str]]:
    """The runs of a replay: ``(label, policy, eviction, placement)`` for
    every policy x eviction x placement, in that nesting order. The label
    is the policy name alone when neither list was given (the config's
    eviction and placement then apply), else ``policy/eviction/placement``.
    O(product of the lengths)."""
    if evictions is None and placements is None:
        return [(n, n, config.eviction, config.placement) for n in names]
    evs = list(evictions) if evictions is not None else [config.eviction]
    pls = list(placements) if placements is not None else [config.placement]
    return [(f"{n}/{e}/{p}", n, e, p) for n in names for e in evs for p in pls]


def replay(
    trace: Trace,
    policies: Sequence[str] | str = POLICIES,
    config: ReplayConfig | None = None,
    *,
    jobs: int = 1,
    events: str | os.PathLike[str] | None = None,
    progress: Callable[[int], None] | None = None,
    evictions: Sequence[str] | None = None,
    placements: Sequence[str] | None = None,
) -> ReplayReport:
    """Replay ``trace`` under each policy (same trace, same seed).

    Args:
        trace: The requests (:func:`~blockpool.replay.traces.read_trace` or
            :func:`~blockpool.replay.synthetic.synthetic_trace`).
        policies: Names, or a comma-separated string.
        config: The :class:`ReplayConfig` (default: defaults).
        jobs: Worker processes (``1``: run in this process).
        events: Write the event log (schema ``blockpool.core.events/2``) here.
        progress: Called with the number of requests done so far over all
            policies (each policy counts up to ``len(trace.requests)``).
        evictions, placements: Run every policy under each of these pool
            eviction policies and placements (results labelled
            ``policy/eviction/placement``); ``None``: the config's.

    Returns:
        The :class:`~blockpool.replay.report.ReplayReport`.

    Raises:
        UnknownPolicyError: an unknown policy name.
        InvalidArgumentError: ``jobs < 1``.
        UnknownEvictionPolicyError: an unknown eviction policy or placement.
        ReplayError: a policy's replay stalled or leaked blocks.
        OSError: the event log cannot be written.

    Runtime complexity: the sum of the policies' runs (see
    :func:`~blockpool.replay.driver.run_policy`), divided among ``jobs``.
    """
    names = parse_policies(policies) if isinstance(policies, str) else parse_policies(",".join(policies))
    cfg = config if config is not None else ReplayConfig()
    if not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be an int >= 1, got {jobs!r}")
    for e in evictions or ():
        attrs.evolve(cfg, eviction=e)  # raises the typed error before any run
    for p in placements or ():
        attrs.evolve(cfg, placement=p)
    runs = units(names, evictions, placements, cfg)
    labels = tuple(u[0] for u in runs)
    requests = trace.requests
    parts: list[str | None] = [
        f"{os.fspath(events)}.{u[0].replace('/', '_')}.part" if events is not None else None for u in runs
    ]
    t0 = time.perf_counter()
    jobs = min(jobs, len(runs))
    try:
        if jobs == 1:
            results = []
            for i, unit in enumerate(runs):
                base = i * len(requests)
                cb = (lambda n, base=base: progress(base + n)) if progress is not None else None
                results.append(_one(requests, unit, i, cfg, parts[i], cb))
        else:
            results = _parallel(requests, runs, cfg, parts, jobs, progress)
        wall = time.perf_counter() - t0
        if events is not None:
            _join(Path(events), [p for p in parts if p is not None], trace, labels, cfg)
    finally:
        for part in parts:
            if part is not None and os.path.exists(part):
                os.remove(part)
    return ReplayReport(
        source=trace.source,
        format=trace.format,
        requests=len(requests),
        skipped=tuple(str(s) for s in trace.skipped),
        config={**cfg.to_json(), "policies": list(labels)},
        results=tuple(results),
        wall_s=wall,
    )


def _parallel(
    requests: tuple[TraceRequest, ...],
    names: list[tuple[str, str, str, str]],
    cfg: ReplayConfig,
    parts: list[str | None],
    jobs: int,
    progress: Callable[[int], None] | None,
) -> list[PolicyResult]:
    ctx = multiprocessing.get_context("fork")
    counts = ctx.Array("q", len(names), lock=False)
    with ctx.Pool(jobs, initializer=_init, initargs=(counts,)) as pool:
        pending = [pool.apply_async(_one, (requests, n, i, cfg, parts[i], None)) for i, n in enumerate(names)]
        while not all(p.ready() for p in pending):
            if progress is not None:
                progress(sum(counts))
            time.sleep(0.2)
        results = [p.get() for p in pending]
    if progress is not None:
        progress(len(names) * len(requests))
    return results


def _join(path: Path, parts: list[str], trace: Trace, names: tuple[str, ...], cfg: ReplayConfig) -> None:
    header = {
        "source": trace.source,
        "format": trace.format,
        "requests": len(trace.requests),
        "policies": list(names),
        "block_size": cfg.block_size,
        "num_blocks": cfg.num_blocks,
        "seed": cfg.seed,
        "streams": {n: s.kind.value for n, s in cfg.streams.items()},
        "time_unit": "s",
    }

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as out:
            log = EventLog(out, header)
            for part in parts:
                with open(part, encoding="utf-8") as f:
                    log.copy_events(f)
            log.close()

    write_atomic(path, write)


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` for a temporary file beside ``path`` (hidden,
    ``.part`` and ``path``'s extension in its name), then rename it to ``path`` with the mode a plain
    ``open`` would give. On any exception, interrupts included, the
    temporary file is removed and ``path`` is left as it was. O(1) besides
    ``write``.

    Raises:
        OSError: the temporary file cannot be created or renamed; whatever
            ``write`` raises.
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    ext = os.path.splitext(path)[1]  # kept last: writers that go by the extension (savefig)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=f".part{ext}", dir=d)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
