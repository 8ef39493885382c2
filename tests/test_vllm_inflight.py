"""Blocks held back for KV transfers in flight: vLLM's real ``Scheduler``
waits for them instead of preempting more requests for room that is
already coming back.

Four requests fill the pool; a host engine (MooncakeStore's send thread)
still reads the blocks of three of them. When every request needs one
more block, the scheduler preempts the last request; its blocks cannot be
handed out while the PUT reads them (the pool holds them back), so the
free count does not rise. Without the wiring the scheduler then preempts
the next request, whose blocks are held too, and so on until it preempts
the request it was making room for: no request runs. With it, vLLM's
``has_pending_block_frees()`` says room is coming; the request waits one
step and runs once the PUT's report brings the blocks back.

Needs vLLM (skipped otherwise) and the shape-only model configs of
``../shared/vllm-parity/hf``, like ``test_vllm_connectors.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from blockpool.integrations.vllm import connectors as vc
from blockpool.integrations.vllm.served import SERVED
from tests import test_vllm_connectors as tc
from tests.test_vllm_connectors import lookup, make_request, make_scheduler, model_output

registered = tc.registered  # the plugin installed, hazards on or off (request.param)

MOONCAKE = "mooncake_store"


def full_pool() -> Any:
    """vLLM's Scheduler with MooncakeStore (consumer: it loads, saves
    nothing) over 8 usable blocks, and four requests A-D of 31 distinct
    tokens each, after their prefill and one decode step: two blocks each,
    none free; each needs a third block in the next step."""
    scheduler = make_scheduler("MooncakeStoreConnector", num_blocks=9, role="kv_consumer")
    scheduler.connector.connector_scheduler.client.lookup.return_value = lookup(0)
    for r in "ABCD":
        scheduler.add_request(make_request(r, [ord(r) * 100 + i for i in range(31)]))
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(out))
    assert sorted(out.num_scheduled_tokens) == ["A", "B", "C", "D"]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    return scheduler


def wiring(scheduler: Any) -> vc.ConnectorWiring:
    (w,) = [w for _, w in vc._wirings_under(scheduler.connector) if w is not None]
    return w


def put_in_flight(scheduler: Any, req_ids: str) -> None:
    """Begin a PUT of each request's blocks on MooncakeStore's send thread,
    as the connector's planner does (keyed by a job), not yet reported."""
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    w = wiring(scheduler)
    for r in req_ids:
        assert w.store(r, [b.block_id for b in blocks[r]], MOONCAKE, key=(MOONCAKE, r)) is not None


def step(scheduler: Any) -> tuple[list[str], list[str]]:
    """One step: (requests scheduled, requests preempted), sorted."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, model_output(out))
    return sorted(out.num_scheduled_tokens), sorted(out.preempted_req_ids or ())


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_a_request_waits_for_blocks_held_by_a_transfer_instead_of_preempting_more(registered: bool) -> None:
    scheduler = full_pool()
    put_in_flight(scheduler, "BCD")
    pool = scheduler.kv_cache_manager.block_pool
    # D is preempted (nothing was on its way yet); its two blocks are held
    # behind its PUT. A waits for them: C, B and A itself are not preempted.
    assert step(scheduler) == ([], ["D"])
    assert pool.core.stats().held == 2 and pool.get_num_free_blocks() == 0
    assert [r.request_id for r in scheduler.running] == ["A", "B", "C"]
    assert pool.hazards.preemptions_deferred == 1
    # The connector reports D's PUT done: its blocks come back, A and B run.
    assert wiring(scheduler).finish((MOONCAKE, "D")) == 1
    assert pool.get_num_free_blocks() == 2
    scheduled, preempted = step(scheduler)
    assert scheduled == ["A", "B"]
    # C finds nothing free and nothing on its way: it is preempted, as vLLM
    # would (its blocks are now held behind its PUT); nobody else is.
    assert preempted == ["C"]


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_held_blocks_come_back_when_the_transfer_fails_too(registered: bool) -> None:
    scheduler = full_pool()
    put_in_flight(scheduler, "D")
    assert step(scheduler) == ([], ["D"])  # D's blocks held behind its PUT: A waits
    pool = scheduler.kv_cache_manager.block_pool
    assert wiring(scheduler).finish((MOONCAKE, "D"), failed=True) == 1
    assert (pool.core.stats().held, pool.get_num_free_blocks()) == (0, 2)
    # Nothing is held any more: the scheduler preempts again when it must.
    assert step(scheduler) == (["A", "B"], ["C"])


@pytest.mark.parametrize("registered", [True, False], indirect=True)
def test_with_no_block_held_the_scheduler_preempts_as_vllm_does(registered: bool) -> None:
    scheduler = full_pool()
    deferred = SERVED.preemptions_deferred
    # vLLM's own answer: D is preempted for A, D's blocks let A and B run,
    # C finds none left and is preempted itself.
    assert step(scheduler) == (["A", "B"], ["C", "D"])
    assert SERVED.preemptions_deferred == deferred


@pytest.mark.parametrize("registered", [True], indirect=True)
def test_the_first_wait_is_logged_once_per_process(
    registered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = full_pool()
    put_in_flight(scheduler, "BCD")
    SERVED.preemptions_deferred = 0
    with caplog.at_level(logging.INFO, logger="vllm.plugins.blockpool"):
        step(scheduler)
        step(scheduler)
    lines = [r.getMessage() for r in caplog.records if "instead of preempting" in r.getMessage()]
    expected = (
        "blockpool: a request did not fit while 2 block(s) were held back for KV transfers in flight: it "
        "waits for them instead of preempting another request (once per process; counted in "
        "SERVED.preemptions_deferred)"
    )
    assert lines == [expected]
    assert SERVED.preemptions_deferred == 2
