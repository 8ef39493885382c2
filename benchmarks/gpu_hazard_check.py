#!/usr/bin/env python3
"""GPU hazard check: do the pool's fences order real CUDA work, and what do they cost?

Run from a checkout, no install step (needs torch, attrs, sortedcontainers)::

    PYTHONPATH=. python benchmarks/gpu_hazard_check.py

Prints ONE JSON object on stdout (progress goes to stderr); exit status 0
when every sub-check ran and every fenced run kept the data intact, 1
otherwise. Without a CUDA GPU it prints
``gpu_hazard_check: skipped: no CUDA GPU available`` and exits 0. A
watchdog prints the JSON gathered so far and exits 3 if the run passes
``WATCHDOG_S`` seconds. ``--dry-run-cpu`` runs the same control flow on the
CPU stand-in streams of :mod:`blockpool.worker.standins` (side streams run
at once, compute only when waited on: the GPU's timing in caricature), for
the CPU tests.

Sub-checks (each fenced run is repeated with the fence dropped, and
``corruption_observed`` is what the data showed, not an assumption):

``war_free_then_reload``
    A paged KV tensor; on ``compute``: a delay (``torch.cuda._sleep``) then a
    read of K blocks into a checksum (step token ``e``). The blocks are freed
    with ``token=e`` while the read is still queued, re-allocated through
    ``HazardAwareBlockPool.allocate_for``/``begin_load`` for a load on the
    ``h2d`` stream, which waits on the fence (``stream.wait_event``) and then
    copies a known pattern in from pinned host memory (``non_blocking=True``).
    Checks that the read saw the old data and the blocks hold the pattern.
``cow_then_load``
    The contract's race: a copy-on-write copy ``s -> d`` enqueued on
    ``compute`` behind a delay; a background receive thread loads into ``d``
    (``begin_load`` on a ``HOST`` engine), waiting on the fence with
    ``event.synchronize()``. Checks that ``d`` ends with the loaded data.
``offload_store_then_reload``
    The Offloading connector's cross-direction reuse, through the plugin's
    own worker wrapper (``blockpool.integrations.vllm.worker.offload_transfer_async``)
    around a handler with vLLM 0.33's ``transfer_async`` ordering (a stream
    of its own per direction, ``wait_stream`` on the current stream, each job
    after the previous one of its handler): a d2h store job of K blocks
    (slowed by a delay on its copy stream) still reads them when they are
    re-allocated for an h2d load job. vLLM's ``wait_stream(compute)`` barrier
    does not order the load after the store; the fence (``offload_d2h:1``)
    does. Checks that the stored copy holds the old data and the blocks the
    loaded pattern.
``load_start_delay_ms``
    Step N-1 (short) reads blocks B, step N (long) follows; B is freed with
    step N-1's token and re-allocated for a load on ``h2d``. Time from the
    load's request (an event on an idle stream) to the load's start on the
    GPU (an event on ``h2d``, ``elapsed_time``), when the load waits on the
    exact fence, on the whole of step N ("step done" event), or behind a
    device-wide ``torch.cuda.synchronize()`` (the only device-wide call in
    this file, and only as that baseline).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

SKIP_LINE = "gpu_hazard_check: skipped: no CUDA GPU available"
WATCHDOG_S = 150.0
NUM_BLOCKS = 64
K = 8  # blocks per access
BLOCK_SHAPE = (2, 16, 1024)  # (key/value, tokens per block, heads * head size): 128 KiB fp32
HAZARD_DELAY_MS = 50.0  # compute stays busy this long before the read / the copy
SHORT_STEP_MS = 2.0
LONG_STEP_MS = 20.0
TRIALS = 5
WAIT_S = 60.0  # bound on every host wait and thread join

RESULT: dict[str, Any] = {"check": "gpu_hazard_check", "errors": []}
_emitted = threading.Lock()


def log(msg: str) -> None:
    print(f"[gpu_hazard_check] {msg}", file=sys.stderr, flush=True)


def emit() -> bool:
    """Print the JSON once per run (whoever comes first: main or the
    watchdog); False if it was already printed."""
    if not _emitted.acquire(blocking=False):
        return False
    sys.stdout.write(json.dumps(RESULT, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()
    return True


def on_watchdog() -> None:
    RESULT["errors"].append(f"watchdog: the check ran past {WATCHDOG_S:g}s; partial results")
    if emit():
        os._exit(3)  # the main thread may be stuck in a device call


def error(where: str, exc: BaseException) -> None:
    RESULT["errors"].append(f"{where}: {type(exc).__name__}: {exc}")
    log(f"{where} failed:\n{traceback.format_exc()}")


# ----------------------------------------------------------------------------
# the device: real CUDA, or CPU stand-ins for a dry run of the control flow
# ----------------------------------------------------------------------------


class Gpu:
    """Every device call of the check goes through here."""

    def __init__(self, torch: Any, dry_run: bool) -> None:
        self.torch = torch
        self.dry = dry_run
        if dry_run:
            from blockpool.worker.standins import StandInDevice

            self.standin = StandInDevice()
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cycles_per_ms = 0.0
        self._current: list[Any] = []
        self.compute = self.stream("compute")
        self.h2d = self.stream("h2d")
        self.recv = self.stream("recv")
        self.marker = self.stream("marker")  # idle: an event on it marks "now"

    def stream(self, name: str) -> Any:
        return self.standin.new_stream(name) if self.dry else self.torch.cuda.Stream()

    def event_factory(self) -> Callable[[], Any]:
        if self.dry:
            return self.standin.new_event
        from blockpool.worker.torch_events import event_factory

        return event_factory("cuda")

    def timing_event(self) -> Any:
        return self.standin.new_event() if self.dry else self.torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, a: Any, b: Any) -> float | None:
        return None if self.dry else float(a.elapsed_time(b))

    def enqueue(self, stream: Any, fn: Callable[[], object]) -> None:
        """Enqueue ``fn``'s work on ``stream``. Dry run: side streams run what
        they can at once, ``compute`` only when someone waits on it."""
        if self.dry:
            stream.enqueue(fn)
            if stream is not self.compute:
                stream.run()
            return
        with self.torch.cuda.stream(stream):
            fn()

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        if self.dry:
            self._current.append(stream)
            try:
                yield
            finally:
                self._current.pop()
            return
        with self.torch.cuda.stream(stream):
            yield

    def current_stream(self) -> Any:
        """The calling code's current stream (``compute`` outside ``on``)."""
        if self.dry:
            return self._current[-1] if self._current else self.compute
        return self.torch.cuda.current_stream()

    def delay(self, stream: Any, ms: float) -> None:
        if self.dry:
            if stream is not self.compute and ms > 0:
                # A side stream runs at once here: hold it behind a point of
                # compute, which runs only when someone waits on it.
                self.compute.enqueue(lambda: None)
                ev = self.standin.new_event()
                ev.record(self.compute)
                stream.wait_event(ev)
            return
        cycles = max(1, int(ms * self.cycles_per_ms))
        self.enqueue(stream, lambda: self.torch.cuda._sleep(cycles))

    def calibrate(self) -> None:
        """Measure GPU cycles per ms of ``torch.cuda._sleep``."""
        if self.dry:
            return
        n = 20_000_000
        for _ in range(2):  # the first warms the clocks up
            a, b = self.timing_event(), self.timing_event()
            a.record(self.compute)
            self.enqueue(self.compute, lambda: self.torch.cuda._sleep(n))
            b.record(self.compute)
            b.synchronize()
            ms = a.elapsed_time(b)
        self.cycles_per_ms = n / max(float(ms), 1e-3)

    def pinned(self, t: Any) -> Any:
        return t if self.dry else t.pin_memory()

    def index(self, ids: list[int]) -> Any:
        """A block-id index tensor on the device, made on ``compute`` and
        waited for now (a host->device copy of a pageable list blocks until
        its stream is idle: make it before any delay is enqueued)."""
        box: dict[str, Any] = {}
        self.enqueue(self.compute, lambda: box.setdefault("idx", self.torch.tensor(ids, device=self.device)))
        self.compute.synchronize()
        return box["idx"]

    def device_synchronize(self) -> None:
        if self.dry:
            self.standin.run()
        else:
            self.torch.cuda.synchronize()

    def drain(self) -> None:
        """Every stream of the check finished (stream by stream)."""
        for s in (self.compute, self.h2d, self.recv, self.marker):
            s.synchronize()


# ----------------------------------------------------------------------------
# sub-checks
# ----------------------------------------------------------------------------


class Buffers:
    """The paged KV tensor and the pinned host data, made once up front (no
    allocation that might synchronize happens while a delay is queued)."""

    def __init__(self, gpu: Gpu) -> None:
        torch = gpu.torch
        box: dict[str, Any] = {}
        shape = (NUM_BLOCKS, *BLOCK_SHAPE)
        gpu.enqueue(gpu.compute, lambda: box.setdefault("kv", torch.zeros(shape, device=gpu.device)))
        gpu.compute.synchronize()
        self.kv = box["kv"]
        # the known pattern a load copies in: block j of an access holds 1000 + j
        self.pattern = gpu.pinned(torch.stack([torch.full(BLOCK_SHAPE, 1000.0 + j) for j in range(K)]))
        self.remote = gpu.pinned(torch.full(BLOCK_SHAPE, 5.0))
        # warm the caching allocator for the reads the checks enqueue behind delays
        idx = gpu.index(list(range(1, K + 1)))
        for _ in range(2):
            gpu.enqueue(
                gpu.compute,
                lambda: box.setdefault("w", []).append(
                    (
                        self.kv.index_select(0, idx).sum(dtype=torch.float64),
                        self.kv.index_select(0, idx).sum(),
                    )
                ),
            )
        gpu.compute.synchronize()
        box.clear()


def block_elems() -> int:
    n = 1
    for x in BLOCK_SHAPE:
        n *= x
    return n


def war_free_then_reload(gpu: Gpu, buf: Buffers, use_fence: bool) -> dict[str, Any]:
    from blockpool import Fence, HazardAwareBlockPool, StreamKind
    from blockpool.worker.torch_events import EventLedger

    torch = gpu.torch
    pool = HazardAwareBlockPool(
        NUM_BLOCKS, enable_caching=False, streams={"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE}
    )
    ledger = EventLedger(gpu.event_factory(), streams={"compute": gpu.compute, "h2d": gpu.h2d})
    kv, pattern = buf.kv, buf.pattern
    blocks, _ = pool.allocate_for(K, "compute")
    ids = [b.block_id for b in blocks]
    idx = gpu.index(ids)

    def old_data() -> None:
        for i in ids:
            kv[i].fill_(float(i + 1))

    gpu.enqueue(gpu.compute, old_data)
    gpu.compute.synchronize()
    expected_old = float(sum((i + 1) * block_elems() for i in ids))

    # step N on compute: busy, then reads the blocks into a checksum
    box: dict[str, Any] = {}

    def read() -> None:
        box["checksum"] = kv.index_select(0, idx).sum(dtype=torch.float64)

    gpu.delay(gpu.compute, HAZARD_DELAY_MS)
    gpu.enqueue(gpu.compute, read)
    e = pool.issue("compute")
    ledger.record(e)
    pool.free_blocks(blocks, token=e)  # freed while the read is still queued

    # re-allocated for a load on h2d
    new_blocks, alloc_fence = pool.allocate_for(K, "h2d")
    load_tok, load_fence = pool.begin_load(new_blocks, "h2d")
    fence = alloc_fence.merge(load_fence)
    new_ids = [b.block_id for b in new_blocks]
    waited = ledger.wait_device(fence, gpu.h2d) if use_fence else ()

    def load() -> None:
        for j, bid in enumerate(new_ids):
            kv[bid].copy_(pattern[j], non_blocking=True)

    gpu.enqueue(gpu.h2d, load)
    ledger.record(load_tok)
    ledger.wait_host(Fence([e, load_tok]), timeout=WAIT_S)  # exactly those two events
    with gpu.on(gpu.compute):
        got = float(box["checksum"].item())
        loaded = all(bool(torch.equal(kv[bid].cpu(), pattern[j].cpu())) for j, bid in enumerate(new_ids))
    out = {
        "fence": [str(t) for t in fence],
        "waited_on": [str(t) for t in waited],
        "reused_same_blocks": sorted(new_ids) == sorted(ids),
        "read_saw_old_data": got == expected_old,
        "load_landed": loaded,
        "corruption_observed": got != expected_old or not loaded,
    }
    if not out["reused_same_blocks"] or not fence:
        RESULT["errors"].append(
            f"war_free_then_reload: vacuous run (blocks {ids} -> {new_ids}, fence {fence})"
        )
    return out


def cow_then_load(gpu: Gpu, buf: Buffers, use_fence: bool) -> dict[str, Any]:
    from blockpool import Fence, HazardAwareBlockPool, StreamKind
    from blockpool.worker.torch_events import EventLedger

    torch = gpu.torch
    pool = HazardAwareBlockPool(
        NUM_BLOCKS, enable_caching=False, streams={"compute": StreamKind.DEVICE, "recv": StreamKind.HOST}
    )
    ledger = EventLedger(gpu.event_factory(), streams={"compute": gpu.compute})
    (s,), _ = pool.allocate_for(1, "compute")
    (d,), _ = pool.allocate_for(1, "compute")
    kv, remote = buf.kv, buf.remote

    def init() -> None:
        kv[s.block_id].fill_(1.0)
        kv[d.block_id].zero_()

    gpu.enqueue(gpu.compute, init)
    gpu.compute.synchronize()

    copy_tok, copy_fence = pool.begin_copy([(s, d)], "compute")
    ledger.wait_device(copy_fence, gpu.compute)
    gpu.delay(gpu.compute, HAZARD_DELAY_MS)
    gpu.enqueue(gpu.compute, lambda: kv[d.block_id].copy_(kv[s.block_id]))
    ledger.record(copy_tok)

    load_tok, load_fence = pool.begin_load([d], "recv")
    wire = load_fence.to_wire()
    thread_out: dict[str, Any] = {}

    def receive() -> None:
        try:
            if not gpu.dry:
                torch.cuda.set_device(gpu.device)
            f = Fence.from_wire(wire)
            thread_out["waited_on"] = (
                [str(t) for t in ledger.wait_host(f, timeout=WAIT_S)] if use_fence else []
            )
            gpu.enqueue(gpu.recv, lambda: kv[d.block_id].copy_(remote, non_blocking=True))
            gpu.recv.synchronize()  # the engine's own completion (its stream only)
            ledger.mark_host_complete(load_tok)
        except BaseException as exc:  # noqa: BLE001
            thread_out["error"] = f"{type(exc).__name__}: {exc}"

    th = threading.Thread(target=receive, name="recv-thread", daemon=True)
    th.start()
    th.join(WAIT_S)
    if th.is_alive():
        raise RuntimeError("the receive thread did not finish")
    if "error" in thread_out:
        raise RuntimeError(f"receive thread: {thread_out['error']}")
    ledger.wait_host(Fence([copy_tok]), timeout=WAIT_S)  # the copy ran, late or not
    with gpu.on(gpu.compute):
        final_is_loaded = bool(torch.equal(kv[d.block_id].cpu(), remote.cpu()))
    return {
        "fence": [str(t) for t in load_fence],
        "needs_host_wait": load_fence.needs_host_wait,
        "waited_on": thread_out.get("waited_on", []),
        "block_holds_loaded_data": final_is_loaded,
        "corruption_observed": not final_is_loaded,
    }


class OffloadHandler:
    """vLLM 0.33's ``SingleDirectionOffloadingHandler.transfer_async``,
    reduced to its ordering: the job's copy stream waits for the current
    stream (``wait_stream``) and for the previous job of this handler, then
    runs ``_swap_blocks_batch`` with the copy stream current and records the
    job's end event."""

    def __init__(
        self, gpu: Gpu, stream: Any, copy: Callable[[Any, Any], None], delay_ms: float = 0.0
    ) -> None:
        self.gpu, self.stream, self.delay_ms = gpu, stream, delay_ms
        self._transfers: list[Any] = []
        self._swap_blocks_batch = copy

    def transfer_async(self, job_id: int, src: Any, dst: Any) -> bool:
        gpu = self.gpu
        self.stream.wait_stream(gpu.current_stream())
        if self._transfers:
            self.stream.wait_event(self._transfers[-1].end_event)
        end = gpu.timing_event()
        with gpu.on(self.stream):
            gpu.delay(self.stream, self.delay_ms)
            self._swap_blocks_batch(src, dst)  # enqueues the copies on the current (copy) stream
            end.record(self.stream)
        from types import SimpleNamespace

        self._transfers.append(SimpleNamespace(stream=self.stream, end_event=end))
        return True


def offload_store_then_reload(gpu: Gpu, buf: Buffers, use_fence: bool, audit: bool = False) -> dict[str, Any]:
    from blockpool import HazardAwareBlockPool, StreamKind
    from blockpool.integrations.vllm import worker as vw
    from blockpool.integrations.vllm.audit import Audit
    from blockpool.integrations.vllm.hazards import Transfer
    from blockpool.worker.torch_events import EventLedger

    torch = gpu.torch
    streams = {
        "compute": StreamKind.DEVICE,
        "offload_d2h": StreamKind.DEVICE,
        "offload_h2d": StreamKind.DEVICE,
    }
    pool = HazardAwareBlockPool(NUM_BLOCKS, enable_caching=False, streams=streams)
    ledger = EventLedger(gpu.event_factory(), streams={"compute": gpu.compute})
    wh = vw.WorkerHazards(ledger, gpu.current_stream, timeout=WAIT_S, audit=Audit() if audit else None)
    kv, pattern = buf.kv, buf.pattern
    blocks, _ = pool.allocate_for(K, "compute")
    ids = [b.block_id for b in blocks]
    stored = gpu.pinned(torch.zeros((K, *BLOCK_SHAPE)))

    def old_data() -> None:
        for i in ids:
            kv[i].fill_(float(i + 1))

    gpu.enqueue(gpu.compute, old_data)
    gpu.compute.synchronize()

    def d2h(src: Any, dst: Any) -> None:
        def work() -> None:
            for j, bid in enumerate(ids):
                stored[j].copy_(kv[bid], non_blocking=True)

        gpu.enqueue(gpu.current_stream(), work)

    store_tok, store_fence = pool.begin_store(blocks, "offload_d2h")
    pool.free_blocks(blocks)  # the request ended; the store still runs
    new_blocks, alloc_fence = pool.allocate_for(K, "offload_h2d")
    load_tok, load_fence = pool.begin_load(new_blocks, "offload_h2d")
    fence = alloc_fence.merge(load_fence)
    new_ids = [b.block_id for b in new_blocks]

    def h2d(src: Any, dst: Any) -> None:
        def work() -> None:
            for j, bid in enumerate(new_ids):
                kv[bid].copy_(pattern[j], non_blocking=True)

        gpu.enqueue(gpu.current_stream(), work)

    store_h = OffloadHandler(gpu, gpu.stream("d2h-copy"), d2h, delay_ms=HAZARD_DELAY_MS)
    load_h = OffloadHandler(gpu, gpu.h2d, h2d)
    vw.install(wh)
    try:
        wh.jobs[("offloading", 0)] = Transfer("A", "store", store_tok, store_fence, tuple(ids))
        if use_fence:
            wh.jobs[("offloading", 1)] = Transfer("B", "load", load_tok, fence, tuple(new_ids))
        vw.offload_transfer_async(OffloadHandler.transfer_async)(store_h, 0, None, None)
        vw.offload_transfer_async(OffloadHandler.transfer_async)(load_h, 1, None, None)
        waited = wh.waits
        gpu.device_synchronize() if gpu.dry else None
        store_h._transfers[-1].end_event.synchronize()
        load_h._transfers[-1].end_event.synchronize()
    finally:
        vw.install(None)
    expected = [float(i + 1) for i in ids]
    with gpu.on(gpu.compute):
        got = [float(stored[j].flatten()[0]) for j in range(K)]
        store_ok = got == expected
        loaded = all(bool(torch.equal(kv[bid].cpu(), pattern[j].cpu())) for j, bid in enumerate(new_ids))
    out = {
        "fence": [str(t) for t in fence],
        "fenced_waits": waited,
        "reused_same_blocks": sorted(new_ids) == sorted(ids),
        "store_saw_old_data": store_ok,
        "load_landed": loaded,
        "corruption_observed": not store_ok or not loaded,
    }
    if audit:  # the fences are only observed: vLLM's own ordering alone, counted
        out["audit_would_have_raced"] = wh.audit.totals()[2]
    if not out["reused_same_blocks"] or [str(t) for t in fence] != [str(store_tok)]:
        RESULT["errors"].append(
            f"offload_store_then_reload: unexpected run (blocks {ids} -> {new_ids}, fence {fence})"
        )
    return out


def delay_trial(gpu: Gpu, buf: Buffers, mode: str) -> dict[str, Any]:
    from blockpool import Fence, HazardAwareBlockPool, StreamKind
    from blockpool.worker.torch_events import EventLedger

    pool = HazardAwareBlockPool(
        NUM_BLOCKS, enable_caching=False, streams={"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE}
    )
    ledger = EventLedger(gpu.event_factory(), streams={"compute": gpu.compute, "h2d": gpu.h2d})
    blocks, _ = pool.allocate_for(K, "compute")
    others, _ = pool.allocate_for(K, "compute")
    kv, pattern = buf.kv, buf.pattern
    idx = gpu.index([b.block_id for b in blocks])
    other_idx = gpu.index([b.block_id for b in others])
    sink: dict[str, Any] = {}

    def read(which: Any, key: str) -> Callable[[], None]:
        def fn() -> None:
            sink[key] = kv.index_select(0, which).sum()

        return fn

    # step N-1: short, last reader of the blocks; step N: long, other blocks
    gpu.delay(gpu.compute, SHORT_STEP_MS)
    gpu.enqueue(gpu.compute, read(idx, "a"))
    e1 = pool.issue("compute")
    ledger.record(e1)
    pool.free_blocks(blocks, token=e1)
    gpu.delay(gpu.compute, LONG_STEP_MS)
    gpu.enqueue(gpu.compute, read(other_idx, "b"))
    e2 = pool.issue("compute")
    ledger.record(e2)

    request = gpu.timing_event()
    request.record(gpu.marker)
    new_blocks, f1 = pool.allocate_for(K, "h2d")
    load_tok, f2 = pool.begin_load(new_blocks, "h2d")
    fence = f1.merge(f2)
    if mode == "exact_fence":
        ledger.wait_device(fence, gpu.h2d)
    elif mode == "whole_step":
        ev = ledger.event_of(e2)
        if ev is not None:
            gpu.h2d.wait_event(ev)
    elif mode == "device_synchronize":
        gpu.device_synchronize()
    else:
        raise ValueError(mode)
    start = gpu.timing_event()
    start.record(gpu.h2d)
    new_ids = [b.block_id for b in new_blocks]

    def load() -> None:
        for j, bid in enumerate(new_ids):
            kv[bid].copy_(pattern[j], non_blocking=True)

    gpu.enqueue(gpu.h2d, load)
    ledger.record(load_tok)
    ledger.wait_host(Fence([e2, load_tok]), timeout=WAIT_S)
    start.synchronize()
    request.synchronize()
    return {"fence": [str(t) for t in fence], "ms": gpu.elapsed_ms(request, start)}


def summarize(samples: list[float | None]) -> dict[str, Any]:
    vals = [x for x in samples if x is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "samples": samples}
    return {
        "median": round(statistics.median(vals), 4),
        "min": round(min(vals), 4),
        "max": round(max(vals), 4),
        "samples": [round(x, 4) for x in vals],
    }


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------


def guarded(name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.monotonic()
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - every failure goes into the JSON
        error(name, exc)
        value = None
    RESULT.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 3)
    return value


def run(dry_run: bool) -> int:
    import torch

    RESULT["torch"] = torch.__version__
    RESULT["dry_run_cpu"] = dry_run
    RESULT["config"] = {
        "num_blocks": NUM_BLOCKS,
        "blocks_per_access": K,
        "block_shape": list(BLOCK_SHAPE),
        "hazard_delay_ms": HAZARD_DELAY_MS,
        "short_step_ms": SHORT_STEP_MS,
        "long_step_ms": LONG_STEP_MS,
        "trials": TRIALS,
    }
    gpu = guarded("setup", lambda: Gpu(torch, dry_run))
    if gpu is None:
        return 1
    if not dry_run:
        RESULT["device"] = guarded("device_name", lambda: torch.cuda.get_device_name(gpu.device))
    guarded("calibrate", gpu.calibrate)
    RESULT["sleep_cycles_per_ms"] = round(gpu.cycles_per_ms, 1)
    buf = guarded("allocate_buffers", lambda: Buffers(gpu))
    if buf is None:
        return 1

    subchecks = (
        ("war_free_then_reload", war_free_then_reload),
        ("cow_then_load", cow_then_load),
        ("offload_store_then_reload", offload_store_then_reload),
    )
    for name, fn in subchecks:
        RESULT[name] = {
            "with_fence": guarded(f"{name}/with_fence", lambda fn=fn: fn(gpu, buf, True)),
            "without_fence": guarded(f"{name}/without_fence", lambda fn=fn: fn(gpu, buf, False)),
        }
        guarded(f"{name}/drain", gpu.drain)
        log(f"{name}: {RESULT[name]}")
    # Audit mode (BLOCKPOOL_VLLM_HAZARDS=audit) on the offload reuse: no wait
    # added, the would-be race counted.
    RESULT["offload_store_then_reload"]["audit"] = guarded(
        "offload_store_then_reload/audit", lambda: offload_store_then_reload(gpu, buf, True, audit=True)
    )
    guarded("offload_store_then_reload/audit/drain", gpu.drain)

    modes = ("exact_fence", "whole_step", "device_synchronize")
    samples: dict[str, list[float | None]] = {m: [] for m in modes}
    fences: dict[str, list[str]] = {}
    for i in range(TRIALS):
        for m in modes:
            out = guarded(f"load_start_delay/{m}/{i}", lambda m=m: delay_trial(gpu, buf, m))
            if out is not None:
                samples[m].append(out["ms"])
                fences[m] = out["fence"]
            guarded(f"load_start_delay/{m}/{i}/drain", gpu.drain)
    delays = {m: summarize(samples[m]) for m in modes}
    delays["fence"] = fences.get("exact_fence")
    RESULT["load_start_delay_ms"] = delays
    log(f"load_start_delay_ms: {delays}")

    def ok(name: str) -> bool:
        r = (RESULT.get(name) or {}).get("with_fence") or {}
        return r.get("corruption_observed") is False

    def corrupt(name: str) -> bool | None:
        r = (RESULT.get(name) or {}).get("without_fence") or {}
        return r.get("corruption_observed")

    ex, ws = delays["exact_fence"]["median"], delays["whole_step"]["median"]
    RESULT["summary"] = {
        "fenced_runs_kept_data": all(ok(name) for name, _ in subchecks),
        "corruption_without_fence": {name: corrupt(name) for name, _ in subchecks},
        "audit_would_have_raced": (RESULT["offload_store_then_reload"].get("audit") or {}).get(
            "audit_would_have_raced"
        ),
        "whole_step_over_exact_fence": round(ws / ex, 2) if ex and ws else None,
        "device_synchronize_over_exact_fence": (
            round(delays["device_synchronize"]["median"] / ex, 2)
            if ex and delays["device_synchronize"]["median"]
            else None
        ),
    }
    if not RESULT["summary"]["fenced_runs_kept_data"]:
        RESULT["errors"].append("a fenced run did not keep the data intact")
    return 0 if not RESULT["errors"] else 1


def main(argv: list[str]) -> int:
    """Run the check; returns the exit status (the JSON is printed)."""
    global _emitted
    _emitted = threading.Lock()
    RESULT.clear()
    RESULT.update({"check": "gpu_hazard_check", "errors": []})
    dry_run = "--dry-run-cpu" in argv
    if not dry_run:
        try:
            import torch

            has_gpu = bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
        except Exception:  # noqa: BLE001 - no torch, or a broken driver: nothing to check
            has_gpu = False
        if not has_gpu:
            print(SKIP_LINE)
            return 0
    watchdog = threading.Timer(WATCHDOG_S, on_watchdog)
    watchdog.daemon = True
    watchdog.start()
    t0 = time.monotonic()
    try:
        code = run(dry_run)
    except BaseException as exc:  # noqa: BLE001
        error("run", exc)
        code = 1
    watchdog.cancel()
    RESULT["total_seconds"] = round(time.monotonic() - t0, 3)
    if not emit():  # the watchdog fired and printed
        time.sleep(WATCHDOG_S)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
