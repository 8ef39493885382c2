#!/usr/bin/env python3
"""Where the trace op log's time goes, per pool call: each recorded call
replayed with a timer around it, per pool (``on``, ``off``, ``vllm``),
totals per method name. The timer adds about 0.1 µs a call to every pool
alike, so read differences between pools (or between commits), not
absolute figures; the headline figures are ``run.py -k trace``'s.

Run from a checkout (the ``vllm`` column needs a supported vLLM: run it
with ``.venv-vllm034/bin/python`` for the newest line, another line's
venv for that line; the output names the vLLM measured)::

    python benchmarks/per_call.py --oplog /tmp/oplog.pkl --pools on,off

Without ``--oplog`` the log is recorded first (about 2.5 minutes) into a
temp dir (:func:`_oplog.record`). Prints a table: method, calls, seconds
per pool (the best of ``--rounds`` replays, by total).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _oplog
from _pools import make_pool, vllm_line

import blockpool


def per_call(log: _oplog.OpLog, kind: str) -> tuple[dict[str, float], dict[str, int]]:
    """One timed replay of ``log`` against a fresh ``kind`` pool: seconds
    and calls per method name. O(calls)."""
    calls, _ = _oplog.build_replay(log, kind, lambda: make_pool(kind, log.num_blocks))
    names = [getattr(getattr(fn, "func", fn), "__name__", "?") for fn, _ in calls]
    secs: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    clock = time.perf_counter
    gc.collect()
    gc.freeze()
    try:
        for name, (fn, args) in zip(names, calls):
            t0 = clock()
            fn(*args)
            secs[name] += clock() - t0
            count[name] += 1
    finally:
        gc.unfreeze()
    return secs, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oplog", type=Path, help="a recorded op log (else one is recorded first)")
    ap.add_argument("--pools", default="on,off", help="comma-separated: on, off, vllm")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    path = a.oplog
    if path is None:
        path = Path(tempfile.mkdtemp()) / "oplog.pkl"
        _oplog.record(path)
    log = _oplog.load(path)
    kinds = a.pools.split(",")
    best: dict[str, tuple[dict[str, float], dict[str, int]]] = {}
    for kind in kinds:
        runs = [per_call(log, kind) for _ in range(a.rounds)]
        best[kind] = min(runs, key=lambda r: sum(r[0].values()))
    first = best[kinds[0]]
    names = sorted(set().union(*(b[0] for b in best.values())), key=lambda n: -first[0].get(n, 0.0))
    build = "compiled (mypyc)" if blockpool.__compiled__ else "pure Python"
    print(f"blockpool {build}, {blockpool.__file__}; against {vllm_line()}")
    print(f"{'method':<22} {'calls':>8} " + " ".join(f"{k:>9}" for k in kinds))
    for n in names:
        print(f"{n:<22} {first[1].get(n, 0):>8} " + " ".join(f"{best[k][0].get(n, 0.0):9.3f}" for k in kinds))
    print(f"{'total':<22} {'':>8} " + " ".join(f"{sum(best[k][0].values()):9.3f}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
