#!/usr/bin/env python3
"""Run the benchmark suite, then write the comparison report.

Usage, from the repository root::

    python benchmarks/run.py                  # everything, about 10 minutes on 2 cores
    python benchmarks/run.py -k trace         # only the trace op log
    python benchmarks/run.py --out out/bench --timer perf_counter

The suite runs under the venv of the newest supported vLLM line that exists
(``.venv-vllm034``, built by ``bash scripts/vllm_parity.sh``; else
``.venv-vllm``, vLLM 0.33.0, built by ``VLLM_PARITY_VERSION=0.33.0 bash
scripts/vllm_parity.sh``), so vLLM's ``BlockPool`` is measured side by
side; ``--python`` picks another (e.g. ``.venv-vllm/bin/python`` for the
0.33 line); without one, under this interpreter (the vLLM rows are then
skipped, with the reason). The report names the vLLM measured. The
interpreter needs ``pytest-benchmark`` (``.venv-vllm034/bin/pip install
pytest-benchmark``) and ``blockpool`` importable (the venv's editable
install, or the repo root on the path).

Writes ``OUT/bench.json`` (pytest-benchmark's JSON), then, with this
interpreter (which needs matplotlib for the chart), ``OUT/report.md`` and
``OUT/ratios.png`` (``benchmarks/report.py``). Default ``OUT``:
``out/bench`` (git-ignored).

Timer: ``time.process_time`` by default (CPU time of the process, so that
other work on a shared machine does not count); ``--timer perf_counter``
for wall time. The trace op log is recorded once per run into a temp dir;
``BLOCKPOOL_BENCH_OPLOG=path.pkl`` keeps it between runs.

Exit status: pytest's (0 when every benchmark ran or was skipped).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def _interpreter(explicit: str | None) -> str:
    if explicit:
        return explicit
    for name in (".venv-vllm034", ".venv-vllm"):  # newest supported line first
        venv = REPO / name / "bin" / "python"
        if venv.exists():
            return str(venv)
    return sys.executable


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "out" / "bench"), help="output directory (default out/bench)")
    ap.add_argument(
        "--python",
        help="interpreter for the suite (default: .venv-vllm034/bin/python, else .venv-vllm/bin/python, if present)",
    )
    ap.add_argument("--timer", default="process_time", choices=["process_time", "perf_counter"])
    ap.add_argument("-k", dest="keyword", help="pytest -k expression (run part of the suite)")
    ap.add_argument("--no-report", action="store_true", help="only run the suite")
    args, extra = ap.parse_known_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    py = _interpreter(args.python)
    files = sorted(str(p.relative_to(REPO)) for p in BENCH.glob("test_*.py"))
    cmd = [
        py,
        "-m",
        "pytest",
        "-o",
        "addopts=",  # no doctest collection, no coverage of the default run's options
        "-p",
        "no:cacheprovider",
        "-q",
        f"--benchmark-json={json_path}",
        f"--benchmark-timer=time.{args.timer}",
        "--benchmark-columns=median,iqr,rounds",
        "--benchmark-sort=name",
        *files,
        *extra,
    ]
    if args.keyword:
        cmd += ["-k", args.keyword]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    if args.no_report or not json_path.exists():
        return rc
    report = [
        sys.executable,
        str(BENCH / "report.py"),
        str(json_path),
        "--md",
        str(out / "report.md"),
        "--png",
        str(out / "ratios.png"),
    ]
    print("+", " ".join(report), flush=True)
    rc2 = subprocess.call(report, cwd=REPO)
    return rc or rc2


if __name__ == "__main__":
    sys.exit(main())
