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
import shutil
import signal
import stat
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

__all__ = ["OUTPUT_FILE", "OUTPUT_STREAM", "output_kind", "replay", "write_atomic"]

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
    names: Sequence[str],
    evictions: Sequence[str] | None,
    placements: Sequence[str] | None,
    config: ReplayConfig,
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
        events: Write the event log (schema ``blockpool.core.events/3``) here
            (:func:`write_atomic`: a symlink's target; a device or a FIFO
            written through, its policies' part files in a temporary
            directory).
        progress: Called with the number of requests done so far over all
            policies (each policy counts up to ``len(trace.requests)``).
        evictions, placements: Run every policy under each of these pool
            eviction policies and placements (results labelled
            ``policy/eviction/placement``); ``None``: the config's.

    Returns:
        The :class:`~blockpool.replay.report.ReplayReport`.

    Raises:
        UnknownPolicyError: an unknown policy name.
        InvalidArgumentError: ``jobs < 1``; ``events`` is a directory, a
            socket or a block device.
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
    part_dir = (
        None  # the policies' event logs: beside a regular output, in a temporary directory for a device
    )
    part_base = ""
    if events is not None:
        target, kind = output_kind(events)
        part_dir = None if kind == OUTPUT_FILE else tempfile.mkdtemp(prefix="blockpool-events-")
        part_base = (
            target if part_dir is None else os.path.join(part_dir, os.path.basename(target) or "events")
        )
    parts: list[str | None] = [
        f"{part_base}.{u[0].replace('/', '_')}.part" if events is not None else None for u in runs
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
        if part_dir is not None:
            shutil.rmtree(part_dir, ignore_errors=True)
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


OUTPUT_FILE = "file"
""":func:`output_kind`: a regular file, or no file yet (written atomically)."""
OUTPUT_STREAM = "stream"
""":func:`output_kind`: a character device or a FIFO (written through, in place)."""


def output_kind(path: str | os.PathLike[str]) -> tuple[str, str]:
    """How an output path is written: ``(target, kind)``.

    ``target`` is ``path`` with every symlink resolved (a link's target is
    written, never the link). ``kind`` is :data:`OUTPUT_FILE` when the
    target is a regular file or does not exist (written to a temporary file
    beside it and renamed over it), :data:`OUTPUT_STREAM` when it is a
    character device or a FIFO (opened and written through, never replaced
    or renamed over: ``/dev/null``, ``/dev/stdout``, a named pipe). One
    ``stat``; changes nothing.

    Raises:
        InvalidArgumentError: the target exists and is neither (a
            directory, a socket, a block device), naming what it is.
    """
    target = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target, OUTPUT_FILE
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return target, OUTPUT_FILE
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return target, OUTPUT_STREAM
    what = (
        "a directory" if stat.S_ISDIR(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a block device" if stat.S_ISBLK(mode)
        else "not a regular file"
    )  # fmt: skip
    raise InvalidArgumentError(f"{os.fspath(path)}: it is {what}")


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Write an output through ``write(tmp)``, which writes a whole file at
    the path it is given, without ever leaving a part-written output.

    The output is ``path`` with its symlinks resolved (:func:`output_kind`):
    a regular file or a new one is written as a temporary file beside it
    (hidden, ``.part`` and ``path``'s extension in its name) renamed over it
    with the mode a plain ``open`` would give; a character device or a FIFO
    is written through: the temporary file is made in the temporary
    directory and copied into it, so the device or FIFO stays what it was
    (a writer that blocks until a FIFO has a reader blocks here too). On any
    exception, interrupts included, the temporary file is removed and a
    regular ``path`` is left as it was. O(1) besides ``write``; O(size) more
    for a device or a FIFO.

    Raises:
        InvalidArgumentError: ``path`` is a directory, a socket or a block
            device (nothing is written).
        OSError: the temporary file cannot be created or renamed, or the
            device or FIFO cannot be written (``/dev/full``: ``ENOSPC``);
            whatever ``write`` raises.
    """
    target, kind = output_kind(path)
    ext = os.path.splitext(target)[1]  # kept last: writers that go by the extension (savefig)
    d = os.path.dirname(target) if kind == OUTPUT_FILE else None
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=f".part{ext}", dir=d)
    os.close(fd)
    try:
        write(tmp)
        if kind == OUTPUT_STREAM:
            with open(tmp, "rb") as src, open(target, "wb") as dst:  # no O_TRUNC effect on a device or FIFO
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
