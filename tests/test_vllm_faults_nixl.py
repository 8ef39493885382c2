"""The seeded fault harness over NIXL (``tests/vllm_faults_nixl.py``): on
vLLM's real scheduler, the plugin (hazards on, and audit) serves every
request stock vLLM serves with ``NixlConnector`` and with
``MultiConnector([NixlConnector, MooncakeStoreConnector])``, and no
MooncakeStore PUT reads a block before NIXL's post-receive kernels
rewrote it; with the pool's tracking of those kernels removed, the harness
finds the unordered PUT. ``BLOCKPOOL_FAULT_SCHEDULES`` sets the budget per
connector (default 8). Needs vLLM (skipped otherwise) and the shape-only
model configs of ``../shared/vllm-parity/hf``.
"""

from __future__ import annotations

import os
from unittest.mock import patch

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from tests import vllm_faults as vf
from tests import vllm_faults_nixl as vn
from tests.test_vllm_faults import BUDGET

CONNECTORS = [n for n in ("nixl", "nixl_mooncake") if n in vf.SIMS]

PUT_AFTER_RECEIVE_SEEDS = (2, 4)
"""``nixl_mooncake`` schedules whose first PUT reads blocks NIXL received
(and rewrote) in the step before."""


@pytest.mark.parametrize("connector", CONNECTORS)
def test_the_plugin_serves_every_nixl_schedule_stock_serves(connector: str) -> None:
    t = vf.run_many(connector, range(BUDGET))
    assert t.schedules == BUDGET
    lines = [f"seed {v.schedule.seed}: {'; '.join(v.failures)}\n  replay: {v.replay()}" for v in t.failed]
    assert lines == []


def test_both_nixl_pairs_are_registered_with_the_harness() -> None:
    assert vf.SIMS["nixl"] is vn.NixlSim
    assert vf.SIMS["nixl_mooncake"].connector == "MultiConnector"


def test_a_put_of_blocks_nixl_rewrote_is_ordered_after_the_rewrite() -> None:
    for seed in PUT_AFTER_RECEIVE_SEEDS:
        v = vf.run_schedule(seed, "nixl_mooncake", ("stock", "on"))
        assert v.failures == [], v.replay()


def test_the_harness_finds_a_put_unordered_after_nixls_post_receive_writes_when_the_pool_does_not_track_them() -> (
    None
):
    """The negative control: without the pool's record of NIXL's
    post-receive kernels (``StepHazards.rewrites_on_receive`` a no-op),
    the PUT of the received blocks names no compute token after them, and
    the simulated worker's check fails the plugin's run, not stock's."""
    from blockpool.integrations.vllm.hazards import StepHazards

    with patch.object(StepHazards, "rewrites_on_receive", lambda self, name: None):
        for seed in PUT_AFTER_RECEIVE_SEEDS:
            v = vf.run_schedule(seed, "nixl_mooncake", ("stock", "on"))
            assert v.results["stock"].error is None
            (line,) = v.failures
            assert line.startswith("on: raised where stock did not: ") and "UnorderedRead" in line
            assert "unordered after NIXL's post-receive write" in line


def test_a_send_the_remote_never_reads_is_reaped_at_the_lease_and_its_blocks_come_back() -> None:
    schedule = vf.make_schedule(0, "nixl")
    spec = schedule.requests[0]
    schedule.requests[:] = [spec]
    schedule.options["roles"] = {spec.req_id: "decode"}
    schedule.faults[:] = [vf.Fault(spec.req_id, "store", 0, "never")]
    schedule.events[:] = []
    results = {m: vf.serve(schedule, m) for m in ("stock", "on")}
    v = vf.judge(schedule, results)
    assert v.failures == [] and v.stock_only == []
    for r in results.values():
        assert r.fired == {schedule.faults[0]: 1}
        assert r.leaked == [] and r.unfinished == []
