"""``blockpool sweep`` / :mod:`blockpool.replay.sweep`: a grid of replays."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

from blockpool.cli import main
from blockpool.core.errors import (
    BlockPoolError,
    ClusterUnavailableError,
    InvalidArgumentError,
    MissingDependencyError,
)
from blockpool.core.eviction import UnknownEvictionPolicyError
from blockpool.replay.config import ReplayConfig
from blockpool.replay.policies import UnknownPolicyError
from blockpool.replay.run import replay
from blockpool.replay.sweep import COLUMNS, SCHEMA, SweepSpec, cells, format_sweep, sweep, sweep_json
from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace
from blockpool.replay.traces import TraceNotFoundError

GRID = SweepSpec(
    traces="synthetic",
    policies=("exact", "blind"),
    evictions=("lru", "2q"),
    num_blocks=(256, 512),
    seeds=0,
    limit=30,
)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    t0 = time.perf_counter()
    out = sweep(GRID, jobs=2)
    assert time.perf_counter() - t0 < 30  # a few seconds here; generous for a loaded CI
    return out


def test_eight_cells_in_grid_order(rows) -> None:
    assert len(cells(GRID)) == len(rows) == 8
    assert [(r["policy"], r["eviction"], r["num_blocks"]) for r in rows] == [
        ("exact", "lru", 256), ("exact", "lru", 512), ("exact", "2q", 256), ("exact", "2q", 512),
        ("blind", "lru", 256), ("blind", "lru", 512), ("blind", "2q", 256), ("blind", "2q", 512),
    ]  # fmt: skip
    for r in rows:
        assert list(r) == list(COLUMNS)
        assert (
            r["trace"] == "synthetic" and r["placement"] == "lru" and r["seed"] == 0 and r["requests"] == 30
        )


def test_exact_never_races_and_blind_does(rows) -> None:
    assert [r["races"] for r in rows if r["policy"] == "exact"] == [0, 0, 0, 0]
    assert all(r["races"] > 0 for r in rows if r["policy"] == "blind")


def test_a_cell_is_the_replay_of_its_config(rows) -> None:
    trace = synthetic_trace(SyntheticSpec(num_requests=30), seed=0)
    res = replay(trace, "exact", ReplayConfig(num_blocks=512, eviction="2q")).result("exact")
    cell = rows[3]
    assert (cell["eviction"], cell["num_blocks"]) == ("2q", 512)
    assert cell["loads"] == res.loads > 0
    assert cell["evictions"] == res.pool_stats["evictions"]
    assert cell["prefix_hit_rate_pct"] == round(res.prefix_hit_rate_pct, 3)
    assert cell["load_delay_mean_ms"] == round(res.load_delay_mean_ms, 6)
    assert cell["makespan_s"] == round(res.makespan_s, 6)


def test_jobs_do_not_change_rows(rows) -> None:
    one = sweep(
        SweepSpec(traces="synthetic", policies="exact", evictions="2q", num_blocks=512, limit=30), jobs=1
    )
    strip = lambda r: {k: v for k, v in r.items() if k != "wall_s"}
    assert [strip(r) for r in one] == [strip(rows[3])]


def test_seeds_move_the_synthetic_workload() -> None:
    a, b = sweep(SweepSpec(policies="exact", num_blocks=512, seeds=(0, 1), limit=20))
    assert (a["seed"], b["seed"]) == (0, 1)
    assert (a["loads"], a["evictions"], a["makespan_s"]) != (b["loads"], b["evictions"], b["makespan_s"])


def test_json_and_table(rows) -> None:
    doc = sweep_json(GRID, rows, 1.5)
    assert doc["schema"] == SCHEMA == "blockpool.sweep/1"
    assert doc["cells"] == 8 and doc["rows"] == rows and doc["wall_s"] == 1.5
    assert doc["grid"]["num_blocks"] == [256, 512] and doc["grid"]["limit"] == 30
    json.dumps(doc)
    lines = format_sweep(rows).splitlines()
    assert len(lines) == 10 and lines[0].split()[:4] == ["trace", "policy", "evict", "placement"]


@pytest.mark.parametrize(
    ("kw", "err"),
    [
        ({"evictions": ("lru", "fifo")}, UnknownEvictionPolicyError),
        ({"placements": "ready"}, UnknownEvictionPolicyError),
        ({"policies": "exactly"}, UnknownPolicyError),
        ({"num_blocks": (1,)}, InvalidArgumentError),
        ({"seeds": ("a",)}, InvalidArgumentError),
        ({"limit": 0}, InvalidArgumentError),
        ({"traces": ()}, InvalidArgumentError),
    ],
)
def test_bad_grid_is_a_typed_error(kw, err) -> None:
    with pytest.raises(err):
        SweepSpec(**kw)


def test_default_pool_size_per_trace() -> None:
    (c,) = cells(SweepSpec())
    assert c.num_blocks == 2048 and c.policy == "exact" and c.eviction == "lru"
    (c,) = cells(SweepSpec(traces="x.jsonl"))
    assert c.num_blocks == 16384


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    argv = ["sweep", "--policy", "exact", "--placement", "lru,ready_first_cached", "--num-blocks", "512",
            "--limit", "20", "--jobs", "1", "--quiet", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA and [r["placement"] for r in doc["rows"]] == ["lru", "ready_first_cached"]
    assert all(r["races"] == 0 for r in doc["rows"])
    assert "ready_first_cached" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad",
    [
        ["--eviction", "fifo"],
        ["--num-blocks", "x"],
        ["--seed", ""],
        ["--jobs", "0"],
        ["/nonexistent/trace.jsonl"],
    ],
)
def test_cli_bad_input_is_status_2_before_any_cell(bad, tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.json"
    assert main(["sweep", "--limit", "5", "--quiet", "--json", str(out), *bad]) == 2
    assert not out.exists()
    assert "blockpool sweep: error:" in capsys.readouterr().err


# -- on Ray ----------------------------------------------------------------------------

GRID_ARGV = ["--policy", "exact,blind", "--eviction", "lru,2q", "--num-blocks", "256,512", "--limit", "30"]


def strip_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


def test_ray_not_installed_is_a_typed_error_before_any_cell(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, installed or not
    ran = []
    with pytest.raises(MissingDependencyError) as ei:
        sweep(GRID, ray="local", progress=lambda d, t: ran.append(d))
    assert ran == []
    assert isinstance(ei.value, ImportError) and isinstance(ei.value, BlockPoolError)
    assert (ei.value.package, ei.value.extra, ei.value.name) == ("ray", "ray", "ray")
    assert "pip install 'blockpool[ray]'" in str(ei.value)
    out = tmp_path / "s.json"
    assert main(["sweep", *GRID_ARGV, "--ray", "local", "--quiet", "--json", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert (
        err.startswith("blockpool sweep: error: a sweep on Ray needs Ray installed")
        and "blockpool[ray]" in err
    )


@pytest.mark.parametrize("bad", ["", "  ", 6379, b"local"])
def test_bad_ray_address_is_a_typed_error(bad) -> None:
    with pytest.raises(InvalidArgumentError, match="ray must be a Ray address"):
        sweep(GRID, ray=bad)


def test_cli_empty_ray_address_is_status_2(capsys) -> None:
    assert main(["sweep", "--limit", "5", "--quiet", "--ray", ""]) == 2
    assert "--ray takes a Ray address" in capsys.readouterr().err


def fake_ray(init_error: Exception | None = None) -> types.ModuleType:
    """A stand-in for the ``ray`` module: tasks run in this process (at
    ``ray.get``); ``ray.init`` raises ``init_error``."""
    ray = types.ModuleType("ray")
    exc = types.SimpleNamespace()
    exc.RayError = type("RayError", (Exception,), {})
    exc.RayTaskError = type("RayTaskError", (exc.RayError,), {})
    exc.RaySystemError = type("RaySystemError", (exc.RayError,), {})
    ray.exceptions = exc
    ray.calls = []
    state = {"up": False}

    def init(**kw):
        ray.calls.append(("init", kw))
        if init_error is not None:
            raise init_error
        state["up"] = True

    def remote(num_cpus):
        def deco(fn):
            return types.SimpleNamespace(remote=lambda *a: (fn, a))

        return deco

    ray.init, ray.remote, ray.get = init, remote, lambda ref: ref[0](*ref[1])
    ray.is_initialized = lambda: state["up"]
    ray.wait = lambda pending, num_returns: (pending[:num_returns], pending[num_returns:])
    ray.cancel = lambda ref: ray.calls.append(("cancel", ref[1][0].seed))
    ray.shutdown = lambda: ray.calls.append(("shutdown",))
    return ray


SMALL = SweepSpec(policies="exact", num_blocks=512, seeds=(0, 1, 2), limit=5)


def test_ray_that_cannot_start_is_a_typed_error(monkeypatch, capsys) -> None:
    ray = fake_ray(init_error=ConnectionError("could not find any running Ray instance"))
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(ClusterUnavailableError, match="cannot join or start Ray at 'head:6379'") as ei:
        sweep(SMALL, ray="head:6379", jobs=4)
    assert isinstance(ei.value, ConnectionError) and ei.value.address == "head:6379"
    assert isinstance(ei.value.__cause__, ConnectionError)
    assert ray.calls == [
        ("init", {"address": "head:6379", "log_to_driver": False})
    ]  # no num_cpus off-machine
    assert main(["sweep", "--limit", "5", "--quiet", "--ray", "local", "--jobs", "3"]) == 2
    assert ray.calls[-1] == ("init", {"address": "local", "log_to_driver": False, "num_cpus": 3,
                                      "include_dashboard": False})  # fmt: skip
    assert "blockpool sweep: error: cannot join or start Ray at 'local'" in capsys.readouterr().err


def test_ray_task_that_never_ran_its_cell_is_a_typed_error(monkeypatch) -> None:
    """A worker that cannot import blockpool: Ray's system error, not the
    cell's; the other tasks are cancelled and the sweep's instance stopped."""
    ray = fake_ray()

    def get(ref):
        raise ray.exceptions.RaySystemError("No module named 'blockpool'")

    ray.get = get
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(
        ClusterUnavailableError, match="No module named 'blockpool'.*importable on every Ray worker"
    ):
        sweep(SMALL, ray="local")
    assert ray.calls[1:] == [("cancel", 1), ("cancel", 2), ("shutdown",)]


def test_fake_ray_runs_the_same_rows(monkeypatch) -> None:
    ray = fake_ray()
    monkeypatch.setitem(sys.modules, "ray", ray)
    got = sweep(SMALL, ray="local")
    assert strip_wall(got) == strip_wall(sweep(SMALL))
    assert [r["seed"] for r in got] == [0, 1, 2] and ray.calls[-1] == ("shutdown",)


@pytest.fixture()
def no_ray_connection():
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    yield ray
    if ray.is_initialized():  # the sweep failed before its own shutdown
        ray.shutdown()


@pytest.fixture()
def ray_connection():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_cli_ray_local_gives_the_local_process_rows(rows, no_ray_connection, tmp_path: Path, capsys) -> None:
    """The 8-cell grid as Ray tasks on a local instance that the sweep
    starts (2 CPUs) and stops: the rows of local processes, but wall_s."""
    ray = no_ray_connection
    out = tmp_path / "s.json"
    t0 = time.perf_counter()
    assert main(["sweep", *GRID_ARGV, "--ray", "local", "--jobs", "2", "--quiet", "--json", str(out)]) == 0
    assert time.perf_counter() - t0 < 60  # about 8 s here: Ray's start and stop are most of it
    assert not ray.is_initialized()  # the sweep's own instance is shut down
    doc = json.loads(out.read_text())
    assert doc["cells"] == 8 and [list(r) for r in doc["rows"]] == [list(COLUMNS)] * 8
    assert strip_wall(doc["rows"]) == strip_wall(rows)
    assert all(isinstance(r["wall_s"], float) and r["wall_s"] >= 0 for r in doc["rows"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 11 and lines[-1] == f"wrote {out}"  # the table, then the file written


def test_ray_uses_an_open_connection_and_keeps_a_cell_error_type(rows, ray_connection) -> None:
    ray = ray_connection
    done: list[tuple[int, int]] = []
    got = sweep(
        GRID, ray="this address is not used: connected already", progress=lambda d, t: done.append((d, t))
    )
    assert strip_wall(got) == strip_wall(rows)
    assert done == [(i, 8) for i in range(1, 9)]
    assert ray.is_initialized()  # not ours to shut down
    with pytest.raises(TraceNotFoundError):
        sweep(SweepSpec(traces=("synthetic", "/nonexistent/trace.jsonl"), limit=5), ray="local")
    assert ray.is_initialized()
