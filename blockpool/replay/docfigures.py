"""The deterministic figures of ``docs/replay.md``, generated from one place.

The replay's simulated figures (races, loads, empty fences, load-start
delays, makespan, throughput, scheduler counts) are deterministic for a
trace, a configuration and a seed; wall and pool times are not. The docs
keep each block of generated figures between two markers::

    <!-- figures:NAME -->
    ...generated text...
    <!-- /figures:NAME -->

and ``python -m blockpool.replay.docfigures`` rewrites them (``--check``:
exit 1 naming every block that drifted, writing nothing). Blocks:

- ``synthetic``: the built-in synthetic workload at its defaults
  (``blockpool replay``), always generated;
- ``trace-2000``: the first 2,000 requests of the Mooncake conversation
  trace, only with ``--trace PATH`` (minutes of CPU).

``tests/test_doc_figures.py`` checks the ``synthetic`` block on every test
run. Run times are not generated: the docs state them as measured, with the
machine, as ranges.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from blockpool.replay.config import DEFAULT_NUM_BLOCKS, SYNTHETIC_NUM_BLOCKS, ReplayConfig
from blockpool.replay.policies import POLICIES
from blockpool.replay.report import PolicyResult, ReplayReport

__all__ = ["BLOCKS", "format_synthetic", "format_trace_table", "generate", "main", "replace_block"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "replay.md"
"""The page the blocks live in."""

_MARK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.DOTALL)


def _n(x: int) -> str:
    return f"{x:,}"


def _races(r: PolicyResult) -> str:
    if not r.races:
        return "0"
    by = ", ".join(f"{k} {_n(v)}" for k, v in sorted(r.races_by_hazard.items()) if v)
    return f"{_n(r.races)} ({by})"


def format_synthetic(report: ReplayReport) -> str:
    """The ``synthetic`` block: races per policy, mean load-start delays,
    the exact policy's empty-fence share and scheduler counts. O(policies)."""
    res = {r.policy: r for r in report.results}
    ex = res["exact"]
    c = ex.counts
    races = ", ".join(f"{p} {_n(r.races)}" for p, r in res.items())
    delays = ", ".join(f"{p} {r.load_delay_mean_ms:.2f} ms" for p, r in res.items() if p != "blind")
    return (
        f"Races: {races}.\n"
        f"Mean load-start delay (simulated): {delays};\n"
        f"{ex.loads_empty_fence_pct:.1f}% of exact loads wait on nothing. Under exact: "
        f"{_n(c.get('preemptions', 0))} preemptions,\n"
        f"{_n(ex.pool_stats.get('evictions', 0))} evictions, {_n(c.get('cow_copies', 0))} copy-on-write copies, "
        f"prefix hit rate {ex.prefix_hit_rate_pct:.2f}%.\n"
    )


def format_trace_table(report: ReplayReport) -> str:
    """A trace block: one row per policy (races by hazard, loads, empty
    fences, load-start delay mean / p99, makespan, throughput) and the exact
    policy's counts. O(policies)."""
    rows = [
        "| policy | races | loads | empty fence | load-start delay mean / p99 (ms) | makespan (s) | throughput (tok/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        rows.append(
            f"| {r.policy} | {_races(r)} | {_n(r.loads)} | {r.loads_empty_fence_pct:.1f}% | "
            f"{r.load_delay_mean_ms:.1f} / {r.load_delay_p99_ms:.1f} | {r.makespan_s:,.1f} | {r.throughput_tok_s:,.0f} |"
        )
    ex = next(r for r in report.results if r.policy == "exact")
    c = ex.counts
    rows.append("")
    rows.append(
        f"Under `exact`: {_n(c.get('finished', 0))} finished, {_n(c.get('aborted', 0))} aborted, "
        f"{_n(c.get('preemptions', 0))} preemptions, {_n(ex.pool_stats.get('evictions', 0))}\n"
        f"evictions, prefix hit rate {ex.prefix_hit_rate_pct:.2f}%."
    )
    return "\n".join(rows) + "\n"


def _synthetic(jobs: int) -> str:
    from blockpool.replay.run import replay
    from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace

    rep = replay(synthetic_trace(SyntheticSpec(), seed=0), POLICIES, ReplayConfig(num_blocks=SYNTHETIC_NUM_BLOCKS), jobs=jobs)
    return format_synthetic(rep)


def _trace(path: str, limit: int, jobs: int) -> str:
    from blockpool.replay.run import replay
    from blockpool.replay.traces import read_trace

    rep = replay(read_trace(path, limit=limit), POLICIES, ReplayConfig(num_blocks=DEFAULT_NUM_BLOCKS), jobs=jobs)
    return format_trace_table(rep)


BLOCKS: dict[str, Callable[..., str]] = {"synthetic": _synthetic, "trace-2000": _trace}
"""Block name -> its generator."""


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with block ``name``'s body replaced by ``body``. O(len(text)).

    Raises:
        KeyError: ``text`` has no block ``name``.
    """
    for m in _MARK.finditer(text):
        if m.group("name") == name:
            return text[: m.start("body")] + body + text[m.end("body") :]
    raise KeyError(f"no <!-- figures:{name} --> block")


def blocks_of(text: str) -> dict[str, str]:
    """Every block of ``text``: name -> body. O(len(text))."""
    return {m.group("name"): m.group("body") for m in _MARK.finditer(text)}


def generate(names: Sequence[str], *, trace: str | None = None, jobs: int = 1) -> dict[str, str]:
    """The bodies of blocks ``names`` (``trace-2000`` needs ``trace``).
    Runs the replays: seconds to minutes of CPU."""
    out = {}
    for name in names:
        if name == "synthetic":
            out[name] = _synthetic(jobs)
        elif name == "trace-2000":
            if trace is None:
                raise ValueError("trace-2000 needs --trace PATH")
            out[name] = _trace(trace, 2000, jobs)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m blockpool.replay.docfigures [--trace PATH] [--check]``:
    0 written (or, with ``--check``, the docs hold the figures), 1 a block
    drifted (``--check``), 2 bad usage."""
    p = argparse.ArgumentParser(prog="python -m blockpool.replay.docfigures", description=__doc__.split("\n")[0])
    p.add_argument("--trace", help="the conversation trace (adds the trace-2000 block)")
    p.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 on drift")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    args = p.parse_args(argv)
    names = ["synthetic"] + (["trace-2000"] if args.trace else [])
    text = DOC.read_text(encoding="utf-8")
    fresh = generate(names, trace=args.trace, jobs=args.jobs)
    if args.check:
        held = blocks_of(text)
        drift = [n for n in names if held.get(n) != fresh[n]]
        for n in drift:
            print(f"docs/replay.md: figures:{n} drifted:\n{fresh[n]}", file=sys.stderr)
        return 1 if drift else 0
    for n, body in fresh.items():
        text = replace_block(text, n, body)
    DOC.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
