#!/usr/bin/env python3
"""The trace op log in instructions: what each pool's replay executes,
counted by valgrind's callgrind, so that two builds or two commits can be
compared on a machine shared with other jobs (the count does not move with
the load; time does).

Usage::

    python benchmarks/instructions.py --oplog out/oplog300.pkl [--compiled build/compiled-suite] [--pools on,off]

Record a short log first (the 2,000-request log of ``builds.py`` takes
about ten minutes a pool under callgrind; 300 requests, about one)::

    python -c "import sys; sys.path.insert(0, 'benchmarks'); import _oplog, pathlib; _oplog.record(pathlib.Path('out/oplog300.pkl'), limit=300)"

For each build (the pure one, this checkout; each ``--compiled``
directory, as in ``builds.py``) and pool, two child processes run under
``valgrind --tool=callgrind`` with ``PYTHONHASHSEED=0``: one loads the log
and builds the pool and its calls, the other does the same and replays
the calls; the replay's count is the difference. Prints the counts (in
millions of instructions) and the ratios ``on / off`` (the hazard
tracking's own work) and ``on / vllm`` when ``vllm`` is measured (slow:
vLLM's import runs under callgrind too, about ten minutes). An
instruction is not a nanosecond (cache misses, branch mispredictions and
the memory system are not counted): read the counts for A/B comparisons of
code, and time (``builds.py``) for the figures. Needs ``valgrind`` on the
``PATH``; exits 2 without it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import gc, sys
sys.path.insert(0, sys.argv[2])
import _oplog
from _pools import make_pool
log = _oplog.load(__import__("pathlib").Path(sys.argv[1]))
kind = sys.argv[3]
calls, _ = _oplog.build_replay(log, kind, lambda: make_pool(kind, log.num_blocks))
gc.collect()
if sys.argv[4] == "1":
    _oplog.run_calls(calls)
"""

_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def _count(root: Path, oplog: Path, kind: str, replay: bool) -> int:
    """Instructions of one child process under callgrind. O(the child)."""
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED="0")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-c",
        _CHILD,
        str(oplog),
        str(REPO / "benchmarks"),
        kind,
        "1" if replay else "0",
    ]
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True)
    m = _COLLECTED.search(res.stderr)
    if m is None:
        raise RuntimeError(f"callgrind printed no count for {kind} ({root}):\n{res.stderr[-2000:]}")
    return int(m.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oplog", type=Path, required=True)
    ap.add_argument("--compiled", action="append", default=[], metavar="[NAME=]DIR")
    ap.add_argument("--pools", default="on,off", help="comma-separated: on, off, vllm (default on,off)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("instructions.py: valgrind is not on the PATH", file=sys.stderr)
        return 2
    builds: dict[str, Path] = {"pure": REPO}
    for spec in args.compiled:
        name, _, path = spec.rpartition("=")
        builds[name or ("compiled" if len(args.compiled) == 1 else path)] = Path(path).resolve()
    kinds = [k for k in args.pools.split(",") if k]
    oplog = args.oplog.resolve()
    for name, root in builds.items():
        got = {k: _count(root, oplog, k, True) - _count(root, oplog, k, False) for k in kinds}
        line = ", ".join(f"{k} {v / 1e6:,.0f} M" for k, v in got.items())
        if "on" in got and "off" in got:
            line += f" (on/off {got['on'] / got['off']:.3f}"
            line += f", on/vllm {got['on'] / got['vllm']:.3f})" if "vllm" in got else ")"
        print(f"{name:8s}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
