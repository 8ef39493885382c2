"""The ``blockpool replay`` command: exit codes, outputs, optional dependencies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from blockpool.cli import main
from blockpool.replay.policies import WaitPolicy

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--limit", "40", "--num-blocks", "1024", "--jobs", "1", "--quiet"]
GOOD = {"timestamp": 0, "input_length": 700, "output_length": 20, "hash_ids": [1, 2]}


def _trace(tmp_path: Path, *extra: str) -> Path:
    p = tmp_path / "t.jsonl"
    lines = [json.dumps({**GOOD, "timestamp": 100 * i, "hash_ids": [1, 100 + i]}) for i in range(12)]
    p.write_text("\n".join([*lines, *extra]) + "\n")
    return p


def test_synthetic_replay_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *SMALL, "--policy", "exact,blind"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["policy", "races"] and "blind" in out


def test_json_report_has_every_figure_for_every_policy(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["replay", *SMALL, "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert list(rep["policies"]) == ["exact", "step-event", "device-sync", "blind"]
    assert {
        "races",
        "loads_empty_fence_pct",
        "load_start_delay_ms",
        "makespan_s",
        "throughput_tok_s",
        "pool_ns_per_op",
    } <= set(rep["policies"]["blind"])
    assert (rep["trace"]["format"], rep["config"]["num_blocks"]) == ("synthetic", 1024)


def test_events_file_starts_with_the_schema_header(tmp_path: Path) -> None:
    out = tmp_path / "ev.jsonl"
    assert main(["replay", *SMALL, "--policy", "exact", "--events", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert json.loads(lines[0])["schema"] == "blockpool.events/1"
    assert {json.loads(x)["ev"] for x in lines[1:]} == {"issue", "wait", "access", "end"}


def test_trace_file_replay_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(_trace(tmp_path)), *SMALL]) == 0
    assert "12 requests (mooncake" in capsys.readouterr().out


def test_exact_races_give_exit_status_one(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(WaitPolicy, "waits", lambda self, fence, consumer, transfer=False: ())
    assert main(["replay", *SMALL, "--policy", "exact"]) == 1
    assert "exact policy shows" in capsys.readouterr().err


def test_missing_trace_gives_exit_status_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "nope.jsonl"), *SMALL]) == 2
    assert "not found" in capsys.readouterr().err


def test_bad_line_gives_exit_status_two_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = _trace(tmp_path, '{"timestamp": 5}')
    assert main(["replay", str(p), *SMALL]) == 2
    assert f"{p}:13: missing field 'input_length'" in capsys.readouterr().err


def test_skip_bad_lines_replays_and_counts_the_skipped_line(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = _trace(tmp_path, "not json")
    assert main(["replay", str(p), *SMALL, "--skip-bad-lines", "--json", str(out)]) == 0
    trace = json.loads(out.read_text())["trace"]
    assert (trace["requests"], trace["skipped_lines"]) == (12, 1)


def test_unknown_policy_gives_exit_status_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *SMALL, "--policy", "exact,hopeful"]) == 2
    assert "unknown policy 'hopeful'" in capsys.readouterr().err


def test_bad_option_value_gives_exit_status_two() -> None:
    with pytest.raises(SystemExit) as ei:
        main(["replay", "--num-blocks", "many"])
    assert ei.value.code == 2


def test_too_small_pool_gives_exit_status_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *SMALL[:2], "--num-blocks", "1", "--quiet"]) == 2
    assert "num_blocks" in capsys.readouterr().err


def test_plot_is_written_as_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.png"
    assert main(["replay", *SMALL, "--policy", "exact,blind", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_gives_exit_status_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["replay", *SMALL, "--policy", "exact", "--plot", str(tmp_path / "r.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_progress_bar_is_skipped_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["replay", *SMALL[:-1], "--policy", "exact"]) == 0


def test_python_dash_m_blockpool_runs_the_command() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "blockpool", "replay", "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert res.returncode == 0 and "--skip-bad-lines" in res.stdout


def test_importing_the_cli_and_replay_loads_neither_tqdm_nor_matplotlib() -> None:
    code = (
        "import sys, blockpool, blockpool.cli, blockpool.replay.run, blockpool.replay.plot;"
        "print(sorted(m for m in ('tqdm', 'matplotlib', 'torch', 'vllm') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_output_in_a_missing_directory_is_refused_before_the_replay(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from blockpool.cli import main

    rc = main(["replay", "--limit", "5", "--json", str(tmp_path / "nope" / "r.json")])
    assert rc == 2
    assert "no such directory" in capsys.readouterr().err
