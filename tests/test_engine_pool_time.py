"""``benchmarks/engine_pool_time.py``'s statistics (no engine): the rounds'
mode order and the paired ratios the engine figure of ``docs/performance.md``
is read from."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "engine_pool_time.py"
)
_spec = importlib.util.spec_from_file_location("engine_pool_time", _PATH)
assert _spec is not None and _spec.loader is not None
ept: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ept)


def _run(mode: str, rnd: int, median_us: float, mean_us: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "round": rnd,
        "pool_time": {"pool.get_new_blocks": [10, 1000]},
        "timing": {"steps": 10, "cpu_per_step_median_us": median_us, "cpu_per_step_mean_us": mean_us},
        "core_build": "pure Python",
    }


def test_every_mode_runs_once_in_every_position_over_as_many_rounds() -> None:
    modes = ["off", "on", "hazards-off"]
    orders = [ept._rotated(modes, r) for r in (1, 2, 3, 4)]
    assert orders[:3] == [
        ["off", "on", "hazards-off"],
        ["on", "hazards-off", "off"],
        ["hazards-off", "off", "on"],
    ]
    assert orders[3] == orders[0]
    assert all(sorted(o[i] for o in orders[:3]) == sorted(modes) for i in range(3))


def test_paired_ratios_divide_each_round_by_the_same_rounds_off_run() -> None:
    # The machine doubles its speed in round 2: the unpaired ratio of
    # medians (1100 / 1000) hides that "on" costs 10% in every round.
    runs = [
        _run("off", 1, 1000.0, 1200.0), _run("on", 1, 1100.0, 1320.0),
        _run("off", 2, 500.0, 600.0), _run("on", 2, 550.0, 660.0),
        _run("off", 3, 1000.0, 1200.0), _run("on", 3, 1100.0, 1320.0),
    ]  # fmt: skip
    s = ept.summarize(runs)
    assert s["on"]["sched_cpu_paired_ratios"] == [1.1, 1.1, 1.1]
    assert (s["on"]["sched_cpu_paired_ratio_median"], s["on"]["sched_cpu_mean_paired_ratio_median"]) == (
        1.1,
        1.1,
    )
    assert s["off"]["sched_cpu_paired_ratio_median"] == 1.0
    assert "on           scheduler CPU, median step 1.100 (1.10, 1.10, 1.10)" in ept.format_table(s)


def test_per_method_figures_are_medians_over_runs_and_the_pool_delta_is_paired() -> None:
    runs = [_run("off", r, 1000.0, 1000.0) for r in (1, 2, 3)] + [
        _run("on", r, 1000.0, 1000.0) for r in (1, 2, 3)
    ]
    for r in runs[:3]:
        r["pool_time"] = {"pool.get_new_blocks": [10, 10_000]}  # 1 µs a step
    for r, ns in zip(runs[3:], (20_000, 90_000, 30_000)):
        r["pool_time"] = {"pool.get_new_blocks": [10, ns], "wiring.end_step": [10, 5_000]}
    s = ept.summarize(runs)
    assert s["on"]["methods"] == {
        "pool.get_new_blocks": {"calls": 10, "us_per_step": 3.0, "ns_per_call": 3000},  # the middle run's
        "wiring.end_step": {"calls": 10, "us_per_step": 0.5, "ns_per_call": 500},
    }
    assert (
        s["on"]["pool_paired_delta_us"] == [1.5, 8.5, 2.5] and s["on"]["pool_paired_delta_us_median"] == 2.5
    )


def test_a_round_without_an_off_run_is_left_out_of_the_pairs() -> None:
    runs = [_run("off", 1, 1000.0, 1000.0), _run("on", 1, 1200.0, 1300.0), _run("on", 2, 900.0, 900.0)]
    s = ept.summarize(runs)
    assert s["on"]["sched_cpu_paired_ratios"] == [1.2] and s["on"]["sched_cpu_mean_paired_ratios"] == [1.3]
    assert s["on"]["sched_cpu_us_runs"] == [1200.0, 900.0]


def test_attributed_ratio_adds_the_paired_pool_excess_to_offs_mean_step() -> None:
    # The whole step swings by 2x between rounds; the pool's excess (2.5,
    # 8 and 1.5 µs a step over off's 1 µs) is what the attributed ratio reads.
    runs = [
        _run("off", 1, 100.0, 100.0), _run("on", 1, 190.0, 200.0),
        _run("off", 2, 200.0, 200.0), _run("on", 2, 110.0, 100.0),
        _run("off", 3, 50.0, 50.0), _run("on", 3, 60.0, 60.0),
    ]  # fmt: skip
    for r in runs[0::2]:
        r["pool_time"] = {"pool.get_new_blocks": [10, 10_000]}
    for r, ns in zip(runs[1::2], (35_000, 90_000, 25_000)):
        r["pool_time"] = {"pool.get_new_blocks": [10, ns]}
    s = ept.summarize(runs)
    assert s["on"]["attributed_ratios"] == [1.025, 1.04, 1.03]
    assert s["on"]["attributed_ratio_median"] == 1.03 and s["off"]["attributed_ratio_median"] == 1.0
    assert (
        "attributed (off's mean step plus the pool's and wiring's excess, over off's mean step) 1.030"
        in ept.format_table(s)
    )
