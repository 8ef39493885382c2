#!/usr/bin/env python3
"""The Python floor: what one container operation per block costs here.

Usage: ``python benchmarks/floor.py`` (about 20 s). Prints ns per block
for loops over blocks of a real pool that do (a) nothing, (b) one
attribute read, (c) one list append, (d) one dict lookup by the block's
36-byte key, (e) one attribute store, over 256 blocks that stay in cache
and over 10^6 blocks visited in a shuffled order (each a cache miss).
A pool operation that must touch each block once (allocate, free, touch,
cache) cannot beat (a)+(the operation's container work); the figures in
``docs/performance.md`` are compared with these.
"""

from __future__ import annotations

import random
import sys
import timeit
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from _pools import hashes, keys36, make_pool


def _loops(blocks: list, keymap: dict, keys: list) -> dict:  # type: ignore[type-arg]
    def nothing() -> None:
        for _b in blocks:
            pass

    def attr() -> None:
        for b in blocks:
            b.ref_cnt  # noqa: B018

    def append() -> None:
        out = []
        for b in blocks:
            out.append(b)  # noqa: PERF402  (the point: one append per block)

    def lookup() -> None:
        get = keymap.get
        for k in keys:
            get(k)

    def store() -> None:
        for b in blocks:
            b.ref_cnt = 0

    return {
        "loop only": nothing,
        "+ attribute read": attr,
        "+ list append": append,
        "dict lookup by key": lookup,
        "+ attribute store": store,
    }


def main() -> None:
    n = 1_000_000
    pool = make_pool("off", n + 1)
    blocks = pool.blocks[1:]
    ks = keys36(hashes(n, salt="floor"))
    keymap = dict(zip(ks, blocks))
    order = list(range(n))
    random.Random(0).shuffle(order)
    cold_blocks = [blocks[i] for i in order]
    cold_keys = [ks[i] for i in order]
    hot_blocks, hot_keys = blocks[:256], ks[:256]
    print(f"{'operation per block':28s} {'256 hot blocks':>16s} {'10^6 shuffled':>16s}   (ns per block)")
    hot = _loops(hot_blocks, keymap, hot_keys)
    cold = _loops(cold_blocks, keymap, cold_keys)
    for name in hot:
        h = min(timeit.repeat(hot[name], number=2000, repeat=5)) / 2000 / 256 * 1e9
        c = min(timeit.repeat(cold[name], number=1, repeat=3)) / n * 1e9
        print(f"{name:28s} {h:16.1f} {c:16.1f}")


if __name__ == "__main__":
    main()
