#!/usr/bin/env python3
"""Comparison report from a pytest-benchmark JSON file.

Usage::

    python benchmarks/report.py out/bench/bench.json [--md report.md] [--png ratios.png]

Writes a Markdown table of medians and their ratios (blockpool / vLLM with
hazards on and off, hazards on / off) for every scenario of the suite, the
scale and memory figures, the targets of ``docs/performance.md`` (met or
not), and a PNG bar chart of the ratios (matplotlib, Agg backend; skipped
with a note when matplotlib is missing). All numbers are medians of the
same run; the machine is described from the JSON (CPU model from
``/proc/cpuinfo``, cores, Python).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

SECTIONS = ("trace", "alloc", "prefix", "fence", "scale", "memory", "policy", "adapter")
TITLES = {
    "trace": "Trace op log (headline)",
    "alloc": "Allocation and free",
    "prefix": "Prefix hits",
    "fence": "Allocation for a load with a fence (blockpool only)",
    "scale": "Scale (ns per block)",
    "memory": "Memory and construction (10^6 blocks)",
    "policy": "Eviction policy and placement (blockpool, hazards on; ns per block, ratio to the baseline of the same run)",
    "adapter": "vLLM adapter: own-block check in free_blocks (ns per block, ratio to the core of the same run)",
}
TARGETS = {
    "trace_vs_vllm": 0.6,  # trace op log, hazards on / vLLM
    "on_vs_off": 1.15,  # trace op log, hazards on / off
    "bytes_vs_vllm": 1.0,  # bytes per block, hazards on / vLLM
    "scale": 1.3,  # ns per block at 10^6 / at 10^4, hazards on
}


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "–"
    for unit, f in (("s", 1.0), ("ms", 1e3), ("µs", 1e6), ("ns", 1e9)):
        if s * f >= 1:
            return f"{s * f:.3g} {unit}" if s * f < 100 else f"{s * f:.0f} {unit}"
    return f"{s * 1e9:.2g} ns"


def _ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.{digits}f}"


def load(path: Path) -> tuple[dict[str, Any], dict[tuple[str, str], dict[str, Any]], list[str]]:
    data = json.loads(path.read_text())
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    order: list[str] = []
    for b in data["benchmarks"]:
        ex = b.get("extra_info", {})
        scen, kind = ex.get("scenario"), ex.get("kind")
        if scen is None or kind is None:
            continue
        rows[(scen, kind)] = {"median": b["stats"]["median"], "iqr": b["stats"].get("iqr"), **ex}
        if scen not in order:
            order.append(scen)
    return data, rows, order


def machine_lines(data: dict[str, Any]) -> list[str]:
    mi = data.get("machine_info", {})
    bb = mi.get("blockpool_bench", {})
    cpu = bb.get("cpu_model") or mi.get("cpu", {}).get("brand_raw", "unknown CPU")
    cores = bb.get("cores", mi.get("cpu", {}).get("count", "?"))
    impl = bb.get("implementation", mi.get("python_implementation", ""))
    load = ", ".join(f"{x:.2f}" for x in bb.get("load_average") or [])
    lines = [
        (f"- Machine: {cpu}, {cores} logical cores, {mi.get('system', '')} {mi.get('release', '')}").rstrip(),
        (
            f"- Python {bb.get('python', mi.get('python_version', '?'))} ({impl}); "
            f"blockpool {bb.get('blockpool', '?')}; vLLM {bb.get('vllm') or 'not installed'}"
        ),
        f"- Run: {data.get('datetime', '?')}; timer {bb.get('timer') or '?'}; load average at start {load}",
        "- Every figure is the median of its benchmark's rounds; every ratio divides two medians of this run.",
    ]
    return lines


def _vllm_name(data: dict[str, Any]) -> str:
    """``vLLM X.Y.Z``, the version the run measured (``machine_info``), or ``vLLM``."""
    version = (data.get("machine_info") or {}).get("blockpool_bench", {}).get("vllm")
    return f"vLLM {version}" if version else "vLLM"


def build(
    data: dict[str, Any], rows: dict[tuple[str, str], dict[str, Any]], order: list[str]
) -> tuple[str, list[tuple[str, float | None, float | None, float | None]]]:
    def med(scen: str, kind: str) -> float | None:
        r = rows.get((scen, kind))
        return None if r is None else r["median"]

    out = [f"# blockpool vs {_vllm_name(data)} `BlockPool`: benchmark report", ""]
    out += machine_lines(data)
    out += [
        "",
        (
            "Columns: median time per call for blockpool with hazard tracking on (`on`), off (`off`), "
            "and vLLM's `BlockPool` (`vLLM`); ratios of those medians. Below 1 means blockpool is faster."
        ),
        "",
    ]
    chart: list[tuple[str, float | None, float | None, float | None]] = []
    by_section: dict[str, list[str]] = defaultdict(list)
    for scen in order:
        sec = next(r["section"] for (s, _), r in rows.items() if s == scen)
        by_section[sec].append(scen)
    for sec in SECTIONS:
        scens = by_section.get(sec)
        if not scens:
            continue
        out += [f"## {TITLES[sec]}", ""]
        if sec == "memory":
            out += [
                "| figure | on | off | vLLM | on / vLLM | off / vLLM | on / off |",
                "|---|---|---|---|---|---|---|",
            ]
            for scen in scens:
                vals = {k: rows.get((scen, k)) for k in ("on", "off", "vllm")}
                for key, label in (
                    ("bytes_per_block", "bytes per block (new pool)"),
                    ("bytes_per_block_after_use", "bytes per block (after one use)"),
                    ("bytes_per_block_with_generations", "bytes per block, block generations on (after use)"),
                ):
                    v = {k: (r.get(key) if r else None) for k, r in vals.items()}
                    b2 = {k: "–" if x is None else f"{x:.2f}" for k, x in v.items()}
                    out.append(
                        f"| {label} | {b2['on']} | {b2['off']} | {b2['vllm']} | "
                        f"{_ratio(v['on'], v['vllm'], 4)} | {_ratio(v['off'], v['vllm'], 4)} | {_ratio(v['on'], v['off'], 4)} |"
                    )
                m = {k: med(scen, k) for k in ("on", "off", "vllm")}
                out.append(
                    f"| {scen} | {_fmt_time(m['on'])} | {_fmt_time(m['off'])} | {_fmt_time(m['vllm'])} | "
                    f"{_ratio(m['on'], m['vllm'])} | {_ratio(m['off'], m['vllm'])} | {_ratio(m['on'], m['off'])} |"
                )
                b = {k: (r["bytes_per_block"] if r else None) for k, r in vals.items()}
                chart.append(
                    (
                        "bytes per block",
                        _r(b["on"], b["vllm"]),
                        _r(b["off"], b["vllm"]),
                        _r(b["on"], b["off"]),
                    )
                )
            out.append("")
            continue
        if sec in ("policy", "adapter"):
            out += _policy_rows(rows, scens)
            continue
        per_block = sec == "scale"
        head = "ns per block" if per_block else "per call"
        out += [
            f"| scenario | on ({head}) | off | vLLM | on / vLLM | off / vLLM | on / off |",
            "|---|---|---|---|---|---|---|",
        ]
        for scen in scens:
            m = {k: med(scen, k) for k in ("on", "off", "vllm")}
            if per_block:
                bpc = next(r["blocks_per_call"] for (s, _), r in rows.items() if s == scen)
                cells = [_num(None if x is None else x * 1e9 / bpc) for x in m.values()]
            else:
                cells = [_fmt_time(x) for x in m.values()]
            out.append(
                f"| {scen} | {cells[0]} | {cells[1]} | {cells[2]} | {_ratio(m['on'], m['vllm'])} | "
                f"{_ratio(m['off'], m['vllm'])} | {_ratio(m['on'], m['off'])} |"
            )
            if not per_block:
                chart.append((scen, _r(m["on"], m["vllm"]), _r(m["off"], m["vllm"]), _r(m["on"], m["off"])))
        out.append("")
        if per_block:
            out += _scale_summary(rows, scens)
    out += _targets(rows, order)
    return "\n".join(out) + "\n", chart


def _policy_rows(rows: dict[tuple[str, str], dict[str, Any]], scens: list[str]) -> list[str]:
    """One row per (scenario, knob value): ns per block and the ratio to the
    scenario's ``baseline`` kind (``extra_info["baseline"]``), same run."""
    out = ["| scenario | variant | ns per block | / baseline |", "|---|---|---|---|"]
    for scen in scens:
        mine = [(k, r) for (s, k), r in rows.items() if s == scen]
        base_kind = mine[0][1].get("baseline")
        base = rows.get((scen, base_kind)) if base_kind else None
        for kind, r in mine:
            ns = r["median"] * 1e9 / r["blocks_per_call"]
            ratio = _ratio(r["median"], base["median"] if base else None)
            out.append(
                f"| {scen} | {kind}{' (baseline)' if kind == base_kind else ''} | {_num(ns)} | {ratio} |"
            )
    return out + [""]


def _num(x: float | None) -> str:
    return "–" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.3g}")


def _r(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _scale_summary(rows: dict[tuple[str, str], dict[str, Any]], scens: list[str]) -> list[str]:
    groups: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for (scen, kind), r in rows.items():
        if scen in scens:
            groups[r["order"]].setdefault(r["blocks"], {})[kind] = r["median"]
    out = ["ns per block at the largest pool over ns per block at the smallest (1 = flat):", ""]
    out += ["| workload | on | off | vLLM |", "|---|---|---|---|"]
    for order, by_size in groups.items():
        lo, hi = min(by_size), max(by_size)
        cells = [_ratio(by_size[hi].get(k), by_size[lo].get(k)) for k in ("on", "off", "vllm")]
        out.append(f"| {order}, {hi:,} / {lo:,} blocks | {' | '.join(cells)} |")
    return out + [""]


def _targets(rows: dict[tuple[str, str], dict[str, Any]], order: list[str]) -> list[str]:
    def med(scen: str, kind: str) -> float | None:
        r = rows.get((scen, kind))
        return None if r is None else r["median"]

    out = ["## Targets", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    trace = next((s for s in order if rows.get((s, "on"), {}).get("section") == "trace"), None)
    if trace:
        r = _r(med(trace, "on"), med(trace, "vllm"))
        out.append(
            _target_row(
                "trace op log, hazards on / vLLM",
                f"≤ {TARGETS['trace_vs_vllm']}",
                r,
                TARGETS["trace_vs_vllm"],
            )
        )
        r = _r(med(trace, "on"), med(trace, "off"))
        out.append(
            _target_row(
                "trace op log, hazards on / off", f"≤ {TARGETS['on_vs_off']}", r, TARGETS["on_vs_off"]
            )
        )
    mem = next((s for s in order if rows.get((s, "on"), {}).get("section") == "memory"), None)
    if mem:
        on, v = rows.get((mem, "on")), rows.get((mem, "vllm"))
        r = _r(on["bytes_per_block"] if on else None, v["bytes_per_block"] if v else None)
        out.append(
            _target_row("bytes per block at 10^6, hazards on / vLLM", "≤ 1", r, TARGETS["bytes_vs_vllm"])
        )
    groups: dict[str, dict[int, float]] = defaultdict(dict)
    for (scen, kind), rr in rows.items():
        if kind == "on" and rr.get("section") == "scale":
            groups[rr["order"]][rr["blocks"]] = rr["median"]
    for o, by_size in groups.items():
        r = _r(by_size[max(by_size)], by_size[min(by_size)])
        out.append(
            _target_row(
                f"ns per block at 10^6 / 10^4, hazards on, {o}", f"≤ {TARGETS['scale']}", r, TARGETS["scale"]
            )
        )
    return out + [""]


def _target_row(name: str, goal: str, r: float | None, limit: float) -> str:
    if r is None:
        return f"| {name} | {goal} | – | not measured |"
    shown = f"{r:.4f}" if abs(r - limit) < 0.01 else f"{r:.2f}"
    return f"| {name} | {goal} | {shown} | {'yes' if r <= limit else 'no'} |"


def chart_png(
    chart: list[tuple[str, float | None, float | None, float | None]], path: Path, title: str
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no chart: matplotlib is not importable ({exc})"
    labels = [c[0] for c in chart]
    series = [
        ("blockpool, hazards on / vLLM", 1, "#1f77b4"),
        ("blockpool, hazards off / vLLM", 2, "#aec7e8"),
        ("hazards on / off", 3, "#ff7f0e"),
    ]
    h = 0.26
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(labels) + 1.6))
    for j, (name, idx, color) in enumerate(series):
        ys = [i + (j - 1) * h for i in range(len(labels))]
        xs = [c[idx] if c[idx] is not None and not math.isnan(c[idx]) else 0.0 for c in chart]
        ax.barh(ys, xs, height=h, label=name, color=color)
        for y, x in zip(ys, xs):
            if x:
                ax.text(x + 0.01, y, f"{x:.2f}", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels([_wrap(lbl) for lbl in labels], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio of medians (below 1: the first is faster / smaller)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _wrap(s: str, width: int = 48) -> str:
    words, lines, cur = s.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    return "\n".join([*lines, cur])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Markdown table and PNG chart from a pytest-benchmark JSON file."
    )
    ap.add_argument("json", type=Path)
    ap.add_argument("--md", type=Path, help="write the Markdown here (default: next to the JSON, report.md)")
    ap.add_argument("--png", type=Path, help="write the chart here (default: next to the JSON, ratios.png)")
    args = ap.parse_args(argv)
    data, rows, order = load(args.json)
    if not rows:
        print(f"{args.json}: no benchmark of this suite in it", file=sys.stderr)
        return 2
    md, chart = build(data, rows, order)
    md_path = args.md or args.json.with_name("report.md")
    png_path = args.png or args.json.with_name("ratios.png")
    note = chart_png(chart, png_path, f"blockpool vs {_vllm_name(data)} BlockPool (medians, same run)")
    if note is None:
        md += f"\n![ratios]({png_path.name})\n"
    else:
        md += f"\n({note})\n"
    md_path.write_text(md, encoding="utf-8")
    print(md)
    print(f"wrote {md_path}" + ("" if note else f" and {png_path}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
