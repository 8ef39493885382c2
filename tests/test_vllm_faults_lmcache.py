"""The seeded fault harness's LMCache workers (``tests/vllm_faults_lmcache.py``)
on vLLM's real scheduler with LMCache 0.5.6's own code: they register with
the harness (whose CI test, ``tests/test_vllm_faults.py``, runs their
schedules), their simulated store answers lookups as LMCache does, and
schedules built by hand serve what stock serves: two requests filling one
LMCache prefix in one step, and a prefix-cache reset while an LMCache MP
store op still reads a running request's blocks. Needs vLLM and LMCache
(skipped otherwise: run in ``.venv-lmcache``) and the shape-only model
configs of ``../shared/vllm-parity/hf``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("torch")
if importlib.util.find_spec("lmcache") is None:
    pytest.skip("this vLLM venv has no LMCache: run in .venv-lmcache", allow_module_level=True)
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from tests import vllm_faults as vf
from tests import vllm_faults_lmcache as vl


@pytest.fixture(autouse=True)
def _stand_ins_stopped() -> Iterator[None]:
    """LMCache's stand-ins a run started are stopped after each test, even
    one whose build failed."""
    try:
        yield
    finally:
        vl.stand_ins_off()


def test_both_lmcache_connectors_are_registered_with_the_harness() -> None:
    assert vf.SIMS["lmcache"] is vl.LMCacheSim
    assert vf.SIMS["lmcache_mp"] is vl.LMCacheMPSim


def test_the_simulated_store_hits_the_longest_saved_run_of_whole_chunks() -> None:
    store = vl.ChunkStore()
    store.save(range(1, 80))  # two whole chunks: [0, 32), [0, 64)
    assert store.hit(range(1, 80)) == 64
    assert store.hit([*range(1, 40), 999]) == 32
    assert store.hit([5, *range(2, 80)]) == 0


def shared_prefix_after_a_reset(connector: str, policy: str) -> vf.Schedule:
    """r0 computes a 64-token prefix (LMCache saves it) and finishes; the
    prefix cache is reset (vLLM forgets the prefix, LMCache keeps it); r1
    and r2, sharing that prefix, then arrive together: LMCache loads the
    prefix into the blocks vLLM allocated for r1 and published at once,
    which r2 hits in the same step."""
    schedule = vf.make_schedule(0, connector)
    prefix = tuple(range(1, 65))
    schedule.requests[:] = [
        vf.RequestSpec("r0", (*prefix, 500), 2, 1),
        vf.RequestSpec("r1", (*prefix, 600, 601), 3, 8),
        vf.RequestSpec("r2", (*prefix, 700, 701, 702), 3, 8),
    ]
    schedule.faults[:] = []
    schedule.events[:] = [vf.Event("reset", "r0", 2)]
    schedule.ranks = 1
    schedule.num_blocks = 32
    schedule.policy = policy
    return schedule


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_two_requests_filling_one_lmcache_prefix_in_one_step_are_served_as_stock_serves_them(
    policy: str,
) -> None:
    """A load into blocks whose keys vLLM published when it allocated them,
    which a second request hits in the same step, is the fill those keys
    announce: LMCache runs it in every mode, and under either policy both
    requests finish with stock's tokens."""
    schedule = shared_prefix_after_a_reset("lmcache", policy)
    loads: list[tuple[str, int]] = []
    begin = vl.LMCacheSim.begin

    def recording(self: Any, req_id: str, kind: str, *a: Any, **k: Any) -> Any:
        t = begin(self, req_id, kind, *a, **k)
        if kind == "load":
            loads.append((req_id, t.planned))
        return t

    results = {}
    with patch.object(vl.LMCacheSim, "begin", recording):
        for mode in vf.MODES:
            loads.clear()
            results[mode] = vf.serve(schedule, mode)
            assert loads == [("r1", 8)], mode  # r2 hit r1's blocks in the step of r1's load
    v = vf.judge(schedule, results)
    assert v.failures == [] and v.stock_only == []
    assert set(results["on"].status.values()) == {"FINISHED_LENGTH_CAPPED"}


def test_a_prefix_cache_reset_while_a_store_op_still_reads_a_running_requests_blocks_is_served_as_stock() -> (
    None
):
    """LMCache MP on two ranks, r0's first store op reported late; the
    prefix cache is reset (vLLM preempts r0) while the op still reads r0's
    blocks. Stock resets; so does the plugin
    (the held blocks keep their hold and lose their keys), and r0 finishes
    with stock's tokens."""
    late = vf.Fault("r0", "store", 0, "late", 4)
    schedule = vf.make_schedule(0, "lmcache_mp")
    schedule.requests[:] = [vf.RequestSpec("r0", tuple(range(1, 65)), 6, 1)]
    schedule.faults[:] = [late]
    schedule.events[:] = [vf.Event("reset", "r0", 1)]
    schedule.ranks = 2
    schedule.num_blocks = 16
    schedule.options.update(delay=1, reversed_ranks=False, lazy_offload=False)
    results = {m: vf.serve(schedule, m) for m in vf.MODES}
    v = vf.judge(schedule, results)
    assert v.failures == [] and v.stock_only == []
    assert all(r.fired == {late: 1} and len(r.outputs["r0"]) == 6 for r in results.values())
