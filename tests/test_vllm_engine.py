"""The engine check's comparison and report logic
(blockpool.checking.vllm_engine), on hand-made run results: no
vLLM, torch or model needed (the engine runs themselves are
scripts/vllm_engine_check.sh)."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from typing import Any

import attrs
import pytest

from blockpool.checking import vllm_engine as ec
from blockpool.checking.vllm_engine import (
    CONNECTOR_MODE,
    EXIT_MISMATCH,
    EXIT_PASS,
    EXIT_SETUP,
    OUR_POOL,
    VLLM_POOL,
    WORKLOADS,
    ModelSpec,
    Workload,
    build_prompts,
    compare_runs,
    exit_status,
    format_report,
    mode_env,
    normalize_event,
    plugin_line_warnings,
    plugin_lines,
    step_stats,
)
from blockpool.cli import main as cli_main


def stored(hashes: list[int], parent: int | None = None, tokens: list[int] | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens or [1, 2], "block_size": 32, "medium": "GPU"}  # fmt: skip


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def run_result(mode: str) -> dict[str, Any]:
    """A run as the engine process reports it, correct for its mode."""
    ours = mode != "off"
    r: dict[str, Any] = {
        "mode": mode,
        "vllm_version": "0.33.0",
        "torch_version": "2.13.0+cpu",
        "device": "cpu",
        "pool_class": OUR_POOL if ours else VLLM_POOL,
        "pool_is_ours": ours,
        "pool_hazards": mode in ("on", "audit", CONNECTOR_MODE),
        "tokens": [[5, 6, 7], [8, 9, 10]],
        "num_cached_tokens": [0, 32],
        "prefix_cache_stats": {"requests": 2, "queries": 100, "hits": 32},
        "events": [stored([11, 12]), stored([13], parent=12), removed([11])],
        "events_per_batch": [2, 1],
        "timing": step_stats([0.001] * 4, [0.0005] * 4, [0.0008] * 4, [0.0004] * 4),
        "wall_s": {"total": 20.0},
        "plugin_lines": [],
    }
    if ours:
        r["served"] = {"allocations": 3, "steps_issued": 4 if r["pool_hazards"] else 0}
    return r


def runs(*modes: str) -> dict[str, dict[str, Any]]:
    return {m: run_result(m) for m in (modes or ec.MODES)}


# --- workloads ---------------------------------------------------------------


def test_builtin_workloads_are_valid() -> None:
    for w in WORKLOADS.values():
        w.validate(ModelSpec())


def test_prompts_are_deterministic_share_prefixes_and_repeat_whole_prompts() -> None:
    w = WORKLOADS["quick"]
    waves = build_prompts(w)
    assert waves == build_prompts(w)
    assert build_prompts(attrs.evolve(w, seed=1)) != waves
    assert [len(x) for x in waves] == [8, 8, 8] and sum(map(len, waves)) == w.requests
    plen = w.prefix_blocks * w.block_size
    flat = [p for wave in waves for p in wave]
    prefixes = [p[:plen] for p in flat[: w.prefixes]]
    assert len({tuple(p) for p in prefixes}) == w.prefixes
    for i, p in enumerate(flat):
        repeat = i >= len(waves[0]) and (i % len(waves[0])) % 4 == 3
        assert p[:plen] == (flat[i - len(waves[0])][:plen] if repeat else prefixes[i % w.prefixes])
        assert plen + w.suffix_tokens // 2 <= len(p) <= plen + w.suffix_tokens
        assert all(1 <= t < 1000 for t in p)
    assert waves[1][3] == waves[0][3] and waves[2][7] == waves[1][7]  # whole prompts again
    assert waves[1][0] != waves[0][0]


def test_prompts_split_into_uneven_waves() -> None:
    w = attrs.evolve(WORKLOADS["quick"], requests=10, waves=3)
    assert [len(x) for x in build_prompts(w)] == [4, 3, 3]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"requests": 0}, "requests must be >= 1"),
        ({"prefix_blocks": -1}, "prefix_blocks must be >= 0"),
        ({"waves": 30}, "30 waves for 24 requests"),
        ({"max_model_len": 4096}, "> the model's 1024 positions"),
        ({"prefix_blocks": 40}, "needs up to"),
        ({"num_blocks": 20}, "cannot hold one request"),
    ],
)
def test_workload_validation(change: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        attrs.evolve(WORKLOADS["quick"], **change).validate(ModelSpec())


# --- the runs' environments ----------------------------------------------------


def test_mode_env_sets_the_switches_and_clears_the_other_modes() -> None:
    base = {
        "PATH": "/bin",
        "BLOCKPOOL_VLLM_HAZARDS": "0",
        "BLOCKPOOL_VLLM_PLUGIN": "0",
        "BLOCKPOOL_VLLM_UNWIRED": "all",
    }
    off = mode_env("off", base)
    on = mode_env("on", base)
    hz = mode_env("hazards-off", base)
    assert off["BLOCKPOOL_VLLM_PLUGIN"] == "0" and "BLOCKPOOL_VLLM_HAZARDS" not in off
    assert "BLOCKPOOL_VLLM_PLUGIN" not in on and "BLOCKPOOL_VLLM_HAZARDS" not in on
    assert "BLOCKPOOL_VLLM_UNWIRED" not in on
    assert hz["BLOCKPOOL_VLLM_HAZARDS"] == "0" and "BLOCKPOOL_VLLM_PLUGIN" not in hz
    for env in (off, on, hz):
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert env["PYTHONHASHSEED"] == "0" and env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
        assert "VLLM_PLUGINS" not in env
    assert base["BLOCKPOOL_VLLM_HAZARDS"] == "0"  # not modified


def test_mode_env_allowlist() -> None:
    assert mode_env("off", {}, off_by="allowlist")["VLLM_PLUGINS"] == ""
    assert "BLOCKPOOL_VLLM_PLUGIN" not in mode_env("off", {}, off_by="allowlist")
    assert mode_env("on", {"VLLM_PLUGINS": ""})["VLLM_PLUGINS"] == "blockpool"
    assert mode_env("on", {"VLLM_PLUGINS": "a, blockpool"})["VLLM_PLUGINS"] == "a, blockpool"
    assert mode_env(CONNECTOR_MODE, {"VLLM_PLUGINS": "a"})["VLLM_PLUGINS"] == "a,blockpool"
    with pytest.raises(ValueError, match="unknown mode"):
        mode_env("sideways", {})
    with pytest.raises(ValueError, match="off_by"):
        mode_env("off", {}, off_by="kill")


# --- what a run records -------------------------------------------------------------


class FakeStored:
    """Stands for vLLM's msgspec BlockStored."""

    __struct_fields__ = ("block_hashes", "parent_block_hash", "token_ids", "extra_keys")

    def __init__(self) -> None:
        self.block_hashes = [b"\x00\x10", 7]
        self.parent_block_hash = None
        self.token_ids = (1, 2)
        self.extra_keys = [("lora", frozenset({2, 1}))]


@attrs.define
class Cleared:
    pass


def test_normalize_event() -> None:
    assert normalize_event(FakeStored()) == {
        "type": "FakeStored",
        "block_hashes": ["0010", 7],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "extra_keys": [["lora", [1, 2]]],
    }
    assert normalize_event(Cleared())["type"] == "Cleared"
    assert json.loads(json.dumps(normalize_event(FakeStored()))) == normalize_event(FakeStored())


def test_step_stats() -> None:
    s = step_stats([0.001, 0.002, 0.010], [0.001, 0.001])
    assert s["steps"] == 3 and s["updates"] == 2
    assert s["per_step_median_us"] == pytest.approx(3000.0)
    assert s["per_step_mean_us"] == pytest.approx((2000 + 3000 + 10000) / 3, abs=0.1)
    assert s["per_step_p90_us"] == pytest.approx(10000.0)
    assert s["total_ms"] == pytest.approx(15.0)
    assert s["schedule_ms"] == pytest.approx(13.0) and s["update_ms"] == pytest.approx(2.0)
    c = step_stats([0.002], [0.001], [0.001], [0.0005])
    assert c["cpu_per_step_median_us"] == pytest.approx(1500.0) and c["cpu_total_ms"] == pytest.approx(1.5)
    assert "cpu_total_ms" not in s
    empty = step_stats([], [])
    assert empty["steps"] == 0 and empty["per_step_median_us"] is None and empty["total_ms"] == 0


LOG = """\
(MainProcess pid=5087) INFO 12-01 20:51:25 [kv_cache_utils.py:1147] CPU KV cache size: 1,536 tokens
(MainProcess pid=5221) INFO 12-01 20:51:40 [__init__.py:153] blockpool 0.1.0: vLLM 0.33.0's BlockPool is \
now blockpool.integrations.vllm.pool.VllmBlockPool (HazardAwareBlockPool core, pure Python; hazard tracking on) in 7 modules
(MainProcess pid=5221) WARNING 12-01 20:51:41 [connectors.py:692] blockpool: KV connector ExampleConnector is \
not wired to the pool: its transfers are not fenced (wired: nixl)
INFO 12-01 20:51:41 [x.py:1] loading /path/blockpool/model
blockpool: plugin disabled by BLOCKPOOL_VLLM_PLUGIN=0; vLLM keeps its own BlockPool
"""


def test_plugin_lines() -> None:
    lines = plugin_lines(LOG)
    assert len(lines) == 3
    assert lines[0].startswith("blockpool 0.1.0: vLLM 0.33.0's BlockPool is now")
    assert lines[1].startswith("blockpool: KV connector ExampleConnector is not wired")
    assert lines[2].startswith("blockpool: plugin disabled")
    assert plugin_lines("nothing here\n[a] blockpooling\n") == []


def test_plugin_line_warnings() -> None:
    reg = "blockpool 0.1.0: vLLM 0.33.0's BlockPool is now X (hazard tracking on)"
    reg_off = (
        "blockpool 0.1.0: vLLM 0.33.0's BlockPool is now X (hazard tracking off by BLOCKPOOL_VLLM_HAZARDS)"
    )
    disabled = "blockpool: plugin disabled by BLOCKPOOL_VLLM_PLUGIN=0; vLLM keeps its own BlockPool"
    unwired = "blockpool: KV connector ExampleConnector is not wired to the pool"
    assert plugin_line_warnings("on", [reg]) == []
    assert plugin_line_warnings("hazards-off", [reg_off]) == []
    assert plugin_line_warnings("off", [disabled]) == []
    assert plugin_line_warnings("off", [], off_by="allowlist") == []
    assert plugin_line_warnings(CONNECTOR_MODE, [reg, unwired]) == []
    assert "registration line" in plugin_line_warnings("on", [])[0]
    assert "plugin disabled" in plugin_line_warnings("off", [])[0]
    assert "hazard tracking off" in plugin_line_warnings("hazards-off", [reg])[0]
    assert "not wired" in plugin_line_warnings(CONNECTOR_MODE, [reg])[0]
    bad = plugin_line_warnings("on", ["blockpool 0.1.0: x", "blockpool: cannot install into vLLM 0.32.0 (E)"])
    assert bad[0] == "on: the plugin says: blockpool: cannot install into vLLM 0.32.0 (E)"
    assert "registration line" in bad[1]
    old = plugin_line_warnings(
        "hazards-off", ["blockpool 0.1.0: vLLM 0.34.0 is not a supported version (...)"]
    )
    assert "not a supported version" in old[0] and "registration line" in old[1]
    assert "cannot wire" in plugin_line_warnings("on", [reg, "blockpool: cannot wire KV connector nixl"])[0]


# --- comparing the runs ------------------------------------------------------------------


def test_identical_runs_pass() -> None:
    r = runs()
    assert compare_runs("quick", r) == []
    assert exit_status([], {"quick": r}) == EXIT_PASS


def diffs_of(mode: str, edit: Any) -> list[ec.Difference]:
    r = runs()
    edit(r[mode])
    return compare_runs("quick", r)


def test_a_token_difference_names_request_and_position() -> None:
    def edit(x: dict[str, Any]) -> None:
        x["tokens"][1][2] = 99

    (d,) = diffs_of("on", edit)
    assert (d.workload, d.mode, d.what) == ("quick", "on", "tokens")
    assert "request 1, token 2: [99]" in d.detail and "[10]" in d.detail
    assert str(d).startswith("quick/on: tokens: ")


def test_a_shorter_output_and_fewer_requests_are_token_differences() -> None:
    (d,) = diffs_of("hazards-off", lambda x: x["tokens"][0].pop())
    assert "request 0, token 2" in d.detail and "2 vs 3 tokens" in d.detail
    (d,) = diffs_of("on", lambda x: x["tokens"].pop())
    assert d.detail == "1 requests, reference 2"


def test_a_hit_difference() -> None:
    def edit(x: dict[str, Any]) -> None:
        x["num_cached_tokens"][1] = 0

    (d,) = diffs_of("on", edit)
    assert d.what == "hits" and "request 1: 0 cached tokens, reference 32" in d.detail
    (d,) = diffs_of("on", lambda x: x["prefix_cache_stats"].update(hits=0))
    assert d.what == "hits" and "prefix-cache stats" in d.detail


def test_an_event_difference_names_the_fields() -> None:
    def edit(x: dict[str, Any]) -> None:
        x["events"][1]["parent_block_hash"] = 11

    (d,) = diffs_of("on", edit)
    assert d.what == "events" and d.detail.startswith("event 1 (parent_block_hash differ)")
    (d,) = diffs_of("on", lambda x: x["events"].append(removed([12])))
    assert "4 events, reference 3" in d.detail and "BlockRemoved" in d.detail
    (d,) = diffs_of("on", lambda x: x["events"].pop(0))
    assert d.detail.startswith("event 0 (")


def test_the_same_events_in_other_steps() -> None:
    def edit(x: dict[str, Any]) -> None:
        x["events_per_batch"] = [1, 2]

    (d,) = diffs_of("on", edit)
    assert d.what == "events" and "other steps" in d.detail


def test_pool_and_served_expectations() -> None:
    (d,) = diffs_of("off", lambda x: x.update(pool_class=OUR_POOL))
    assert (d.mode, d.what) == ("off", "pool") and "expected vLLM's" in d.detail
    (d,) = diffs_of("on", lambda x: x.update(pool_is_ours=False, pool_class=VLLM_POOL))
    assert d.what == "pool" and OUR_POOL in d.detail
    (d,) = diffs_of("hazards-off", lambda x: x.update(pool_hazards=True))
    assert d.what == "pool" and "hazards off" in d.detail
    (d,) = diffs_of("on", lambda x: x["served"].update(allocations=0))
    assert d.what == "served" and "no allocations" in d.detail
    (d,) = diffs_of("on", lambda x: x["served"].update(steps_issued=0))
    assert d.what == "served" and "saw no step" in d.detail
    (d,) = diffs_of("hazards-off", lambda x: x["served"].update(steps_issued=3))
    assert d.what == "served" and "saw 3 steps" in d.detail
    (d,) = diffs_of("hazards-off", lambda x: x["served"].update(steps_untokened=2))
    assert d.what == "served" and "saw 2 steps" in d.detail
    # With the compute stream alone the wiring sees steps without tokens:
    # that is the wiring at work (StepHazards.step_tokens), not a difference.
    assert diffs_of("on", lambda x: x["served"].update(steps_issued=0, steps_untokened=4)) == []
    # ... but a wired KV connector registers streams: its steps need tokens.
    (d,) = diffs_of(
        "on", lambda x: (x.update(kv_connector="offloading"), x["served"].update(steps_untokened=4))
    )
    assert d.what == "served" and "offloading wired, but steps went without tokens" in d.detail
    diffs = diffs_of(
        "on", lambda x: (x.update(kv_connector="offloading"), x["served"].update(steps_issued=0))
    )
    assert {d.what for d in diffs} == {"served"} and any("without tokens" in d.detail for d in diffs)
    assert diffs_of("on", lambda x: x.update(kv_connector="offloading")) == []


def test_a_run_on_another_build_of_the_core_is_a_difference() -> None:
    """A run that imported the other build than the check's own (a
    compiled tree asked for with VLLM_ENGINE_BLOCKPOOL but the pure
    checkout served, say) fails the check, naming both builds."""
    other = "pure Python" if ec.core_build() == "compiled (mypyc)" else "compiled (mypyc)"
    assert diffs_of("on", lambda x: x.update(core_build=ec.core_build())) == []
    (d,) = diffs_of("on", lambda x: x.update(core_build=other))
    assert (d.mode, d.what) == ("on", "build")
    assert d.detail == f"the run's blockpool core is {other}, this process's {ec.core_build()}"


def test_a_failed_run_is_a_difference_and_a_failed_reference_a_setup_error() -> None:
    r = runs()
    r["on"] = {"mode": "on", "error": "Traceback ...\nAttributeError: no _generate_event_extra_keys\n"}
    (d,) = compare_runs("quick", r)
    assert (d.what, d.detail) == ("run", "AttributeError: no _generate_event_extra_keys")
    assert exit_status([d], {"quick": r}) == EXIT_MISMATCH
    r = runs()
    r["off"] = {"mode": "off", "error": "ModuleNotFoundError: vllm"}
    diffs = compare_runs("quick", r)
    assert [d.mode for d in diffs] == ["off"]  # the others are not compared with a missing reference
    assert exit_status(diffs, {"quick": r}) == EXIT_SETUP
    assert exit_status([], {"quick": {"on": run_result("on")}}) == EXIT_SETUP


def test_the_connector_run_is_compared_on_tokens_only() -> None:
    r = runs("off", CONNECTOR_MODE)
    r[CONNECTOR_MODE]["events"].append(removed([99]))
    r[CONNECTOR_MODE]["num_cached_tokens"] = [32, 32]
    assert compare_runs("quick", r) == []
    r[CONNECTOR_MODE]["tokens"][0][0] = 1
    (d,) = compare_runs("quick", r)
    assert (d.mode, d.what) == (CONNECTOR_MODE, "tokens")


def test_one_difference_of_each_kind_per_run() -> None:
    r = runs()
    for m in ("on", "hazards-off"):
        r[m]["tokens"] = [[0, 0, 0], [0, 0, 0]]
        r[m]["num_cached_tokens"] = [0, 0]
        r[m]["events"] = []
    diffs = compare_runs("quick", r)
    assert sorted((d.mode, d.what) for d in diffs) == [
        ("hazards-off", "events"), ("hazards-off", "hits"), ("hazards-off", "tokens"),
        ("on", "events"), ("on", "hits"), ("on", "tokens"),
    ]  # fmt: skip


# --- the report and the exit status, end to end with fake runs ----------------------------


def fake_runs(monkeypatch: pytest.MonkeyPatch, edit: Any = None) -> list[tuple[str, str]]:
    """Replace the engine subprocess with hand-made results; returns the
    (workload, mode) of each run asked for."""
    calls: list[tuple[str, str]] = []

    def run_one(mode: str, w: Workload, *args: Any) -> dict[str, Any]:
        calls.append((w.name, mode))
        r = copy.deepcopy(run_result(mode))
        r["plugin_lines"] = {
            "off": ["blockpool: plugin disabled by BLOCKPOOL_VLLM_PLUGIN=0; vLLM keeps its own BlockPool"],
            "on": ["blockpool 0.1.0: vLLM 0.33.0's BlockPool is now X (hazard tracking on)"],
            "hazards-off": ["blockpool 0.1.0: vLLM 0.33.0's BlockPool is now X (hazard tracking off by Y)"],
            "audit": ["blockpool 0.1.0: vLLM 0.33.0's BlockPool is now X (hazard tracking audit by Y)"],
        }.get(mode, [])
        if edit is not None:
            edit(w.name, mode, r)
        return r

    monkeypatch.setattr(ec, "_run_one", run_one)
    monkeypatch.setattr(ec, "_find_spec", lambda name: object())
    return calls


def test_check_passes_and_writes_the_json_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_runs(monkeypatch)
    out = tmp_path / "r.json"
    assert (
        ec.main(["--workload", "quick,timing", "--json", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    )
    assert calls == [(w, m) for w in ("quick", "timing") for m in ec.MODES]
    text = capsys.readouterr().out
    assert "check-vllm: PASS" in text and "identical in off, on, hazards-off, audit" in text
    assert "workload timing: 768 requests" in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == ec.SCHEMA and doc["passed"] is True and doc["exit_status"] == 0
    assert doc["warnings"] == [] and doc["environment"]["vllm_version"] == "0.33.0"
    assert set(doc["workloads"]) == {"quick", "timing"}
    assert doc["workloads"]["quick"]["runs"]["on"]["pool_class"] == OUR_POOL


def test_check_reports_a_mismatch_with_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def edit(workload: str, mode: str, r: dict[str, Any]) -> None:
        if mode == "hazards-off":
            r["events"][0]["block_hashes"] = [1, 2]

    fake_runs(monkeypatch, edit)
    assert cli_main(["check-vllm"]) == EXIT_MISMATCH
    cap = capsys.readouterr()
    assert "check-vllm: FAIL" in cap.out and "hazards-off: events: event 0 (block_hashes differ)" in cap.out
    assert "blockpool check-vllm: quick/hazards-off: events:" in cap.err


def test_a_missing_log_line_is_a_warning_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_runs(monkeypatch, lambda w, mode, r: r.update(plugin_lines=[]) if mode == "on" else None)
    assert ec.main(["--modes", "on"]) == EXIT_PASS
    out = capsys.readouterr().out
    assert "warnings:\n  quick/on: the plugin's registration line" in out and "PASS" in out


def test_connector_run_is_added_to_the_first_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_runs(monkeypatch)
    assert ec.main(["--workload", "quick,timing", "--modes", "off", "--connector"]) == EXIT_PASS
    assert calls == [("quick", "off"), ("quick", CONNECTOR_MODE), ("timing", "off")]


def test_a_failed_reference_run_is_a_setup_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_runs(monkeypatch, lambda w, mode, r: r.update(error="RuntimeError: no engine"))
    assert ec.main(["--workload", "quick,timing"]) == EXIT_SETUP
    assert calls == [("quick", "off")]  # nothing else runs
    assert "SETUP ERROR" in capsys.readouterr().out


def test_size_flags_override_every_selected_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Workload] = []
    fake_runs(monkeypatch)
    inner = ec._run_one

    def spy(mode: str, w: Workload, *args: Any) -> dict[str, Any]:
        seen.append(w)
        return inner(mode, w, *args)

    monkeypatch.setattr(ec, "_run_one", spy)
    assert (
        ec.main(["--workload", "quick,timing", "--modes", "off", "--requests", "12", "--num-blocks", "64"])
        == 0
    )
    assert [(w.name, w.requests, w.num_blocks) for w in seen] == [("quick", 12, 64), ("timing", 12, 64)]
    assert seen[1].max_num_seqs == WORKLOADS["timing"].max_num_seqs


def test_repetitions_are_interleaved_compared_and_the_best_timing_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    medians = iter(
        [900.0, 1200.0, 1100.0, 1150.0, 800.0, 1000.0, 1300.0, 1250.0]
    )  # off, on, hazards-off, audit, ..., x2

    def edit(workload: str, mode: str, r: dict[str, Any]) -> None:
        r["timing"] = dict(r["timing"], per_step_median_us=next(medians))

    calls = fake_runs(monkeypatch, edit)
    out = tmp_path / "r.json"
    assert ec.main(["--repeat", "2", "--json", str(out)]) == EXIT_PASS
    assert calls == [("quick", m) for m in ec.MODES] * 2
    doc = json.loads(out.read_text())
    on = doc["workloads"]["quick"]["runs"]["on"]
    assert [t["per_step_median_us"] for t in on["timing_repeats"]] == [1200.0, 1000.0]
    assert on["timing_best"]["per_step_median_us"] == 1000.0
    assert on["timing_best_cpu"]["cpu_per_step_median_us"] == pytest.approx(1200.0)
    assert doc["workloads"]["quick"]["runs"]["off"]["timing_best"]["per_step_median_us"] == 800.0
    assert "best of 2 repetitions" in capsys.readouterr().out


def test_a_repetition_that_differs_is_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, int] = {}

    def edit(workload: str, mode: str, r: dict[str, Any]) -> None:
        seen[mode] = seen.get(mode, 0) + 1
        if seen[mode] == 2 and mode in ("off", "on"):
            r["tokens"][0][0] = 0

    fake_runs(monkeypatch, edit)
    assert ec.main(["--repeat", "2"]) == EXIT_MISMATCH
    out = capsys.readouterr().out
    assert "off#2: tokens: request 0, token 0" in out and "on#2: tokens:" in out
    assert "hazards-off#2" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "huge"], "unknown workload 'huge'"),
        (["--modes", "on,sideways"], "unknown mode(s) sideways"),
        (["--num-blocks", "4"], "cannot hold one request"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--repeat", "0"], "--repeat must be >= 1"),
    ],
)
def test_bad_flags_are_setup_errors(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_runs(monkeypatch)
    assert ec.main(argv) == EXIT_SETUP
    assert message in capsys.readouterr().err and calls == []


def test_missing_vllm_is_a_setup_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_runs(monkeypatch)
    monkeypatch.setattr(ec, "_find_spec", lambda name: None if name == "vllm" else object())
    assert cli_main(["check-vllm"]) == EXIT_SETUP
    assert "vllm not importable" in capsys.readouterr().err and calls == []


def test_format_report_of_a_failed_run() -> None:
    r = runs()
    r["on"] = {"mode": "on", "error": "Traceback\nValueError: boom"}
    diffs = compare_runs("quick", r)
    text = format_report({
        "workloads": {"quick": {"description": "d", "runs": r, "differences": [attrs.asdict(d) for d in diffs]}},
        "exit_status": exit_status(diffs, {"quick": r}),
        "wall_s": 3.0,
    })  # fmt: skip
    assert "on           FAILED: ValueError: boom" in text
    assert "on: run: ValueError: boom" in text and "check-vllm: FAIL in 3 s" in text


def test_importing_the_check_and_the_cli_loads_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, blockpool.cli, blockpool.checking.vllm_engine as e; "
        "blockpool.cli.build_parser(); e.build_prompts(e.WORKLOADS['timing']); "
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kv_connector_runs_are_workload_variants_served_in_every_mode() -> None:
    p = argparse.ArgumentParser()
    ec.add_arguments(p)
    ws = ec._workloads(
        p.parse_args(["--workload", "quick", "--kv-connector", "offloading,simple_cpu_offload"])
    )
    assert [(w.name, w.kv_connector) for w in ws] == [
        ("quick", None), ("quick+offloading", "offloading"), ("quick+simple_cpu_offload", "simple_cpu_offload"),
    ]  # fmt: skip
    assert ws[1].describe().endswith("; KV connector OffloadingConnector")
    with pytest.raises(ValueError, match="unknown --kv-connector nixl"):
        ec._workloads(p.parse_args(["--kv-connector", "nixl"]))


def test_engine_script_refuses_an_unknown_version_before_building_anything(tmp_path: Any) -> None:
    """scripts/vllm_engine_check.sh checks VLLM_ENGINE_VERSIONS first: a
    misspelt version costs no venv build (vLLM 0.32's takes minutes)."""
    import os
    import shutil

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "vllm_engine_check.sh")
    env = dict(os.environ, VLLM_ENGINE_VERSIONS="0.34 0.35", VLLM032_VENV=str(tmp_path / "venv032"),
               VLLM_ENGINE_RESULTS=str(tmp_path / "results"))  # fmt: skip
    proc = subprocess.run([bash, script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "unknown version '0.35' in VLLM_ENGINE_VERSIONS (known: 0.32 0.33 0.34)" in proc.stderr
    assert not (tmp_path / "venv032").exists() and not (tmp_path / "results").exists()
