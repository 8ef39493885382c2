#!/usr/bin/env python3
"""The trace op log, pure-Python build against compiled build, interleaved.

Usage::

    python benchmarks/builds.py --oplog out/oplog.pkl --compiled build/compiled-suite [--rounds 3]

``--compiled`` is a directory holding the compiled package (what
``scripts/compiled_suite.sh`` unpacks), as ``DIR`` or ``NAME=DIR``;
repeat it to compare compiled variants (two mypyc builds, say) in the same
run. The pure build is this checkout.
Each round runs, for each build in turn, one process that validates the
replay against the recording (block ids of every allocation and lookup,
free counts) and then times one pass per pool (``on``, ``off``, and
``vllm`` when a supported vLLM imports: run it with
``.venv-vllm034/bin/python`` for the newest line, or another line's venv;
the output names the vLLM), process time, in an order rotated from round
to round so that no pool always takes a process's first timed pass.
Prints each round's seconds and ratios, then the medians.
Record the log first with the pure build (the recorder subclasses the
pool, which the compiled build does not allow)::

    python -c "import sys; sys.path.insert(0, 'benchmarks'); import _oplog, pathlib; _oplog.record(pathlib.Path('out/oplog.pkl'))"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import gc, json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import blockpool, _oplog
from _oplog import OpLog, build_replay, compile_calls, run_calls, validate
from _pools import make_pool, vllm_line, vllm_missing
log = _oplog.load(Path(sys.argv[1]))
kinds = ["on", "off"] + ([] if vllm_missing() else ["vllm"])
k = int(sys.argv[3]) % len(kinds)
kinds = kinds[k:] + kinds[:k]  # rotated by round: no pool always times first
out = {"compiled": blockpool.__compiled__, "file": blockpool.__file__, "vllm_line": vllm_line()}
for kind in kinds:
    pool = make_pool(kind, log.num_blocks)
    calls, checks = compile_calls(log, kind, pool)
    out[kind + "_checked"] = validate(calls, checks)
    del calls, checks, pool
    gc.collect()
    calls, _ = build_replay(log, kind, lambda: make_pool(kind, log.num_blocks))
    gc.collect()
    t = time.process_time()
    run_calls(calls)
    out[kind] = time.process_time() - t
    del calls
    gc.collect()
print(json.dumps(out))
"""


def _measured_vllm() -> str:
    """The vLLM this interpreter measures (``vLLM 0.34.0``), or why none."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _pools import vllm_line

    return vllm_line()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oplog", type=Path, required=True)
    ap.add_argument("--compiled", action="append", required=True, metavar="[NAME=]DIR")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    builds: dict[str, Path] = {"pure": REPO}
    for spec in args.compiled:
        name, _, path = spec.rpartition("=")
        builds[name or ("compiled" if len(args.compiled) == 1 else path)] = Path(path).resolve()
    rows: dict[str, list[dict[str, float]]] = {b: [] for b in builds}
    print(f"against {_measured_vllm()}", flush=True)
    for r in range(args.rounds):
        for name, root in builds.items():
            env = dict(os.environ, PYTHONPATH=str(root))
            res = subprocess.run(
                [sys.executable, "-c", _CHILD, str(args.oplog.resolve()), str(REPO / "benchmarks"), str(r)],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(res.stdout.strip().splitlines()[-1])
            assert got["compiled"] is (name != "pure"), got
            rows[name].append(got)
            ratios = f"on/off {got['on'] / got['off']:.2f}"
            if "vllm" in got:
                ratios += f", on/vLLM {got['on'] / got['vllm']:.2f}, off/vLLM {got['off'] / got['vllm']:.2f}"
            secs = ", ".join(f"{k} {got[k]:.2f} s" for k in ("on", "off", "vllm") if k in got)
            print(f"round {r + 1} {name:8s}: {secs} ({ratios})", flush=True)
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("on", "off", "vllm") if k in rs[0]}
        line = f"median {name:8s}: on/off {statistics.median(x['on'] / x['off'] for x in rs):.2f}"
        if "vllm" in med:
            line += f", on/vLLM {statistics.median(x['on'] / x['vllm'] for x in rs):.2f}"
            line += f", off/vLLM {statistics.median(x['off'] / x['vllm'] for x in rs):.2f}"
        print(line + " (" + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
