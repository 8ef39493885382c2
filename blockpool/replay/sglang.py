"""What exact fences are worth to SGLang's HiCache: a replay of a trace
through a model of SGLang's overlap scheduler, radix cache and LIFO page
allocator, counting the loads and write-backs whose exact fence lets them
start before the stream tail (the forward in flight) that SGLang's
``wait_stream`` waits on.

The model (one forward in flight, SGLang 0.5.23's ``event_loop_overlap``):

* Step ``s``: forward ``s`` is enqueued (the tail), then the result of
  forward ``s - 1`` is processed (frees, inserts, write-through), then
  batch ``s + 1`` is built (admission, load-backs, allocation). Tags are
  forward numbers; forward ``s - 1`` and older are complete at step ``s``.
* Pages are the trace's 512-token hash blocks: one radix node per hash id
  (a prefix chain), one page per node, plus ``ceil(output / 512)`` scratch
  pages per request freed when it finishes.
* The device pool is a :class:`~blockpool.integrations.sglang.account.PageAccount`
  (LIFO, as ``PagedTokenToKVPoolAllocator`` without ``need_sort``); the
  host pool is unbounded. Eviction is LRU over unlocked device leaves;
  an evicted node keeps its host copy (write-through backs every node up).
* Admission takes waiting requests in trace order (arrival times are not
  modelled) while ``max_running`` allows: device prefix hit, then a host
  hit (a load-back of its pages, after evicting for it), then new pages for
  the rest of the prompt and the output (``alloc_extend``). A request runs
  its prefill forward then ``ceil(output / decode_tokens)`` more forwards.
* Write-through of a request's new full prompt nodes happens when its
  prefill's result is processed (the prefill forward is their writer); a
  partial last node is written when the request finishes (its decode
  forwards wrote into it: the tail is its writer); the finished
  request releases its locks and scratch pages while the next forward,
  which may still include it, is in flight (their tag is that forward).

Tag sources (``tags``): ``"free"`` tags every release with the tail at
release (the first cut of the plugin) and every write with the tail;
``"node"`` tags an eviction's pages with the node's last use and a write
with its node's writer. Placement of loads (``placement``): ``"lifo"``
(SGLang's, the front of the free list) or ``"cold"`` (the back: pages
freed longest ago). A transfer is early when its fence is empty or older
than the tail (:func:`~blockpool.integrations.sglang.account.classify`):
under one forward in flight it may start that forward earlier, overlapping
it instead of waiting for it to end.

Simulated time (:class:`~blockpool.sim.costmodel.CostModel`, Llama-3.1-8B
on an H100; loads on its ``h2d`` stream): a forward computes its requests'
uncached prompt tokens and one token per decoding request, reading their
contexts. An early load's copy may start the in-flight forward's duration
sooner; the consumer forward's wait shrinks by at most ``min(copy, that
forward)``.

Run it: ``python -m blockpool.replay.sglang --trace "$(blockpool fetch-trace mooncake)"``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import deque
from collections.abc import Sequence

import attrs

from blockpool.core.errors import InvalidArgumentError
from blockpool.integrations.sglang.account import PageAccount, TransferCounters, classify
from blockpool.replay.traces import MOONCAKE_HASH_BLOCK_TOKENS, TraceRequest, read_trace
from blockpool.sim.costmodel import DEFAULT_STREAM_SPECS, CostModel

__all__ = ["SGLangReplayConfig", "SGLangReplayResult", "main", "replay_sglang", "tiny_workload"]


def _pos(_: object, a: attrs.Attribute, v: object) -> None:  # type: ignore[type-arg]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InvalidArgumentError(f"{a.name} must be an int >= 1, got {v!r}")


def _one_of(*names: str):  # type: ignore[no-untyped-def]
    def check(_: object, a: attrs.Attribute, v: object) -> None:  # type: ignore[type-arg]
        if v not in names:
            raise InvalidArgumentError(f"{a.name} must be one of {names}, got {v!r}")

    return check


@attrs.frozen(slots=True)
class SGLangReplayConfig:
    """Settings of :func:`replay_sglang`.

    Attributes:
        device_pages: Device KV pages (512-token hash blocks) of the pool.
        tags: ``"free"`` or ``"node"`` (see the module docstring).
        placement: ``"lifo"`` or ``"cold"`` for loads.
        max_running: Requests running at once.
        decode_tokens: Output tokens one forward stands for.

    Raises:
        InvalidArgumentError: a count ``< 1`` or an unknown name.
    """

    device_pages: int = attrs.field(default=2048, validator=_pos)
    tags: str = attrs.field(default="free", validator=_one_of("free", "node"))
    placement: str = attrs.field(default="lifo", validator=_one_of("lifo", "cold"))
    max_running: int = attrs.field(default=16, validator=_pos)
    decode_tokens: int = attrs.field(default=1, validator=_pos)


@attrs.frozen(slots=True)
class SGLangReplayResult:
    """What :func:`replay_sglang` counted.

    Attributes:
        counters: The transfers by verdict (``TransferCounters.as_dict()``).
        steps: Forwards run.
        requests: Requests served.
        skipped: Requests larger than the device pool (never admitted).
        evictions: Device nodes evicted.
        forward_s: Simulated seconds of all forwards
            (:meth:`~blockpool.sim.costmodel.CostModel.step_seconds`).
        load_s: Simulated seconds of all loads' copies (the ``h2d`` stream
            of :data:`~blockpool.sim.costmodel.DEFAULT_STREAM_SPECS`); under
            ``wait_stream`` each delays the forward that consumes it by up
            to that much.
        wait_saved_s: Over the early loads, the in-flight forward's
            duration: how much sooner each copy may start after its plan.
        stall_saved_s: Over the early loads, ``min(copy, in-flight
            forward)``: how much of the consumer forward's wait the overlap
            removes (an upper bound: SGLang's per-layer load events already
            let a forward start on the layers loaded).
    """

    counters: dict[str, int]
    steps: int
    requests: int
    skipped: int
    evictions: int
    forward_s: float = 0.0
    load_s: float = 0.0
    wait_saved_s: float = 0.0
    stall_saved_s: float = 0.0


class _Node:
    __slots__ = ("children", "device", "host", "last_use", "lock", "parent", "writer")

    def __init__(self, parent: _Node | None) -> None:
        self.parent = parent
        self.children = 0  # children on the device
        self.device = False
        self.host = False
        self.lock = 0
        self.last_use = 0
        self.writer = 0


class _Req:
    __slots__ = ("ctx", "end", "new", "nodes", "partial", "prefill", "scratch")

    def __init__(
        self, nodes: list[_Node], new: list[_Node], scratch: int, prefill: int, end: int, ctx: int
    ) -> None:
        self.nodes, self.new, self.scratch, self.prefill, self.end = nodes, new, scratch, prefill, end
        self.ctx = ctx
        self.partial: _Node | None = None


def replay_sglang(
    requests: Sequence[TraceRequest], config: SGLangReplayConfig | None = None
) -> SGLangReplayResult:
    """Replay ``requests`` (Mooncake-style: ``segments`` are hash blocks)
    through the model in the module docstring and count every load and
    write-through by :func:`~blockpool.integrations.sglang.account.classify`.
    Deterministic. O(steps + requests * blocks * log(nodes)).

    Raises:
        InvalidArgumentError: ``config`` is not a :class:`SGLangReplayConfig`.
    """
    cfg = SGLangReplayConfig() if config is None else config
    if not isinstance(cfg, SGLangReplayConfig):
        raise InvalidArgumentError(f"config must be an SGLangReplayConfig, got {config!r}")
    acct: PageAccount[int] = PageAccount(cfg.device_pages, name="replay")
    counters = TransferCounters()
    tree: dict[tuple[int, ...], _Node] = {}
    heap: list[tuple[int, int, _Node]] = []  # (last_use, seq, node), lazily checked
    seq = 0
    evictions = 0
    waiting = deque(requests)
    running: list[_Req] = []
    served = skipped = 0
    step = 0
    cost = CostModel()
    h2d = DEFAULT_STREAM_SPECS["h2d"]
    dur: dict[int, float] = {}
    load_s = wait_saved = stall_saved = 0.0

    def evictable(n: _Node) -> bool:
        return n.device and n.lock == 0 and n.children == 0

    def push(n: _Node) -> None:
        nonlocal seq
        if evictable(n):
            seq += 1
            heapq.heappush(heap, (n.last_use, seq, n))

    def evict(need: int, tail: int) -> None:
        nonlocal evictions
        while acct.free_len < need and heap:
            use, _, n = heapq.heappop(heap)
            if not evictable(n) or use != n.last_use:
                continue
            n.device = False
            evictions += 1
            acct.release(1, n.last_use if cfg.tags == "node" else tail)
            if n.parent is not None:
                n.parent.children -= 1
                push(n.parent)

    while waiting or running:
        step += 1
        tail = step  # forward `step` is enqueued: the tail
        # 1. the result of forward step - 1: write-through of prefills, finishes
        for r in running:
            if r.prefill == step - 1:
                for n in r.new:
                    if not n.host and n is not r.partial:
                        w = n.writer if cfg.tags == "node" else tail
                        counters.record("write", 1, classify(frozenset({w}), tail))
                        n.host = True
        done = [r for r in running if r.end == step - 1]
        running = [r for r in running if r.end != step - 1]
        for r in done:  # forward `step` may still include it: tag with the tail
            if r.partial is not None and not r.partial.host:  # decode wrote into it: the tail
                counters.record("write", 1, classify(frozenset({tail}), tail))
                r.partial.host = True
            acct.release(r.scratch, tail)
            for n in r.nodes:
                n.lock -= 1
                n.last_use = tail
                push(n)
            served += 1
        # 2. build batch step + 1
        prefill_tokens = 0
        while waiting and len(running) < cfg.max_running:
            req = waiting[0]
            blocks = [cid for cid, _ in req.segments]
            scratch = math.ceil(req.output_tokens / MOONCAKE_HASH_BLOCK_TOKENS)
            if len(blocks) + scratch > cfg.device_pages:
                waiting.popleft()
                skipped += 1
                continue
            nodes: list[_Node] = []
            key: tuple[int, ...] = ()
            parent: _Node | None = None
            hits = loads = 0
            for cid in blocks:
                key = (*key, cid)
                node = tree.get(key)
                if node is None:
                    node = tree[key] = _Node(parent)
                nodes.append(node)
                parent = node
            while hits < len(nodes) and nodes[hits].device:
                hits += 1
            while hits + loads < len(nodes) and nodes[hits + loads].host and not nodes[hits + loads].device:
                loads += 1
            for n in nodes[:hits]:
                n.lock += 1
            need = len(nodes) - hits + scratch
            evict(need, tail)
            if acct.free_len < need:
                for n in nodes[:hits]:
                    n.lock -= 1
                    push(n)
                break
            waiting.popleft()
            if loads:
                fence = acct.take_back(loads) if cfg.placement == "cold" else acct.take(loads)
                verdict = classify(fence, tail)
                counters.record("load", loads, verdict)
                t_load = h2d.transfer_seconds(loads * MOONCAKE_HASH_BLOCK_TOKENS * cost.kv_bytes_per_token)
                load_s += t_load
                if verdict == "early":
                    wait_saved += dur.get(step, 0.0)
                    stall_saved += min(t_load, dur.get(step, 0.0))
            acct.take(len(nodes) - hits - loads + scratch)
            new = []
            for i, n in enumerate(nodes[hits:], start=hits):
                n.device = True
                n.lock += 1
                if n.parent is not None:
                    n.parent.children += 1
                if i >= hits + loads:
                    n.writer = step + 1
                    new.append(n)
            end = step + 1 + math.ceil(req.output_tokens / cfg.decode_tokens)
            prefill_tokens += sum(n for _, n in req.segments[hits + loads :])
            running.append(_Req(nodes, new, scratch, step + 1, end, req.prompt_tokens))
            if req.segments[-1][1] < MOONCAKE_HASH_BLOCK_TOKENS and nodes[-1] in new:
                running[-1].partial = nodes[-1]
        if running:
            decoding = sum(1 for r in running if r.prefill < step + 1)
            dur[step + 1] = cost.step_seconds(prefill_tokens + decoding, sum(r.ctx for r in running))
    return SGLangReplayResult(
        counters.as_dict(),
        step,
        served,
        skipped,
        evictions,
        sum(dur.values()),
        load_s,
        wait_saved,
        stall_saved,
    )


def tiny_workload() -> list[TraceRequest]:
    """Six requests of a two-turn chat over four pages of prefix each, in
    an order that evicts the first conversation and loads it back. O(1)."""
    b = MOONCAKE_HASH_BLOCK_TOKENS
    chains = [
        (1, 2, 3, 4),
        (10, 11, 12, 13),
        (1, 2, 3, 4, 5),
        (20, 21, 22, 23),
        (10, 11, 12, 13, 14),
        (1, 2, 3, 4, 5, 6),
    ]
    return [
        TraceRequest(i, 0.0, b * len(c), 64, tuple((h, b) for h in c), -(i + 1)) for i, c in enumerate(chains)
    ]


def _table(requests: Sequence[TraceRequest], device_pages: int, max_running: int) -> str:
    rows = [
        (
            "| tags | placement | loads | early | load pages early | copy starts sooner by (mean) "
            "| load stall removed | write-throughs | early |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(a: float, b: float) -> str:
        return f"{100 * a / b:.1f}%" if b else "0%"

    r = None
    for tags in ("free", "node"):
        for placement in ("lifo", "cold"):
            cfg = SGLangReplayConfig(
                device_pages=device_pages, tags=tags, placement=placement, max_running=max_running
            )
            r = replay_sglang(requests, cfg)
            c = r.counters
            sooner = f"{1e3 * r.wait_saved_s / c['loads_early']:.2f} ms" if c["loads_early"] else "-"
            rows.append(
                f"| {tags} | {placement} | {c['loads']} | {c['loads_early']} ({pct(c['loads_early'], c['loads'])}) "
                f"| {pct(c['load_pages_early'], c['load_pages'])} | {sooner} "
                f"| {pct(r.stall_saved_s, r.load_s)} of {r.load_s:.3f} s "
                f"| {c['writes']} | {c['writes_early']} ({pct(c['writes_early'], c['writes'])}) |"
            )
    assert r is not None
    rows.append(
        f"\n{r.requests} requests ({r.skipped} too large), {r.steps} forwards "
        f"({r.forward_s:.1f} s simulated), {r.evictions} evictions, {device_pages} device pages of "
        f"{MOONCAKE_HASH_BLOCK_TOKENS} tokens, {max_running} running at most"
    )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m blockpool.replay.sglang [--trace PATH] [--limit N]
    [--device-pages N] [--max-running N] [--json]``: print the table of loads and
    write-throughs an exact fence lets start before the stream tail, for
    both tag sources and both placements (the tiny built-in workload when
    no trace is given). Returns 0."""
    p = argparse.ArgumentParser(prog="python -m blockpool.replay.sglang", description=main.__doc__)
    p.add_argument("--trace", help="a Mooncake trace (.jsonl)")
    p.add_argument("--limit", type=int, default=2000, help="requests read from the trace (default 2000)")
    p.add_argument("--device-pages", type=int, default=2048, help="device pages of 512 tokens (default 2048)")
    p.add_argument("--max-running", type=int, default=16, help="requests running at once (default 16)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per tag source and placement instead of the table",
    )
    a = p.parse_args(argv)
    reqs = list(read_trace(a.trace, limit=a.limit).requests) if a.trace else tiny_workload()
    if not a.json:
        print(_table(reqs, a.device_pages, a.max_running))
        return 0
    for tags in ("free", "node"):
        for placement in ("lifo", "cold"):
            cfg = SGLangReplayConfig(a.device_pages, tags, placement, a.max_running)
            print(
                json.dumps(
                    {"config": attrs.asdict(cfg), **attrs.asdict(replay_sglang(reqs, cfg))}, sort_keys=True
                )
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
