#!/usr/bin/env python3
"""The garbage collector's cost of a pool full of cached blocks: ours
against vLLM's, in the newest supported vLLM.

vLLM 0.34 keeps its prefix-cache map as block ids in a dict the cyclic
garbage collector does not track (its ``BlockHashToBlockMap``), because a
full collection with many cached blocks costs serving latency. This
measures what a pool with ``--blocks`` cached, free blocks adds to one full
``gc.collect()``: each pool is built in a fresh process, which times
``--reps`` full collections before building it and ``--reps`` after, and
reports the difference of the medians (ms). Each process first moves what
its imports made to the permanent generation (``gc.freeze()``, as vLLM's
engine does after start-up), so the figure is the pool's own. Pools (``--pools``): ``vllm``
(vLLM's ``BlockPool``), ``adapter`` (our ``VllmBlockPool``, hazards on),
``core`` (``HazardAwareBlockPool``, hazards on), ``core-off`` (hazards
off). Processes run in rotated order, ``--rounds`` times; the report gives
each pool's median over rounds and its ratio to vLLM's in the same rounds
(paired). ``vllm`` and ``adapter`` need vLLM installed.

Run (in a vLLM environment with blockpool installed)::

    python benchmarks/gc_pause.py --blocks 100000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import gc, json, statistics, sys, time
pool, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if pool in ("vllm", "adapter"):
    from vllm.v1.core.block_pool import BlockPool
    from types import SimpleNamespace
    from blockpool.integrations.vllm.pool import VllmBlockPool
from blockpool.core.pool import HazardAwareBlockPool

def collections():
    gc.collect()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        gc.collect()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)

# As vLLM does after start-up: the objects that exist now (the imports,
# torch's) move to the permanent generation and no collection visits them.
gc.collect()
gc.freeze()
before = collections()
keys = [i.to_bytes(32, "little") for i in range(n)]
if pool in ("vllm", "adapter"):
    # The path vLLM's scheduler takes: cache_full_blocks with a request's
    # block hashes (each block gets its key and the tokens it covers).
    p = (BlockPool if pool == "vllm" else VllmBlockPool)(n + 1, True, 16)
    blocks = p.get_new_blocks(n)
    p.cache_full_blocks(SimpleNamespace(block_hashes=keys), blocks, 0, n, 16, 0)
else:
    p = HazardAwareBlockPool(n + 1, True, 16, track_hazards=pool == "core")
    blocks = p.get_new_blocks(n)
    p.publish_full_blocks(blocks, keys, 0, n, 16)
p.free_blocks(blocks)
del blocks, keys
after = collections()
import blockpool
print(json.dumps({"pool": pool, "compiled": blockpool.__compiled__, "before_ms": before * 1e3, "after_ms": after * 1e3, "added_ms": (after - before) * 1e3}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100_000, help="cached blocks per pool (default 100000)")
    ap.add_argument("--reps", type=int, default=9, help="full collections timed before and after (default 9)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each pool once per round (default 5)")
    ap.add_argument(
        "--pools", default="vllm,adapter,core,core-off", help="comma-separated (default all four)"
    )
    ap.add_argument("--json", metavar="OUT", help="write the rows here")
    args = ap.parse_args(argv)
    pools = [p for p in args.pools.split(",") if p]
    rows: list[dict[str, float | str | int]] = []
    for r in range(args.rounds):
        order = pools[r % len(pools) :] + pools[: r % len(pools)]
        for pool in order:
            out = subprocess.run(
                [sys.executable, "-W", "ignore", "-c", _CHILD, pool, str(args.blocks), str(args.reps)],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            row = json.loads(out.strip().splitlines()[-1])
            row["round"] = r
            rows.append(row)
    build = "compiled" if all(x.get("compiled") for x in rows if x["pool"] != "vllm") else "pure"
    print(
        f"full gc.collect() added by a pool of {args.blocks} cached free blocks "
        f"(ms, median over {args.rounds} rounds; blockpool core: {build})"
    )
    by = {p: [x for x in rows if x["pool"] == p] for p in pools}
    for pool in pools:
        added = [float(x["added_ms"]) for x in by[pool]]
        line = f"  {pool:<9} {statistics.median(added):8.1f}  (range {min(added):.1f} to {max(added):.1f})"
        if "vllm" in by and pool != "vllm":
            paired = [
                float(a["added_ms"]) / float(v["added_ms"])
                for a, v in zip(by[pool], by["vllm"])
                if float(v["added_ms"]) > 0
            ]
            if paired:
                line += f"; / vLLM's, paired: {statistics.median(paired):.2f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
