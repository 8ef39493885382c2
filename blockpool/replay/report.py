"""Figures of a replay: per-policy results, the report, the terminal table.

Definitions (``docs/replay.md`` has the long form):

- **races**: violations the race oracle found (``blockpool.checking.race_oracle``).
- **loads with an empty fence**: loads whose policy waits were empty when
  they began, in percent of all loads.
- **load-start delay**: simulated ms from the moment a load was requested to
  the moment it could start (after its waits and its stream's queue); mean
  and p99 (nearest-rank).
- **makespan**: simulated seconds from 0 to the last completion.
- **throughput**: prompt + output tokens of finished requests per simulated
  second of makespan (``output_tok_s``: output tokens only).
- **pool ns/op**: real wall time spent inside pool operations, per call.
- **hit%**: prefix-cache hit rate, blocks found over blocks looked up by
  admissions.

>>> percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50), percentile([], 99)
(3.0, 0.0)
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Mapping, Sequence

import attrs

from blockpool.sim.simulator import Work

__all__ = ["NEGATIVE_CONTROL", "REPORT_SCHEMA", "PolicyResult", "ReplayReport", "format_table", "percentile"]

REPORT_SCHEMA = "blockpool.replay-report/1"
"""Name and version of the JSON report's schema."""


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank ``p``-th percentile (``0 < p <= 100``); 0.0 for no values.
    O(n log n)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, math.ceil(p / 100.0 * len(s)) - 1)
    return float(s[min(k, len(s) - 1)])


@attrs.frozen(slots=True)
class PolicyResult:
    """What one policy's replay measured (see the module docstring).

    Attributes:
        policy: The policy.
        races, races_by_hazard, race_examples: Oracle violations: count, by
            hazard (``RAW``/``WAR``/``WAW``), the first five as text.
        oracle_accesses: Block accesses the oracle checked.
        loads, loads_empty_fence: Loads begun, and those that waited on nothing.
        load_delays_ms: Load-start delay of every load (simulated ms).
        makespan_s: Simulated seconds to the last completion.
        tokens_served, output_tokens: Tokens of finished requests.
        counts: Scheduler counters (finished, aborted, preemptions, ...).
        pool_ops: ``{op: (calls, wall ns)}``.
        pool_stats: The pool's ``stats()`` at the end.
        oracle_ms: Real ms spent in the oracle.
        wall_s: Real seconds of the whole policy run.
        timeline: Works around ``timeline_at`` (for plots).
        timeline_at: When the first load was requested (simulated s), or
            ``None`` when nothing was loaded (``timeline`` then holds the last
            works).
        load_runs, store_runs: Runs of consecutive block ids of every load
            and every store, in order (:func:`blockpool.replay.machine.runs`):
            the descriptors each posts when a run is one.
        loads_short_of_ready: Loads that waited on something and were
            placed when the free queue held fewer ready blocks (empty
            fence for the load's stream) than they needed: no placement
            could have given them an empty fence.
        load_min_runs: For every load, the fewest runs its block count
            could have had, from the free blocks when it was placed
            (:func:`blockpool.replay.machine.min_runs`).
    """

    policy: str
    races: int
    races_by_hazard: dict[str, int]
    race_examples: tuple[str, ...]
    oracle_accesses: int
    loads: int
    loads_empty_fence: int
    load_delays_ms: tuple[float, ...] = attrs.field(repr=False)
    makespan_s: float
    tokens_served: int
    output_tokens: int
    counts: dict[str, int]
    pool_ops: dict[str, tuple[int, int]]
    pool_stats: dict[str, int]
    oracle_ms: float = attrs.field(eq=False)
    wall_s: float = attrs.field(eq=False)
    timeline: tuple[Work, ...] = attrs.field(eq=False, repr=False)
    timeline_at: float | None = attrs.field(default=None, eq=False, repr=False)
    load_runs: tuple[int, ...] = attrs.field(default=(), repr=False)
    store_runs: tuple[int, ...] = attrs.field(default=(), repr=False)
    load_min_runs: tuple[int, ...] = attrs.field(default=(), repr=False)
    loads_short_of_ready: int = 0

    @property
    def loads_empty_fence_pct(self) -> float:
        """Percent of loads that began with nothing to wait on (0 with no loads)."""
        return 100.0 * self.loads_empty_fence / self.loads if self.loads else 0.0

    @property
    def load_delay_mean_ms(self) -> float:
        """Mean load-start delay, simulated ms."""
        d = self.load_delays_ms
        return sum(d) / len(d) if d else 0.0

    @property
    def load_delay_p99_ms(self) -> float:
        """p99 (nearest-rank) load-start delay, simulated ms."""
        return percentile(self.load_delays_ms, 99)

    @property
    def runs_per_load(self) -> float:
        """Mean runs of consecutive block ids per load (descriptors it
        posts); 1.0 is the minimum for any block count. 0.0 with no loads."""
        r = self.load_runs
        return sum(r) / len(r) if r else 0.0

    @property
    def min_runs_per_load(self) -> float:
        """Mean of the fewest runs each load's block count allowed (from the
        free set it was placed from); 0.0 with no loads."""
        r = self.load_min_runs
        return sum(r) / len(r) if r else 0.0

    @property
    def runs_per_store(self) -> float:
        """Mean runs of consecutive block ids per store; 0.0 with no stores."""
        r = self.store_runs
        return sum(r) / len(r) if r else 0.0

    @property
    def prefix_hit_rate_pct(self) -> float:
        """Prefix-cache hit rate, %: blocks found by admissions' prefix
        lookups over the blocks they looked up (each admission looks up at
        most ``(tokens - 1) // block_size`` blocks, vLLM's query; loads and
        copy-on-write are not hits). 0 with no lookup."""
        q = self.counts.get("prefix_query_blocks", 0)
        return 100.0 * self.counts.get("prefix_hit_blocks", 0) / q if q else 0.0

    @property
    def throughput_tok_s(self) -> float:
        """Prompt + output tokens of finished requests per simulated second."""
        return self.tokens_served / self.makespan_s if self.makespan_s else 0.0

    @property
    def pool_ns_per_op(self) -> float:
        """Mean real ns per pool operation, all operations together."""
        calls = sum(c for c, _ in self.pool_ops.values())
        return sum(ns for _, ns in self.pool_ops.values()) / calls if calls else 0.0

    def to_json(self, *, timing: bool = True) -> dict[str, object]:
        """The figures as JSON-ready data; ``timing=False`` leaves out the
        real (wall-clock) times, which differ from run to run. O(loads + ops)."""
        out: dict[str, object] = {
            "races": self.races,
            "races_by_hazard": dict(sorted(self.races_by_hazard.items())),
            "race_examples": list(self.race_examples),
            "oracle_accesses": self.oracle_accesses,
            "loads": self.loads,
            "loads_empty_fence": self.loads_empty_fence,
            "loads_empty_fence_pct": round(self.loads_empty_fence_pct, 3),
            "loads_short_of_ready": self.loads_short_of_ready,
            "load_start_delay_ms": {
                "mean": round(self.load_delay_mean_ms, 6),
                "p50": round(percentile(self.load_delays_ms, 50), 6),
                "p99": round(self.load_delay_p99_ms, 6),
                "max": round(max(self.load_delays_ms, default=0.0), 6),
            },
            "runs_per_load": round(self.runs_per_load, 4),
            "min_runs_per_load": round(self.min_runs_per_load, 4),
            "runs_per_store": round(self.runs_per_store, 4),
            "prefix_hit_rate_pct": round(self.prefix_hit_rate_pct, 3),
            "makespan_s": round(self.makespan_s, 6),
            "tokens_served": self.tokens_served,
            "output_tokens": self.output_tokens,
            "throughput_tok_s": round(self.throughput_tok_s, 3),
            "output_throughput_tok_s": round(self.output_tokens / self.makespan_s, 3)
            if self.makespan_s
            else 0.0,
            "counts": dict(self.counts),
            "pool_stats": dict(self.pool_stats),
        }
        ops: dict[str, dict[str, float]] = {op: {"calls": c} for op, (c, _) in sorted(self.pool_ops.items())}
        if timing:
            for op, (c, ns) in self.pool_ops.items():
                ops[op]["mean_ns"] = round(ns / c, 1) if c else 0.0
                ops[op]["total_ms"] = round(ns / 1e6, 3)
            out["pool_ns_per_op"] = round(self.pool_ns_per_op, 1)
            out["oracle_ms"] = round(self.oracle_ms, 3)
            out["wall_s"] = round(self.wall_s, 3)
        out["pool_ops"] = ops
        return out


@attrs.frozen(slots=True)
class ReplayReport:
    """All policies of one replay.

    Attributes:
        source, format: The trace (``"synthetic"`` for the built-in one).
        requests: Requests replayed.
        skipped: Bad lines skipped (``"file:line: reason"``).
        config: The configuration, JSON-ready.
        results: One :class:`PolicyResult` per policy, in the order run.
        wall_s: Real seconds of the whole replay.
    """

    source: str
    format: str
    requests: int
    skipped: tuple[str, ...]
    config: Mapping[str, object]
    results: tuple[PolicyResult, ...]
    wall_s: float = attrs.field(eq=False)

    def result(self, policy: str) -> PolicyResult:
        """The result of ``policy``.

        Raises:
            KeyError: the policy was not run.
        """
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(policy)

    def to_json(self, *, timing: bool = True) -> dict[str, object]:
        """The whole report as JSON-ready data (schema
        ``blockpool.replay-report/1``). O(size of the figures)."""
        out: dict[str, object] = {
            "schema": REPORT_SCHEMA,
            "trace": {
                "source": self.source,
                "format": self.format,
                "requests": self.requests,
                "skipped_lines": len(self.skipped),
                "skipped": list(self.skipped[:20]),
            },
            "config": dict(self.config),
            "policies": {r.policy: r.to_json(timing=timing) for r in self.results},
        }
        if timing:
            out["machine"] = {
                "python": f"{platform.python_implementation()} {platform.python_version()}",
                "cpus": os.cpu_count(),
                "platform": platform.platform(terse=True),
            }
            out["wall_s"] = round(self.wall_s, 3)
        return out


NEGATIVE_CONTROL = "blind"
"""The policy that waits on nothing: it must race (the oracle's negative control)."""


def plural(n: int, one: str, many: str | None = None) -> str:
    """``"1 time"``, ``"2 times"``, ``"1,234 races"``: ``n`` with thousands
    separators and the noun in the number it takes. O(1)."""
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def verdict(report: ReplayReport) -> str:
    """The line a person acts on: the ``exact`` policy's races among the
    accesses the oracle checked, and the negative control's races, e.g.
    ``exact: 0 races in 1,234,567 checked accesses; blind (no waits): 10,378
    races``. Without ``exact``, the same for each policy run. O(policies)."""
    res = {r.policy.split("/")[0]: r for r in report.results}
    judged = [r for r in report.results if r.policy.split("/")[0] == "exact"] or [
        r for r in report.results if r.policy.split("/")[0] != NEGATIVE_CONTROL
    ]
    parts = [f"{r.policy}: {plural(r.races, 'race')} in {plural(r.oracle_accesses, 'checked access', 'checked accesses')}"
             for r in judged]  # fmt: skip
    control = res.get(NEGATIVE_CONTROL)
    if control is not None:
        parts.append(f"{NEGATIVE_CONTROL} (no waits): {plural(control.races, 'race')}")
    bad = [r for r in judged if r.races and r.policy.split("/")[0] == "exact"]
    line = "; ".join(parts)
    return f"{line}: the exact policy raced (a bug)" if bad else line


def format_table(report: ReplayReport) -> str:
    """The terminal summary (fits 100 columns; every figure is also in
    ``--json``): one row per policy, under a header that says which columns
    are simulated (``sim``: cost model, simulated clock) and which are
    measured (``meas``: real time on this machine); the negative control is
    labelled as such; a policy with no loads shows ``n/a`` for the load
    figures. Ends with the :func:`verdict` line. O(policies)."""
    head = (
        "policy",
        "races",
        "loads",
        "empty%",
        "mean ms",
        "p99 ms",
        "hit%",
        "makespan s",
        "tok/s",
        "wall s",
    )
    kind = ("", "", "", "", "sim", "sim", "count", "sim", "sim", "meas")
    rows = [head, kind]
    for r in report.results:
        loads = bool(r.loads)
        rows.append(
            (
                f"{r.policy} (negative control)" if r.policy == NEGATIVE_CONTROL else r.policy,
                str(r.races),
                str(r.loads),
                f"{r.loads_empty_fence_pct:.1f}" if loads else "n/a",
                f"{r.load_delay_mean_ms:.3f}" if loads else "n/a",
                f"{r.load_delay_p99_ms:.3f}" if loads else "n/a",
                f"{r.prefix_hit_rate_pct:.2f}",
                f"{r.makespan_s:.1f}",
                f"{r.throughput_tok_s:.0f}",
                f"{r.wall_s:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines = [x.rstrip() for x in lines]
    lines.insert(2, "  ".join("-" * w for w in widths))
    first = report.results[0] if report.results else None
    if first is not None:
        c = first.counts
        lines.append(f"{plural(report.requests, 'request')} ({report.format}: {report.source})")
        lines.append(
            f"{first.policy}: finished {c.get('finished', 0):,}, aborted {c.get('aborted', 0):,}, "
            f"rejected {c.get('rejected', 0):,}, {plural(c.get('preemptions', 0), 'preemption')},"
        )
        lines.append(
            f"  {plural(first.pool_stats.get('evictions', 0), 'eviction')}, "
            f"{plural(c.get('cow_copies', 0), 'copy-on-write copy', 'copy-on-write copies')}, "
            f"{plural(c.get('load_failures', 0), 'load failure')}"
        )
    waited = [r for r in report.results if r.loads > r.loads_empty_fence]
    if waited:
        lines.append("loads that waited while fewer ready free blocks existed than they needed")
        lines.append(
            "  (no placement avoids those): "
            + ", ".join(
                f"{r.policy} {r.loads_short_of_ready}/{r.loads - r.loads_empty_fence}" for r in waited
            )
        )
    lines.append("sim: cost model on the simulated clock (ms: load-start delay); meas: real time here;")
    lines.append("count: counted (hit%: prefix-cache hits over looked-up blocks)")
    lines.append("runs per load and store, pool ns/op and every other figure: --json")
    if any(r.policy == NEGATIVE_CONTROL for r in report.results):
        lines.append(
            f"{NEGATIVE_CONTROL} waits on nothing: its races show the hazards the other policies avoid"
        )
    if report.skipped:
        lines.append(f"skipped {plural(len(report.skipped), 'bad line')}, first: {report.skipped[0]}")
    lines.append(verdict(report))
    return "\n".join(lines)
