"""``blockpool sweep``: a grid of replays, one row per cell.

A cell is one replay of one trace under one wait policy, with one pool
eviction policy, placement, pool size and seed. The grid is the product
traces x policies x evictions x placements x pool sizes x seeds, in that
nesting order. Cells run in local worker processes
(:class:`concurrent.futures.ProcessPoolExecutor`; ``jobs=1`` runs them in
this process), or as Ray tasks on a Ray cluster (``ray=ADDRESS``; Ray is
the optional extra ``blockpool[ray]``, imported only then), and are
gathered into one table and one JSON document (schema
``blockpool.sweep/1``), in grid order whatever order they finish in. Both
run the same cell function, so their rows differ only in ``wall_s``.

A trace is a path (Mooncake ``.jsonl`` / Azure ``.csv``, read in place) or
:data:`SYNTHETIC` (the built-in workload, generated per cell from the cell's
seed, so the seed moves the workload as well as the plans and the
simulator, as ``blockpool replay --seed`` does).

Example::

    >>> from blockpool.replay.sweep import SweepSpec, sweep
    >>> rows = sweep(SweepSpec(traces=("synthetic",), policies=("exact",),
    ...                        num_blocks=(512,), seeds=(0,), limit=10))
    >>> [(r["policy"], r["num_blocks"], r["races"]) for r in rows]
    [('exact', 512, 0)]
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from blockpool.core.errors import ClusterUnavailableError, InvalidArgumentError, MissingDependencyError
from blockpool.core.eviction import EVICTION_POLICIES, UnknownEvictionPolicyError
from blockpool.core.pool import PLACEMENTS
from blockpool.replay.config import DEFAULT_NUM_BLOCKS, SYNTHETIC_NUM_BLOCKS, ReplayConfig
from blockpool.replay.policies import parse_policies

__all__ = [
    "RAY_LOCAL", "SCHEMA", "SYNTHETIC", "SweepSpec", "cells", "format_sweep", "require_ray", "sweep", "sweep_json",
]  # fmt: skip

SCHEMA = "blockpool.sweep/1"
"""The ``schema`` of :func:`sweep_json`'s document."""

SYNTHETIC = "synthetic"
"""The trace name of the built-in synthetic workload."""

RAY_LOCAL = "local"
"""The Ray address that starts a fresh Ray instance on this machine for the
sweep (``ray.init(address="local")``) and stops it afterwards."""

COLUMNS = (
    "trace", "policy", "eviction", "placement", "num_blocks", "seed", "requests", "skipped", "races", "loads",
    "loads_empty_fence_pct", "loads_short_of_ready", "load_delay_mean_ms", "load_delay_p99_ms",
    "runs_per_load", "min_runs_per_load", "prefix_hit_rate_pct", "makespan_s", "throughput_tok_s",
    "evictions", "preemptions", "wall_s",
)  # fmt: skip
"""The fields of a row, in table order."""


def _axis(v: object) -> tuple[Any, ...]:
    """A sweep axis: a single value (str, int, None) as a one-element tuple;
    repeats dropped, order kept."""
    out = (v,) if v is None or isinstance(v, (str, int)) else tuple(v)  # type: ignore[arg-type]
    return tuple(dict.fromkeys(out))


def _nonempty(inst: object, att: attrs.Attribute, v: tuple[Any, ...]) -> None:  # type: ignore[type-arg]
    if not v:
        raise InvalidArgumentError(f"sweep {att.name} names nothing")


@attrs.frozen
class SweepSpec:
    """A grid. Every axis is a sequence (a single value is taken as a
    one-element one; repeats are dropped, order kept).

    Attributes:
        traces: Trace paths, or :data:`SYNTHETIC`.
        policies: Wait policies (``exact``, ``step-event``, ``device-sync``,
            ``blind``).
        evictions: Pool eviction policies (:data:`blockpool.core.eviction.EVICTION_POLICIES`).
        placements: Pool placements (:data:`blockpool.core.pool.PLACEMENTS`).
        num_blocks: Pool sizes (null block included); ``None`` in the
            tuple: the default for the trace (16,384, or 2,048 for the
            synthetic workload).
        seeds: Seeds.
        limit: Replay the first ``limit`` requests (for the synthetic
            workload: generate that many); ``None``: all (500 synthetic).
        block_size: Tokens per block.
        skip_bad_lines: Skip bad trace lines (counted in each row's
            ``skipped``) instead of failing, as ``replay --skip-bad-lines``.

    Raises:
        UnknownPolicyError: an unknown wait policy.
        InvalidArgumentError: an empty axis, a pool
            size that is not an int ``>= 2`` or ``None``, a seed that is
            not an int, ``limit < 1``.
        UnknownEvictionPolicyError: an unknown eviction or placement (an
            :class:`InvalidArgumentError`).
    """

    traces: tuple[str, ...] = attrs.field(default=(SYNTHETIC,), converter=_axis, validator=_nonempty)
    policies: tuple[str, ...] = attrs.field(default=("exact",), converter=_axis, validator=_nonempty)
    evictions: tuple[str, ...] = attrs.field(default=("lru",), converter=_axis, validator=_nonempty)
    placements: tuple[str, ...] = attrs.field(default=("lru",), converter=_axis, validator=_nonempty)
    num_blocks: tuple[int | None, ...] = attrs.field(default=(None,), converter=_axis, validator=_nonempty)
    seeds: tuple[int, ...] = attrs.field(default=(0,), converter=_axis, validator=_nonempty)
    limit: int | None = None
    block_size: int = 16
    skip_bad_lines: bool = False

    def __attrs_post_init__(self) -> None:
        parse_policies(",".join(self.policies))
        for e in self.evictions:
            if e not in EVICTION_POLICIES:
                raise UnknownEvictionPolicyError(
                    f"unknown eviction policy {e!r}; choose from {', '.join(EVICTION_POLICIES)}"
                )
        for p in self.placements:
            if p not in PLACEMENTS:
                raise UnknownEvictionPolicyError(
                    f"unknown placement {p!r}; choose from {', '.join(PLACEMENTS)}"
                )
        for n in self.num_blocks:
            if n is not None and (type(n) is not int or n < 2):
                raise InvalidArgumentError(f"sweep pool sizes must be ints >= 2, got {n!r}")
        for s in self.seeds:
            if type(s) is not int:
                raise InvalidArgumentError(f"sweep seeds must be ints, got {s!r}")
        if self.limit is not None and (type(self.limit) is not int or self.limit < 1):
            raise InvalidArgumentError(f"sweep limit must be an int >= 1, got {self.limit!r}")


@attrs.frozen
class Cell:
    """One replay of the grid."""

    trace: str
    policy: str
    eviction: str
    placement: str
    num_blocks: int
    seed: int


def cells(spec: SweepSpec) -> list[Cell]:
    """The cells of ``spec`` in grid order (traces outermost, seeds
    innermost). O(cells)."""
    out = []
    for tr, pol, ev, pl, nb, seed in itertools.product(
        spec.traces, spec.policies, spec.evictions, spec.placements, spec.num_blocks, spec.seeds
    ):
        if nb is None:
            nb = SYNTHETIC_NUM_BLOCKS if tr == SYNTHETIC else DEFAULT_NUM_BLOCKS
        out.append(Cell(tr, pol, ev, pl, nb, seed))
    return out


def _run_cell(cell: Cell, limit: int | None, block_size: int, skip_bad_lines: bool = False) -> dict[str, Any]:
    """Replay one cell; its row. Runs in a worker process."""
    from blockpool.replay.driver import run_policy
    from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace
    from blockpool.replay.traces import read_trace

    t0 = time.perf_counter()
    if cell.trace == SYNTHETIC:
        spec = SyntheticSpec() if limit is None else SyntheticSpec(num_requests=limit)
        trace = synthetic_trace(spec, seed=cell.seed)
    else:
        trace = read_trace(cell.trace, limit=limit, skip_bad_lines=skip_bad_lines)
    cfg = ReplayConfig(
        block_size=block_size, num_blocks=cell.num_blocks, seed=cell.seed,
        eviction=cell.eviction, placement=cell.placement,
    )  # fmt: skip
    r = run_policy(trace.requests, cell.policy, cfg)
    return {
        **attrs.asdict(cell),
        "requests": len(trace.requests),
        "skipped": len(trace.skipped),
        "races": r.races,
        "loads": r.loads,
        "loads_empty_fence_pct": round(r.loads_empty_fence_pct, 3) if r.loads else None,
        "loads_short_of_ready": r.loads_short_of_ready,
        "load_delay_mean_ms": round(r.load_delay_mean_ms, 6) if r.loads else None,
        "load_delay_p99_ms": round(r.load_delay_p99_ms, 6) if r.loads else None,
        "runs_per_load": round(r.runs_per_load, 4) if r.loads else None,
        "min_runs_per_load": round(r.min_runs_per_load, 4) if r.loads else None,
        "prefix_hit_rate_pct": round(r.prefix_hit_rate_pct, 3),
        "makespan_s": round(r.makespan_s, 6),
        "throughput_tok_s": round(r.throughput_tok_s, 3),
        "evictions": r.pool_stats.get("evictions", 0),
        "preemptions": r.counts.get("preemptions", 0),
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def sweep(
    spec: SweepSpec,
    *,
    jobs: int = 1,
    progress: Callable[[int, int], None] | None = None,
    ray: str | None = None,
) -> list[dict[str, Any]]:
    """Run every cell of ``spec``; one row (a dict with :data:`COLUMNS`)
    per cell, in grid order. ``progress(done, total)`` after each cell.

    Local processes (``ray=None``, the default): ``jobs > 1`` runs that
    many worker processes (``concurrent.futures.ProcessPoolExecutor``);
    ``jobs == 1`` runs the cells in this process.

    Ray (``ray="ADDRESS"``): every cell is one Ray task (``ray.remote``,
    1 CPU) running the same cell function; rows are gathered with
    ``ray.wait`` as tasks finish and put back in grid order, so they equal
    the local rows except ``wall_s``. If this process is already connected
    to Ray (``ray.is_initialized()``), the sweep uses that connection
    whatever ``ray`` names and leaves it open (this is how to pass a
    ``runtime_env`` or other ``ray.init`` options). Otherwise
    ``ray.init(address=ray)`` is called and ``ray.shutdown()`` after the
    sweep: :data:`RAY_LOCAL` (``"local"``) starts a fresh local instance
    with ``jobs`` CPUs and no dashboard; ``"auto"`` joins the cluster this
    machine runs (``ray start``); ``"HOST:PORT"`` a cluster's head node
    (GCS port, default 6379); ``"ray://HOST:10001"`` goes through Ray
    Client (``ray[client]``). On a cluster the cluster's free CPUs bound
    how many cells run at once (``jobs`` only sizes a local instance).
    Workers import :mod:`blockpool` (the same version must be installed on
    every node, or shipped by connecting first with
    ``runtime_env={"py_modules": [blockpool]}``) and read trace files at
    the same paths as given (a shared file system; the synthetic workload
    needs none).

    A cell that raises stops the sweep (the other cells are cancelled) and
    its error propagates, on Ray as its own type (a ``TraceNotFoundError``
    stays one).

    Raises:
        InvalidArgumentError: ``jobs`` is not an int ``>= 1``; ``ray`` is
            not a non-empty str or ``None``.
        MissingDependencyError: ``ray`` is given and Ray is not installed
            (checked before any cell runs).
        ClusterUnavailableError: ``ray.init`` failed (an unreachable
            address, a local instance that cannot start), or a task failed
            without running its cell (a worker that cannot import
            :mod:`blockpool`, a worker that died); ``__cause__`` is Ray's
            error.
        TraceNotFoundError, TraceFormatError: a trace cannot be read.
        ReplayError: a cell's replay stalled or leaked blocks.

    Runtime complexity: the sum of the cells' replays, divided among
    ``jobs`` processes (on Ray: among the cluster's CPUs), plus Ray's
    start-up (about 2-3 s for a local instance) when this call connects.
    """
    if type(jobs) is not int or jobs < 1:
        raise InvalidArgumentError(f"jobs must be an int >= 1, got {jobs!r}")
    if ray is not None and (not isinstance(ray, str) or not ray.strip()):
        raise InvalidArgumentError(
            f"ray must be a Ray address (e.g. 'local', 'auto', 'HOST:PORT'), got {ray!r}"
        )
    grid = cells(spec)
    if ray is not None:
        return _sweep_ray(spec, grid, ray.strip(), jobs, progress)
    rows: list[dict[str, Any] | None] = [None] * len(grid)
    if jobs == 1 or len(grid) == 1:
        for i, c in enumerate(grid):
            rows[i] = _run_cell(c, spec.limit, spec.block_size, spec.skip_bad_lines)
            if progress is not None:
                progress(i + 1, len(grid))
        return rows  # type: ignore[return-value]
    ex = concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(grid)), initializer=_ignore_sigint)
    try:
        futs = {
            ex.submit(_run_cell, c, spec.limit, spec.block_size, spec.skip_bad_lines): i
            for i, c in enumerate(grid)
        }
        for done, f in enumerate(concurrent.futures.as_completed(futs), 1):
            rows[futs[f]] = f.result()
            if progress is not None:
                progress(done, len(grid))
    except BaseException:
        # Ctrl-C, SIGTERM turned into an exception, a cell's error: stop the
        # workers now (a running cell is not waited for) and go.
        workers = list((getattr(ex, "_processes", None) or {}).values())
        ex.shutdown(wait=False, cancel_futures=True)
        for p in workers:
            p.terminate()
        for p in workers:
            p.join(5)
        raise
    ex.shutdown()
    return rows  # type: ignore[return-value]


def _ignore_sigint() -> None:
    """Worker initializer: Ctrl-C reaches the whole process group; the
    parent handles it and stops the workers (SIGTERM), as ``replay`` does.
    SIGTERM gets its default action back: a forked worker inherits the
    CLI's handler, which raises ``Terminated`` into the running cell, and
    the executor's worker loop catches that as the cell's error and runs on
    (Ctrl-C then waited for every running cell to finish)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def require_ray() -> Any:
    """The ``ray`` module, imported now (never at ``import blockpool``).
    O(1) after the first call.

    Raises:
        MissingDependencyError: Ray is not installed (``pip install
            'blockpool[ray]'``).
    """
    try:
        import ray as ray_mod
    except ImportError as e:
        raise MissingDependencyError(
            "a sweep on Ray needs Ray installed: pip install 'blockpool[ray]' (or 'ray>=2.9')",
            package="ray", extra="ray",
        ) from e  # fmt: skip
    return ray_mod


def _sweep_ray(
    spec: SweepSpec, grid: list[Cell], address: str, jobs: int, progress: Callable[[int, int], None] | None
) -> list[dict[str, Any]]:
    """:func:`sweep` on Ray: one task per cell, gathered in grid order."""
    ray_mod = require_ray()
    owned = not ray_mod.is_initialized()
    if owned:
        kw: dict[str, Any] = {"address": address, "log_to_driver": False}
        if address == RAY_LOCAL:
            kw.update(num_cpus=jobs, include_dashboard=False)
        try:
            ray_mod.init(**kw)
        except Exception as e:
            raise ClusterUnavailableError(
                f"cannot join or start Ray at {address!r}: {e}", address=address
            ) from e
    try:
        task = ray_mod.remote(num_cpus=1)(_run_cell)
        index = {}
        for i, c in enumerate(grid):
            index[task.remote(c, spec.limit, spec.block_size, spec.skip_bad_lines)] = i
        rows: list[dict[str, Any] | None] = [None] * len(grid)
        pending = list(index)
        try:
            while pending:
                ready, pending = ray_mod.wait(pending, num_returns=1)
                for ref in ready:
                    try:
                        rows[index[ref]] = ray_mod.get(ref)
                    except ray_mod.exceptions.RayTaskError as e:
                        cause = getattr(e, "cause", None)
                        if isinstance(cause, Exception):
                            raise cause from e  # the cell's own error, as local processes raise it
                        raise
                    except ray_mod.exceptions.RayError as e:  # the task never ran its cell
                        raise ClusterUnavailableError(
                            f"Ray could not run cell {index[ref]} ({grid[index[ref]]}): {e}; blockpool and its "
                            "dependencies must be importable on every Ray worker (docs/replay.md)",
                            address=address,
                        ) from e
                    if progress is not None:
                        progress(len(grid) - len(pending), len(grid))
        except BaseException:
            for ref in pending:
                ray_mod.cancel(ref)
            raise
        return rows  # type: ignore[return-value]
    finally:
        if owned:
            ray_mod.shutdown()


def sweep_json(
    spec: SweepSpec, rows: Sequence[dict[str, Any]], wall_s: float | None = None
) -> dict[str, Any]:
    """The JSON document of a sweep (schema :data:`SCHEMA`): the grid and
    one row per cell. O(cells)."""
    return {
        "schema": SCHEMA,
        "grid": {
            "traces": list(spec.traces), "policies": list(spec.policies), "evictions": list(spec.evictions),
            "placements": list(spec.placements), "num_blocks": list(spec.num_blocks), "seeds": list(spec.seeds),
            "limit": spec.limit, "block_size": spec.block_size, "skip_bad_lines": spec.skip_bad_lines,
        },
        "cells": len(rows),
        "wall_s": None if wall_s is None else round(wall_s, 3),
        "rows": list(rows),
        "machine": {"cpus": os.cpu_count()},
    }  # fmt: skip


_HEAD = (
    ("trace", "trace"), ("policy", "policy"), ("eviction", "evict"), ("placement", "placement"),
    ("num_blocks", "blocks"), ("seed", "seed"), ("races", "races"), ("loads", "loads"),
    ("loads_empty_fence_pct", "empty%"), ("load_delay_mean_ms", "mean ms"), ("load_delay_p99_ms", "p99 ms"),
    ("runs_per_load", "runs/load"), ("prefix_hit_rate_pct", "hit%"), ("makespan_s", "makespan s"), ("evictions", "evictions"), ("wall_s", "wall s"),
)  # fmt: skip


def format_sweep(rows: Sequence[dict[str, Any]]) -> str:
    """The terminal table: one line per cell (trace shown by file name).
    O(cells)."""

    def cell(k: str, v: Any) -> str:
        if v is None:
            return "n/a"
        if k == "trace":
            return os.path.basename(str(v))
        if isinstance(v, float):
            return f"{v:.3f}" if k.endswith("_ms") else f"{v:.1f}" if k.endswith("_pct") else f"{v:.2f}"
        return str(v)

    table = [[h for _, h in _HEAD]] + [[cell(k, r.get(k)) for k, _ in _HEAD] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(_HEAD))]
    lines = []
    for j, row in enumerate(table):
        lines.append(
            "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
