"""The race that started blockpool, and how the fence closes it.

One scheduler step forks a request: a copy-on-write copy of block ``s`` into
block ``d`` is enqueued on the ``compute`` stream (behind the rest of the
step, so it runs late). The connector then loads the rest of that block from
a remote store into the same destination ``d``: a background receive thread
(a ``HOST`` engine, like a Mooncake GET or an RDMA read) writes ``d`` with a
plain tensor copy from host memory. Without ordering, the GET can land
before the copy has run, and the late copy then overwrites the loaded KV.

``HazardAwareBlockPool.begin_load`` hands the load the exact fence it must
wait on (the copy's token). The receive thread gets the fence as plain data
and waits on exactly that (``EventLedger.wait_host``: one
``event.synchronize()``), then posts the GET. The store path is the mirror
image: the next step appends a token's KV into ``d`` and the scheduler
offloads ``d`` at once; the store thread waits on that step's token before
it reads.

Run (CPU stand-in streams by default; real CUDA streams with ``--device cuda``)::

    PYTHONPATH=. python docs/examples/cow_then_load.py
    PYTHONPATH=. python docs/examples/cow_then_load.py --drop-fence   # show the race

Exit status 0 when the run behaved as expected (with the fence: the block
holds the loaded KV and the store read the appended token; with
``--drop-fence`` the run only reports whether corruption was observed).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from blockpool import AccessKind, Fence, HazardAwareBlockPool, StreamKind, Token
from blockpool.worker.standins import StandInDevice
from blockpool.worker.torch_events import EventLedger, event_factory

BLOCK_SHAPE = (2, 16, 64)  # (key/value, tokens per block, heads * head size)
SLEEP_CYCLES = 200_000_000  # CUDA only: ~0.1 s of a busy step before the copy


class Backend:
    """Where work runs: CPU stand-in streams (deferred until driven) or CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        if self.cuda:
            self.device = torch.device("cuda")
            self.factory = event_factory("cuda")
        else:
            self.device = torch.device("cpu")
            self.standin = StandInDevice()
            self.factory = self.standin.new_event

    def stream(self, name: str) -> Any:
        return torch.cuda.Stream() if self.cuda else self.standin.new_stream(name)

    def enqueue(self, stream: Any, fn: Callable[[], object]) -> None:
        """Enqueue ``fn``'s kernels on ``stream``."""
        if self.cuda:
            with torch.cuda.stream(stream):
                fn()
        else:
            stream.enqueue(fn)

    def busy(self, stream: Any) -> None:
        """The rest of the step, enqueued ahead of the copy."""
        if self.cuda:
            self.enqueue(stream, lambda: torch.cuda._sleep(SLEEP_CYCLES))

    def drain(self, *streams: Any) -> None:
        """Let every enqueued kernel run (per stream; nothing device-wide)."""
        if self.cuda:
            for s in streams:
                s.synchronize()
        else:
            self.standin.run()


class FakeRemoteStore:
    """A remote KV store reached by a host-driven engine: GET copies host
    memory into a block, PUT copies a block into host memory."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.objects: dict[str, torch.Tensor] = {}
        self.stream = torch.cuda.Stream() if backend.cuda else None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self.stream.synchronize()  # the engine's own completion, not a device-wide sync

    def get(self, key: str, dst: torch.Tensor) -> None:
        self._copy(dst, self.objects[key])

    def put(self, key: str, src: torch.Tensor) -> None:
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.backend.cuda)
        self._copy(host, src)
        self.objects[key] = host


def run(device: str, drop_fence: bool) -> int:
    be = Backend(device)
    compute = be.stream("compute")
    box: dict[str, torch.Tensor] = {}
    # the paged KV cache: 8 blocks, made on compute (CUDA: ordered before its uses there)
    be.enqueue(compute, lambda: box.setdefault("kv", torch.zeros((8, *BLOCK_SHAPE), device=be.device)))
    be.drain(compute)
    kv = box["kv"]
    ledger = EventLedger(be.factory, streams={"compute": compute})
    remote = FakeRemoteStore(be)
    loaded = torch.full(BLOCK_SHAPE, 5.0, pin_memory=be.cuda)
    remote.objects["prefix-of-B"] = loaded

    pool = HazardAwareBlockPool(
        8,
        enable_caching=False,
        streams={"compute": StreamKind.DEVICE, "recv": StreamKind.HOST, "send": StreamKind.HOST},
    )
    # Request A's last block s, computed in an earlier, finished step.
    (s,), _ = pool.allocate_for(1, "compute")
    be.enqueue(compute, lambda: kv[s.block_id].fill_(1.0))
    be.drain(compute)

    # -- scheduler step 1: fork A -> copy-on-write s into d, on compute -----------
    (d,), _ = pool.allocate_for(1, "compute")
    copy_tok, copy_fence = pool.begin_copy([(s, d)], "compute")
    # worker: the copy waits on its own fence, runs behind the busy step, is recorded
    ledger.wait_device(copy_fence, compute)
    be.busy(compute)
    be.enqueue(compute, lambda: kv[d.block_id].copy_(kv[s.block_id]))
    ledger.record(copy_tok)
    print(f"copy-on-write block {s.block_id} -> {d.block_id} enqueued on compute as {copy_tok}")

    # -- the connector loads into the same destination d, by a receive thread ------
    load_tok, load_fence = pool.begin_load([d], "recv")
    print(
        f"pool handed the load {load_tok} the fence {[str(t) for t in load_fence]} "
        f"(needs_host_wait={load_fence.needs_host_wait})"
    )
    wire = load_fence.to_wire()  # what crosses to the worker's receive thread
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            fence = Fence.from_wire(wire)
            waited = () if drop_fence else ledger.wait_host(fence, timeout=60)
            print(f"load thread waited on {', '.join(map(str, waited)) or 'nothing'} before its GET")
            remote.get("prefix-of-B", kv[d.block_id])
            ledger.mark_host_complete(load_tok)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=receive, name="recv-thread")
    th.start()
    th.join(120)
    be.drain(compute)
    ledger.poll().apply(pool)
    after_load = kv[d.block_id].cpu()
    load_ok = bool(torch.equal(after_load, loaded))
    print(f"block {d.block_id} holds the loaded KV: {load_ok}")

    # -- step 2 appends a token's KV into d; the scheduler offloads d right away ----
    step_fence = pool.fence_for([d], "compute", AccessKind.WRITE)
    waited = ledger.wait_device(step_fence, compute, allow_host_wait=True)
    print(
        f"step 2 (compute) fence {[str(t) for t in step_fence]}: the load ended, "
        f"compute waited on {[str(t) for t in waited]}"
    )
    be.busy(compute)
    be.enqueue(compute, lambda: kv[d.block_id][:, -1].fill_(7.0))
    e2: Token = pool.issue("compute")
    pool.tag([d], e2, AccessKind.WRITE)
    ledger.record(e2)
    store_tok, store_fence = pool.begin_store([d], "send")
    print(f"pool handed the store {store_tok} the fence {[str(t) for t in store_fence]}")
    store_wire = store_fence.to_wire()

    def send() -> None:
        try:
            fence = Fence.from_wire(store_wire)
            waited = () if drop_fence else ledger.wait_host(fence, timeout=60)
            print(f"store thread waited on {', '.join(map(str, waited)) or 'nothing'} before reading")
            remote.put("block-d", kv[d.block_id])
            ledger.mark_host_complete(store_tok)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=send, name="send-thread")
    th.start()
    th.join(120)
    be.drain(compute)
    report = ledger.poll()
    print(f"worker reports to the scheduler: {report.to_wire()}")
    report.apply(pool)
    pool.poll()
    pool.check()

    stored = remote.objects.get("block-d")
    store_ok = stored is not None and bool(torch.equal(stored, kv[d.block_id].cpu()))
    print(f"store read the appended token: {store_ok}")
    if errors:
        print(f"errors: {errors!r}")
        return 1
    if drop_fence:
        print(f"without the fences, corruption observed: {not (load_ok and store_ok)}")
        return 0
    return 0 if load_ok and store_ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--drop-fence", action="store_true", help="skip the waits to show the race")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; run without --device cuda", file=sys.stderr)
        return 2
    return run(args.device, args.drop_fence)


if __name__ == "__main__":
    sys.exit(main())
