"""pytest plugin: stream each test's outcome to a file as it happens, and
run only part of the selection, so that ``scripts/vllm_parity_pass.py`` can
resume a pass that a hung test killed.

A pytest run writes its junit XML and its summary only when the session
ends; a test that hangs (or a process that hangs at exit, joining a
deadlocked multiprocessing child) loses every outcome of the pass. This
plugin appends one JSON object per line, flushed at once, to the file named
by ``VLLM_PARITY_PROGRESS``:

- ``{"start": NODEID}`` when a test's protocol begins
  (``pytest_runtest_logstart``);
- ``{"nodeid": NODEID, "when": "setup"|"call"|"teardown", "outcome":
  "passed"|"failed"|"skipped", "xfail": bool, "message": TEXT}`` per report
  (``message`` is the failure's long repr, first 20,000 characters; empty
  when it passed);
- ``{"finish": EXITSTATUS}`` when the session ends (``pytest_sessionfinish``).

``VLLM_PARITY_DESELECT`` names a file of node ids (one a line) to deselect;
``VLLM_PARITY_ONLY`` names a file of node ids to keep, all others being
deselected. Both apply after every other plugin's collection hook.

Loaded with ``-p vllm_parity_progress`` (``scripts/`` on ``PYTHONPATH``) in
both parity passes; without the variables it does nothing. It imports nothing
from vLLM or blockpool.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

import pytest

_MESSAGE_CHARS = 20_000
_out: IO[str] | None = None


def _emit(record: dict[str, Any]) -> None:
    if _out is not None:
        _out.write(json.dumps(record) + "\n")
        _out.flush()


def _read_ids(var: str) -> set[str] | None:
    path = os.environ.get(var)
    if not path:
        return None
    with open(path) as f:
        return {line.rstrip("\n") for line in f if line.strip()}


def pytest_configure(config: pytest.Config) -> None:
    global _out
    path = os.environ.get("VLLM_PARITY_PROGRESS")
    if path:
        _out = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the session


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect = _read_ids("VLLM_PARITY_DESELECT") or set()
    only = _read_ids("VLLM_PARITY_ONLY")
    keep, drop = [], []
    for item in items:
        if item.nodeid in deselect or (only is not None and item.nodeid not in only):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _emit({"start": nodeid})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    message = "" if report.passed else report.longreprtext[:_MESSAGE_CHARS]
    _emit(
        {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "xfail": hasattr(report, "wasxfail"),
            "message": message,
        }
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _emit({"finish": int(exitstatus)})
