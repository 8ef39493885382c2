"""The SGLang plugin's field cases, on the CPU: a load whose device pages come
from more than one shadowed allocation, a ``register()`` that cannot read
SGLang's sources, a prebuilt batch that launches no forward.

``HiCacheController.load`` allocates its rows with
``mem_pool_device_allocator.alloc``. Under ``SWATokenToKVPoolAllocator``
that one call is two shadowed allocations (its ``full_attn_allocator`` and
its ``swa_attn_allocator``, both the exact ``TokenToKVPoolAllocator``), and
the host-to-device copy writes the pages of both (full layers at the full
rows, sliding-window layers at the rows the full-to-SWA mapping names). The
load's fence must cover the releases of both: waiting on one allocation's
tokens alone is weaker than SGLang's ``wait_stream``.

The real ``SWATokenToKVPoolAllocator.alloc`` runs (the object is built with
``object.__new__`` and the attributes that method reads), over two real
``TokenToKVPoolAllocator`` on ``device="cpu"``, with the fake streams and
transfer engine of :mod:`tests.test_sglang_controllers`.

Runs in .venv-sglang (scripts/sglang_setup.sh); skipped where SGLang is not
installed.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any
from unittest.mock import MagicMock

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang.srt.managers.cache_controller")

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.plugins.hook_registry import HookRegistry

import blockpool.integrations.sglang as plugin
from blockpool.integrations.sglang import hooks, surface
from tests.test_sglang_controllers import PAGE, TARGETS, FakeEvent, build, kinds, launch, runtime

SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def installed() -> Any:
    """The plugin registered and SGLang's hooks applied, once per session
    (the controller tests' module may have done it already)."""
    if not TARGETS:
        hooks.set_runtime(None)
        assert plugin.register()
        HookRegistry.apply_hooks()
        rt = hooks.runtime()
        assert rt is not None
        TARGETS[:] = rt.targets
    yield
    hooks.set_runtime(None)


def swa_allocator() -> Any:
    """A ``SWATokenToKVPoolAllocator`` over two real CPU token allocators."""
    swa = object.__new__(SWATokenToKVPoolAllocator)
    swa.page_size = 1
    swa._swa_req_ring = False
    swa.full_attn_allocator = TokenToKVPoolAllocator(SIZE, torch.int64, "cpu", MagicMock(), False)
    swa.swa_attn_allocator = TokenToKVPoolAllocator(SIZE, torch.int64, "cpu", MagicMock(), False)
    swa.full_to_swa_index_mapping = torch.zeros(SIZE + 1, dtype=torch.int64)
    return swa


def token_events(log: list[tuple[Any, ...]], start: int) -> list[FakeEvent]:
    """The events recorded on the forward stream after ``start``."""
    return [e[2] for e in log[start:] if e[0] == "record_event" and e[1] == "forward"]


@pytest.mark.parametrize("mode", ["on", "audit"])
def test_a_load_over_two_allocations_waits_on_both_releases(mode: str) -> None:
    rt = runtime(mode)
    ctrl, _paged, _fwd, log = build(rt)
    swa = swa_allocator()
    ctrl.mem_pool_device_allocator = swa
    full, side = swa.full_attn_allocator, swa.swa_attn_allocator
    # The SWA rows are released first, a forward is launched, then the full
    # rows are released and another forward launched: the SWA release's
    # launch token is the older one.
    mark = len(log)
    side.free(side.alloc(4))
    launch()
    full.free(full.alloc(4))
    launch()
    _, swa_token, _, full_token = token_events(log, mark)  # release, launch, release, launch
    # Both lists are FIFO: the released rows are at the back. Drain the front
    # so the load takes exactly the rows released above from both lists.
    full.alloc(SIZE - 4)
    side.alloc(SIZE - 4)
    mark = len(log)
    rows = ctrl.load(torch.arange(4, dtype=torch.int64))
    assert rows is not None and sorted(rows.tolist()) == [1, 2, 3, 4]
    # The SWA rows' last forward has completed, the full rows' has not: a
    # fence of the SWA allocation alone would let the copy start before it.
    swa_token.done = True
    ctrl.start_loading()
    got = kinds(log, mark)
    if mode == "on":
        assert got == [("wait_event", "h2d", full_token.name), ("submit", "h2d", (1, 2, 3, 4))]
    else:
        assert got == [("wait_stream", "h2d", "forward"), ("submit", "h2d", (1, 2, 3, 4))]
    # The full rows' release is incomplete: the batch is not counted as one
    # that needs no wait.
    assert (rt.counters.exact, rt.counters.fence_complete, rt.counters.fence_empty) == (1, 0, 0)


def test_register_refuses_without_raising_when_sources_are_unreadable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # SGLang installed without its .py files: no body can be fingerprinted.
    def no_source(obj: Any) -> str:
        raise OSError("could not get source code")

    saved = hooks.runtime()
    hooks.set_runtime(None)
    try:
        monkeypatch.setattr(inspect, "getsource", no_source)
        with caplog.at_level(logging.WARNING, logger="blockpool.integrations.sglang"):
            assert plugin.register() is False
        assert hooks.runtime() is None
        drifted = [r.getMessage() for r in caplog.records if "drifted" in r.getMessage()]
        assert len(drifted) == 1 and "HiCacheController.start_loading: body unreadable" in drifted[0]
        drift = next(d for d in surface.check_surface(surface.surface_for("0.5.23") or ()))
        assert (drift.what, drift.found) == ("body", "unreadable")
    finally:
        hooks.set_runtime(saved)


def test_a_prebuilt_batch_is_no_forward_launch() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rt = runtime("audit")
    ctrl, alloc, _fwd, _log = build(rt)
    prebuilt = MagicMock(forward_mode=ForwardMode.PREBUILT)
    extend = MagicMock(forward_mode=ForwardMode.EXTEND)
    alloc.free(alloc.alloc(PAGE))
    ctrl.load(torch.arange(PAGE, dtype=torch.int64))
    hooks.hook_run_batch(lambda self, batch: None, None, prebuilt)  # no forward enqueued
    ctrl.start_loading()  # the release's token has no launch after it yet
    assert (rt.counters.exact, rt.counters.fallback, rt.launches) == (0, 1, 0)
    alloc.free(alloc.alloc(PAGE))
    hooks.hook_run_batch(lambda self, batch: None, None, extend)  # one forward: the launch token
    ctrl.load(torch.arange(PAGE, dtype=torch.int64))
    hooks.hook_run_batch(lambda self, batch: None, None, prebuilt)
    ctrl.start_loading()  # the launch token is still the tail
    assert (rt.counters.exact, rt.counters.fence_behind_tail, rt.counters.gain()) == (1, 0, 0)
    alloc.free(alloc.alloc(PAGE))
    hooks.hook_run_batch(lambda self, batch: None, None, extend)
    ctrl.load(torch.arange(PAGE, dtype=torch.int64))
    hooks.hook_run_batch(lambda self, batch: None, None, extend)  # a forward after the launch token
    ctrl.start_loading()
    assert (rt.counters.exact, rt.counters.fence_behind_tail, rt.counters.gain()) == (2, 1, 1)
