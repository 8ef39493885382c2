"""The seeded fault harness (``tests/vllm_faults.py``) on vLLM's real
scheduler: over a budget of schedules per simulated connector, the plugin
(hazards on, and audit) serves every request stock vLLM serves, with the
same tokens, no exception, no stall beyond the bound, no leaked block and no
more blocks handed out under a live transfer than stock; every fault kind a
connector's simulated worker declares fires. Negative controls: with the
plugin's deferral bound or its leases taken away, the harness reports the
stall and the leak they prevent. ``BLOCKPOOL_FAULT_SCHEDULES`` sets the
budget per connector (default 8; ``.ci/run`` raises it). Needs vLLM 0.34
(skipped otherwise: the simulated workers follow its connectors' worker
halves) and the shape-only model configs of ``../shared/vllm-parity/hf``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("torch")
if not os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES"):
    pytest.skip("no shape-only model configs (../shared/vllm-parity/hf)", allow_module_level=True)

from blockpool.integrations import vllm as plugin
from tests import vllm_faults as vf

if plugin.release_line(plugin.vllm_version()) != (0, 34):
    pytest.skip(
        f"the simulated workers follow vLLM 0.34's connectors (vLLM {plugin.vllm_version()} here)",
        allow_module_level=True,
    )

BUDGET = int(os.environ.get("BLOCKPOOL_FAULT_SCHEDULES", "8"))
"""Schedules per connector."""
FIRING_SEARCH = 300
"""Seeds tried at most (stock runs only) for a fault kind the budget's
schedules did not fire."""

CONNECTORS = sorted(vf.load_sims())

KNOWN_DEFECTS: dict[tuple[str, int], str] = {}
"""Schedules the plugin fails on a defect not yet fixed, with the defect:
left out of the budget's assertion, each skipped by name in
:func:`test_a_schedule_of_a_known_defect`."""


@pytest.fixture(scope="module")
def totals() -> dict[str, vf.Totals]:
    """Each connector's totals over the budget, computed once for the module."""
    return {}


def _totals(cache: dict[str, vf.Totals], connector: str) -> vf.Totals:
    if connector not in cache:
        seeds = [s for s in range(BUDGET) if (connector, s) not in KNOWN_DEFECTS]
        cache[connector] = vf.run_many(connector, seeds)
    return cache[connector]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_the_plugin_serves_every_schedule_stock_serves(totals: dict[str, vf.Totals], connector: str) -> None:
    t = _totals(totals, connector)
    assert t.schedules == BUDGET - sum(c == connector and s < BUDGET for c, s in KNOWN_DEFECTS)
    lines = [f"seed {v.schedule.seed}: {'; '.join(v.failures)}\n  replay: {v.replay()}" for v in t.failed]
    assert lines == []


@pytest.mark.parametrize(
    ("connector", "seed"),
    [
        pytest.param(c, s, marks=pytest.mark.skip(reason=f"known defect: {why}"))
        for (c, s), why in KNOWN_DEFECTS.items()
    ],
)
def test_a_schedule_of_a_known_defect(connector: str, seed: int) -> None:
    v = vf.run_schedule(seed, connector)
    assert v.failures == [], v.replay()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_every_fault_kind_a_connector_declares_fires(totals: dict[str, vf.Totals], connector: str) -> None:
    """Over the budget, and where a kind did not fire there, over stock runs
    of the next seeds (at most :data:`FIRING_SEARCH`): each fault kind the
    connector's simulated worker declares is confirmed fired."""
    t = _totals(totals, connector)
    fired = {k for k, n in t.fired.items() if n}
    declared = set(vf.SIMS[connector].fault_kinds)
    seed = BUDGET
    while declared - fired and seed < BUDGET + FIRING_SEARCH:
        schedule = vf.make_schedule(seed, connector)
        if {f.fault for f in schedule.faults} & (declared - fired):
            fired |= {f.fault for f in vf.serve(schedule, "stock").fired}
        seed += 1
    assert declared - fired == set()


# ----------------------------------------------------------------------
# negative controls: what the bound and the leases prevent, the harness finds
# ----------------------------------------------------------------------

STALL_SEED = 27
"""A MooncakeStore schedule whose PUT pins nothing and never reports, in a
pool too small to serve the next request without its blocks."""
LEAK_SEED = 315
"""A MooncakeStore schedule whose PUT pins nothing and never reports, in a
pool large enough to serve every request without its blocks."""


def _verdict(seed: int) -> vf.Verdict:
    return vf.run_schedule(seed, "mooncake_store", modes=("stock", "on"))


def test_the_stall_schedule_is_served_with_the_deferral_bound() -> None:
    v = _verdict(STALL_SEED)
    assert any(f.fault == "never" for f in v.results["stock"].fired)
    assert v.failures == []


def test_without_the_deferral_bound_the_harness_reports_the_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    from blockpool.integrations.vllm import hazards as vh

    monkeypatch.setattr(vh.StepHazards, "end_schedule", lambda self, scheduled: 0)  # never gives up
    v = _verdict(STALL_SEED)
    assert any("stalled" in f for f in v.failures)
    assert any("never finished" in f for f in v.failures)
    assert v.stock_only == []


def test_the_leak_schedule_is_served_with_the_leases() -> None:
    v = _verdict(LEAK_SEED)
    assert any(f.fault == "never" for f in v.results["stock"].fired)
    assert v.failures == []


def test_without_the_leases_the_harness_reports_the_leaked_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from blockpool.integrations.vllm import hazards as vh

    monkeypatch.setattr(vh.StepHazards, "expire_transfers", lambda self: 0)  # no lease ever ends
    v = _verdict(LEAK_SEED)
    (failure,) = v.failures
    assert failure.startswith("on: leaked blocks [")
    assert v.results["stock"].leaked == []


# ----------------------------------------------------------------------
# the oracle on results made by hand
# ----------------------------------------------------------------------


def _schedule(faults: list[vf.Fault] | None = None) -> vf.Schedule:
    return vf.Schedule(seed=0, connector="offloading", requests=[], faults=faults or [], events=[],
                       num_blocks=8, max_num_batched_tokens=64, ranks=1, policy="fail")  # fmt: skip


def _run(mode: str, **kw: Any) -> vf.RunResult:
    r = vf.RunResult(mode, outputs={"r0": (5, 6)}, status={"r0": "FINISHED_LENGTH_CAPPED"})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_the_oracle_reports_a_request_stock_served_and_the_plugin_failed() -> None:
    on = _run("on", status={"r0": "FINISHED_ERROR"})
    v = vf.judge(_schedule(), {"stock": _run("stock"), "on": on})
    assert v.failures == ["on: r0 failed (stock: FINISHED_LENGTH_CAPPED)"]


def test_the_oracle_reports_a_request_the_plugin_served_where_stock_failed_it_apart() -> None:
    # The plugin's prefix cache may keep content stock evicted, so a load
    # that fails in stock never runs: serving the request is no failure.
    stock = _run("stock", outputs={"r0": ()}, status={"r0": "FINISHED_ERROR"})
    v = vf.judge(_schedule(), {"stock": stock, "on": _run("on")})
    assert v.failures == [] and v.ok
    assert v.served_more == ["on: r0 served (stock: FINISHED_ERROR)"]
    totals = vf.Totals("offloading")
    totals.add(v)
    assert totals.served_more == 1 and totals.requests_failed == 0
    assert "served where stock failed them: offloading 1" in vf.format_totals([totals])


def test_the_oracle_reports_other_tokens_a_stall_beyond_the_bound_and_a_leak() -> None:
    on = _run("on", outputs={"r0": (5, 7)}, longest_idle=3 + 10, leaked=[4])
    v = vf.judge(_schedule(), {"stock": _run("stock", longest_idle=3), "on": on}, bound=9)
    assert v.failures == [
        "on: r0 output (5, 7) != stock's (5, 6)",
        "on: stalled 13 steps without scheduled work (stock's longest 3, bound 9)",
        "on: leaked blocks [4]",
    ]
    same = vf.judge(
        _schedule(), {"stock": _run("stock", longest_idle=3), "on": _run("on", longest_idle=12)}, bound=9
    )
    assert same.failures == []  # within the bound


def test_the_oracle_reports_stock_failures_apart_and_unfired_faults() -> None:
    fault = vf.Fault("r0", "load", 0, "late", 2)
    stock = _run("stock", leaked=[3], unfinished=["r0"])
    v = vf.judge(_schedule([fault]), {"stock": stock, "on": _run("on", leaked=[3], unfinished=["r0"])})
    assert v.failures == [] and v.ok
    assert v.stock_only == ["stock left ['r0'] unfinished", "stock leaked blocks [3]"]
    assert v.unfired == [fault]
    assert v.replay() == "python -m tests.vllm_faults --connector offloading --seed 0 --schedules 1 -v"


def test_the_totals_count_each_failure_in_its_column() -> None:
    v = vf.Verdict(_schedule(), {"stock": _run("stock")}, failures=[
        "on: r0 failed (stock: FINISHED_LENGTH_CAPPED)",
        "audit: r1 never finished (stock: FINISHED_LENGTH_CAPPED)",
        "on: raised where stock did not: RuntimeError: Failed to reset",
        "audit: stalled 40 steps without scheduled work (stock's longest 0, bound 18)",
        "on: leaked blocks [3]",
        "on: 2 block(s) reused under a live transfer (stock: 0): step 4: block 3",
    ])  # fmt: skip
    t = vf.Totals("offloading")
    t.add(v)
    assert (t.requests_failed, t.crashes, t.stalls, t.leaked, t.reused_live) == (2, 1, 1, 1, 1)
    assert t.failed == [v] and t.schedules == 1


def test_the_modes_after_stock_meet_exactly_the_faults_stock_met_on_its_requests() -> None:
    by_request = vf.Fault("r1", "load", 0, "fail")
    nth = vf.Fault("*", "store", 2, "never")
    unmet = vf.Fault("r2", "store", 1, "late", 3)
    stock = _run("stock", met={by_request, nth}, resolved={nth: vf.Fault("r0", "store", 1, "never")})
    fixed = vf.resolved(_schedule([by_request, nth, unmet]), stock)
    assert fixed.faults == [by_request, vf.Fault("r0", "store", 1, "never")]
