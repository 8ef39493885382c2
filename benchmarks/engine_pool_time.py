#!/usr/bin/env python3
"""The pool's part of a real vLLM engine's scheduler time, per step and per method.

The engine check's yardstick (``python -m blockpool.checking.vllm_engine
--workload timing``) times the whole of ``Scheduler.schedule`` and
``update_from_output``; run to run it drifts by 10-15% on a shared machine,
more than the 5% it is asked to resolve. This script serves the same
workload in the same engine (the check's own child, in-process engine
core) and times only what the plugin changes: every call the scheduler
makes into the pool (vLLM's ``BlockPool`` with the plugin off, our
``VllmBlockPool`` with it on) and, with hazards on, into the wiring's
:class:`~blockpool.integrations.vllm.hazards.StepHazards`. Outermost calls
only (a pool method calling another is counted once), with
``time.perf_counter_ns``: about 0.1 µs per call added alike to every mode.

Each mode runs ``--repeat`` times, interleaved: one run of every mode per
round, the order rotated from round to round (``off, on, hazards-off``,
then ``on, hazards-off, off``, ...), so that no mode always runs first
after a slower or faster stretch of the machine. The table gives, per mode,
the median over runs of µs per step in the pool (and the wiring), its ratio
to ``off``, the scheduler's CPU µs per step (median of steps, median of
runs: the engine check's figure, with the timers' cost in it), its mean
per step (median of runs: the pool figure's own kind, so on's excess over
off is the pool's and the wiring's excess plus whatever else the plugin
changes), the **paired** ratios (each round's run against the same
round's ``off`` run, the median over rounds: the machine's speed drifts
from minute to minute by more than the plugin's cost, and a round's runs
see the same stretch of it), the **attributed** ratio (each round: ``1 +
(the mode's pool and wiring µs per step - off's) / off's mean CPU µs per
step``, the median over rounds: the whole step's ratio with only the
timed calls' difference in it, which repeats from run to run where the
whole step does not; it leaves out what the plugin's calls cost the rest
of the scheduler through the caches) and the per-method split (each
method's median over runs).
Why per-step cost in an engine is several
times a hot loop's (the scheduler's code runs on caches the forward pass
has just evicted): ``docs/performance.md``, "A real vLLM engine: scheduler time per step".

Run from a checkout, with a vLLM venv (``scripts/vllm_engine_check.sh``
builds ``.venv-vllm032``)::

    .venv-vllm032/bin/python benchmarks/engine_pool_time.py --repeat 3
    .venv-vllm032/bin/python benchmarks/engine_pool_time.py --blockpool build/compiled-suite

``--blockpool DIR`` serves from another build of the package (the compiled
wheel unpacked: ``scripts/compiled_suite.sh``); every run's report must name
the build it asked for (``core_build``), else the script stops.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POOL_METHODS = (
    "get_new_blocks",
    "touch",
    "free_blocks",
    "get_cached_block",
    "cache_full_blocks",
    "cache_partial_block",
    "take_events",
    "get_num_free_blocks",
    "get_usage",
    "evict_blocks",
    "reset_prefix_cache",
    "unpin_blocks",
    "move_block_hashes",
    "is_block_writable",
)
"""vLLM's ``BlockPool`` methods its scheduler and KV cache managers call."""

WIRING_METHODS = (
    "step_record",
    "skip_step",
    "end_step",
    "on_connector_output",
    "begin_copies",
    "tag_step_writes",
)
"""The :class:`StepHazards` calls the scheduler wiring makes (hazards on)."""


def time_calls(
    obj: Any,
    names: Iterable[str],
    prefix: str,
    totals: dict[str, list[int]],
    depth: list[int],
    clock: Callable[[], int] = time.perf_counter_ns,
) -> None:
    """Replace each method of ``obj`` named in ``names`` (those it has) by a
    wrapper on the instance that adds, per outermost call (``depth[0] == 0``;
    share ``depth`` between objects whose methods call one another), one
    call and its nanoseconds to ``totals[prefix + name]``. O(len(names))."""
    for name in names:
        fn = getattr(obj, name, None)
        if fn is None:
            continue

        def wrapper(*a: Any, _fn: Any = fn, _key: str = prefix + name, **k: Any) -> Any:
            if depth[0]:
                return _fn(*a, **k)
            depth[0] = 1
            t0 = clock()
            try:
                return _fn(*a, **k)
            finally:
                dt = clock() - t0
                depth[0] = 0
                entry = totals.setdefault(_key, [0, 0])
                entry[0] += 1
                entry[1] += dt

        setattr(obj, name, wrapper)


def _child(spec_path: str, out_path: str) -> int:
    """One engine run: the engine check's child, with the pool's and the
    wiring's methods timed; the totals go into the result as ``pool_time``."""
    from blockpool.checking import vllm_engine as ec

    totals: dict[str, list[int]] = {}
    depth = [0]
    find = ec._find_scheduler

    def find_and_time(llm: Any) -> Any:
        sched = find(llm)
        pool = sched.kv_cache_manager.block_pool
        time_calls(pool, POOL_METHODS, "pool.", totals, depth)
        hz = getattr(pool, "hazards", None)
        if hz is not None:
            time_calls(hz, WIRING_METHODS, "wiring.", totals, depth)
        return sched

    ec._find_scheduler = find_and_time
    exit_ = os._exit

    def write_then_exit(status: int) -> None:  # the child leaves by os._exit
        try:
            with open(out_path, encoding="utf-8") as f:
                result = json.load(f)
            result["pool_time"] = totals
            result["gc_collections"] = [g["collections"] for g in gc.get_stats()]  # per generation, whole run
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(result, f)
        finally:
            exit_(status)

    os._exit = write_then_exit  # type: ignore[assignment]
    return ec._child(spec_path, out_path)


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: µs per step in the pool (median over runs), the scheduler's
    CPU µs per step (median over runs of the per-run median, and of the
    per-run mean: the mean is the pool figure's own kind, the median the
    engine check's), each method's µs per step and ns per call (medians over
    runs) and, with an ``off`` mode, the paired and attributed ratios
    (module docstring).
    O(runs * methods)."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).append(r)
    out: dict[str, Any] = {}
    for mode, rs in by_mode.items():
        pool_us = [_pool_us(r) for r in rs]
        sched_us = [r["timing"]["cpu_per_step_median_us"] for r in rs]
        sched_mean = [r["timing"].get("cpu_per_step_mean_us") or 0.0 for r in rs]  # 0: no step timed
        first = rs[0]
        out[mode] = {
            "pool_us_per_step": [round(x, 1) for x in pool_us],
            "pool_us_median": round(statistics.median(pool_us), 1),
            "sched_cpu_us_median": round(statistics.median(sched_us), 1),
            "sched_cpu_us_runs": sched_us,
            "sched_cpu_mean_us_median": round(statistics.median(sched_mean), 1),
            "sched_cpu_mean_us_runs": sched_mean,
            "methods": _methods(rs),
            "core_build": first.get("core_build"),
            "gc_collections_runs": [r.get("gc_collections") for r in rs],
        }
    base = by_mode.get("off")
    if base is not None:
        off_by_round = {r.get("round"): r for r in base}
        for mode, rs in by_mode.items():
            pairs = [(r, off_by_round.get(r.get("round"))) for r in rs]
            pairs = [(r, b) for r, b in pairs if b is not None]
            med = _paired(pairs, "cpu_per_step_median_us")
            mean = _paired(pairs, "cpu_per_step_mean_us")
            delta = [_pool_us(r) - _pool_us(b) for r, b in pairs]
            out[mode]["pool_paired_delta_us"] = [round(x, 1) for x in delta]
            out[mode]["pool_paired_delta_us_median"] = round(statistics.median(delta), 1) if delta else None
            attributed = [
                1.0 + (_pool_us(r) - _pool_us(b)) / b["timing"]["cpu_per_step_mean_us"]
                for r, b in pairs
                if b["timing"].get("cpu_per_step_mean_us")
            ]
            out[mode]["attributed_ratios"] = [round(x, 3) for x in attributed]
            out[mode]["attributed_ratio_median"] = (
                round(statistics.median(attributed), 3) if attributed else None
            )
            out[mode]["sched_cpu_paired_ratios"] = [round(x, 3) for x in med]
            out[mode]["sched_cpu_paired_ratio_median"] = round(statistics.median(med), 3) if med else None
            out[mode]["sched_cpu_mean_paired_ratios"] = [round(x, 3) for x in mean]
            out[mode]["sched_cpu_mean_paired_ratio_median"] = (
                round(statistics.median(mean), 3) if mean else None
            )
    return out


def _paired(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], key: str) -> list[float]:
    """``run / off run`` of the timing figure ``key`` for each pair where
    both have it (a run with no step timed has none). O(len(pairs))."""
    return [
        r["timing"][key] / b["timing"][key] for r, b in pairs if r["timing"].get(key) and b["timing"].get(key)
    ]


def _pool_us(r: dict[str, Any]) -> float:
    """A run's µs per step in every timed call (pool and wiring). O(methods)."""
    return float(sum(ns for _, ns in r["pool_time"].values()) / 1e3 / r["timing"]["steps"])


def _methods(rs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per method over one mode's runs: calls (the first run's), µs per
    step and ns per call (medians over the runs that called it), the
    costliest first. O(runs * methods)."""
    names = {k for r in rs for k in r["pool_time"]}
    out = {}
    for k in names:
        per = [(r["pool_time"][k], r["timing"]["steps"]) for r in rs if k in r["pool_time"]]
        out[k] = {
            "calls": per[0][0][0],
            "us_per_step": round(statistics.median(ns / 1e3 / steps for (_, ns), steps in per), 2),
            "ns_per_call": round(statistics.median(ns / n for (n, ns), _ in per if n)),
        }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us_per_step"]))


def _rotated(modes: Sequence[str], rnd: int) -> list[str]:
    """``modes`` in round ``rnd``'s order (1-based): rotated left by
    ``rnd - 1``, so over ``len(modes)`` rounds each mode runs once in every
    position. O(len(modes))."""
    k = (rnd - 1) % len(modes)
    return [*modes[k:], *modes[:k]]


def format_table(summary: dict[str, Any]) -> str:
    """The summary as text: one line per mode (ratios against ``off``),
    then each mode's per-method split."""
    base = summary.get("off")
    head = f"{'mode':<12} {'pool µs/step (runs)':<30} {'median':>8} {'/ off':>6} {'sched CPU µs/step':>18} {'/ off':>6}"
    lines = [head + f" {'mean':>8} {'/ off':>6}"]
    for mode, s in summary.items():
        r_pool = f"{s['pool_us_median'] / base['pool_us_median']:.3f}" if base else "-"
        r_sched = f"{s['sched_cpu_us_median'] / base['sched_cpu_us_median']:.3f}" if base else "-"
        r_mean = (
            f"{s['sched_cpu_mean_us_median'] / base['sched_cpu_mean_us_median']:.3f}"
            if base and base["sched_cpu_mean_us_median"]
            else "-"
        )
        runs = ", ".join(f"{x:.0f}" for x in s["pool_us_per_step"])
        lines.append(
            f"{mode:<12} {runs:<30} {s['pool_us_median']:>8.1f} {r_pool:>6} {s['sched_cpu_us_median']:>18.1f} {r_sched:>6}"
            f" {s['sched_cpu_mean_us_median']:>8.1f} {r_mean:>6}"
        )
    if base and len(summary) > 1:
        lines.append(
            "\npaired: each round's run / the same round's off run (median over rounds; the rounds' ratios)"
        )
        for mode, s in summary.items():
            if mode == "off" or s.get("sched_cpu_paired_ratio_median") is None:
                continue
            lines.append(
                f"  {mode:<12} scheduler CPU, median step {s['sched_cpu_paired_ratio_median']:.3f}"
                f" ({', '.join(f'{x:.2f}' for x in s['sched_cpu_paired_ratios'])});"
                f" mean step {s['sched_cpu_mean_paired_ratio_median'] or float('nan'):.3f}"
                f" ({', '.join(f'{x:.2f}' for x in s['sched_cpu_mean_paired_ratios'])});"
                f" pool and wiring {s['pool_paired_delta_us_median']:+.1f} µs/step"
            )
            lines.append(
                f"  {mode:<12} attributed (off's mean step plus the pool's and wiring's excess, over off's mean step)"
                f" {s['attributed_ratio_median']:.3f} ({', '.join(f'{x:.3f}' for x in s['attributed_ratios'])})"
            )
    for mode, s in summary.items():
        gcs = "; ".join("/".join(map(str, g)) for g in s.get("gc_collections_runs", ()) if g)
        lines.append(
            f"\n{mode} ({s['core_build']}), µs per step by method, medians over runs"
            f" (gc collections by generation, per run: {gcs}):"
        )
        for k, m in s["methods"].items():
            lines.append(
                f"  {k:<28} {m['calls']:>7} calls {m['us_per_step']:>8.2f} µs/step {m['ns_per_call']:>8} ns/call"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"] and len(argv) == 3:
        return _child(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--modes", default="off,on,hazards-off", help="modes, comma-separated (default off,on,hazards-off)"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per mode, interleaved (default 3)")
    p.add_argument("--requests", type=int, default=1536, help="the timing workload's requests (default 1536)")
    p.add_argument("--prefixes", type=int, default=32, help="the timing workload's prefixes (default 32)")
    p.add_argument(
        "--blockpool", metavar="DIR", help="serve from the package in DIR (e.g. build/compiled-suite)"
    )
    p.add_argument("--model-dir", default=os.path.join(ROOT, ".cache", "vllm-engine", "tiny-llama"))
    p.add_argument("--log-dir", help="keep specs, logs and results here (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")

    import attrs

    from blockpool.checking import vllm_engine as ec

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ec.MODES:
            p.error(f"unknown mode {m!r} (known: {', '.join(ec.MODES)})")
    model = ec.ModelSpec()
    w = attrs.evolve(ec.WORKLOADS["timing"], requests=args.requests, prefixes=args.prefixes)
    w.validate(model)
    work = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="blockpool-engine-pool-time-"))
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.abspath(args.model_dir)
    os.makedirs(os.path.dirname(model_dir), exist_ok=True)
    ec._ensure_model(model_dir, model)
    pkg = os.path.abspath(args.blockpool) if args.blockpool else ROOT
    want = None
    if args.blockpool:
        want = (
            "compiled (mypyc)"
            if any(f.endswith(".so") for f in os.listdir(os.path.join(pkg, "blockpool", "core")))
            else "pure Python"
        )
    runs: list[dict[str, Any]] = []
    for rep in range(1, args.repeat + 1):
        for mode in _rotated(modes, rep):
            tag = f"{mode}-{rep}"
            spec_path, out_path, log_path = (
                os.path.join(work, f"{tag}.{x}") for x in ("spec.json", "result.json", "log")
            )
            with open(spec_path, "w", encoding="utf-8") as f:
                json.dump({"mode": mode, "workload": attrs.asdict(w), "model": attrs.asdict(model),
                           "model_dir": model_dir}, f)  # fmt: skip
            env = ec.mode_env(mode, os.environ)
            env["PYTHONPATH"] = os.pathsep.join(x for x in (pkg, env.get("PYTHONPATH", "")) if x)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", spec_path, out_path]
            t0 = time.perf_counter()
            with open(log_path, "w", encoding="utf-8") as log:
                subprocess.run(
                    cmd, env=env, cwd=pkg, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False
                )
            try:
                with open(out_path, encoding="utf-8") as f:
                    r = json.load(f)
            except (OSError, ValueError):
                print(f"{tag}: no result (log: {log_path})", file=sys.stderr)
                return 1
            if "error" in r or "pool_time" not in r:
                print(f"{tag}: failed (log: {log_path}):\n{r.get('error', 'no pool_time')}", file=sys.stderr)
                return 1
            if want is not None and r.get("core_build") != want:
                print(f"{tag}: served by {r.get('core_build')}, not {want}", file=sys.stderr)
                return 1
            print(f"{tag}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            r["round"] = rep
            runs.append(r)
    summary = summarize(runs)
    print(format_table(summary))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"workload": attrs.asdict(w), "repeat": args.repeat, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
