"""Never worse than stock in availability.

:class:`StepHazards`' bounded deferral and leases on the pure pool (a
clock moved by hand, no sleeping), and vLLM's real ``Scheduler`` with
MooncakeStore (a host-engine connector) serving every request while a
transfer never reports: preemption is deferred for held blocks only while
they could cover the need, and for a bounded number of steps; a hold ends
when the engine's give-up time passes (a lease), with one warning, and the
blocks are reused after. The scheduler tests need vLLM, torch and the
shape-only model configs (skipped otherwise), like ``test_vllm_connectors.py``,
whose helpers they use.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Iterator
from typing import Any
from unittest.mock import MagicMock, patch

import pytest

from blockpool import HazardAwareBlockPool, StreamKind
from blockpool.core.errors import InvalidArgumentError, UnknownStreamError
from blockpool.integrations.vllm.hazards import (
    DEFAULT_DEFER_STEPS,
    DEFAULT_GIVE_UP_S,
    ENV_DEFER_STEPS,
    ENV_TRANSFER_TIMEOUT,
    StepHazards,
    Transfer,
    engine_give_up,
)
from blockpool.integrations.vllm.served import SERVED

LOGGER = "vllm.plugins.blockpool"
_VLLM = (
    importlib.util.find_spec("vllm") is not None
    and importlib.util.find_spec("torch") is not None
    and bool(os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"))
)
needs_vllm = pytest.mark.skipif(not _VLLM, reason="needs vLLM, torch and the shape-only model configs")


class Clock:
    """A monotonic clock the test moves by hand (no sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------
# StepHazards on the pure pool
# ----------------------------------------------------------------------

ENGINE = "engine"


def hazards(num_blocks: int = 8, **kw: Any) -> tuple[HazardAwareBlockPool, StepHazards, Clock]:
    """A pool with the compute stream and one host engine, its StepHazards
    on a clock moved by hand."""
    pool = HazardAwareBlockPool(num_blocks, streams={"compute": StreamKind.DEVICE})
    clock = Clock()
    hz = StepHazards(pool, clock=clock, **kw)
    hz.add_stream(ENGINE, StreamKind.HOST)
    return pool, hz, clock


class AbandonFails:
    """The pool behind a StepHazards whose ``abandon`` raises (a proxy: the
    compiled core's methods cannot be patched on the instance)."""

    def __init__(self, pool: HazardAwareBlockPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def abandon(self, token: Any) -> list[int]:
        raise RuntimeError("engine state not understood")


def held_store(pool: HazardAwareBlockPool, hz: StepHazards, rid: str, n: int = 2) -> Transfer:
    """A store of ``n`` fresh blocks on the engine, the blocks then freed
    by their request: held back until the store ends."""
    blocks = pool.get_new_blocks(n)
    t = hz.begin_store(rid, blocks, ENGINE)
    pool.free_blocks(blocks)
    return t


def test_a_host_transfer_that_never_reports_is_given_up_at_its_give_up_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, hz, clock = hazards()
    hz.give_up_after(ENGINE, 10.0)
    t = held_store(pool, hz, "r1")
    free = pool.get_num_free_blocks()
    assert hz.blocks_on_their_way() == 2
    clock.now += 9.9
    assert hz.begin_schedule() == 0 and hz.blocks_on_their_way() == 2
    clock.now += 0.2
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert hz.begin_schedule() == 1
        assert hz.begin_schedule() == 0  # once
    assert pool.is_ended(t.token) and hz.transfers_abandoned == 1 and hz.blocks_reclaimed == 2
    assert hz.blocks_on_their_way() == 0 and pool.get_num_free_blocks() == free + 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert "engine: store of request 'r1'" in line and "within 10 s (2 scheduler steps)" in line
    assert str(list(t.block_ids)) in line and "stock vLLM would already have reused them" in line
    # The late report ends nothing: the transfer is forgotten.
    assert hz.end_transfers(finished_sending={"r1"}) == 0 and hz.pending_transfers() == []


def test_a_transfer_that_reported_is_not_given_up_and_its_lease_is_dropped() -> None:
    pool, hz, clock = hazards()
    held_store(pool, hz, "r1")
    assert hz.leases_pending() == 1
    assert hz.end_transfers(finished_sending={"r1"}) == 1
    clock.now += DEFAULT_GIVE_UP_S + 1
    assert hz.begin_schedule() == 0 and hz.transfers_abandoned == 0
    assert hz.leases_pending() == 0


def test_each_engine_gives_up_at_its_own_time_and_device_streams_have_no_lease() -> None:
    pool, hz, clock = hazards(transfer_timeout=100.0)
    hz.add_stream("other", StreamKind.HOST)
    hz.add_stream("h2d", StreamKind.DEVICE)
    hz.give_up_after("other", 5.0)
    assert (hz.give_up_time(ENGINE), hz.give_up_time("other"), hz.give_up_time("h2d")) == (100.0, 5.0, None)
    slow = hz.begin_store("a", pool.get_new_blocks(1), ENGINE)
    fast = hz.begin_store("b", pool.get_new_blocks(1), "other")
    hz.begin_load("c", pool.get_new_blocks(1), "h2d")
    assert hz.leases_pending() == 2
    clock.now += 6
    assert hz.begin_schedule() == 1
    assert pool.is_ended(fast.token) and not pool.is_ended(slow.token)
    clock.now += 100
    assert hz.begin_schedule() == 1 and pool.is_ended(slow.token)
    # None: the engine has no time of its own, the default applies.
    hz.give_up_after("other", None)
    assert hz.give_up_time("other") == 100.0


def test_an_abandoned_load_fails_and_its_late_report_is_ignored() -> None:
    pool, hz, clock = hazards()
    hz.give_up_after(ENGINE, 1.0)
    t = hz.begin_load("r1", pool.get_new_blocks(2), ENGINE)
    clock.now += 2
    failed = pool.stats().failed_tokens
    assert hz.begin_schedule() == 1
    assert pool.stats().failed_tokens == failed + 1 and pool.is_ended(t.token)
    assert hz.end_transfers(finished_recving={"r1"}) == 0 and hz.finish("r1") == 0
    assert pool.stats().failed_tokens == failed + 1


@pytest.mark.parametrize("seconds", [0, -1.0, math.nan, math.inf, True, "10"])
def test_give_up_after_refuses_a_time_that_is_not_positive_and_finite(seconds: Any) -> None:
    _, hz, _ = hazards()
    hz.give_up_after(ENGINE, 7.0)
    with pytest.raises(InvalidArgumentError):
        hz.give_up_after(ENGINE, seconds)
    assert hz.give_up_time(ENGINE) == 7.0


@pytest.mark.parametrize("stream", ["compute", "nowhere"])
def test_give_up_after_refuses_a_stream_that_is_not_a_host_engine(stream: str) -> None:
    _, hz, _ = hazards()
    with pytest.raises(UnknownStreamError):
        hz.give_up_after(stream, 5.0)
    assert hz.give_up_time(stream) is None


@pytest.mark.parametrize("kw", [{"defer_steps": -1}, {"defer_steps": 1.5}, {"transfer_timeout": 0.0}])
def test_step_hazards_refuses_a_bound_or_timeout_out_of_range(kw: dict[str, Any]) -> None:
    pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE})
    with pytest.raises(InvalidArgumentError):
        StepHazards(pool, **kw)


def test_the_settings_are_read_and_a_bad_value_is_refused_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE})
    with patch.dict(os.environ, {ENV_DEFER_STEPS: "3", ENV_TRANSFER_TIMEOUT: "12.5"}):
        hz = StepHazards(pool)
    assert (hz.defer_steps, hz.transfer_timeout) == (3, 12.5)
    bad = {ENV_DEFER_STEPS: "many", ENV_TRANSFER_TIMEOUT: "-4"}
    with patch.dict(os.environ, bad), caplog.at_level(logging.ERROR, logger=LOGGER):
        hz = StepHazards(pool)
    assert (hz.defer_steps, hz.transfer_timeout) == (DEFAULT_DEFER_STEPS, DEFAULT_GIVE_UP_S)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and ENV_DEFER_STEPS in lines[0] and ENV_TRANSFER_TIMEOUT in lines[1]


def test_a_fault_while_checking_leases_is_counted_logged_once_and_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, hz, clock = hazards()
    held_store(pool, hz, "r1")
    clock.now += DEFAULT_GIVE_UP_S + 1

    with patch.object(hz, "pool", AbandonFails(pool)), caplog.at_level(logging.ERROR, logger=LOGGER):
        assert hz.begin_schedule() == 0
        assert hz.begin_schedule() == 0
    assert hz.lease_faults == 2 and len(caplog.records) == 1


def deferring(defer_steps: int = 3) -> tuple[HazardAwareBlockPool, StepHazards]:
    """Two blocks held back for a store, none free."""
    pool, hz, _ = hazards(num_blocks=4, defer_steps=defer_steps)
    held_store(pool, hz, "r1", 2)
    pool.get_new_blocks(pool.get_num_free_blocks())
    return pool, hz


def step(hz: StepHazards, need: int | None = 1) -> None:
    """A ``schedule()`` begins, and vLLM's coordinator computes that a
    request needs ``need`` blocks (what the scheduler wiring records)."""
    hz.begin_schedule()
    hz.last_need = need


def test_preemption_is_deferred_for_at_most_the_bound_of_consecutive_steps() -> None:
    _, hz = deferring(3)
    answers = []
    for _ in range(8):
        step(hz)
        answers.append(hz.defer_preemption())
        answers.append(hz.defer_preemption())  # a second ask in the same step answers the same
    # Two steps deferred, the third answers as stock (vLLM preempts): at most
    # three steps in a row without the preemption; the count starts again.
    assert answers == ([True] * 4 + [False] * 2) * 2 + [True] * 4
    assert hz.deferrals_given_up == 2 and hz.preemptions_deferred == 12


def test_a_step_without_a_deferral_ends_the_run() -> None:
    _, hz = deferring(3)
    step(hz)
    assert hz.defer_preemption()
    step(hz)  # the request fitted: nobody asked
    step(hz)
    assert hz.defer_preemption()
    step(hz)
    assert hz.defer_preemption()
    step(hz)
    assert not hz.defer_preemption()


def test_no_deferral_for_a_need_beyond_the_held_blocks_an_unknown_need_or_a_zero_bound() -> None:
    _, hz = deferring(3)
    step(hz, 3)  # short of 3, 2 held
    assert not hz.defer_preemption() and hz.deferrals_too_small == 1
    step(hz, None)  # no allocation seen this step: the need of an earlier step is not used
    assert not hz.defer_preemption()
    for bound in (0, 1):
        _, hz = deferring(bound)
        step(hz)
        assert not hz.defer_preemption() and hz.preemptions_deferred == 0


def test_nothing_held_is_no_deferral() -> None:
    pool, hz, _ = hazards(num_blocks=4)
    pool.get_new_blocks(pool.get_num_free_blocks())
    step(hz)
    assert not hz.defer_preemption()


def test_held_transfers_are_given_up_after_the_bound_of_steps_held_up_by_their_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool, hz = deferring(3)
    # A request needs 2 blocks, none is free, the 2 held would do: held up.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            step(hz, 2)
            assert hz.end_schedule(scheduled=False) == 0
        step(hz, 2)
        assert hz.end_schedule(scheduled=False) == 1  # the third such step in a row
    assert hz.held_releases == 1 and hz.blocks_on_their_way() == 0 and pool.get_num_free_blocks() == 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert "store of request 'r1'" in line and "scheduled nothing for 3 steps" in line
    assert hz.end_transfers(finished_sending={"r1"}) == 0  # its late report ends nothing


def test_a_fault_while_releasing_held_blocks_keeps_the_lease_and_is_never_raised() -> None:
    pool, hz = deferring(2)

    with patch.object(hz, "pool", AbandonFails(pool)):
        for _ in range(2):
            step(hz, 2)
            assert hz.end_schedule(scheduled=False) == 0
    assert hz.lease_faults == 1 and hz.leases_pending() == 1 and hz.blocks_on_their_way() == 2
    for _ in range(2):  # the next run of held-up steps gives it up
        step(hz, 2)
        hz.end_schedule(scheduled=False)
    assert hz.held_releases == 1 and hz.leases_pending() == 0 and hz.blocks_on_their_way() == 0


@pytest.mark.parametrize("interruption", ["a step that scheduled work", "a step that asked for no block"])
def test_a_step_not_held_up_by_held_blocks_restarts_the_count(interruption: str) -> None:
    _, hz = deferring(3)
    for _ in range(2):
        step(hz, 2)
        hz.end_schedule(scheduled=False)
    if interruption == "a step that scheduled work":
        step(hz, 2)
        hz.end_schedule(scheduled=True)
    else:
        step(hz, None)
        hz.end_schedule(scheduled=False)
    for _ in range(2):
        step(hz, 2)
        assert hz.end_schedule(scheduled=False) == 0
    assert hz.blocks_on_their_way() == 2 and hz.held_releases == 0


def test_engine_give_up_reads_each_connectors_own_time() -> None:
    from types import SimpleNamespace as NS

    assert engine_give_up("lmcache_mp", NS(scheduler_adapter=NS(_mq_timeout=300.0))) == 300.0
    assert engine_give_up("lmcache_mp", NS(scheduler_adapter=NS(_mq_timeout="300"))) is None
    assert engine_give_up("lmcache_mp", NS(scheduler_adapter=MagicMock())) is None  # a stand-in adapter
    assert engine_give_up("lmcache_mp", NS()) is None  # a worker-side object: no adapter
    with patch.dict(os.environ, {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "120"}):
        assert engine_give_up("nixl", NS()) == 120.0
    with patch.dict(os.environ, {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "0"}):
        assert engine_give_up("nixl", NS()) is None
    for name in ("mooncake_store", "offloading", "simple_cpu_offload", "lmcache"):
        assert engine_give_up(name, NS(scheduler_adapter=NS(_mq_timeout=5.0))) is None


# ----------------------------------------------------------------------
# vLLM's real Scheduler with MooncakeStore
# ----------------------------------------------------------------------


@pytest.fixture
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """``"stock"``: vLLM's own pool (the plugin disabled); ``"on"``: the
    plugin installed with hazards on. Undone afterwards."""
    from blockpool.integrations import vllm as plugin

    which = getattr(request, "param", "on")
    plugin.unregister()
    env = {plugin.ENV_PLUGIN: "0" if which == "stock" else "1", plugin.ENV_HAZARDS: "1"}
    with patch.dict(os.environ, env):
        plugin.register()
    try:
        yield which
    finally:
        plugin.unregister()


def scheduler_with_a_get_that_never_reports(
    num_blocks: int = 15, clock: Clock | None = None, **env: str
) -> tuple[Any, Any]:
    """vLLM's Scheduler with MooncakeStore (a consumer: loads only, the
    GET in the forward's step) and ``num_blocks`` blocks; requests A and C
    (40-token prompts, 60 tokens out) run, then B (80-token prompt, 20 out)
    whose first 48 tokens MooncakeStore holds: B's GET into its first three
    blocks begins and is never reported. Returns the scheduler and B's GET
    (``None`` with the plugin off). ``env``: settings read while the
    scheduler is built; ``clock``: the leases' clock."""
    from blockpool.integrations.vllm import connectors as vc
    from tests.test_vllm_connectors import lookup, make_request, make_scheduler, model_output

    with patch.dict(os.environ, env):
        scheduler = make_scheduler(
            "MooncakeStoreConnector", {"load_async": False}, num_blocks=num_blocks, role="kv_consumer"
        )
    if clock is not None:
        scheduler.kv_cache_manager.block_pool.hazards.clock = clock
    cs = scheduler.connector.connector_scheduler
    cs.client.lookup.return_value = lookup(0)
    for rid in ("A", "C"):
        scheduler.add_request(
            make_request(rid, list(range(1, 41)) if rid == "A" else list(range(300, 340)), 60)
        )
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(out))
    cs.client.lookup.return_value = lookup(48)
    scheduler.add_request(make_request("B", list(range(100, 180)), 20))
    out = scheduler.schedule()
    cs.client.lookup.return_value = lookup(0)  # B recomputes after a preemption: no second GET
    (meta,) = [rm for rm in out.kv_connector_metadata.requests if rm.req_id == "B"]
    wire = getattr(meta, vc.META_LOAD, None)
    scheduler.update_from_output(out, model_output(out))  # B's GET never appears in finished_recving
    return scheduler, None if wire is None else Transfer.from_wire(wire)


def serve(scheduler: Any, max_steps: int = 400, each_step: Any = None) -> tuple[int, int]:
    """Step the scheduler (every scheduled request samples one token) until
    no request is left or ``max_steps`` steps ran. Returns the requests left
    unfinished and the longest run of steps that scheduled nothing."""
    from tests.test_vllm_connectors import model_output

    longest = run = 0
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        if each_step is not None:
            each_step()
        out = scheduler.schedule()
        run = 0 if out.total_num_scheduled_tokens else run + 1
        longest = max(longest, run)
        scheduler.update_from_output(out, model_output(out))
    return scheduler.get_num_unfinished_requests(), longest


@needs_vllm
@pytest.mark.parametrize("mode", ["stock", "on"], indirect=True)
def test_a_get_that_never_reports_does_not_stop_the_scheduler(mode: str) -> None:
    scheduler, get = scheduler_with_a_get_that_never_reports()
    assert (get is not None) == (mode == "on")
    left, longest = serve(scheduler)
    assert left == 0  # A, B and C finish, plugin on as stock
    bound = 16 if mode == "on" else 0
    assert longest <= bound
    if mode == "on":
        hz = scheduler.kv_cache_manager.block_pool.hazards
        assert hz.defer_steps == 16
        # B was preempted with its GET pending: its blocks stayed held, and a
        # later shortfall waited for them at most the bound, then vLLM preempted.
        assert hz.blocks_on_their_way() == len(get.block_ids)
        assert hz.preemptions_deferred > 0 and hz.deferrals_given_up > 0


@needs_vllm
@pytest.mark.parametrize("mode", ["on"], indirect=True)
def test_defer_steps_zero_preempts_at_once(mode: str) -> None:
    scheduler, get = scheduler_with_a_get_that_never_reports(**{ENV_DEFER_STEPS: "0"})
    hz = scheduler.kv_cache_manager.block_pool.hazards
    assert hz.defer_steps == 0
    left, longest = serve(scheduler)
    assert (left, longest) == (0, 0)
    assert hz.preemptions_deferred == 0 and hz.blocks_on_their_way() == len(get.block_ids)


@needs_vllm
@pytest.mark.parametrize("mode", ["on"], indirect=True)
def test_held_blocks_too_few_for_the_need_do_not_defer(mode: str) -> None:
    scheduler, _ = scheduler_with_a_get_that_never_reports()
    hz = scheduler.kv_cache_manager.block_pool.hazards
    core = hz.pool
    coordinator = scheduler.kv_cache_manager.coordinator
    need = coordinator.get_num_blocks_to_allocate

    def beyond_the_held_blocks(*a: Any, **k: Any) -> int:
        # vLLM allocates for the count it computed; the wiring reads a need
        # that the held blocks and the free ones together fall one short of.
        n = need(*a, **k)
        hz.last_need = n + len(core.holdback) + core.get_num_free_blocks() + 1
        return n

    coordinator.get_num_blocks_to_allocate = beyond_the_held_blocks
    left, longest = serve(scheduler)
    assert (left, longest) == (0, 0)  # preempted at once, as stock
    assert hz.preemptions_deferred == 0 and hz.deferrals_too_small > 0


@needs_vllm
@pytest.mark.parametrize("mode", ["on"], indirect=True)
def test_the_lease_gives_up_a_get_that_never_reports_and_its_blocks_are_reused(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    scheduler, get = scheduler_with_a_get_that_never_reports(clock=clock, **{ENV_TRANSFER_TIMEOUT: "30"})
    hz = scheduler.kv_cache_manager.block_pool.hazards
    core = scheduler.kv_cache_manager.block_pool.core
    assert hz.give_up_time("mooncake_store") == 30.0

    def tick() -> None:
        clock.now += 1.0  # one second per step

    given_up_before = SERVED.transfers_given_up
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        left, longest = serve(scheduler, each_step=tick)
    assert left == 0 and longest <= 16
    # The lease ended the GET once 30 s passed: its token failed, its blocks
    # came back, and nothing is held any more.
    assert core.is_ended(get.token)
    assert hz.transfers_abandoned == 1 and SERVED.transfers_given_up - given_up_before == 1
    assert hz.blocks_on_their_way() == 0 and len(core.holdback) == 0
    warnings = [r.getMessage() for r in caplog.records if "did not report within" in r.getMessage()]
    assert len(warnings) == 1
    assert (
        "'B'" in warnings[0] and "mooncake_store" in warnings[0] and str(list(get.block_ids)) in warnings[0]
    )
    # Every block is back: the pool's free count is its whole size less the null block.
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    # The blocks are reused after: a new request is served from them.
    from tests.test_vllm_connectors import make_request

    scheduler.add_request(make_request("D", list(range(500, 700)), 4))
    assert serve(scheduler) == (0, 0)


@needs_vllm
@pytest.mark.parametrize("mode", ["on"], indirect=True)
def test_a_late_report_of_a_given_up_transfer_is_ignored(mode: str) -> None:
    clock = Clock()
    scheduler, get = scheduler_with_a_get_that_never_reports(clock=clock, **{ENV_TRANSFER_TIMEOUT: "30"})
    hz = scheduler.kv_cache_manager.block_pool.hazards
    core = scheduler.kv_cache_manager.block_pool.core
    from tests.test_vllm_connectors import model_output

    clock.now += 31
    out = scheduler.schedule()
    assert hz.transfers_abandoned == 1 and core.is_ended(get.token)
    scheduler.update_from_output(out, model_output(out))
    failed = core.stats().failed_tokens
    # The connector's report comes after the give-up: it ends nothing.
    assert hz.end_transfers(finished_recving={"B"}) == 0
    core.poll()
    assert core.stats().failed_tokens == failed and hz.pending_transfers() == []
    assert serve(scheduler)[0] == 0


def scheduler_with_blocks_held_by_an_aborted_get(**env: str) -> Any:
    """vLLM's Scheduler with MooncakeStore (14 blocks, chunks of 64 tokens):
    B's GET of 48 tokens begins and never reports, and B is aborted, so its
    three GET blocks are held (the plugin on) or free again (stock); A (40
    tokens, 8 out) runs; E (160 tokens, 4 out) arrives: it fits in the
    blocks only with the held ones."""
    from vllm.v1.request import RequestStatus

    from tests.test_vllm_connectors import lookup, make_request, make_scheduler, model_output

    with patch.dict(os.environ, env):
        scheduler = make_scheduler(
            "MooncakeStoreConnector",
            {"load_async": False},
            num_blocks=14,
            role="kv_consumer",
            max_num_batched_tokens=64,
        )
    cs = scheduler.connector.connector_scheduler
    cs.client.lookup.return_value = lookup(48)
    scheduler.add_request(make_request("B", list(range(100, 180)), 20))
    out = scheduler.schedule()
    scheduler.update_from_output(out, model_output(out))
    cs.client.lookup.return_value = lookup(0)
    scheduler.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("A", list(range(1, 41)), 8))
    out = scheduler.schedule()
    scheduler.update_from_output(out, model_output(out))
    scheduler.add_request(make_request("E", list(range(1000, 1160)), 4))
    return scheduler


@needs_vllm
@pytest.mark.parametrize("mode", ["stock", "on"], indirect=True)
def test_a_request_that_needs_blocks_held_for_a_get_that_never_reports_is_served_within_the_bound(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = scheduler_with_blocks_held_by_an_aborted_get()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        left, longest = serve(scheduler)
    assert left == 0
    if mode == "stock":
        assert longest == 0
        return
    hz = scheduler.kv_cache_manager.block_pool.hazards
    # E waited while running (15 steps deferred), preempted itself in the
    # 16th, which still scheduled nothing and gave the held GET up: at most
    # the bound of steps scheduled nothing.
    assert longest <= hz.defer_steps
    assert hz.held_releases == 1 and hz.blocks_on_their_way() == 0
    (line,) = [r.getMessage() for r in caplog.records if "did not report within" in r.getMessage()]
    assert "load of request 'B'" in line and "scheduled nothing for 16 steps" in line


@pytest.mark.skipif(
    not _VLLM or importlib.util.find_spec("lmcache") is None, reason="needs vLLM and LMCache (.venv-lmcache)"
)
@pytest.mark.parametrize("mode", ["on"], indirect=True)
def test_lmcache_mp_transfers_are_given_up_at_lmcaches_own_mq_timeout(mode: str) -> None:
    from blockpool.integrations.vllm import lmcache_mp as mp
    from tests import test_vllm_lmcache_mp as lm
    from tests.test_vllm_connectors import make_scheduler

    vmod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector")
    with patch.object(vmod, "LMCacheMPConnector", lm.connector_mod.LMCacheMPConnector), lm.lmcache_io() as io:
        io.scheduler_adapter._mq_timeout = 300.0  # LMCache's own wait for its server (lmcache.mp.mq_timeout)
        scheduler = make_scheduler(lm.CONNECTOR)
    hz = scheduler.kv_cache_manager.block_pool.hazards
    assert hz.give_up_time(mp.LOAD_STREAM) == hz.give_up_time(mp.STORE_STREAM) == 300.0


@pytest.mark.parametrize(
    "need", [0, 2, 3], ids=["free blocks cover it", "held blocks cover it", "neither covers it"]
)
def test_a_refused_allocation_with_blocks_held_counts_as_held_up_whatever_the_arithmetic(need: int) -> None:
    # vLLM refuses an allocation against its free count less its watermark
    # and the blocks it reserves (prefills in flight, speculative decoding),
    # which the need the wiring reads does not include: a step that
    # scheduled nothing after a refused allocation while blocks are held is
    # held up, and the bound gives the held transfers up (stock vLLM would
    # have had those blocks free).
    _, hz = deferring(3)
    for _ in range(2):
        step(hz, need)
        assert hz.end_schedule(scheduled=False) == 0
    step(hz, need)
    assert hz.end_schedule(scheduled=False) == 1
    assert hz.blocks_on_their_way() == 0 and hz.held_releases == 1
