"""Fixtures of the benchmark suite (see ``docs/performance.md``).

Not part of the default test run: the root ``conftest.py`` ignores
``benchmarks/*`` and ``pyproject.toml``'s ``testpaths`` leave it out. Run it
with ``python benchmarks/run.py`` (which passes the files explicitly).

Every benchmark is parametrised over the pool kind (``on``, ``off``,
``vllm``; see :mod:`_pools`) and records, in ``extra_info``, its
``scenario`` (the row of the report), its ``kind`` and, where it makes
sense, ``blocks_per_call`` (so the report can give ns per block).
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _oplog
from _pools import KINDS, vllm_missing


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:  # type: ignore[type-arg]
    """What the report prints about the machine: CPU model (``/proc/cpuinfo``),
    logical cores, Python, and the versions compared."""
    machine_info["blockpool_bench"] = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "blockpool": _version("blockpool"),
        "vllm": _version("vllm"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "timer": config.getoption("benchmark_timer", None) and str(config.getoption("benchmark_timer")),
    }


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Pool kind; ``vllm`` is skipped (with the reason) where vLLM does not import."""
    k: str = request.param
    if k == "vllm":
        reason = vllm_missing()
        if reason is not None:
            pytest.skip(reason)
    return k


@pytest.fixture(params=KINDS[:2])
def ours(request: pytest.FixtureRequest) -> str:
    """Our pool only: ``on`` or ``off``."""
    k: str = request.param
    return k


@pytest.fixture(scope="session")
def oplog(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_oplog.OpLog]:
    """The trace op log, recorded once per session into a temp dir (or read
    from ``$BLOCKPOOL_BENCH_OPLOG`` when that file exists; written there
    when it does not)."""
    if not _oplog.TRACE.exists():
        pytest.skip(f"trace not found: {_oplog.TRACE}")
    env = os.environ.get("BLOCKPOOL_BENCH_OPLOG")
    path = Path(env) if env else tmp_path_factory.mktemp("oplog") / "oplog.pkl"
    if not path.exists():
        _oplog.record(path)
    log = _oplog.load(path)
    yield log
    gc.unfreeze()
