"""Run one pytest pass of ``scripts/vllm_parity.sh`` so that a hung test
costs one test, not the pass.

A vLLM test that hangs (a multiprocessing child deadlocked after a fork, a
socket that never answers, a process that hangs at exit joining such a
child) used to run the whole pass into its time limit and lose every
outcome: CI failed on vLLM's own pool with nothing to say which test hung.
This runner starts pytest in its own session with the progress plugin
(``scripts/vllm_parity_progress.py``), which streams each outcome as it
happens, and watches it:

- pytest-timeout (``--timeout-method=thread``, passed by the script) ends a
  test that runs past its limit by dumping every thread's stack and exiting
  the process; a test that holds the interpreter so that even that cannot
  run is caught here, when no outcome arrives for ``--stall`` seconds;
- after the session's end is recorded, the process gets ``--grace`` seconds
  to exit, then it is killed (outcomes are all in by then);
- whatever way an attempt ends, its whole process group is killed, so no
  deadlocked child outlives it.

The test that started and did not end is recorded as hung, its stack dump
(if any) printed, and the pass resumes without it and without every test
that already has an outcome. Each hung test is then run once more on its
own: its outcome there is its outcome (a pass after a hang is reported); if
it hangs again its outcome is ``hung``. A pass with more than
``--max-hung`` hung tests, one whose attempt ends with no outcome at all, or
one that outlives ``--budget`` seconds in all, did not complete.

Outputs, under ``--results``: ``NAME.log`` (every attempt's pytest output,
each behind a ``==== attempt K`` line), ``NAME.progress`` (the progress
records of every attempt), ``NAME.outcomes`` (sorted ``nodeid<TAB>outcome``
lines, outcome one of ``passed``, ``failed``, ``error``, ``skipped``,
``hung``), ``NAME.unexpected`` (failed, errored or hung tests that are
neither known environment failures nor known flaky, see below), and, where
``--merge-json-env VAR`` names a variable of the pass's environment that
holds a file path, that file: each attempt writes its own ``PATH.K`` and the
runner merges them (numbers summed, booleans and-ed, lists united, mappings
merged key by key, other values from the first attempt). An attempt killed
mid-session writes none, so the merged counts can fall short of the pass's.

Known environment failures come in the environment: ``KNOWN_IDS`` (node ids,
or a test function's id matching all its ``[params]``), ``KNOWN_MSGS``
(Python regexes searched in the failure's text) and ``FLAKY_IDS``, one a
line. A test that hangs twice is reported but, like a known environment
failure, does not make the pass fail: with vLLM's own pool it can only be
the environment's, and with ours the per-test comparison against plugin off
judges it (a test that passed with plugin off and hung with plugin on is a
regression there).

Exit status: 0 = the pass completed (whatever its tests' outcomes);
1 = it did not; 2 = usage error. Prints ``NAME: N passed, N failed`` and
per-file failure counts, as the script's callers expect.

It imports nothing from vLLM or blockpool; it runs under the parity venv's
Python.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLL_S = 1.0


def log(msg: str) -> None:
    print(f"[vllm-parity] {msg}", file=sys.stderr, flush=True)


@dataclass
class Attempt:
    """What one pytest process reported."""

    reports: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    finished: int | None = None  # pytest's exit status, as recorded by the plugin
    rc: int | None = None
    killed: str = ""  # why the runner killed it, or ""

    def unfinished(self) -> str | None:
        """The test that started and has no teardown report, if any."""
        for nodeid in reversed(self.started):
            if not any(r["when"] == "teardown" for r in self.reports.get(nodeid, [])):
                return nodeid
        return None


def outcome_of(reports: list[dict[str, Any]]) -> tuple[str, str]:
    """A test's outcome and failure text from its setup/call/teardown reports,
    as junit would count it: a failed setup or teardown is an error, a failed
    call a failure, any skip (an xfail too) a skip."""
    message = "\n".join(r["message"] for r in reports if r["message"])
    if any(r["outcome"] == "failed" and r["when"] != "call" for r in reports):
        return "error", message
    if any(r["outcome"] == "failed" for r in reports):
        return "failed", message
    if any(r["outcome"] == "skipped" for r in reports):
        return "skipped", message
    return "passed", message


def read_progress(path: Path, attempt: Attempt) -> None:
    attempt.reports.clear()
    attempt.started.clear()
    if not path.exists():
        return
    with path.open() as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            if "start" in rec:
                attempt.started.append(rec["start"])
            elif "finish" in rec:
                attempt.finished = rec["finish"]
            else:
                attempt.reports.setdefault(rec["nodeid"], []).append(rec)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_attempt(
    args: argparse.Namespace, k: int, env: dict[str, str], select: dict[str, str], deadline: float
) -> Attempt:
    """One pytest process over the selection; watched as the module says."""
    progress = Path(args.results) / f"{args.name}.progress.{k}"
    progress.unlink(missing_ok=True)
    env = {**env, "VLLM_PARITY_PROGRESS": str(progress), **select}
    log_path = Path(args.results) / f"{args.name}.log"
    attempt = Attempt()
    with log_path.open("a") as out:
        out.write(f"==== attempt {k}: {' '.join(args.pytest)}\n")
        out.flush()
        proc = subprocess.Popen(
            [args.python, "-m", "pytest", *args.pytest],
            cwd=args.cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            last_size, last_change, finished_at = -1, time.monotonic(), None
            while proc.poll() is None:
                time.sleep(POLL_S)
                now = time.monotonic()
                try:
                    size = progress.stat().st_size
                except FileNotFoundError:  # pytest has not configured the plugin yet
                    size = 0
                if size != last_size:
                    last_size, last_change = size, now
                    if size and finished_at is None and b'"finish"' in progress.read_bytes()[-200:]:
                        finished_at = now
                if finished_at is not None and now - finished_at > args.grace:
                    attempt.killed = f"still running {args.grace:.0f} s after its session ended"
                elif now - last_change > args.stall:
                    attempt.killed = f"no test outcome for {args.stall:.0f} s"
                elif now > deadline:
                    attempt.killed = f"the pass ran past its {args.budget:.0f} s"
                if attempt.killed:
                    break
            attempt.rc = proc.poll()
        finally:
            # Also when this runner fails or is stopped (SIGTERM is turned into
            # SystemExit in main): no pytest process or child outlives it.
            kill_group(proc)  # the process, if still there, and every child left behind
    read_progress(progress, attempt)
    with (Path(args.results) / f"{args.name}.progress").open("a") as all_progress:
        if progress.exists():
            all_progress.write(progress.read_text())
    progress.unlink(missing_ok=True)
    return attempt


def stack_dump(log_path: Path, offset: int, lines: int = 60) -> list[str]:
    """pytest-timeout's dump of every thread's stack in this attempt's log."""
    with log_path.open(errors="replace") as f:
        f.seek(offset)
        text = f.read().splitlines()
    for i, line in enumerate(text):
        if "Timeout" in line and line.lstrip().startswith("+"):
            return text[i : i + lines]
    return []


def merge_json(values: Iterable[Any]) -> Any:
    values = list(values)
    first = values[0]
    if isinstance(first, bool):
        return all(values)
    if isinstance(first, (int, float)):
        return sum(values)
    if isinstance(first, list):
        out: list[Any] = []
        for v in values:
            out.extend(x for x in v if x not in out)
        return out
    if isinstance(first, dict):
        keys: list[str] = []
        for v in values:
            keys.extend(k for k in v if k not in keys)
        return {k: merge_json([v[k] for v in values if k in v]) for k in keys}
    return first


def id_match(nodeid: str, ids: list[str]) -> bool:
    """A test id, or a test function's id without its [params]."""
    return any(nodeid == i or nodeid.startswith(i + "[") for i in ids)


def env_lines(var: str) -> list[str]:
    return [line for line in os.environ.get(var, "").splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--results", required=True, help="results directory")
    p.add_argument("--cwd", required=True, help="directory pytest runs in")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--budget", type=float, default=1800.0, help="seconds for the whole pass")
    p.add_argument("--stall", type=float, default=420.0, help="seconds with no outcome before a kill")
    p.add_argument("--grace", type=float, default=60.0, help="seconds to exit after the session ends")
    p.add_argument("--max-hung", type=int, default=6)
    p.add_argument("--env", action="append", default=[], metavar="VAR=VALUE")
    p.add_argument("--merge-json-env", default="", metavar="VAR")
    p.add_argument("pytest", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = p.parse_args(argv)
    # SIGTERM (the script's outer timeout) unwinds like an error, so the
    # finally in run_attempt kills the pytest process group.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.pytest[:1] == ["--"]:
        args.pytest = args.pytest[1:]
    if not args.pytest:
        p.error("no pytest arguments after --")

    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    for suffix in ("log", "progress", "outcomes", "unexpected"):
        (results / f"{args.name}.{suffix}").unlink(missing_ok=True)
    env = dict(os.environ)
    for kv in args.env:
        key, sep, value = kv.partition("=")
        if not sep:
            p.error(f"--env wants VAR=VALUE, got {kv!r}")
        env[key] = value
    merge_target = env.get(args.merge_json_env, "") if args.merge_json_env else ""
    if merge_target:
        Path(merge_target).unlink(missing_ok=True)

    start = time.monotonic()
    deadline = start + args.budget
    log_path = results / f"{args.name}.log"
    outcomes: dict[str, tuple[str, str]] = {}
    hung: list[str] = []
    retried: dict[str, str] = {}  # nodeid -> outcome on its own run
    merged_parts: list[Path] = []
    completed = False
    tmp = Path(tempfile.mkdtemp(prefix=f"parity-{args.name}-"))
    k = 0

    def attempt_env(k: int) -> dict[str, str]:
        if not merge_target:
            return env
        part = Path(f"{merge_target}.{k}")
        part.unlink(missing_ok=True)
        merged_parts.append(part)
        return {**env, args.merge_json_env: str(part)}

    def take(attempt: Attempt) -> None:
        for nodeid, reports in attempt.reports.items():
            if any(r["when"] == "teardown" for r in reports) or (attempt.finished is not None and reports):
                outcomes[nodeid] = outcome_of(reports)

    # The pass, resumed after each hung test without it and without every
    # test that has an outcome.
    while True:
        k += 1
        deselect = tmp / "deselect"
        deselect.write_text("".join(n + "\n" for n in [*outcomes, *hung]))
        offset = log_path.stat().st_size if log_path.exists() else 0
        attempt = run_attempt(args, k, attempt_env(k), {"VLLM_PARITY_DESELECT": str(deselect)}, deadline)
        take(attempt)
        resumed_empty = k > 1 and attempt.rc == 5  # nothing was left to run
        if attempt.finished is not None and (attempt.finished in (0, 1) or resumed_empty):
            if attempt.killed:
                log(f"pass {args.name}: attempt {k} {attempt.killed}: killed (its outcomes were all in)")
            completed = True
            break
        if attempt.finished is not None:
            log(f"pass {args.name}: pytest ended with status {attempt.finished} (not a test outcome)")
            break
        nodeid = attempt.unfinished()
        why = attempt.killed or f"the process exited with status {attempt.rc}"
        if nodeid is None:
            log(f"pass {args.name}: attempt {k} ended with no test left hanging ({why}), see {log_path}")
            break
        hung.append(nodeid)
        log(f"pass {args.name}: {nodeid} hung ({why}); resuming without it")
        for line in stack_dump(log_path, offset):
            print(f"    {line}", file=sys.stderr)
        if len(hung) > args.max_hung:
            log(f"pass {args.name}: more than {args.max_hung} hung tests")
            break
        if time.monotonic() > deadline:
            log(f"pass {args.name}: ran past its {args.budget:.0f} s")
            break

    # Each hung test once more, on its own.
    if completed:
        for nodeid in hung:
            k += 1
            only = tmp / "only"
            only.write_text(nodeid + "\n")
            attempt = run_attempt(
                args,
                k,
                attempt_env(k),
                {"VLLM_PARITY_ONLY": str(only)},
                max(deadline, time.monotonic() + args.stall),
            )
            reports = attempt.reports.get(nodeid, [])
            if attempt.finished is not None and reports:
                outcomes[nodeid] = outcome_of(reports)
                retried[nodeid] = outcomes[nodeid][0]
                log(f"pass {args.name}: {nodeid} hung once, then {retried[nodeid]} on its own")
            else:
                outcomes[nodeid] = ("hung", f"hung twice ({attempt.killed or attempt.rc})")
                retried[nodeid] = "hung"
                log(f"pass {args.name}: {nodeid} hung again on its own")
                for line in stack_dump(log_path, 0)[:20]:
                    print(f"    {line}", file=sys.stderr)

    if merge_target:
        parts = [json.loads(pp.read_text()) for pp in merged_parts if pp.exists()]
        for pp in merged_parts:
            pp.unlink(missing_ok=True)
        if parts:
            Path(merge_target).write_text(json.dumps(merge_json(parts), indent=1, sort_keys=True) + "\n")
        if len(parts) < len(merged_parts):
            log(
                f"pass {args.name}: {len(parts)} of {len(merged_parts)} attempts wrote {merge_target} "
                "(a killed attempt writes none; its counts are missing)"
            )
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()

    if not completed:
        log(f"pass {args.name} did not complete in {time.monotonic() - start:.0f} s, see {log_path}")
        return 1

    known_ids, flaky = env_lines("KNOWN_IDS"), env_lines("FLAKY_IDS")
    known_msgs = [re.compile(m) for m in env_lines("KNOWN_MSGS")]
    counts: collections.Counter[str] = collections.Counter()
    bad_by_file: collections.Counter[str] = collections.Counter()
    known_by_file: collections.Counter[str] = collections.Counter()
    unexpected = []
    for nodeid, (outcome, message) in outcomes.items():
        counts[outcome] += 1
        if outcome in ("passed", "skipped"):
            continue
        path = nodeid.split("::", 1)[0]
        bad_by_file[path] += 1
        if (
            outcome == "hung"
            or id_match(nodeid, known_ids)
            or id_match(nodeid, flaky)
            or any(m.search(message) for m in known_msgs)
        ):
            known_by_file[path] += 1
        else:
            unexpected.append(nodeid)
    (results / f"{args.name}.outcomes").write_text(
        "".join(f"{n}\t{o}\n" for n, (o, _) in sorted(outcomes.items()))
    )
    (results / f"{args.name}.unexpected").write_text("".join(n + "\n" for n in sorted(unexpected)))
    failed = counts["failed"] + counts["error"] + counts["hung"]
    print(f"{args.name}: {counts['passed']} passed, {failed} failed")
    extra = ", ".join(f"{c} {counts[c]}" for c in ("error", "hung", "skipped") if counts[c])
    if extra:
        print(f"  ({extra}; 'failed' above includes errors and hung tests)")
    for path, n in sorted(bad_by_file.items()):
        kn = known_by_file[path]
        note = f"  [{kn} known environment failures, flaky or hung]" if kn else ""
        print(f"  {path}: {n} failed{note}")
    if hung:
        print(
            f"  {len(hung)} hung once and ran again on its own: "
            + ", ".join(f"{n} -> {retried.get(n, '?')}" for n in hung)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
