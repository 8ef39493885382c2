"""The ``blockpool`` command line (``blockpool replay``; also ``python -m blockpool``).

``blockpool replay [TRACE]`` replays a Mooncake JSONL or Azure CSV trace (or,
with no TRACE, the built-in synthetic chat workload) under the wait policies,
prints one summary row per policy, and optionally writes the JSON report,
a PNG and the event log. See ``docs/replay.md``.

Exit status: 0 done; 1 the ``exact`` policy showed a race; 2 bad usage or
bad input (unreadable trace, bad line, unknown policy); 3 the replay itself
failed (stalled, leaked blocks) or an output could not be written.

tqdm and matplotlib (the ``replay`` extra) are imported only when used; the
command works without them (no progress bar; ``--plot`` then fails with
status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from blockpool.errors import BlockPoolError

__all__ = ["build_parser", "main"]

LONG_RUN_REQUESTS = 20_000
"""Request-replays (requests x policies) from which a progress bar is shown
even when stderr is not a terminal."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``blockpool``. O(1)."""
    from blockpool.replay.policies import POLICIES

    parser = argparse.ArgumentParser(prog="blockpool", description="KV-cache block pool with exact hazard fences.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "replay",
        help="replay a serving trace under several wait policies and check it for races",
        description=(
            "Replay a trace (Mooncake .jsonl, Azure .csv; none: the built-in synthetic chat workload) "
            "on a simulated GPU under each wait policy, check every block access with the race oracle, "
            "and report races, load-start delays, makespan, throughput and allocator time."
        ),
    )
    p.add_argument("trace", nargs="?", metavar="TRACE", help="trace file (default: synthetic workload)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="blocks in the pool, null block included (default 16384 for a trace, 2048 for the synthetic workload)",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first K requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload, the plans and the simulator")
    p.add_argument(
        "--policy",
        default=",".join(POLICIES),
        help=f"comma-separated policies (default {','.join(POLICIES)})",
    )
    p.add_argument("--json", metavar="OUT", help="write the JSON report here")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG of load-start delays and a stream timeline")
    p.add_argument("--events", metavar="OUT.jsonl", help="write every issue, wait, access and completion here")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip bad trace lines (counted) instead of failing")
    p.add_argument("--jobs", type=int, default=None, help="policies run in parallel (default: min(policies, CPUs))")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _progress_bar(total: int, quiet: bool) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A progress callback backed by tqdm, when wanted and installed."""
    if quiet or not (sys.stderr.isatty() or total >= LONG_RUN_REQUESTS):
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, lambda: None
    bar: Any = tqdm(total=total, unit="req", desc="replay", file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 30)

    def update(n: int) -> None:
        if n > bar.n:
            bar.update(n - bar.n)

    return update, bar.close


def _err(msg: str) -> None:
    print(f"blockpool replay: error: {msg}", file=sys.stderr)


def _replay(args: argparse.Namespace) -> int:
    import os

    from blockpool.replay.config import DEFAULT_NUM_BLOCKS, SYNTHETIC_NUM_BLOCKS, ReplayConfig, ReplayError
    from blockpool.replay.policies import parse_policies
    from blockpool.replay.report import format_table
    from blockpool.replay.run import replay
    from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace
    from blockpool.replay.traces import read_trace

    try:
        policies = parse_policies(args.policy)
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        if args.trace is None:
            spec = SyntheticSpec() if args.limit is None else SyntheticSpec(num_requests=args.limit)
            trace = synthetic_trace(spec, seed=args.seed)
        else:
            trace = read_trace(args.trace, limit=args.limit, skip_bad_lines=args.skip_bad_lines)
        nb = args.num_blocks
        if nb is None:
            nb = SYNTHETIC_NUM_BLOCKS if args.trace is None else DEFAULT_NUM_BLOCKS
        cfg = ReplayConfig(block_size=args.block_size, num_blocks=nb, seed=args.seed)
        jobs = args.jobs if args.jobs is not None else max(1, min(len(policies), os.cpu_count() or 1))
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        for out in (args.json, args.plot, args.events):
            # Fail before a long replay, not after it.
            if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
                raise ValueError(f"cannot write {out}: no such directory")
    except (BlockPoolError, ValueError) as e:
        _err(str(e))
        return 2
    if not trace.requests:
        _err(f"no requests in {trace.source}")
        return 2
    update, close = _progress_bar(len(trace.requests) * len(policies), args.quiet)
    try:
        report = replay(trace, policies, cfg, jobs=jobs, events=args.events, progress=update)
    except ReplayError as e:
        close()
        _err(f"replay failed: {e}")
        return 3
    except OSError as e:
        close()
        _err(f"cannot write {args.events}: {e}")
        return 3
    close()
    print(format_table(report))
    try:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report.to_json(), f, indent=2)
                f.write("\n")
        if args.plot:
            from blockpool.replay.plot import PlotUnavailableError, plot_report

            try:
                plot_report(report, args.plot)
            except PlotUnavailableError as e:
                _err(str(e))
                return 2
    except OSError as e:
        _err(f"cannot write an output: {e}")
        return 3
    if "exact" in policies and report.result("exact").races:
        _err(f"the exact policy shows {report.result('exact').races} races")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``blockpool`` command with ``argv`` (default ``sys.argv[1:]``)
    and return the exit status (see the module docstring). argparse exits
    with status 2 itself on bad usage."""
    args = build_parser().parse_args(argv)
    if args.command == "replay":
        return _replay(args)
    return 2  # pragma: no cover (argparse requires a known command)
