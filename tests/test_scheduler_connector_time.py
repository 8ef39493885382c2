"""``benchmarks/scheduler_connector_time.py``: its simulated worker, its
checks that every mode scheduled the same and that the wiring ran (no
vLLM), and one small run end to end (vLLM's venv only). Its statistics are
``engine_pool_time.py``'s (``test_engine_pool_time.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "scheduler_connector_time.py"
)
_spec = importlib.util.spec_from_file_location("scheduler_connector_time", _PATH)
assert _spec is not None and _spec.loader is not None
sct: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sct)


def _meta(
    loads: dict[int, Any] | None = None, stores: dict[int, Any] | None = None, flush: Any = None
) -> Any:
    return SimpleNamespace(load_jobs=loads or {}, store_jobs=stores or {}, jobs_to_flush=flush)


def _job(req: str, sync: bool = False) -> Any:
    return SimpleNamespace(req_id=req, sync=sync)


def test_the_worker_reports_loads_and_stores_after_their_transfer_steps_and_stores_never_in_their_own_step() -> (
    None
):
    w = sct.OffloadWorker(transfer_steps=0)
    w.plan(5, _meta(loads={1: _job("a"), 2: _job("b", sync=True)}, stores={3: _job("a")}))
    # An asynchronous load resumes its request; a synchronous one ran
    # before the forward (nobody waits for it); a store starts next step.
    assert w.due == {1: (5, "a"), 2: (5, None), 3: (6, None)}
    w = sct.OffloadWorker(transfer_steps=2)
    w.plan(5, _meta(loads={1: _job("a")}, stores={3: _job("a")}))
    assert w.due == {1: (7, "a"), 3: (7, None)}


def test_a_flushed_job_is_reported_in_the_step_that_flushes_it() -> None:
    w = sct.OffloadWorker(transfer_steps=3)
    w.plan(1, _meta(stores={4: _job("a"), 5: _job("b")}))
    w.plan(2, _meta(flush={4}))
    assert w.due == {4: (2, None), 5: (4, None)}


def _sig(tokens: list[Any], jobs: Any = None) -> list[Any]:
    return [tokens, [], [], [], [], jobs or [[], [], []]]


def test_the_first_step_scheduled_differently_is_named_with_what_differs() -> None:
    ref = {"mode": "off", "steps": [_sig([["0", 64]]), _sig([["0", 1]])]}
    run = {"mode": "on", "steps": [_sig([["0", 64]]), _sig([["0", 1]], [[[7, "0", 2]], [], []])]}
    assert (
        sct.first_difference(ref, run)
        == "step 2: jobs differ: off [[], [], []] vs on [[[7, '0', 2]], [], []]"
    )
    assert sct.first_difference(ref, ref) is None
    short = {"mode": "on", "steps": ref["steps"][:1]}
    assert sct.first_difference(ref, short) == "off ran 2 steps, on 1"


def _wiring(**kw: int) -> dict[str, Any]:
    w = dict.fromkeys(("loads_unfenced", "stores_unfenced", "transfers_pending_at_end"), 0)
    w.update(loads_begun=3, stores_begun=4, steps_issued=10, step_records=10, steps_ended=10)
    w.update(kw)
    return {"wiring": w}


def test_an_on_run_passes_only_when_every_job_and_step_went_through_the_pool() -> None:
    assert sct.wiring_fault(_wiring()) is None
    assert sct.wiring_fault({}) == "no hazard tracking in the scheduler's pool"
    assert (
        sct.wiring_fault(_wiring(stores_unfenced=1))
        == "0 load and 1 store job(s) without a transfer on the pool"
    )
    assert sct.wiring_fault(_wiring(loads_begun=0)) == (
        "0 loads and 4 stores begun on the pool: the workload moves nothing"
    )
    assert sct.wiring_fault(_wiring(steps_ended=9)) == "10 steps issued, 10 records shipped, 9 ended"
    assert sct.wiring_fault(_wiring(transfers_pending_at_end=2)) == (
        "2 transfer(s) still pending after every job was reported"
    )


def test_a_small_run_schedules_alike_in_every_mode_and_moves_blocks_through_the_pool(tmp_path: Any) -> None:
    pytest.importorskip("vllm.v1.core.sched.scheduler")  # vLLM brings transformers (the tiny model)
    cmd = [sys.executable, _PATH, "--requests", "24", "--prefixes", "8", "--prefix-blocks", "4",
           "--num-blocks", "40", "--max-num-seqs", "2", "--repeat", "1",
           "--log-dir", str(tmp_path / "logs"), "--json", str(tmp_path / "out.json")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every run scheduled the same requests" in done.stdout
    report = json.loads((tmp_path / "out.json").read_text())
    w = report["wiring"]
    assert w["loads_begun"] > 0 and w["stores_begun"] > 0 and w["loads_unfenced"] == w["stores_unfenced"] == 0
    assert 0 < w["steps_issued"] == w["steps_ended"] == w["step_records"]
    on = report["summary"]["on"]
    assert on["sched_cpu_paired_ratio_median"] == on["sched_cpu_paired_ratios"][0] > 0
    assert any(k.startswith("connector.") for k in on["methods"])
    assert not any(k.startswith(("wiring.", "connector.")) for k in report["summary"]["off"]["methods"])
