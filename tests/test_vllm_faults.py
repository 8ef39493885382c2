"""The seeded fault harness (``tests/vllm_faults.py``) on vLLM's real
scheduler: over a budget of schedules per connector, the plugin (hazards on,
and audit) serves every request stock vLLM serves, with the same tokens, no
exception, no stall beyond the bound, no leaked block and no block handed out
under a live transfer; every fault kind fires. ``BLOCKPOOL_FAULT_SCHEDULES``
sets the budget per connector (default 8). Needs vLLM (skipped otherwise)
and the shape-only model configs of ``../shared/vllm-parity/hf``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from tests import vllm_faults as vf

BUDGET = int(os.environ.get("BLOCKPOOL_FAULT_SCHEDULES", "8"))
"""Schedules per connector (``.ci/run`` raises it on the newest vLLM line)."""

CONNECTORS = sorted(vf.SIMS)


@pytest.fixture(scope="module")
def totals() -> dict[str, vf.Totals]:
    return {}


def _totals(cache: dict[str, vf.Totals], connector: str) -> vf.Totals:
    if connector not in cache:
        cache[connector] = vf.run_many(connector, range(BUDGET))
    return cache[connector]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_the_plugin_serves_every_schedule_stock_serves(totals: dict[str, vf.Totals], connector: str) -> None:
    t = _totals(totals, connector)
    assert t.schedules == BUDGET
    lines = [f"seed {v.schedule.seed}: {'; '.join(v.failures)}\n  replay: {v.replay()}" for v in t.failed]
    assert lines == []
