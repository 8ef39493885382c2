#!/usr/bin/env python3
"""Differential run with failures: every fence the pool hands out on N random
allocate / free / tag / load / store / copy / cache / complete / fail
sequences, judged by the independent happens-before model
(``tests/hb_model.py``). See :mod:`tests.differential` for the counts.

Run from a checkout, no install step::

    PYTHONPATH=. python benchmarks/differential.py --sequences 20000

Prints one JSON object on stdout; exit status 0 when missed, redundant,
unsafe and host-mark counts are all zero, 1 otherwise (then the smallest
failing sequence, shrunk by the asserting stateful machine, goes to
stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.differential import FIGURES, run, smallest_failing_case


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=50, help="operations per sequence at most")
    args = ap.parse_args(argv)
    out = run(args.sequences, args.steps)
    print(json.dumps(out, indent=1))
    if any(out[k] for k in FIGURES):
        print(smallest_failing_case(steps=args.steps), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
