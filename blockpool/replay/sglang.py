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

With ``--audit`` (``driver="plugin"``) the allocator's list model, a
stand-in HiCache controller and a stand-in radix cache go through the
plugin's own hooks in audit mode (the plugin tags an eviction's pages with
the node's last use, and a write with the tail at ``write``), and the
plugin's counters are printed.

Run it: ``python -m blockpool.replay.sglang --trace "$(blockpool fetch-trace mooncake)"``
(add ``--audit`` for the plugin's counters).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

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
        driver: ``"account"`` (the replay feeds a
            :class:`~blockpool.integrations.sglang.account.PageAccount`
            itself) or ``"plugin"`` (the plugin's own allocator and
            controller and radix-node hooks, in audit mode, around a list
            model of the allocator, a stand-in controller and a stand-in
            radix cache; node tags and LIFO only, as the plugin does).

    Raises:
        InvalidArgumentError: a count ``< 1``, an unknown name, or the
            plugin driver with free-time tags or cold-first placement.
    """

    device_pages: int = attrs.field(default=2048, validator=_pos)
    tags: str = attrs.field(default="free", validator=_one_of("free", "node"))
    placement: str = attrs.field(default="lifo", validator=_one_of("lifo", "cold"))
    max_running: int = attrs.field(default=16, validator=_pos)
    decode_tokens: int = attrs.field(default=1, validator=_pos)
    driver: str = attrs.field(default="account", validator=_one_of("account", "plugin"))

    def __attrs_post_init__(self) -> None:
        if self.driver == "plugin" and (self.tags, self.placement) != ("node", "lifo"):
            raise InvalidArgumentError(
                "the plugin tags an eviction's pages with the node's last use and places as SGLang does: "
                "tags='node', placement='lifo'"
            )


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
        audit: With the plugin driver, the plugin's audit counters
            (``Counters.as_dict()`` of
            :mod:`blockpool.integrations.sglang.hooks`: transfer batches,
            one per step and direction); else ``None``.
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
    audit: dict[str, int] | None = None


class _Node:
    __slots__ = ("children", "device", "host", "id", "last_use", "lock", "page", "parent", "writer")

    def __init__(self, parent: _Node | None, node_id: int = 0) -> None:
        self.id = node_id
        self.parent = parent
        self.children = 0  # children on the device
        self.device = False
        self.host = False
        self.lock = 0
        self.last_use = 0
        self.writer = 0
        self.page = 0


class _Req:
    __slots__ = ("ctx", "end", "new", "nodes", "partial", "prefill", "scratch")

    def __init__(
        self, nodes: list[_Node], new: list[_Node], scratch: list[int], prefill: int, end: int, ctx: int
    ) -> None:
        self.nodes, self.new, self.scratch, self.prefill, self.end = nodes, new, scratch, prefill, end
        self.ctx = ctx
        self.partial: _Node | None = None


class _Ids(list):  # type: ignore[type-arg]
    """Page ids on the host with ``numel()`` (what the plugin's hooks read
    of a tensor)."""

    def numel(self) -> int:
        return len(self)


class _Alloc:
    """``PagedTokenToKVPoolAllocator`` without ``need_sort`` at page size 1,
    over a host list: ``alloc`` takes from the front, ``_release_page_ids``
    prepends (LIFO). The page ids let the plugin's hooks run on it."""

    need_sort = False
    num_staged_pages = 0
    free_group = None

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.clear()

    def clear(self) -> None:
        self.free_pages: list[int] = list(range(1, self.num_pages + 1))

    def alloc(self, need_size: int) -> _Ids | None:
        if need_size > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:need_size], self.free_pages[need_size:]
        return _Ids(out)

    def alloc_back(self, need_size: int) -> _Ids:
        cut = len(self.free_pages) - need_size
        out, self.free_pages = self.free_pages[cut:], self.free_pages[:cut]
        return _Ids(out)

    def _release_page_ids(self, *page_ids: list[int]) -> None:
        self.free_pages = [p for ids in page_ids for p in ids] + self.free_pages

    def merge_and_sort_free(self) -> None:
        return


class _Op:
    """A queued HiCache operation (no side-pool transfers)."""

    pool_transfers = None


class _Controller:
    """The part of ``HiCacheController`` the plugin's hooks touch: the two
    queues, the fence streams, and ``load`` allocating device pages."""

    def __init__(self, alloc: _Alloc, stream: Any) -> None:
        self.alloc = alloc
        self.load_queue: list[_Op] = []
        self.write_queue: list[_Op] = []
        self.load_fence_stream = self.write_fence_stream = stream

    def load(self, host_indices: _Ids) -> _Ids | None:
        ids = self.alloc.alloc(len(host_indices))
        if ids is not None:
            self.load_queue.append(_Op())
        return ids

    def write(self, device_indices: _Ids) -> None:
        self.write_queue.append(_Op())

    def start_loading(self) -> int:
        self.load_queue.clear()
        return 0

    def start_writing(self) -> None:
        self.write_queue.clear()


class _PathInfo:
    """A node on a root-to-node path, as ``TreePathNodeInfo`` names it."""

    __slots__ = ("full_value_len", "node_id")

    def __init__(self, node: _Node) -> None:
        self.node_id = node.id
        self.full_value_len = 1 if node.device else None  # one page of one (page-sized) token


class _Full:
    name = "FULL"


class _Cache:
    """The part of ``UnifiedRadixCache`` (and its tree core) the plugin's
    radix-node hooks touch: a FULL-only cache over :class:`_Alloc`, the
    root-to-node paths of the replay's nodes, and the lock release, insert
    and leaf eviction the hooks wrap."""

    disable = False
    tree_components = (_Full(),)
    buffer_pipeline = None
    enable_session_radix_cache = False

    def __init__(self, alloc: _Alloc, nodes: dict[int, _Node]) -> None:
        self.token_to_kv_pool_allocator = alloc
        self.nodes = nodes
        self.tree_core = self

    def collect_path_info(self, ids: Sequence[int]) -> tuple[tuple[_PathInfo, ...], ...]:
        paths = []
        for i in ids:
            chain = []
            node: _Node | None = self.nodes[i]
            while node is not None:
                chain.append(_PathInfo(node))
                node = node.parent
            paths.append(tuple(reversed(chain)))
        return tuple(paths)

    def dec_lock_ref(self, node_id: int) -> None:
        return None

    def insert(self, node_id: int) -> Any:
        return _Inserted(node_id)

    def _evict_device_leaf(self, node_id: int, tracker: Any) -> None:
        self.token_to_kv_pool_allocator._release_page_ids(_Ids([self.nodes[node_id].page]))


class _Inserted:
    __slots__ = ("last_device_node",)

    def __init__(self, node_id: int) -> None:
        self.last_device_node = node_id


class _Plugin:
    """The plugin's own hooks (:mod:`blockpool.integrations.sglang.hooks`
    and ``controllers``) in audit mode around :class:`_Alloc` and
    :class:`_Controller`, with a forward stream whose event recorded while
    forward ``t`` is the tail completes once forward ``t + 1`` is
    enqueued (one forward in flight)."""

    def __init__(self, alloc: _Alloc, nodes: dict[int, _Node]) -> None:
        from blockpool.integrations.sglang import controllers, hooks, tree

        self.hooks, self.controllers = hooks, controllers
        self.now = 0
        self.ticks: dict[int, int] = {}
        plugin = self

        class Event:
            __slots__ = ("tick",)

            def __init__(self, tick: int) -> None:
                self.tick = tick

            def query(self) -> bool:
                return self.tick < plugin.now

        class Stream:
            def record_event(self) -> Event:
                plugin.ticks[rt._seq + 1] = plugin.now
                return Event(plugin.now)

        rt = self.rt = hooks.Runtime("audit")
        rt.armed = True
        rt._paged_cls = _Alloc
        rt.launch_hooked = True
        self.controller = _Controller(alloc, Stream())
        rt.bind(self.controller.load_fence_stream)
        self._previous = hooks.runtime()
        for name, hook in (
            ("alloc", hooks.hook_alloc),
            ("_release_page_ids", hooks.hook_release),
            ("merge_and_sort_free", hooks.hook_merge),
            ("clear", hooks.hook_clear),
        ):
            setattr(alloc, name, functools.partial(hook, getattr(_Alloc, name), alloc))
        c = self.controller
        c.load = functools.partial(controllers.hook_load, _Controller.load, c)  # type: ignore[method-assign]
        c.write = functools.partial(controllers.hook_write, _Controller.write, c)  # type: ignore[method-assign]
        self.cache = cache = _Cache(alloc, nodes)
        for name, hook in (
            ("dec_lock_ref", tree.hook_dec_lock_ref),
            ("insert", tree.hook_insert),
            ("_evict_device_leaf", tree.hook_evict_leaf),
        ):
            setattr(cache, name, functools.partial(hook, getattr(_Cache, name), cache))
        hooks.set_runtime(rt)
        alloc.clear()  # the account starts here, as at the allocator's construction

    def launch(self, step: int) -> None:
        self.now = step
        self.hooks.hook_run_batch(lambda _scheduler: None, None)  # one forward launched: run_batch's hook

    def _verdict(self, op: _Op, tail: int) -> Literal["early", "tail", "unknown"]:
        fence = self.rt.op_fences.get(op)
        if fence is not None:
            fence = self.rt.effective_fence(fence)  # launch tokens; None while one is provisional
        return classify(None if fence is None else frozenset(self.ticks[t] for t in fence), tail)

    def load(self, n: int, tail: int) -> tuple[_Ids, str]:
        ids = self.controller.load(_Ids(range(n)))
        assert ids is not None  # the caller made room
        return ids, self._verdict(self.controller.load_queue[-1], tail)

    def write(self, tail: int) -> str:
        self.controller.write(_Ids([0]))
        return self._verdict(self.controller.write_queue[-1], tail)

    def finish(self, node: _Node) -> None:
        """A finished request's insert and lock release, ``node`` its
        deepest node."""
        self.cache.insert(node.id)
        self.cache.dec_lock_ref(node.id)

    def evict(self, node: _Node) -> None:
        self.cache._evict_device_leaf(node.id, None)

    def flush(self) -> None:
        c = self.controller
        self.controllers.hook_start_writing(_Controller.start_writing, c)
        self.controllers.hook_start_loading(_Controller.start_loading, c)

    def close(self) -> dict[str, int]:
        self.hooks.set_runtime(self._previous)
        return self.rt.counters.as_dict()


def replay_sglang(
    requests: Sequence[TraceRequest], config: SGLangReplayConfig | None = None
) -> SGLangReplayResult:
    """Replay ``requests`` (Mooncake-style: ``segments`` are hash blocks)
    through the model in the module docstring and count every load and
    write-through by :func:`~blockpool.integrations.sglang.account.classify`.
    With ``driver="plugin"`` the allocator and the transfers go through the
    plugin's own hooks in audit mode, whose counters are returned as
    ``audit``. Deterministic. O(steps + requests * blocks * (log(nodes) +
    device_pages)).

    Raises:
        InvalidArgumentError: ``config`` is not a :class:`SGLangReplayConfig`.
    """
    cfg = SGLangReplayConfig() if config is None else config
    if not isinstance(cfg, SGLangReplayConfig):
        raise InvalidArgumentError(f"config must be an SGLangReplayConfig, got {config!r}")
    acct: PageAccount[int] = PageAccount(cfg.device_pages, name="replay")
    alloc = _Alloc(cfg.device_pages)
    by_id: dict[int, _Node] = {}
    plugin = _Plugin(alloc, by_id) if cfg.driver == "plugin" else None
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

    def release(ids: list[int], tag: int) -> None:
        if ids:
            alloc._release_page_ids(_Ids(ids))
            if plugin is None:
                acct.release(len(ids), tag)

    def take(n: int) -> _Ids:
        ids = alloc.alloc(n)
        assert ids is not None  # the caller made room
        if plugin is None:
            acct.take(n)
        return ids

    def write(n: _Node, tail: int) -> None:
        if plugin is not None:
            verdict = plugin.write(tail)
        else:
            verdict = classify(frozenset({n.writer if cfg.tags == "node" else tail}), tail)
        counters.record("write", 1, verdict)  # type: ignore[arg-type]
        n.host = True

    def evict(need: int, tail: int) -> None:
        nonlocal evictions
        while len(alloc.free_pages) < need and heap:
            use, _, n = heapq.heappop(heap)
            if not evictable(n) or use != n.last_use:
                continue
            evictions += 1
            if plugin is not None:
                plugin.evict(n)  # the node's page, while it is still on the device
                n.device = False
            else:
                n.device = False
                release([n.page], n.last_use if cfg.tags == "node" else tail)
            if n.parent is not None:
                n.parent.children -= 1
                push(n.parent)

    try:
        while waiting or running:
            step += 1
            tail = step  # forward `step` is enqueued: the tail
            if plugin is not None:
                plugin.launch(step)
            # 1. the result of forward step - 1: write-through of prefills, finishes
            for r in running:
                if r.prefill == step - 1:
                    for n in r.new:
                        if not n.host and n is not r.partial:
                            n.writer = step - 1
                            write(n, tail)
            done = [r for r in running if r.end == step - 1]
            running = [r for r in running if r.end != step - 1]
            for r in done:  # forward `step` may still include it: tag with the tail
                if r.partial is not None and not r.partial.host:  # decode wrote into it: the tail
                    r.partial.writer = tail
                    write(r.partial, tail)
                release(r.scratch, tail)
                if plugin is not None and r.nodes:
                    plugin.finish(r.nodes[-1])
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
                        node = tree[key] = _Node(parent, len(by_id) + 1)
                        by_id[node.id] = node
                    nodes.append(node)
                    parent = node
                while hits < len(nodes) and nodes[hits].device:
                    hits += 1
                while (
                    hits + loads < len(nodes) and nodes[hits + loads].host and not nodes[hits + loads].device
                ):
                    loads += 1
                for n in nodes[:hits]:
                    n.lock += 1
                need = len(nodes) - hits + scratch
                evict(need, tail)
                if len(alloc.free_pages) < need:
                    for n in nodes[:hits]:
                        n.lock -= 1
                        push(n)
                    break
                waiting.popleft()
                loaded: list[int] = []
                if loads:
                    verdict: Literal["early", "tail", "unknown"]
                    if plugin is not None:
                        loaded, verdict = plugin.load(loads, tail)  # type: ignore[assignment]
                    elif cfg.placement == "cold":
                        loaded = alloc.alloc_back(loads)
                        verdict = classify(acct.take_back(loads), tail)
                    else:
                        loaded = alloc.alloc(loads)  # type: ignore[assignment]
                        verdict = classify(acct.take(loads), tail)
                    counters.record("load", loads, verdict)
                    t_load = h2d.transfer_seconds(
                        loads * MOONCAKE_HASH_BLOCK_TOKENS * cost.kv_bytes_per_token
                    )
                    load_s += t_load
                    if verdict == "early":
                        wait_saved += dur.get(step, 0.0)
                        stall_saved += min(t_load, dur.get(step, 0.0))
                ids = loaded + take(len(nodes) - hits - loads + scratch)
                new = []
                for i, n in enumerate(nodes[hits:], start=hits):
                    n.page = ids[i - hits]
                    n.device = True
                    n.lock += 1
                    if n.parent is not None:
                        n.parent.children += 1
                    if i >= hits + loads:
                        new.append(n)
                end = step + 1 + math.ceil(req.output_tokens / cfg.decode_tokens)
                prefill_tokens += sum(n for _, n in req.segments[hits + loads :])
                r = _Req(nodes, new, ids[len(nodes) - hits :], step + 1, end, req.prompt_tokens)
                running.append(r)
                if req.segments[-1][1] < MOONCAKE_HASH_BLOCK_TOKENS and nodes[-1] in new:
                    r.partial = nodes[-1]
            if plugin is not None:
                plugin.flush()
            if running:
                decoding = sum(1 for r in running if r.prefill < step + 1)
                dur[step + 1] = cost.step_seconds(prefill_tokens + decoding, sum(r.ctx for r in running))
    finally:
        audit = plugin.close() if plugin is not None else None
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
        audit,
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
    [--device-pages N] [--max-running N] [--json | --audit]``: print the table of loads and
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
    p.add_argument(
        "--audit",
        action="store_true",
        help="run the plugin's own hooks in audit mode (node tags, LIFO) and print their counters as JSON",
    )
    a = p.parse_args(argv)
    reqs = list(read_trace(a.trace, limit=a.limit).requests) if a.trace else tiny_workload()
    if a.audit:
        cfg = SGLangReplayConfig(a.device_pages, "node", max_running=a.max_running, driver="plugin")
        print(
            json.dumps(
                {"config": attrs.asdict(cfg), **attrs.asdict(replay_sglang(reqs, cfg))}, sort_keys=True
            )
        )
        return 0
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
