"""The deterministic figures of ``docs/replay.md`` and ``docs/guarantees.md``,
generated from one place.

The replay's simulated figures (races, loads, empty fences, load-start
delays, makespan, throughput, scheduler counts), the differential run's
counts and the event-log check's counts are deterministic for their inputs
(trace, configuration, seed; sequence count and hypothesis version); wall
and pool times are not. The docs keep each block of generated figures
between two markers::

    <!-- figures:NAME -->
    ...generated text...
    <!-- /figures:NAME -->

and ``python -m blockpool.replay.docfigures`` rewrites them (``--check``:
exit 1 naming every block that drifted, writing nothing). Blocks:

- ``synthetic`` (``docs/replay.md``): the built-in synthetic workload at
  its defaults (``blockpool replay``), always generated (seconds);
- ``readme-table`` (``README.md``): the table ``blockpool replay`` prints
  for the same run, less its measured ``wall s`` column (the same replay:
  generated once for both blocks);
- ``differential-300`` (``docs/guarantees.md``): the differential run of
  ``tests/test_differential.py``, 300 sequences, always generated (seconds);
- ``differential`` (``docs/guarantees.md``): the documented differential
  run, ``benchmarks/differential.py --sequences 20000``, only with
  ``--differential`` (minutes of CPU);
- ``trace-2000`` (``docs/replay.md``): the first 2,000 requests of the
  Mooncake conversation trace under every policy, only with ``--trace PATH``
  (minutes of CPU);
- ``trace-all`` (``docs/replay.md``): the whole conversation trace (every
  request) under every policy, only with ``--trace PATH --whole-trace``
  (tens of CPU minutes);
- ``trace-events`` (``docs/guarantees.md``): the ``exact`` replay's event
  log of the trace's first 300 requests, every step's ``table`` reads
  judged as reads by a fresh race oracle, only with ``--trace PATH``
  (minutes of CPU).

``--block NAME`` (repeatable) keeps to the named blocks. The differential
blocks run ``benchmarks/differential.py`` from the checkout in a fresh
process and name the hypothesis version they were generated with: the run
is derandomized and draws no constants from the source of the modules the
process imported (``tests/differential.py`` turns hypothesis's local
constants off), so its sequences depend on the sequence count and the
hypothesis version only.

``tests/test_doc_figures.py`` checks ``synthetic`` and ``differential-300``
on every test run, and the others with ``--check`` in tests marked
``slow`` that run only with ``BLOCKPOOL_DOC_FIGURES=1`` (and the trace).
Run times are not generated: the docs state them as measured, with the
machine, as ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from blockpool.replay.config import DEFAULT_NUM_BLOCKS, SYNTHETIC_NUM_BLOCKS, ReplayConfig
from blockpool.replay.policies import POLICIES
from blockpool.replay.report import PolicyResult, ReplayReport

__all__ = [
    "BLOCKS",
    "Block",
    "blocks_of",
    "format_differential",
    "format_readme_table",
    "format_synthetic",
    "format_trace_events",
    "format_trace_table",
    "generate",
    "main",
    "replace_block",
    "table_read_check",
]


def _checkout() -> Path:
    """The checkout whose docs the blocks live in: the one the package was
    imported from (a source tree, an editable install) when it holds
    ``docs/replay.md``, else the working directory (an installed wheel
    carries no docs: run from the checkout). O(1)."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "docs" / "replay.md").is_file() else Path.cwd()


ROOT = _checkout()
"""The checkout (the docs and ``tests/differential.py`` live in it): see
``_checkout``; ``main`` exits 2 naming the pages it does not find there."""

DOC = ROOT / "docs" / "replay.md"
"""The page of the replay's blocks."""

README = ROOT / "README.md"
"""The page of the ``readme-table`` block."""

GUARANTEES = ROOT / "docs" / "guarantees.md"
"""The page of the differential and event-log blocks."""

DIFFERENTIAL_SEQUENCES = 20000
"""Sequences of the documented differential run (``differential``)."""

EVENT_REQUESTS = 300
"""Trace requests of the event-log check (``trace-events``)."""

_MARK = re.compile(
    r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.DOTALL
)


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


_WRITERS = ("step", "tag-write", "free-write", "load", "copy", "store")
"""The failure kinds of the differential run, in the order the docs give them."""


def format_differential(out: Mapping[str, object], hypothesis_version: str) -> str:
    """A differential block: the counts of ``tests.differential.run``'s
    ``out`` as one table row (its ``wall_s`` left out) and the report
    breakdown. O(report kinds)."""
    c = {k: int(v) for k, v in out.items() if isinstance(v, int)}
    reports = out["reports"]
    assert isinstance(reports, dict)
    fails = {k: int(v) for k, v in reports.items() if k.startswith("fail ")}
    kinds = [*_WRITERS, *sorted({k[5:].removesuffix(" (late)") for k in fails} - set(_WRITERS))]
    by = ", ".join(
        f"{w} {_n(fails.get(f'fail {w}', 0))} (late {_n(fails.get(f'fail {w} (late)', 0))})" for w in kinds
    )
    cols = (
        "sequences",
        "operations",
        "fences",
        "handed_out",
        "missed",
        "redundant",
        "unsafe",
        "unsafe_accesses",
        "host_mark_wrong",
    )
    return (
        "| sequences | operations | fences checked | blocks handed out | missed | redundant | unsafe hand-outs "
        "| unsafe accesses | wrong `needs_host_wait` |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        "| " + " | ".join(_n(c.get(k, 0)) for k in cols) + " |\n"
        "\n"
        f"Reports among them: {_n(int(reports.get('complete', 0)))} completions and {_n(sum(fails.values()))} failures:\n"
        f"{by}.\nHypothesis {hypothesis_version}, derandomized, up to 50 operations a sequence.\n"
    )


def table_read_check(lines: Iterable[str]) -> dict[str, object]:
    """Check an event log (schema ``blockpool.core.events/3``) one line at a
    time: its trailer against the lines, and every policy's events replayed
    into a fresh :class:`~blockpool.checking.race_oracle.RaceOracle` with
    each step's ``table`` line judged as a read too (the checker of
    ``tests/test_replay_driver.py``'s
    ``test_every_step_read_of_the_exact_replay_is_race_free``).

    Returns ``lines`` (before the trailer, header included), ``counts`` per
    ``ev``, ``trailer_ok`` (its line and event counts equal those), and
    ``races`` per policy. O(events + oracle work).
    """
    from blockpool.checking.race_oracle import RaceOracle
    from blockpool.core.hazards import AccessKind, StreamKind, Token
    from blockpool.replay.eventlog import decode_runs

    it = iter(lines)
    head = json.loads(next(it))
    kinds = {n: StreamKind(k) for n, k in head["streams"].items()}
    oracles: dict[str, RaceOracle] = {}
    toks: dict[str, dict[str, Token]] = {}
    pending: dict[str, Token] = {}  # policy -> an issued token whose wait line may follow
    counts: dict[str, int] = {}
    n = 1
    trailer = None
    for line in it:
        e = json.loads(line)
        if "trailer" in e:
            trailer = e
            break
        n += 1
        ev = e["ev"]
        counts[ev] = counts.get(ev, 0) + 1
        pol = e["policy"]
        if pol not in oracles:
            oracles[pol], toks[pol] = RaceOracle(kinds, retain=1 << 20), {}
        oracle, tok = oracles[pol], toks[pol]
        held = pending.pop(pol, None)
        if held is not None:
            if ev == "wait" and tok.get(e["token"]) == held:
                oracle.record(held, [tok[t] for t in e["on"]])
                continue
            oracle.record(held, [])
        if ev == "issue":
            tok[e["token"]] = pending[pol] = Token(e["stream"], e["seq"], kinds[e["stream"]])
        elif ev in ("access", "table"):
            oracle.tag(
                tok[e["token"]],
                decode_runs(e["blocks"]),
                AccessKind(e.get("access", "read")),
                e.get("what", "forward"),
            )
        elif ev == "end":
            oracle.complete(tok[e["token"]], failed=e["failed"])
    for pol, held in pending.items():
        oracles[pol].record(held, [])
    counts = dict(sorted(counts.items()))
    ok = trailer is not None and trailer.get("lines") == n and trailer.get("counts") == counts
    return {
        "lines": n,
        "counts": counts,
        "trailer_ok": ok,
        "races": {p: len(o.violations) for p, o in oracles.items()},
    }


def format_trace_events(check: Mapping[str, object], report: ReplayReport, source: str, requests: int) -> str:
    """The ``trace-events`` block: what :func:`table_read_check` found in
    the ``exact`` replay's event log. O(event kinds)."""
    counts, races, lines = check["counts"], check["races"], check["lines"]
    assert isinstance(counts, dict) and isinstance(races, dict) and isinstance(lines, int)
    by = ", ".join(f"{k} {_n(v)}" for k, v in counts.items())
    trailer = "equal to" if check["trailer_ok"] else "NOT equal to"
    return (
        f"The first {_n(requests)} requests of `{source}`, policy `exact`: {_n(lines)} lines\n"
        f"(header included; {by}), trailer counts {trailer} the lines;\n"
        f"every step's `table` reads judged as reads: {_n(int(races.get('exact', 0)))} races "
        f"(the replay's own count: {_n(report.result('exact').races)}).\n"
    )


_SYNTHETIC: list[ReplayReport] = []
"""The default synthetic replay once run in this process (its figures do
not depend on ``jobs``)."""


def _synthetic_report(jobs: int) -> ReplayReport:
    """The default synthetic replay (``blockpool replay``), run once per
    process for the blocks that show it. O(the replay) the first time."""
    from blockpool.replay.run import replay
    from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace

    if not _SYNTHETIC:
        _SYNTHETIC.append(
            replay(
                synthetic_trace(SyntheticSpec(), seed=0),
                POLICIES,
                ReplayConfig(num_blocks=SYNTHETIC_NUM_BLOCKS),
                jobs=jobs,
            )
        )
    return _SYNTHETIC[0]


def _synthetic(jobs: int) -> str:
    return format_synthetic(_synthetic_report(jobs))


def format_readme_table(report: ReplayReport) -> str:
    """The ``readme-table`` block: :func:`~blockpool.replay.report.format_table`'s
    header and policy rows without the measured ``wall s`` column, then its
    verdict line, in a fenced block. O(policies)."""
    from blockpool.replay.report import format_table, verdict

    lines = format_table(report).splitlines()
    cut = lines[0].index("wall s")
    rows = [x[:cut].rstrip() for x in lines[: 3 + len(report.results)]]
    return "```\n" + "\n".join([*rows, verdict(report)]) + "\n```\n"


def _trace(path: str, limit: int | None, jobs: int) -> str:
    from blockpool.replay.run import replay
    from blockpool.replay.traces import read_trace

    rep = replay(
        read_trace(path, limit=limit), POLICIES, ReplayConfig(num_blocks=DEFAULT_NUM_BLOCKS), jobs=jobs
    )
    return format_trace_table(rep)


def _trace_events(path: str, requests: int) -> str:
    from blockpool.replay.run import replay
    from blockpool.replay.traces import read_trace

    with tempfile.TemporaryDirectory(prefix="blockpool-docfigures-") as d:
        ev = Path(d) / "events.jsonl"
        rep = replay(
            read_trace(path, limit=requests), "exact", ReplayConfig(num_blocks=DEFAULT_NUM_BLOCKS), events=ev
        )
        with ev.open(encoding="utf-8") as f:
            check = table_read_check(f)
    return format_trace_events(check, rep, Path(path).name, requests)


def _differential(sequences: int) -> str:
    """The documented command, ``benchmarks/differential.py --sequences
    N``, in a fresh process (derandomized, hypothesis's local constants
    off: the same sequences for a sequence count and a hypothesis version)."""
    import hypothesis

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "differential.py"), "--sequences", str(sequences)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):  # 1: a count is not zero, still figures
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr}")
    return format_differential(json.loads(done.stdout), hypothesis.__version__)


class Block(NamedTuple):
    """A block of generated figures: the page it lives in and what it needs
    (``None``: nothing, always generated; ``"trace"``: ``--trace PATH``;
    ``"differential"``: ``--differential``; ``"whole-trace"``: ``--trace
    PATH --whole-trace``)."""

    doc: Path
    needs: str | None


BLOCKS: dict[str, Block] = {
    "synthetic": Block(DOC, None),
    "readme-table": Block(README, None),
    "trace-2000": Block(DOC, "trace"),
    "trace-all": Block(DOC, "whole-trace"),
    "differential-300": Block(GUARANTEES, None),
    "differential": Block(GUARANTEES, "differential"),
    "trace-events": Block(GUARANTEES, "trace"),
}
"""Block name -> where it lives and what it needs."""


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


_MAKE: dict[str, Callable[[str | None, int], str]] = {
    "synthetic": lambda trace, jobs: _synthetic(jobs),
    "readme-table": lambda trace, jobs: format_readme_table(_synthetic_report(jobs)),
    "trace-2000": lambda trace, jobs: _trace(str(trace), 2000, jobs),
    "trace-all": lambda trace, jobs: _trace(str(trace), None, jobs),
    "differential-300": lambda trace, jobs: _differential(300),
    "differential": lambda trace, jobs: _differential(DIFFERENTIAL_SEQUENCES),
    "trace-events": lambda trace, jobs: _trace_events(str(trace), EVENT_REQUESTS),
}


def generate(names: Sequence[str], *, trace: str | None = None, jobs: int = 1) -> dict[str, str]:
    """The bodies of blocks ``names`` (``trace-2000``, ``trace-all`` and
    ``trace-events`` need ``trace``). Runs the replays and differential runs: seconds to
    minutes of CPU.

    Raises:
        ValueError: a trace block without ``trace``.
        KeyError: an unknown block name.
    """
    out = {}
    for name in names:
        if name not in BLOCKS:
            raise KeyError(f"no figures block {name!r} (blocks: {', '.join(BLOCKS)})")
        if BLOCKS[name].needs in ("trace", "whole-trace") and trace is None:
            raise ValueError(f"{name} needs --trace PATH")
        out[name] = _MAKE[name](trace, jobs)
    return out


def _rel(p: Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m blockpool.replay.docfigures [--trace PATH [--whole-trace]]
    [--differential] [--block NAME]... [--check]``: 0 written (or, with ``--check``, the docs
    hold the figures), 1 a block drifted or is missing (``--check``), 2 bad
    usage or a page of the chosen blocks not found (the message names it and
    the directory searched)."""
    p = argparse.ArgumentParser(
        prog="python -m blockpool.replay.docfigures", description=__doc__.split("\n")[0]
    )
    p.add_argument("--trace", help="the conversation trace (adds the trace-2000 and trace-events blocks)")
    p.add_argument(
        "--whole-trace",
        action="store_true",
        help="add the trace-all block: every request of --trace (tens of CPU minutes)",
    )
    p.add_argument(
        "--differential",
        action="store_true",
        help=f"add the {DIFFERENTIAL_SEQUENCES:,}-sequence differential block",
    )
    p.add_argument("--block", action="append", choices=list(BLOCKS), help="only this block (repeatable)")
    p.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 on drift")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    args = p.parse_args(argv)
    if args.whole_trace and not args.trace:
        p.error("--whole-trace needs --trace PATH")
    have = {
        None,
        "differential" if args.differential else None,
        "trace" if args.trace else None,
        "whole-trace" if args.whole_trace else None,
    }
    names = [n for n, b in BLOCKS.items() if b.needs in have]
    if args.block:
        lacking = [n for n in args.block if n not in names]
        if lacking:
            p.error(
                f"{', '.join(lacking)} needs {' / '.join(sorted({'--' + str(BLOCKS[n].needs) for n in lacking}))}"
            )
        names = [n for n in names if n in args.block]
    absent = sorted({_rel(BLOCKS[n].doc) for n in names if not BLOCKS[n].doc.is_file()})
    if absent:
        p.error(
            f"{', '.join(absent)} not found under {ROOT}: run from the checkout "
            "(an installed wheel carries no docs)"
        )
    fresh = generate(names, trace=args.trace, jobs=args.jobs)
    texts = {doc: doc.read_text(encoding="utf-8") for doc in {BLOCKS[n].doc for n in names}}
    if args.check:
        drift = [n for n in names if blocks_of(texts[BLOCKS[n].doc]).get(n) != fresh[n]]
        for n in drift:
            print(
                f"{_rel(BLOCKS[n].doc)}: figures:{n} drifted; the command prints:\n{fresh[n]}",
                file=sys.stderr,
            )
        return 1 if drift else 0
    for n, body in fresh.items():
        texts[BLOCKS[n].doc] = replace_block(texts[BLOCKS[n].doc], n, body)
    for doc, text in texts.items():
        doc.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
