"""The ``blockpool`` command line (``blockpool replay``; also ``python -m blockpool``).

``blockpool replay [TRACE]`` replays a Mooncake JSONL or Azure CSV trace (or,
with no TRACE, the built-in synthetic chat workload) under the wait policies,
prints one summary row per policy, and optionally writes the JSON report,
a PNG and the event log. ``blockpool sweep [TRACE ...]`` replays a grid
(traces x policies x evictions x placements x pool sizes x seeds) in local
worker processes, or as Ray tasks with ``--ray ADDRESS`` (the ``ray``
extra), and prints one row per cell (:mod:`blockpool.replay.sweep`). See
``docs/replay.md``. ``blockpool fetch-trace NAME`` downloads a public
trace (:data:`blockpool.replay.fetch.TRACES`: ``mooncake``, ``azure-code``)
into a cache directory, checks its published SHA-256 and prints its path,
so ``blockpool replay "$(blockpool fetch-trace mooncake)"`` replays it
(:mod:`blockpool.replay.fetch`). ``blockpool check-vllm`` serves a tiny model on the vLLM
installed here with the vLLM plugin off, on, and on without hazard tracking,
and compares tokens, prefix-cache hits and KV events
(:mod:`blockpool.checking.vllm_engine`; its own exit statuses: 0
identical, 1 a difference, 2 setup error; ``docs/vllm-plugin.md``).

Exit status: 0 done; 1 the ``exact`` policy showed a race; 2 bad usage or
bad input (unreadable trace, bad line, unknown policy, an output path that
cannot be written, checked before the replay); 3 the replay itself failed
(stalled, leaked blocks) or an output could not be written; 130 interrupted
(SIGINT, Ctrl-C); 143 terminated (SIGTERM). An interrupted run prints one
line, leaves no output or part file behind and no worker process running.
``fetch-trace``: 0 the verified path printed, 2 bad usage, 3 the download
failed or its SHA-256 is not the published one.

Errors name an option as it is typed (``--num-blocks``, not the
configuration's ``num_blocks``); after the table, ``replay`` prints one
``wrote PATH`` line per output it wrote (``sweep``: for ``--json``).

``blockpool --version`` prints the version. Every ``--help`` ends with its
command's exit statuses. Interrupted, a command prints one line naming
itself (``blockpool sweep: error: interrupted (SIGINT)``).

Progress goes to stderr (never with ``--quiet``): a tqdm bar on a terminal;
otherwise one line every :data:`PROGRESS_INTERVAL_S` seconds (requests done,
rate, ETA), so logs of long runs show it too.

tqdm and matplotlib (the ``replay`` extra) are imported only when used; the
command works without them (no bar on a terminal, progress lines elsewhere;
``--plot`` then fails with status 2, before the replay).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from blockpool.core.errors import BlockPoolError, ClusterUnavailableError

__all__ = ["build_parser", "main"]

PROGRESS_INTERVAL_S = 5.0
"""Seconds between progress lines on stderr when it is not a terminal."""

EXIT_SIGINT = 130
"""Exit status after SIGINT (Ctrl-C): 128 + the signal number, as shells report."""
EXIT_SIGTERM = 143
"""Exit status after SIGTERM: 128 + 15."""


class Terminated(BaseException):
    """Raised in the main thread when SIGTERM arrives, so that the replay
    unwinds (stops its workers, removes its part files) like on Ctrl-C."""


_EXIT_STATUS_REPLAY = """exit status:
  0    done
  1    the exact policy showed a race
  2    bad usage or input, checked before the replay: unreadable trace, bad
       line, unknown policy, a pool too small for any request, --plot without
       matplotlib, an output that cannot be written (a directory, a socket,
       no such directory), a --plot name not ending in .png
  3    the replay failed (stalled, leaked blocks) or an output could not be
       written
  130  interrupted (SIGINT, Ctrl-C)
  143  terminated (SIGTERM)"""

_EXIT_STATUS_SWEEP = """exit status:
  0    done
  1    an exact cell showed a race
  2    bad usage or input, checked before any cell runs (a trace, a name, --ray
       without Ray, a cluster that cannot be joined)
  3    a cell failed, or the JSON could not be written
  130  interrupted (SIGINT, Ctrl-C)
  143  terminated (SIGTERM)"""

_EXIT_STATUS_FETCH = """exit status:
  0    the trace is in the cache with its published sha256; its path printed
  2    bad usage (an unknown trace name)
  3    the download failed, its sha256 is not the published one, or the
       cache directory cannot be written (nothing is left half-written)"""

_EXIT_STATUS_TOP = """exit status (replay, sweep):
  0 done; 1 the exact policy showed a race; 2 bad usage or input;
  3 the run failed or an output could not be written; 130 interrupted (Ctrl-C);
  143 terminated (SIGTERM). check-vllm: 0 identical, 1 a difference, 2 setup
  error (--surface: 0 every name as declared, 1 a drift, 2 no vLLM or no
  declared line).
  fetch-trace: 0 the path printed, 2 bad usage, 3 download or checksum failed.
  See 'blockpool COMMAND --help'."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``blockpool``. O(1)."""
    from blockpool import __compiled__, __version__
    from blockpool.replay.policies import POLICIES

    parser = argparse.ArgumentParser(
        prog="blockpool",
        description="KV-cache block pool with exact hazard fences.",
        epilog=_EXIT_STATUS_TOP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build = "core compiled (mypyc)" if __compiled__ else "core pure Python"
    parser.add_argument("--version", action="version", version=f"blockpool {__version__}, {build}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "replay",
        help="replay a serving trace under several wait policies and check it for races",
        description=(
            "Replay a trace on a simulated GPU under each wait policy, check every block\n"
            "access with the race oracle, and report races, load-start delays, makespan,\n"
            "throughput and allocator time.\n"
            "\n"
            "TRACE: a Mooncake .jsonl or an Azure .csv file; none: the built-in synthetic\n"
            "chat workload. 'blockpool fetch-trace mooncake' downloads Mooncake's public\n"
            "trace and prints its path."
        ),
        epilog=_EXIT_STATUS_REPLAY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p.add_argument(
        "--eviction",
        default=None,
        metavar="POLICY[,POLICY...]",
        help="pool eviction policies to compare: lru (default), s3fifo, 2q; with this or --placement, "
        "each wait policy runs under every eviction x placement, labelled policy/eviction/placement",
    )
    p.add_argument(
        "--placement",
        default=None,
        metavar="MODE[,MODE...]",
        help="pool placement modes to compare: lru (default), ready_first, ready_first_cached "
        "(ready_first that may also evict ready cached blocks), runs (blocks in runs of consecutive ids; "
        "LRU still picks the evicted keys), runs_cached (runs that may evict a younger key), "
        "ready_first_runs",
    )
    p.add_argument("--json", metavar="OUT", help="write the JSON report here")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="write a PNG of the cumulative load-start delays per policy (a run without loads: the empty axes, "
        "saying so)",
    )
    p.add_argument(
        "--events", metavar="OUT.jsonl", help="write every issue, wait, access and completion here"
    )
    p.add_argument(
        "--skip-bad-lines", action="store_true", help="skip bad trace lines (counted) instead of failing"
    )
    p.add_argument(
        "--jobs", type=int, default=None, help="policies run in parallel (default: min(policies, CPUs))"
    )
    p.add_argument(
        "--quiet", action="store_true",
        help="no progress on stderr: neither the bar (a terminal) nor the progress lines (a log or a pipe)",
    )  # fmt: skip
    w = sub.add_parser(
        "sweep",
        help="a grid of replays: traces x policies x evictions x placements x pool sizes x seeds",
        description=(
            "Replay every cell of a grid (traces x wait policies x eviction policies x\n"
            "placements x pool sizes x seeds) in local worker processes and print one row\n"
            "per cell; --json writes them all (schema blockpool.sweep/1). See docs/replay.md."
        ),
        epilog=_EXIT_STATUS_SWEEP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w.add_argument(
        "traces", nargs="*", metavar="TRACE",
        help="trace files, or 'synthetic' for the built-in workload (default: synthetic)",
    )  # fmt: skip
    w.add_argument("--policy", default="exact", help="wait policies, comma-separated (default exact)")
    w.add_argument("--eviction", default="lru", help="eviction policies, comma-separated (default lru)")
    w.add_argument("--placement", default="lru", help="placements, comma-separated (default lru)")
    w.add_argument(
        "--num-blocks", default=None,
        help="pool sizes, comma-separated (default: 16384 for a trace, 2048 for the synthetic workload)",
    )  # fmt: skip
    w.add_argument("--seed", default="0", help="seeds, comma-separated (default 0)")
    w.add_argument("--limit", type=int, default=None, help="replay only the first K requests of each trace")
    w.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    w.add_argument(
        "--skip-bad-lines", action="store_true",
        help="skip bad trace lines (counted per row) instead of failing; without it, a bad line exits 2 before any cell",
    )  # fmt: skip
    w.add_argument(
        "--jobs", type=int, default=None,
        help="worker processes, or the CPUs of a --ray local instance (default: min(#cells, #CPUs))",
    )  # fmt: skip
    w.add_argument(
        "--ray", metavar="ADDRESS", default=None,
        help="run the cells as Ray tasks on the Ray cluster at ADDRESS ('HOST:PORT', 'auto', 'ray://HOST:10001'); "
        "'local' starts a local Ray instance; needs the 'ray' extra (pip install 'blockpool[ray]')",
    )  # fmt: skip
    w.add_argument("--json", metavar="OUT", help="write every row here (schema blockpool.sweep/1)")
    w.add_argument(
        "--quiet", action="store_true", help="no progress on stderr (the 'sweep: N/M cells' lines)"
    )
    from blockpool.replay.fetch import TRACES

    f = sub.add_parser(
        "fetch-trace",
        help="download a public trace, check its sha256 and print its path",
        description=(
            "Download a public serving trace into the cache directory (once: a copy already\n"
            "there is verified instead), check the SHA-256 of the file as published, and\n"
            "print its path (nothing else on stdout), so that\n"
            '  blockpool replay "$(blockpool fetch-trace mooncake)" --limit 2000\n'
            "replays it. Traces:\n"
            + "".join(
                f"  {t.name:<11} {t.file} ({t.license})\n{'':14}{t.repository}\n" for t in TRACES.values()
            )
        ),
        epilog=_EXIT_STATUS_FETCH,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument("name", metavar="NAME", choices=list(TRACES), help=f"one of: {', '.join(TRACES)}")
    f.add_argument(
        "--dir", default=None, metavar="DIR",
        help="the cache directory (default $XDG_CACHE_HOME/blockpool/traces, or ~/.cache/blockpool/traces)",
    )  # fmt: skip
    # Imports neither torch nor vLLM: only the check's runs do, in subprocesses.
    from blockpool.checking.vllm_engine import add_arguments as add_check_vllm_arguments

    c = sub.add_parser(
        "check-vllm",
        help="serve a tiny model on this vLLM with the blockpool plugin off, on and without hazards; compare",
        description=(
            "Start a real vLLM engine (this environment's vLLM, a tiny Llama with random weights built "
            "locally) with the blockpool plugin off, on, and on with hazard tracking off, each in its own "
            "process; compare the generated tokens, prefix-cache hits and KV cache events, check the "
            "scheduler's pool class, and report the scheduler's time per step. Exit 0 identical, 1 a "
            "difference, 2 setup error. See docs/vllm-plugin.md."
        ),
    )
    add_check_vllm_arguments(c)
    c.add_argument(
        "--surface", action="store_true",
        help="print the vLLM names the plugin depends on, declared for this vLLM's release line, against "
        "the installed vLLM (name, expected, found), and serve nothing; exit 0 all as declared, 1 a drift, "
        "2 no vLLM or no declared line",
    )  # fmt: skip
    s = sub.add_parser(
        "check-sglang",
        help="check the installed SGLang against the names the blockpool SGLang plugin depends on",
        description=(
            "With --surface: print the SGLang methods the plugin wraps or relies on, declared for its "
            "release line (signature and body fingerprint), against the installed SGLang. Exit 0 all as "
            "declared, 1 a drift, 2 no SGLang or no declared line. See docs/sglang.md."
        ),
    )
    s.add_argument("--surface", action="store_true", help="print the surface table (the only check so far)")
    return parser


def _ints(spec: str, what: str, at_least: int | None = None) -> list[int]:
    """``"1,2"`` -> ``[1, 2]`` for option ``--what``. O(len(spec)).

    Raises:
        ValueError: not integers, or one below ``at_least``, naming ``--what``.
    """
    names = _names(spec, what) or []
    try:
        out = [int(x) for x in names]
    except ValueError:
        raise ValueError(f"--{what} takes integers, got {spec!r}") from None
    for v in out:
        if at_least is not None and v < at_least:
            raise ValueError(f"--{what} must be >= {at_least}, got {v}")
    return out


_EMPTY_TRACE = (
    "TRACE is an empty string: give a trace file (an empty one is what "
    '"$(blockpool fetch-trace NAME)" gives when the fetch failed: see its error above)'
)


def _check_at_least(args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """Refuse an option below its minimum, naming the option as it is typed:
    the argparse destination ``num_blocks`` is the option ``--num-blocks``
    (``None``, an option left out, passes). O(len(minimums)).

    Raises:
        ValueError: ``--OPTION must be >= LO, got V``.
    """
    for dest, lo in minimums.items():
        v = getattr(args, dest)
        if v is not None and v < lo:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= {lo}, got {v}")


def _sweep(args: argparse.Namespace) -> int:
    """``blockpool sweep``: exit 0 done, 1 an ``exact`` cell raced, 2 bad
    usage or input (checked before any cell runs; ``--ray`` without Ray
    installed included) or a Ray cluster that cannot be joined or started
    or cannot run a cell (no ``blockpool`` on its workers), 3 a cell failed
    or the JSON could not be written."""
    import os
    import time

    from blockpool.replay.config import ReplayError
    from blockpool.replay.run import write_atomic
    from blockpool.replay.sweep import (
        SYNTHETIC,
        SweepSpec,
        cells,
        format_sweep,
        require_ray,
        sweep,
        sweep_json,
    )
    from blockpool.replay.traces import read_trace

    def err(msg: str) -> None:
        print(f"blockpool sweep: error: {msg}", file=sys.stderr)

    try:
        _check_at_least(args, {"limit": 1, "block_size": 1, "jobs": 1})
        if any(not t.strip() for t in args.traces):
            raise ValueError(_EMPTY_TRACE)
        spec = SweepSpec(
            traces=tuple(args.traces) or (SYNTHETIC,),
            policies=tuple(_names(args.policy, "policy") or ()),
            evictions=tuple(_names(args.eviction, "eviction") or ()),
            placements=tuple(_names(args.placement, "placement") or ()),
            num_blocks=tuple(_ints(args.num_blocks, "num-blocks", 2)) if args.num_blocks else (None,),
            seeds=tuple(_ints(args.seed, "seed")),
            limit=args.limit,
            block_size=args.block_size,
            skip_bad_lines=args.skip_bad_lines,
        )
        for t in spec.traces:
            if t != SYNTHETIC:
                # read as the cells will (every line up to --limit): a bad line fails here, status 2
                read_trace(t, limit=args.limit, skip_bad_lines=args.skip_bad_lines)
        grid = cells(spec)
        jobs = args.jobs if args.jobs is not None else max(1, min(len(grid), os.cpu_count() or 1))
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        if args.ray is not None:
            if not args.ray.strip():
                raise ValueError(
                    "--ray takes a Ray address ('local', 'auto', 'HOST:PORT', 'ray://HOST:PORT')"
                )
            require_ray()  # Ray not installed: status 2 before any cell
        if args.json:
            args.trace, args.plot, args.events = None, None, None
            _check_outputs(args)
    except (BlockPoolError, ValueError) as e:
        err(str(e))
        return 2

    def progress(done: int, total: int) -> None:
        if not args.quiet:
            print(f"sweep: {done}/{total} cells", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        rows = sweep(spec, jobs=jobs, progress=progress, ray=args.ray)
    except ClusterUnavailableError as e:
        err(str(e))
        return 2
    except (ReplayError, BlockPoolError) as e:
        err(f"a cell failed: {e}")
        return 3
    print(format_sweep(rows))
    if args.json:
        doc = sweep_json(spec, rows, time.perf_counter() - t0)

        def write_json(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")

        try:
            write_atomic(args.json, write_json)
        except OSError as e:
            err(f"cannot write {args.json}: {e}")
            return 3
        print(f"wrote {args.json}")
    raced = [r for r in rows if r["policy"] == "exact" and r["races"]]
    if raced:
        err(f"an exact cell shows {raced[0]['races']} races")
        return 1
    return 0


class _ProgressLines:
    """Progress as plain lines on ``stream`` (stderr that is not a terminal):
    at most one every ``interval`` seconds, plus one at the end if any was
    printed. Each names the requests done, the rate and the ETA. O(1) per
    update."""

    def __init__(
        self, total: int, stream: Any, interval: float, clock: Callable[[], float], runs: int = 1
    ) -> None:
        self.total, self.stream, self.interval, self.clock = total, stream, interval, clock
        self.runs = max(1, runs)  # total counts requests x runs; lines count requests, as the summary does
        self.t0 = self.last = clock()
        self.n = 0
        self.printed = False

    def update(self, n: int) -> None:
        self.n = max(self.n, n)
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = max(now - self.t0, 1e-9)
        rate = self.n / elapsed
        left = self.total - self.n
        eta = _hms(left / rate) if rate > 0 else "?"
        pct = 100.0 * self.n / self.total if self.total else 100.0
        runs = self.runs
        done = f"{self.n}/{self.total} requests" if runs == 1 else (
            f"{self.n / runs:,.0f}/{self.total // runs:,} requests x {runs} runs"
        )  # fmt: skip
        print(
            f"replay: {done} ({pct:.0f}%), {rate:.1f} req/s, elapsed {_hms(elapsed)}, ETA {eta}",
            file=self.stream,
            flush=True,
        )
        self.printed = True

    def close(self) -> None:
        if self.printed:
            self._line(self.clock())


def _hms(seconds: float) -> str:
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _progress_bar(
    total: int, quiet: bool, runs: int = 1
) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A progress callback and its closer: a tqdm bar on a terminal (when
    tqdm is installed), progress lines otherwise, nothing with ``quiet``.
    ``total`` counts requests x ``runs`` (the policies' runs); both show
    requests, the unit of the summary."""
    import time

    if quiet:
        return None, lambda: None
    if not sys.stderr.isatty():
        lines = _ProgressLines(total, sys.stderr, PROGRESS_INTERVAL_S, time.monotonic, runs)
        return lines.update, lines.close
    try:
        from tqdm import tqdm
    except ImportError:
        return None, lambda: None
    desc = "replay" if runs == 1 else f"replay ({runs} runs)"
    bar: Any = tqdm(
        total=total, unit="req", unit_scale=1 / max(1, runs), desc=desc, file=sys.stderr, mininterval=0.5
    )

    def update(n: int) -> None:
        if n > bar.n:
            bar.update(n - bar.n)

    return update, bar.close


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before the replay, an output path that cannot be written: a
    directory, a socket, a block device (anything but a regular file, a
    character device or a FIFO), a missing or unwritable directory, an
    unwritable file, device or FIFO, the trace itself, or one path given
    for two outputs. A symlink is judged by its target (which is what is
    written). For a regular or new file, creates and removes a probe file
    beside it; a device or a FIFO is only checked for write permission (it
    is written through, never replaced: :func:`blockpool.replay.run.write_atomic`).
    O(outputs).

    Raises:
        ValueError: naming the option and the path.
    """
    import os
    import tempfile

    from blockpool.replay.run import OUTPUT_STREAM, output_kind

    seen: dict[str, str] = {}
    trace = os.path.realpath(args.trace) if args.trace else None
    for opt, out in (("--json", args.json), ("--plot", args.plot), ("--events", args.events)):
        if not out:
            continue
        try:
            full, kind = output_kind(out)
        except BlockPoolError as e:
            raise ValueError(f"cannot write {opt} {e}") from None
        if full in seen:
            raise ValueError(f"{opt} {out}: the same file as {seen[full]}")
        seen[full] = opt
        if full == trace:
            raise ValueError(f"{opt} {out}: that is the trace being read")
        if kind == OUTPUT_STREAM:
            if not os.access(full, os.W_OK):
                raise ValueError(f"cannot write {opt} {out}: permission denied")
            continue
        d = os.path.dirname(full)
        if not os.path.isdir(d):
            raise ValueError(
                f"cannot write {opt} {out}: no such directory {d} (create it first: mkdir -p {d})"
            )
        if os.path.exists(full) and not os.access(full, os.W_OK):
            raise ValueError(f"cannot write {opt} {out}: permission denied")
        try:
            fd, probe = tempfile.mkstemp(prefix=".blockpool-probe-", dir=d)
        except OSError as e:
            raise ValueError(
                f"cannot write {opt} {out}: cannot create a file in {d}: {e.strerror or e}"
            ) from None
        os.close(fd)
        os.remove(probe)
        if opt == "--plot" and os.path.splitext(full)[1].lower() != ".png":
            raise ValueError(f"cannot write --plot {out}: the plot is a PNG; give a name ending in .png")


def _names(spec: str | None, what: str) -> list[str] | None:
    """``"lru,s3fifo"`` -> ``["lru", "s3fifo"]`` (de-duplicated, in order);
    ``None`` stays ``None``. Raises ValueError for an empty list."""
    if spec is None:
        return None
    out = list(dict.fromkeys(x.strip() for x in spec.split(",") if x.strip()))
    if not out:
        raise ValueError(f"--{what} names nothing")
    return out


def _err(msg: str) -> None:
    print(f"blockpool replay: error: {msg}", file=sys.stderr)


def _replay(args: argparse.Namespace) -> int:
    import os

    from blockpool.replay.config import (
        DEFAULT_NUM_BLOCKS,
        SYNTHETIC_NUM_BLOCKS,
        ReplayConfig,
        ReplayError,
        check_fits,
    )
    from blockpool.replay.policies import parse_policies
    from blockpool.replay.report import format_table
    from blockpool.replay.run import replay, write_atomic
    from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace
    from blockpool.replay.traces import read_trace

    try:
        policies = parse_policies(args.policy)
        evictions = _names(args.eviction, "eviction")
        placements = _names(args.placement, "placement")
        _check_at_least(args, {"limit": 1, "block_size": 1, "num_blocks": 2, "jobs": 1})
        if args.trace is not None and not args.trace.strip():
            raise ValueError(_EMPTY_TRACE)
        if args.trace is None:
            spec = SyntheticSpec() if args.limit is None else SyntheticSpec(num_requests=args.limit)
            trace = synthetic_trace(spec, seed=args.seed)
        else:
            trace = read_trace(args.trace, limit=args.limit, skip_bad_lines=args.skip_bad_lines)
        nb = args.num_blocks
        if nb is None:
            nb = SYNTHETIC_NUM_BLOCKS if args.trace is None else DEFAULT_NUM_BLOCKS
        cfg = ReplayConfig(block_size=args.block_size, num_blocks=nb, seed=args.seed)
        check_fits(trace.requests, cfg, name="--num-blocks")  # too small for any request: status 2
        for e in evictions or ():
            ReplayConfig(eviction=e)  # an unknown name fails here (status 2)
        for pl in placements or ():
            ReplayConfig(placement=pl)
        nruns = len(policies) * len(evictions or [0]) * len(placements or [0])
        jobs = args.jobs if args.jobs is not None else max(1, min(nruns, os.cpu_count() or 1))
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        _check_outputs(args)  # fail before a long replay, not after it
        if args.plot:
            from blockpool.replay.plot import require_matplotlib

            require_matplotlib()  # PlotUnavailableError (a BlockPoolError): status 2, before the replay
    except (BlockPoolError, ValueError) as e:
        _err(str(e))
        return 2
    if not trace.requests:
        _err(f"no requests in {trace.source}")
        return 2
    update, close = _progress_bar(len(trace.requests) * nruns, args.quiet, nruns)
    try:
        report = replay(
            trace, policies, cfg, jobs=jobs, events=args.events, progress=update,
            evictions=evictions, placements=placements,
        )  # fmt: skip
    except ReplayError as e:
        close()
        _err(f"replay failed: {e}")
        return 3
    except OSError as e:
        close()
        _err(f"cannot write {args.events}: {e}")
        return 3
    except BaseException:
        close()
        raise
    close()
    print(format_table(report))
    if args.events:
        print(f"wrote {args.events}")
    try:
        if args.json:

            def write_json(tmp: str) -> None:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(report.to_json(), f, indent=2)
                    f.write("\n")

            write_atomic(args.json, write_json)
            print(f"wrote {args.json}")
        if args.plot:  # a run without loads still gets its figure, saying so
            from blockpool.replay.plot import PlotUnavailableError, plot_report

            try:
                write_atomic(args.plot, lambda tmp: plot_report(report, tmp))
            except PlotUnavailableError as e:
                _err(str(e))
                return 2
            print(f"wrote {args.plot}")
    except OSError as e:
        _err(f"cannot write an output: {e}")
        return 3
    raced = [r for r in report.results if r.policy.split("/")[0] == "exact" and r.races]
    if raced:
        _err(f"the exact policy shows {raced[0].races} races ({raced[0].policy})")
        return 1
    return 0


def _fetch_trace(args: argparse.Namespace) -> int:
    """``blockpool fetch-trace NAME``: :func:`blockpool.replay.fetch.fetch`;
    prints the verified path on stdout (and nothing else there), its steps on
    stderr. Exit 0 the path printed, 3 the download or the checksum failed
    or the directory cannot be written (an unknown NAME: argparse, 2)."""
    from blockpool.replay.fetch import TraceFetchError, fetch

    try:
        path = fetch(args.name, args.dir)
    except TraceFetchError as e:
        print(f"blockpool fetch-trace: error: {e}", file=sys.stderr)
        return 3
    print(path)
    return 0


def _check_vllm(args: argparse.Namespace) -> int:
    """``blockpool check-vllm``: :func:`blockpool.checking.vllm_engine.run`;
    with ``--surface``, :func:`blockpool.integrations.vllm.surface.report`."""
    if args.surface:
        from blockpool.integrations.vllm.surface import report

        status, lines = report()
        print("\n".join(lines))
        return status
    from blockpool.checking.vllm_engine import run

    return run(args)


def _check_sglang(args: argparse.Namespace) -> int:
    """``blockpool check-sglang --surface``:
    :func:`blockpool.integrations.sglang.surface.report` (imports SGLang's
    modules; without ``--surface``: usage error, 2)."""
    if not args.surface:
        print("blockpool check-sglang: error: only --surface is available", file=sys.stderr)
        return 2
    from blockpool.integrations.sglang.surface import report

    status, lines = report()
    print("\n".join(lines))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``blockpool`` command with ``argv`` (default ``sys.argv[1:]``)
    and return the exit status (see the module docstring). argparse exits
    with status 2 itself on bad usage."""
    args = build_parser().parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "replay": _replay,
        "sweep": _sweep,
        "fetch-trace": _fetch_trace,
        "check-vllm": _check_vllm,
        "check-sglang": _check_sglang,
    }
    if args.command not in commands:  # pragma: no cover (argparse requires a known command)
        return 2
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    previous = None
    if main_thread:

        def on_term(signum: int, frame: object) -> None:
            raise Terminated()

        previous = signal.signal(signal.SIGTERM, on_term)

    def stopped(msg: str) -> None:  # one line, naming the command that was stopped
        print(f"blockpool {args.command}: error: {msg}", file=sys.stderr)

    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        stopped("interrupted (SIGINT)")
        return EXIT_SIGINT
    except Terminated:
        stopped("terminated (SIGTERM)")
        return EXIT_SIGTERM
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)
