"""``blockpool replay --eviction/--placement``: variants side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockpool.cli import main
from blockpool.core.eviction import UnknownEvictionPolicyError
from blockpool.replay.config import ReplayConfig
from blockpool.replay.run import replay
from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace

SMALL = ["--limit", "40", "--num-blocks", "512", "--jobs", "1", "--quiet"]


@pytest.fixture(scope="module")
def grid() -> dict:
    trace = synthetic_trace(SyntheticSpec(num_requests=40))
    cfg = ReplayConfig(num_blocks=512)
    plain = replay(trace, "exact", cfg)
    rep = replay(trace, "exact", cfg, evictions=["lru", "s3fifo", "2q"], placements=["lru", "ready_first"])
    return {"plain": plain, "grid": rep}


def test_labels_are_policy_eviction_placement_in_order(grid) -> None:
    labels = [r.policy for r in grid["grid"].results]
    assert labels == [
        "exact/lru/lru", "exact/lru/ready_first", "exact/s3fifo/lru",
        "exact/s3fifo/ready_first", "exact/2q/lru", "exact/2q/ready_first",
    ]  # fmt: skip
    assert grid["grid"].config["policies"] == labels


def test_lru_lru_is_exactly_todays_replay(grid) -> None:
    plain = grid["plain"].result("exact").to_json(timing=False)
    same = grid["grid"].result("exact/lru/lru").to_json(timing=False)
    assert plain == same


def test_every_variant_is_race_free_and_reports_its_hit_rate(grid) -> None:
    for r in grid["grid"].results:
        assert r.races == 0, r.policy
        q, h = r.counts["prefix_query_blocks"], r.counts.get("prefix_hit_blocks", 0)
        assert q > 0 and r.prefix_hit_rate_pct == pytest.approx(100.0 * h / q)
        assert r.to_json()["prefix_hit_rate_pct"] == round(100.0 * h / q, 3)


def test_eviction_changes_what_is_evicted(grid) -> None:
    g = grid["grid"]
    evictions = {r.policy: r.pool_stats["evictions"] for r in g.results}
    assert evictions["exact/lru/lru"] > 0
    assert len({r.counts["prefix_hit_blocks"] for r in g.results if r.policy.endswith("/lru")}) > 1


def test_cli_grid_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert (
        main(["replay", *SMALL, "--policy", "exact", "--eviction", "s3fifo,lru,s3fifo", "--json", str(out)])
        == 0
    )
    rep = json.loads(out.read_text())
    assert list(rep["policies"]) == ["exact/s3fifo/lru", "exact/lru/lru"]
    table = capsys.readouterr().out
    assert "hit%" in table.splitlines()[0] and "exact/s3fifo/lru" in table


@pytest.mark.parametrize("opt", ["--eviction", "--placement"])
def test_cli_unknown_name_is_status_two(opt: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *SMALL, "--policy", "exact", opt, "lru,clock"]) == 2
    err = capsys.readouterr().err
    assert "unknown" in err and "'clock'" in err


def test_config_rejects_unknown_names() -> None:
    with pytest.raises(UnknownEvictionPolicyError):
        ReplayConfig(eviction="mru")
    with pytest.raises(UnknownEvictionPolicyError):
        ReplayConfig(placement="anywhere")
    with pytest.raises(UnknownEvictionPolicyError):
        replay(synthetic_trace(SyntheticSpec(num_requests=2)), "exact", evictions=["lru", "mru"])


def test_ready_first_cached_replay_is_race_free_and_places_cached_blocks() -> None:
    trace = synthetic_trace(SyntheticSpec(num_requests=40))
    cfg = ReplayConfig(num_blocks=512)
    rep = replay(trace, "exact,blind", cfg, placements=["ready_first_cached"])
    exact = rep.result("exact/lru/ready_first_cached")
    assert exact.races == 0 and exact.loads > 0
    assert rep.result("blind/lru/ready_first_cached").races > 0  # the negative control still races


@pytest.fixture(scope="module")
def runs_grid() -> dict:
    trace = synthetic_trace(SyntheticSpec(num_requests=80))
    cfg = ReplayConfig(num_blocks=768)
    rep = replay(trace, "exact", cfg, placements=["lru", "runs", "runs_cached"])
    return {r.policy: r for r in rep.results}


def test_runs_are_counted_per_load_and_store_and_bounded_by_the_floor(runs_grid) -> None:
    for r in runs_grid.values():
        assert len(r.load_runs) == len(r.load_min_runs) == r.loads > 0
        assert r.store_runs and all(k >= 1 for k in r.store_runs)
        # No load posts fewer descriptors than its block count allowed.
        assert all(got >= floor >= 1 for got, floor in zip(r.load_runs, r.load_min_runs))
        data = r.to_json(timing=False)
        assert data["runs_per_load"] == round(r.runs_per_load, 4)
        assert data["min_runs_per_load"] == round(r.min_runs_per_load, 4)


def test_run_aware_placement_posts_fewer_descriptors_than_lru(runs_grid) -> None:
    lru, runs, cached = (runs_grid[f"exact/lru/{p}"] for p in ("lru", "runs", "runs_cached"))
    assert runs.runs_per_load < lru.runs_per_load
    assert cached.runs_per_load < runs.runs_per_load
    assert cached.runs_per_load <= 1.5 * cached.min_runs_per_load  # the target
    # runs keeps LRU's choice of evicted keys: the same hits, the same loads.
    assert (runs.prefix_hit_rate_pct, runs.loads) == (lru.prefix_hit_rate_pct, lru.loads)


def test_loads_short_of_ready_blocks_are_among_the_waiting_loads(runs_grid) -> None:
    for r in runs_grid.values():
        assert 0 <= r.loads_short_of_ready <= r.loads - r.loads_empty_fence
        assert r.to_json(timing=False)["loads_short_of_ready"] == r.loads_short_of_ready
    roomy = replay(synthetic_trace(SyntheticSpec(num_requests=300)), "exact", ReplayConfig(num_blocks=8192))
    res = roomy.result("exact")
    assert res.loads and res.loads_empty_fence == res.loads and res.loads_short_of_ready == 0
