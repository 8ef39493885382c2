"""The seeded fault harness's NIXL workers (``tests/vllm_faults_nixl.py``)
on vLLM's real scheduler: they register with the harness (whose CI test,
``tests/test_vllm_faults.py``, runs their schedules) for ``NixlConnector``
and ``MultiConnector([NixlConnector, MooncakeStoreConnector])``; no
MooncakeStore PUT reads a block before NIXL's post-receive kernels rewrote
it, and with the pool's record of those kernels removed the harness finds
the unordered PUT; a send the remote never reads is reaped at NIXL's lease
and its blocks come back. Needs vLLM (skipped otherwise) and the
shape-only model configs of ``../shared/vllm-parity/hf``.
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


def one_request(
    connector: str, role: str, faults: tuple[vf.Fault, ...] = (), **options: object
) -> vf.Schedule:
    """A schedule of ``connector`` serving one request of ``prompt`` tokens
    (40: two full blocks and a partial one) whose prompt is ``role``'s
    (:data:`~tests.vllm_faults_nixl.ROLES`), with ``faults`` and the
    NIXL ``options`` given (the rest as seed 0 draws them)."""
    schedule = vf.make_schedule(0, connector)
    prompt = tuple(range(1, 1 + int(options.pop("prompt", 40))))  # type: ignore[call-overload]
    schedule.requests[:] = [vf.RequestSpec("r0", prompt, 4, 1)]
    schedule.faults[:] = list(faults)
    schedule.events[:] = []
    schedule.ranks = 1
    schedule.num_blocks = 16
    schedule.options.update(roles={"r0": role}, **options)
    return schedule


def test_both_nixl_pairs_are_registered_with_the_harness() -> None:
    assert vf.SIMS["nixl"] is vn.NixlSim
    assert vf.SIMS["nixl_mooncake"].connector == "MultiConnector"


def serve_put_after_receive() -> vf.Verdict:
    """One remote prefill's 40 tokens received by NIXL (and rewritten by its
    post-receive kernels), then stored by MooncakeStore: stock and the
    plugin, judged."""
    schedule = one_request("nixl_mooncake", "prefill", read_delay=1, post_receive=True)
    return vf.judge(schedule, {m: vf.serve(schedule, m) for m in ("stock", "on")})


def test_a_put_of_blocks_nixl_rewrote_is_ordered_after_the_rewrite() -> None:
    v = serve_put_after_receive()
    assert v.failures == [] and v.stock_only == []
    assert v.results["on"].outputs == v.results["stock"].outputs != {}


def test_the_harness_finds_a_put_unordered_after_nixls_post_receive_writes_when_the_pool_does_not_track_them() -> (
    None
):
    """The negative control: without the pool's record of NIXL's
    post-receive kernels (``StepHazards.rewrites_on_receive`` a no-op),
    the PUT of the received blocks names no compute token after them, and
    the simulated worker's check fails the plugin's run, not stock's."""
    from blockpool.integrations.vllm.hazards import StepHazards

    with patch.object(StepHazards, "rewrites_on_receive", lambda self, name: None):
        v = serve_put_after_receive()
    assert v.results["stock"].error is None
    (line,) = v.failures
    assert line.startswith("on: raised where stock did not: ") and "UnorderedRead" in line
    assert "unordered after NIXL's post-receive write of r0's read" in line


def test_a_send_the_remote_never_reads_is_reaped_at_the_lease_and_its_blocks_come_back() -> None:
    never = vf.Fault("r0", "store", 0, "never")
    schedule = one_request("nixl", "decode", (never,), lease_steps=5)
    results = {m: vf.serve(schedule, m) for m in ("stock", "on")}
    v = vf.judge(schedule, results)
    assert v.failures == [] and v.stock_only == []
    for r in results.values():
        assert r.fired == {never: 1}
        assert r.leaked == [] and r.unfinished == []
