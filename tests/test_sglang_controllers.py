"""SGLang's HiCache controllers under the blockpool plugin, on the CPU.

The real ``HiCacheController.load`` / ``write`` / ``start_loading`` /
``start_writing`` of SGLang 0.5.23 run unchanged (the controller is built
with ``object.__new__`` and the attributes those methods touch, as SGLang's
own load-fence test does), over the real ``PagedTokenToKVPoolAllocator`` on
``device="cpu"`` and fake streams, events and a fake L2 transfer engine that
log every record, wait and submission in order.

Runs in .venv-sglang (scripts/sglang_setup.sh); skipped where SGLang is not
installed.
"""

from __future__ import annotations

import logging
from typing import Any
from unittest.mock import MagicMock

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang.srt.managers.cache_controller")

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins.hook_registry import HookRegistry

import blockpool.integrations.sglang as plugin
from blockpool.integrations.sglang import hooks

PAGE = 4
TARGETS: list[str] = []  # the hook targets register() declared


class FakeEvent:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def record(self, stream: Any = None) -> None:
        self.log.append(("record", self.name))

    def synchronize(self) -> None:
        self.done = True

    def __repr__(self) -> str:
        return f"<event {self.name}>"


class FakeStream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name, self.n = log, name, 0

    def record_event(self, event: Any = None) -> FakeEvent:
        self.n += 1
        ev = FakeEvent(self.log, f"{self.name}#{self.n}")
        self.log.append(("record_event", self.name, ev))
        return ev

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event))

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))


class FakeCompletion:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.start_event = FakeEvent(log, name + ".start")
        self.finish_event = FakeEvent(log, name + ".finish")
        self.timing_enabled = False


class FakeEngine:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.host_to_device_stream = FakeStream(log, "h2d")
        self.device_to_host_stream = FakeStream(log, "d2h")
        self.fail = False

    def submit_host_to_device(self, transfers: Any, **kwargs: Any) -> FakeCompletion:
        if self.fail:
            raise RuntimeError("copy failed")
        self.log.append(("submit", "h2d", tuple(transfers[0].device_indices.tolist())))
        return FakeCompletion(self.log, "h2d")

    def submit_device_to_host(self, transfers: Any, **kwargs: Any) -> FakeCompletion:
        if self.fail:
            raise RuntimeError("copy failed")
        self.log.append(("submit", "d2h", tuple(transfers[0].device_indices.tolist())))
        return FakeCompletion(self.log, "d2h")


class FakeLayerCounter:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        ev = MagicMock()
        ev.start_event = FakeEvent(log, "producer.start")
        self.events = [ev]

    def update_producer(self) -> int:
        return 0


class FakeHostPool:
    size_per_token = 8
    layout = "layer_first"

    def __init__(self) -> None:
        self.next = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        return out


@pytest.fixture(scope="module", autouse=True)
def installed() -> Any:
    """The plugin registered and SGLang's hooks applied once for the module."""
    hooks.set_runtime(None)
    assert plugin.register()
    HookRegistry.apply_hooks()
    rt = hooks.runtime()
    assert rt is not None
    TARGETS[:] = rt.targets
    yield
    hooks.set_runtime(None)


def runtime(mode: str) -> hooks.Runtime:
    """A fresh runtime in ``mode`` (the module's hooks stay applied), as in
    SGLang's scheduler process, where ``Scheduler.run_batch`` is wrapped."""
    rt = hooks.Runtime(mode)
    rt.targets = tuple(TARGETS)
    rt.launch_hooked = True
    hooks.set_runtime(rt)
    return rt


def launch() -> None:
    """One forward launched: ``Scheduler.run_batch`` through the plugin's hook."""
    hooks.hook_run_batch(lambda self: None, None)


def queue_write(ctrl: Any, rows: torch.Tensor) -> None:
    """``HiCacheController.write`` with its flush held back (the operation
    stays queued, as ``HybridCacheController.write(..., flush=False)``)."""
    ctrl.start_writing = lambda: None
    try:
        ctrl.write(rows, node_id=7)
    finally:
        del ctrl.start_writing


def build(
    rt: hooks.Runtime, *, allocator_cls: type = PagedTokenToKVPoolAllocator, need_sort: bool = False
) -> tuple[Any, ...]:
    """A controller over a CPU allocator of 32 pages and fake streams."""
    log: list[tuple[Any, ...]] = []
    alloc = allocator_cls(32 * PAGE, PAGE, torch.int64, "cpu", MagicMock(), need_sort)
    fwd = FakeStream(log, "forward")
    ctrl = object.__new__(HiCacheController)
    ctrl.mem_pool_device_allocator = alloc
    ctrl.mem_pool_device = MagicMock()
    ctrl.mem_pool_host = FakeHostPool()
    ctrl.io_backend = "kernel"
    ctrl.device = "cpu"
    ctrl.page_size = PAGE
    ctrl.load_queue, ctrl.write_queue = [], []
    ctrl.ack_load_queue, ctrl.ack_write_queue = [], []
    ctrl.layer_done_counter = FakeLayerCounter(log)
    ctrl.transfer_layer_id_max = 2
    ctrl.l2_transfer_engine = FakeEngine(log)
    ctrl.load_fence_stream = fwd
    ctrl.write_fence_stream = fwd
    rt.bind(fwd)
    return ctrl, alloc, fwd, log


def kinds(log: list[tuple[Any, ...]], start: int = 0) -> list[tuple[Any, ...]]:
    """The waits and submissions after ``start``, events by name."""
    out = []
    for entry in log[start:]:
        if entry[0] in ("wait_event", "wait_stream", "submit"):
            out.append(tuple(e.name if isinstance(e, FakeEvent) else e for e in entry))
    return out


def release_then_load(
    ctrl: Any, alloc: Any, log: list[tuple[Any, ...]], *, launched: bool = True
) -> tuple[FakeEvent, int]:
    """Free 2 pages (a token on the forward stream), launch a forward (the
    token's launch token is recorded after it), load 8 tokens into the
    pages; returns the launch token's event (the release's, unlaunched)."""
    rows = alloc.alloc(2 * PAGE)
    alloc.free(rows)
    if launched:
        launch()
    token_event = [e for e in log if e[0] == "record_event"][-1][2]
    mark = len(log)
    out = ctrl.load(torch.arange(2 * PAGE, dtype=torch.int64))
    assert torch.equal(torch.sort(out)[0], torch.sort(rows)[0])  # LIFO: the freed pages
    return token_event, mark


def test_on_waits_on_the_fence_event_before_the_copy_and_not_on_the_stream() -> None:
    rt = runtime("on")
    ctrl, alloc, fwd, log = build(rt)
    token_event, mark = release_then_load(ctrl, alloc, log)
    ctrl.start_loading()
    assert kinds(log, mark) == [
        ("wait_event", "h2d", token_event.name),
        ("submit", "h2d", tuple(range(4, 12))),
    ]
    assert ctrl.load_fence_stream is fwd
    c = rt.counters
    assert (c.loads, c.exact, c.fallback, c.waits_replaced, c.events_waited) == (1, 1, 0, 1, 1)


def test_audit_keeps_sglang_wait_stream_and_counts() -> None:
    rt = runtime("audit")
    ctrl, alloc, _fwd, log = build(rt)
    _, mark = release_then_load(ctrl, alloc, log)
    ctrl.start_loading()
    assert kinds(log, mark) == [("wait_stream", "h2d", "forward"), ("submit", "h2d", tuple(range(4, 12)))]
    c = rt.counters
    assert (c.loads, c.exact, c.fallback, c.waits_replaced, c.fence_complete) == (1, 1, 0, 0, 0)


def test_complete_fence_needs_no_wait() -> None:
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt)
    _, mark = release_then_load(ctrl, alloc, log)
    for entry in log:  # every event recorded so far has completed
        if entry[0] == "record_event":
            entry[2].done = True
    ctrl.start_loading()
    assert kinds(log, mark) == [("submit", "h2d", tuple(range(4, 12)))]
    assert rt.counters.fence_complete == 1 and rt.counters.gain() == 1


def test_never_used_pages_have_an_empty_fence() -> None:
    rt = runtime("on")
    ctrl, _alloc, _fwd, log = build(rt)
    ctrl.load(torch.arange(PAGE, dtype=torch.int64))
    ctrl.start_loading()
    assert kinds(log) == [("submit", "h2d", (4, 5, 6, 7))]
    assert rt.counters.fence_empty == 1


def test_unshadowed_allocator_class_keeps_wait_stream() -> None:
    class Subclass(PagedTokenToKVPoolAllocator):
        pass

    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt, allocator_cls=Subclass)
    rows = alloc.alloc(PAGE)
    alloc.free(rows)
    mark = len(log)
    ctrl.load(torch.arange(PAGE, dtype=torch.int64))
    ctrl.start_loading()
    assert kinds(log, mark) == [("wait_stream", "h2d", "forward"), ("submit", "h2d", (4, 5, 6, 7))]
    assert (rt.counters.fallback, rt.counters.exact) == (1, 0)


def test_sorted_merge_keeps_wait_stream() -> None:
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt, need_sort=True)
    rows = alloc.alloc(31 * PAGE)  # one page left
    alloc.free(rows)  # staged
    mark = len(log)
    ctrl.load(torch.arange(2 * PAGE, dtype=torch.int64))  # runs short: merge_and_sort_free
    ctrl.start_loading()
    assert kinds(log, mark) == [
        ("wait_stream", "h2d", "forward"),
        ("submit", "h2d", (4, 5, 6, 7, 8, 9, 10, 11)),
    ]
    assert rt.counters.fallback == 1


def test_length_mismatch_disarms_the_account_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt)
    alloc.free_pages = alloc.free_pages[1:]  # changed behind the account's back
    mark = len(log)
    with caplog.at_level(logging.WARNING, logger="blockpool.integrations.sglang"):
        ctrl.load(torch.arange(PAGE, dtype=torch.int64))
        ctrl.load(torch.arange(PAGE, dtype=torch.int64))
    ctrl.start_loading()
    assert kinds(log, mark)[0] == ("wait_stream", "h2d", "forward")
    assert [r.getMessage() for r in caplog.records if "disarmed" in r.getMessage()] != []
    assert len([r for r in caplog.records if "disarmed" in r.getMessage()]) == 1
    assert rt.counters.disarmed == 1 and rt.counters.fallback == 1


def test_fence_stream_restored_after_an_exception() -> None:
    rt = runtime("on")
    ctrl, alloc, fwd, log = build(rt)
    release_then_load(ctrl, alloc, log)
    ctrl.l2_transfer_engine.fail = True
    with pytest.raises(RuntimeError, match="copy failed"):
        ctrl.start_loading()
    assert ctrl.load_fence_stream is fwd
    queue_write(ctrl, alloc.alloc(PAGE))
    launch()
    with pytest.raises(RuntimeError, match="copy failed"):
        ctrl.start_writing()
    assert ctrl.write_fence_stream is fwd
    assert rt.counters.waits_replaced == 2  # both took the exact path


def test_write_back_flushed_before_a_launch_keeps_wait_stream() -> None:
    # Its token stands for the next forward's launch, not yet made.
    rt = runtime("on")
    ctrl, alloc, fwd, log = build(rt)
    rows = alloc.alloc(PAGE)
    mark = len(log)
    ctrl.write(rows, node_id=7)
    assert kinds(log, mark) == [("wait_stream", "d2h", "forward"), ("submit", "d2h", (4, 5, 6, 7))]
    assert ctrl.write_fence_stream is fwd
    assert (rt.counters.writes, rt.counters.exact, rt.counters.fallback) == (1, 0, 1)


def test_queued_write_back_waits_on_its_launch_token_not_the_stream() -> None:
    rt = runtime("on")
    ctrl, alloc, fwd, log = build(rt)
    rows = alloc.alloc(PAGE)
    queue_write(ctrl, rows)
    launch()
    token = [e for e in log if e[0] == "record_event"][-1][2]
    mark = len(log)
    ctrl.start_writing()
    assert kinds(log, mark) == [("wait_event", "d2h", token.name), ("submit", "d2h", (4, 5, 6, 7))]
    assert ctrl.write_fence_stream is fwd
    assert (rt.counters.writes, rt.counters.exact) == (1, 1)


def test_write_back_audit_keeps_wait_stream() -> None:
    rt = runtime("audit")
    ctrl, alloc, _fwd, log = build(rt)
    rows = alloc.alloc(PAGE)
    mark = len(log)
    ctrl.write(rows)
    assert kinds(log, mark) == [("wait_stream", "d2h", "forward"), ("submit", "d2h", (4, 5, 6, 7))]


def test_other_fence_stream_keeps_wait_stream() -> None:
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt)
    other = FakeStream(log, "other")
    ctrl.load_fence_stream = other
    _token_event, mark = release_then_load(ctrl, alloc, log)
    ctrl.start_loading()
    assert kinds(log, mark) == [("wait_stream", "h2d", "other"), ("submit", "h2d", tuple(range(4, 12)))]
    assert ctrl.load_fence_stream is other


def test_retraction_backup_counted_as_a_race_with_its_line(caplog: pytest.LogCaptureFixture) -> None:
    rt = runtime("audit")
    cache = object.__new__(UnifiedRadixCache)
    req = MagicMock()
    req.seqlen = 2
    with caplog.at_level(logging.WARNING, logger="blockpool.integrations.sglang"):
        with pytest.raises(AttributeError):
            cache.backup_kv_cache(req)  # no tree built: fails after the count
        with pytest.raises(AttributeError):
            cache.backup_kv_cache(req)
    races = [r.getMessage() for r in caplog.records if "race" in r.getMessage()]
    assert len(races) == 1 and "unified_radix_cache.py:1583" in races[0]
    assert rt.counters.races == 2


def test_inert_when_a_target_was_not_patched(caplog: pytest.LogCaptureFixture) -> None:
    rt = runtime("on")
    rt.targets = rt.targets + ("sglang.srt.managers.cache_controller.HiCacheController.evict_host",)
    with caplog.at_level(logging.WARNING, logger="blockpool.integrations.sglang"):
        ctrl, alloc, _fwd, log = build(rt)
        alloc.free(alloc.alloc(PAGE))
        ctrl.load(torch.arange(PAGE, dtype=torch.int64))
        ctrl.start_loading()
    assert rt.armed is False
    assert not [e for e in log if e[0] == "record_event"]  # no token taken
    assert kinds(log) == [("wait_stream", "h2d", "forward"), ("submit", "h2d", (4, 5, 6, 7))]
    assert any("evict_host" in r.getMessage() for r in caplog.records)
    assert rt.counters.loads == 0


def test_a_release_no_forward_was_launched_after_keeps_wait_stream() -> None:
    # SGLang builds batch N+1, processes batch N's finished requests (their
    # pages released), then launches N+1, whose rows may still hold them:
    # the release's token does not cover N+1 until N+1 is launched.
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt)
    _, mark = release_then_load(ctrl, alloc, log, launched=False)
    ctrl.start_loading()
    assert kinds(log, mark) == [("wait_stream", "h2d", "forward"), ("submit", "h2d", tuple(range(4, 12)))]
    assert (rt.counters.exact, rt.counters.fallback) == (0, 1)


def test_without_run_batch_wrapped_every_fence_keeps_wait_stream() -> None:
    rt = runtime("on")
    rt.launch_hooked = False  # outside SGLang's scheduler process
    ctrl, alloc, _fwd, log = build(rt)
    _, mark = release_then_load(ctrl, alloc, log)
    ctrl.start_loading()
    assert kinds(log, mark)[0] == ("wait_stream", "h2d", "forward")
    assert rt.counters.fallback == 1


def test_a_run_batch_that_raises_launches_nothing_and_promotes_nothing() -> None:
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt)

    def failing(self: Any) -> None:
        raise RuntimeError("forward failed")

    _, mark = release_then_load(ctrl, alloc, log, launched=False)
    with pytest.raises(RuntimeError, match="forward failed"):
        hooks.hook_run_batch(failing, None)
    ctrl.start_loading()
    assert rt.launches == 0
    assert kinds(log, mark)[0] == ("wait_stream", "h2d", "forward")
    assert rt.counters.fallback == 1


def test_an_event_that_cannot_be_recorded_keeps_wait_stream_and_raises_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = runtime("on")
    ctrl, alloc, fwd, log = build(rt)

    def broken(event: Any = None) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    fwd.record_event = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="blockpool.integrations.sglang"):
        alloc.free(alloc.alloc(2 * PAGE))  # a release and a launch, neither recorded
        launch()
        mark = len(log)
        ctrl.load(torch.arange(2 * PAGE, dtype=torch.int64))
    ctrl.start_loading()
    assert kinds(log, mark)[0] == ("wait_stream", "h2d", "forward")
    assert rt.counters.fallback == 1
    assert len([r for r in caplog.records if "recording an event" in r.getMessage()]) == 1


def test_fence_behind_tail_counts_a_forward_launched_after_the_fence() -> None:
    rt = runtime("audit")
    ctrl, alloc, _fwd, log = build(rt)
    release_then_load(ctrl, alloc, log)
    ctrl.start_loading()  # the launch token is the tail
    assert (rt.counters.exact, rt.counters.fence_behind_tail) == (1, 0)
    release_then_load(ctrl, alloc, log)
    launch()  # one more forward launched after the launch token
    ctrl.start_loading()
    assert (rt.counters.exact, rt.counters.fence_behind_tail, rt.counters.gain()) == (2, 1, 1)


def hybrid_of(ctrl: Any) -> Any:
    """A ``HybridCacheController`` sharing ``ctrl``'s attributes (its queues
    included), so ``ctrl.start_loading`` submits what its ``load`` queued."""
    hybrid = object.__new__(HybridCacheController)
    hybrid.__dict__.update(ctrl.__dict__)
    return hybrid


def test_hybrid_load_into_caller_owned_rows_keeps_wait_stream() -> None:
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt)
    rows = alloc.alloc(PAGE)
    mark = len(log)
    hybrid_of(ctrl).load(torch.arange(PAGE, dtype=torch.int64), device_indices=rows)
    ctrl.start_loading()
    assert kinds(log, mark) == [("wait_stream", "h2d", "forward"), ("submit", "h2d", (4, 5, 6, 7))]
    assert (rt.counters.fallback, rt.counters.exact) == (1, 0)


def test_hybrid_load_into_allocated_rows_is_exact() -> None:
    rt = runtime("on")
    ctrl, alloc, _fwd, log = build(rt)
    rows = alloc.alloc(PAGE)
    alloc.free(rows)
    launch()
    token = [e for e in log if e[0] == "record_event"][-1][2]
    mark = len(log)
    hybrid_of(ctrl).load(torch.arange(PAGE, dtype=torch.int64))
    ctrl.start_loading()
    assert kinds(log, mark) == [("wait_event", "h2d", token.name), ("submit", "h2d", (4, 5, 6, 7))]
    assert (rt.counters.fallback, rt.counters.exact) == (0, 1)
