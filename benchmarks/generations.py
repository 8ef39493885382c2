#!/usr/bin/env python3
"""What block generations (stale block tables) cost, per call and per block.

Usage: ``python benchmarks/generations.py [--base PATH]`` (about 30 s).
Prints, for a pool of 10^5 blocks, the hot-set allocation (``get_new_blocks(256)``
+ ``free_blocks``) with generations off and on, ``begin_store`` and
``cache_full_blocks`` of a 256-block table without and with
``generations=``, ``generations()`` itself, and 1-block calls without
``generations`` (the fast path). ``--base PATH``: a directory holding
another ``blockpool`` package (e.g. ``git archive <commit> blockpool |
tar -x -C PATH``); the fast-path figures are then measured for both,
interleaved, each in its own process. Memory is measured by
``benchmarks/test_memory.py`` (``bytes per block, block generations on``).
Figures: ``docs/performance.md``, "Block generations".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
K = 256


def _child(mode: str) -> dict[str, float]:
    from blockpool import HazardAwareBlockPool, StreamKind

    streams = {"compute": StreamKind.DEVICE, "d2h": StreamKind.DEVICE, "h2d": StreamKind.DEVICE}
    out: dict[str, float] = {}
    if mode == "fast":
        pool = HazardAwareBlockPool(10_000, streams=streams)
        t = pool.get_new_blocks(1)
        calls = {
            "get_new_blocks(1) + free_blocks, ns": lambda: pool.free_blocks(
                pool.get_new_blocks(1), token=None
            ),
            "begin_store(1 block), ns": lambda: pool.begin_store(t, "d2h"),
            "begin_load(1 block), ns": lambda: pool.begin_load(t, "h2d"),
            "cache_full_blocks(1 block), ns": lambda: pool.cache_full_blocks(t, ["k"], 0, 1, 16),
        }
        for name, fn in calls.items():
            out[name] = min(timeit.repeat(fn, number=20_000, repeat=15)) / 20_000 * 1e9
        return out

    pool = HazardAwareBlockPool(100_000, streams=streams)
    on = mode == "on"
    if on:
        pool.generations([])

    def per_call(fn: object, inner: int = 200) -> float:
        ts = []
        for _ in range(15):
            t0 = time.process_time()
            for _ in range(inner):
                fn()  # type: ignore[operator]
            ts.append((time.process_time() - t0) / inner)
        return statistics.median(ts)

    out["hot set get_new_blocks(256) + free_blocks, ns per block"] = (
        per_call(lambda: pool.free_blocks(pool.get_new_blocks(K), token=None)) / K * 1e9
    )
    table = pool.get_new_blocks(K)
    keys = [("k", i) for i in range(K)]
    out["begin_store(256), us"] = per_call(lambda: pool.begin_store(table, "d2h"), 100) * 1e6
    out["cache_full_blocks(256, cached), us"] = (
        per_call(lambda: pool.cache_full_blocks(table, keys, 0, K, 16)) * 1e6
    )
    if on:
        g = pool.generations(table)
        out["begin_store(256, generations=), us"] = (
            per_call(lambda: pool.begin_store(table, "d2h", generations=g), 100) * 1e6
        )
        out["cache_full_blocks(256, cached, generations=), us"] = (
            per_call(lambda: pool.cache_full_blocks(table, keys, 0, K, 16, generations=g)) * 1e6
        )
        out["generations(256), us"] = per_call(lambda: pool.generations(table)) * 1e6
    return out


def _run(path: Path, mode: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    res = subprocess.run(
        [sys.executable, __file__, "--child", mode], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="a directory holding the blockpool package to compare with")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return
    for mode in ("off", "on"):
        for name, v in _run(ROOT, mode).items():
            print(f"generations {mode:3}  {name}: {v:.2f}")
    trees = [("this tree", ROOT)] + ([("base", args.base)] if args.base else [])
    for rnd in range(3):
        for label, path in trees:
            figures = ", ".join(f"{k} {v:.0f}" for k, v in _run(path, "fast").items())
            print(f"fast path, round {rnd + 1}, {label}: {figures}")


if __name__ == "__main__":
    main()
