#!/usr/bin/env python3
"""The vLLM adapter's calls on cold caches: vLLM's pool beside ours, per call kind.

In a real engine the scheduler's code runs after the forward pass has
evicted the caches, so a call costs several times what a hot loop says and
what it costs is mostly the code and data it touches, not its work
(``docs/performance.md``, "A real vLLM engine: scheduler time per step"). This script replays
one step shape many times and evicts the caches (a 48 MiB buffer and 150,000
small dicts walked) before every timed call, with the kinds of pool
interleaved step by step so that they see the same machine:

- ``vllm``: vLLM's own ``BlockPool``;
- ``on`` / ``off``: our ``VllmBlockPool`` with hazards on / off;
- ``core``: our core alone, called with the keys the adapter would make
  (what the adapter adds is ``on`` minus ``core``).

Per step: 30 ``get_num_free_blocks``, 16 ``get_cached_block`` (one prefix
of 16 blocks, of which the first 8 tokens are shared by 32 prefixes),
``get_new_blocks(17)``, ``cache_full_blocks`` of 16 blocks,
``free_blocks`` of a request 8 steps old, ``take_events``. Prints µs per
step for each call kind and kind of pool. It is a probe for finding where
the adapter's time goes, not a yardstick: ``benchmarks/engine_pool_time.py``
measures the real engine.

Needs vLLM (0.32 or 0.33)::

    .venv-vllm032/bin/python benchmarks/adapter_cold.py
    PYTHONPATH=build/compiled-suite .venv-vllm032/bin/python benchmarks/adapter_cold.py --kinds vllm,on,core
    .venv-vllm032/bin/python benchmarks/adapter_cold.py --warm --no-events
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.request import Request

import blockpool
from blockpool.integrations.vllm.pool import VLLM_BLOCK_POOL, VllmBlockPool

BLOCK_SIZE = 16
NUM_BLOCKS = 2048
KINDS = ("vllm", "off", "on", "core")


def _request(rid: str, tokens: list[int]) -> Any:
    sp = SamplingParams(max_tokens=17)
    sp.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


class _Evictor:
    """Walks enough memory to evict this machine's caches and TLBs (a
    48 MiB buffer, one byte a page, and 30,000 of 150,000 small dicts)."""

    def __init__(self) -> None:
        self.big = bytearray(48 * 1024 * 1024)
        self.junk = [{"a": i, "b": str(i)} for i in range(150_000)]

    def __call__(self) -> None:
        pages = self.big[::4096]
        self.big[::4096] = b"\x01" * len(pages)
        s = 0
        for d in self.junk[::5]:
            s += d["a"]


def _steps(kind: str, steps: int, events: bool, evict: Any) -> Iterator[dict[str, float] | None]:
    """One kind of pool's run, a step per ``next()``; the last item is
    the µs per step by call kind."""
    api: Any
    if kind == "vllm":
        api = VLLM_BLOCK_POOL(NUM_BLOCKS, True, BLOCK_SIZE, enable_kv_cache_events=events)
    else:
        pool = VllmBlockPool(
            NUM_BLOCKS, True, BLOCK_SIZE, enable_kv_cache_events=events, track_hazards=kind != "off"
        )
        api = pool.core if kind == "core" else pool
    n = 16 * BLOCK_SIZE + 3
    reqs = [
        _request(f"r{i}", [i % 32] * 8 + list(range(1000 + i * 300, 1000 + i * 300 + n)))
        for i in range(steps)
    ]
    totals: dict[str, int] = {}
    clock = time.perf_counter_ns

    def add(name: str, t0: int) -> None:
        totals[name] = totals.get(name, 0) + clock() - t0

    held: list[Any] = []
    for r in reqs:
        keys = [make_block_hash_with_group_id(h, 0) for h in r.block_hashes]
        evict()
        t0 = clock()
        for _ in range(30):
            api.get_num_free_blocks()
        add("get_num_free_blocks x30", t0)
        yield None
        evict()
        t0 = clock()
        if kind == "core":
            for k in keys:
                api.get_cached_block(k)
        else:
            for h in r.block_hashes:
                api.get_cached_block(h, [0])
        add("get_cached_block x16", t0)
        evict()
        t0 = clock()
        blocks = api.get_new_blocks(17)
        add("get_new_blocks(17)", t0)
        evict()
        t0 = clock()
        if kind == "core":
            api.publish_full_blocks(blocks, keys, 0, 16, BLOCK_SIZE)
        else:
            api.cache_full_blocks(r, blocks, 0, 16, BLOCK_SIZE, 0)
        add("cache_full_blocks(16)", t0)
        held.append(blocks)
        if len(held) > 8:
            evict()
            t0 = clock()
            api.free_blocks(list(reversed(held.pop(0))))
            add("free_blocks(17)", t0)
        evict()
        t0 = clock()
        api.take_events()
        add("take_events", t0)
    yield {k: v / steps / 1e3 for k, v in totals.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--kinds", default=",".join(KINDS), help=f"kinds of pool, comma-separated (default {','.join(KINDS)})"
    )
    p.add_argument("--steps", type=int, default=600, help="steps per kind (default 600)")
    p.add_argument("--warm", action="store_true", help="do not evict the caches between calls")
    p.add_argument("--no-events", action="store_true", help="KV cache events off (default on)")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or len(set(kinds)) != len(kinds) or args.steps < 1:
        p.error(
            f"--kinds: distinct names among {', '.join(KINDS)}; --steps >= 1 (got {args.kinds!r}, {args.steps})"
        )
    init_none_hash(sha256)
    evict = (lambda: None) if args.warm else _Evictor()
    runs = {k: _steps(k, args.steps, not args.no_events, evict) for k in kinds}
    result: dict[str, dict[str, float]] = {}
    while len(result) < len(kinds):  # interleaved: one step of each kind in turn
        for k in kinds:
            if k not in result:
                got = next(runs[k])
                if got is not None:
                    result[k] = got
    build = "compiled" if blockpool.__compiled__ else "pure"
    print(f"build {build}, {'warm' if args.warm else 'cold'}, events {'off' if args.no_events else 'on'}")
    print(f"{'':26s} " + " ".join(f"{k:>8s}" for k in kinds) + "  (µs per step)")
    for name in result[kinds[0]]:
        print(f"{name:26s} " + " ".join(f"{result[k].get(name, 0):8.2f}" for k in kinds))
    print(f"{'total':26s} " + " ".join(f"{sum(result[k].values()):8.2f}" for k in kinds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
