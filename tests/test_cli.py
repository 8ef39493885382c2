"""The ``blockpool replay`` command (``blockpool/cli.py``): exit codes, outputs, optional dependencies."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
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
    assert out.splitlines()[0].split()[:2] == ["policy", "races"]
    races = {re.split(r"\s{2,}", x)[0]: int(re.split(r"\s{2,}", x)[1]) for x in out.splitlines()[3:5]}
    assert races["exact"] == 0 and races["blind (negative control)"] > 0, out
    assert "40 requests (synthetic" in out


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
    races = {p: f["races"] for p, f in rep["policies"].items()}
    assert races["exact"] == races["step-event"] == races["device-sync"] == 0 < races["blind"], races


def test_events_file_starts_with_the_schema_header(tmp_path: Path) -> None:
    out = tmp_path / "ev.jsonl"
    assert main(["replay", *SMALL, "--policy", "exact", "--events", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert json.loads(lines[0])["schema"] == "blockpool.core.events/3"
    assert {json.loads(x)["ev"] for x in lines[1:-1]} == {"issue", "wait", "access", "fence", "table", "end"}
    trailer = json.loads(lines[-1])
    assert trailer["trailer"] == "blockpool.core.events/3" and trailer["lines"] == len(lines) - 1
    assert sum(trailer["counts"].values()) == len(lines) - 2


def test_a_truncated_events_file_is_detectable(tmp_path: Path) -> None:
    out = tmp_path / "ev.jsonl"
    assert main(["replay", *SMALL, "--policy", "exact", "--events", str(out)]) == 0
    lines = out.read_text().splitlines()[:-3]  # cut: no trailer, and fewer lines
    assert "trailer" not in json.loads(lines[-1])


def test_trace_file_replay_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(_trace(tmp_path)), *SMALL]) == 0
    assert "12 requests (mooncake" in capsys.readouterr().out


def test_exact_races_give_exit_status_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
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
    assert capsys.readouterr().err == "blockpool replay: error: --num-blocks must be >= 2, got 1\n"


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
        [sys.executable, "-m", "blockpool", "replay", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0 and "--skip-bad-lines" in res.stdout


def test_importing_the_cli_and_replay_loads_neither_tqdm_nor_matplotlib() -> None:
    code = (
        "import sys, blockpool, blockpool.cli, blockpool.replay.run, blockpool.replay.plot, blockpool.replay.sweep;"
        "print(sorted(m for m in ('tqdm', 'matplotlib', 'torch', 'vllm', 'ray') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_output_in_a_missing_directory_is_refused_before_the_replay(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from blockpool.cli import main

    rc = main(["replay", "--limit", "5", "--json", str(tmp_path / "nope" / "r.json")])
    assert rc == 2
    assert "no such directory" in capsys.readouterr().err


# Outputs checked before the replay, interrupts, progress lines -----------------


@pytest.mark.parametrize("opt", ["--json", "--plot", "--events"])
def test_output_that_is_a_directory_is_refused_before_the_replay(
    opt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import blockpool.replay.run as run_mod

    def no_replay(*a: object, **k: object) -> None:
        raise AssertionError("the replay started")

    monkeypatch.setattr(run_mod, "replay", no_replay)
    assert main(["replay", *SMALL, opt, str(tmp_path)]) == 2
    assert f"cannot write {opt} {tmp_path}: it is a directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("opt", ["--json", "--plot", "--events"])
def test_output_that_cannot_be_created_is_refused_before_the_replay(
    opt: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import blockpool.replay.run as run_mod

    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: pytest.fail("the replay started"))
    out = "/proc/blockpool-out.json"  # no file can be created in /proc, not even by root
    assert main(["replay", *SMALL, opt, out]) == 2
    assert f"cannot write {opt} {out}: cannot create a file in /proc" in capsys.readouterr().err


def test_unwritable_existing_output_is_refused_before_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    import blockpool.replay.run as run_mod

    out = tmp_path / "r.json"
    out.write_text("keep")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(out) else real_access(p, m))
    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: pytest.fail("the replay started"))
    assert main(["replay", *SMALL, "--json", str(out)]) == 2
    assert "permission denied" in capsys.readouterr().err and out.read_text() == "keep"


def test_one_path_for_two_outputs_or_the_trace_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "x")
    assert main(["replay", *SMALL, "--json", out, "--events", out]) == 2
    assert "the same file as --json" in capsys.readouterr().err
    trace = _trace(tmp_path)
    assert main(["replay", str(trace), *SMALL, "--json", str(trace)]) == 2
    assert "that is the trace being read" in capsys.readouterr().err


def test_outputs_are_written_whole_with_no_part_file_left(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    args = [
        "--json",
        str(tmp_path / "r.json"),
        "--events",
        str(tmp_path / "e.jsonl"),
        "--plot",
        str(tmp_path / "r.png"),
    ]
    assert main(["replay", *SMALL, "--policy", "exact,blind", "--jobs", "2", *args]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.jsonl", "r.json", "r.png"]


def test_progress_lines_when_stderr_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from blockpool import cli

    monkeypatch.setattr(cli, "PROGRESS_INTERVAL_S", 0.0)
    assert main(["replay", *SMALL[:-1], "--limit", "200", "--policy", "exact"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("replay: ")]
    assert len(lines) >= 2
    assert all(
        re.fullmatch(r"replay: \d+/200 requests \(\d+%\), [\d.]+ req/s, elapsed \S+, ETA \S+", x)
        for x in lines
    )
    assert lines[-1].startswith("replay: 200/200 requests (100%)")


def test_no_progress_lines_with_quiet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from blockpool import cli

    monkeypatch.setattr(cli, "PROGRESS_INTERVAL_S", 0.0)
    assert main(["replay", *SMALL, "--policy", "exact"]) == 0
    assert capsys.readouterr().err == ""


def test_progress_lines_name_rate_and_eta() -> None:
    import io

    from blockpool.cli import _ProgressLines

    t = [0.0]
    buf = io.StringIO()
    p = _ProgressLines(1000, buf, 5.0, lambda: t[0])
    t[0] = 1.0
    p.update(100)  # before the interval: nothing
    t[0] = 5.0
    p.update(250)
    t[0] = 6.0
    p.update(300)  # within the interval again: nothing
    p.close()
    assert buf.getvalue().splitlines() == [
        "replay: 250/1000 requests (25%), 50.0 req/s, elapsed 00:05, ETA 00:15",
        "replay: 300/1000 requests (30%), 50.0 req/s, elapsed 00:06, ETA 00:14",
    ]


@pytest.fixture()
def sigint_as_in_a_terminal() -> Iterator[None]:
    """A CLI run that the test interrupts gets SIGINT at its default, as
    under a terminal. A job started in the background (``cmd &`` in a
    shell without job control, as ``nohup`` runs are) has SIGINT ignored;
    its children inherit that across ``exec``, and Python then installs
    no ``KeyboardInterrupt`` handler, so the run ignores Ctrl-C as such a
    job should. The test's own handler (any but ``SIG_IGN``) becomes the
    default in the child."""
    import signal

    old = signal.getsignal(signal.SIGINT)
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _children(pid: int) -> set[int]:
    import os

    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.add(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    ("sig", "status", "jobs"), [("SIGINT", 130, "2"), ("SIGTERM", 143, "2"), ("SIGINT", 130, "1")]
)
@pytest.mark.usefixtures("sigint_as_in_a_terminal")
def test_interrupt_exits_with_the_conventional_status_and_leaves_nothing(
    sig: str, status: int, jobs: str, tmp_path: Path
) -> None:
    import os
    import signal
    import time

    outs = ["--json", "r.json", "--events", "e.jsonl"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockpool", "replay", "--limit", "3000", "--jobs", jobs, "--quiet", *outs],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*.part")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # mid-replay
    kids = _children(proc.pid)
    assert proc.poll() is None, "the replay ended before it could be interrupted"
    assert len(kids) >= (2 if jobs == "2" else 0)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert err.splitlines() == [
        f"blockpool replay: error: {'interrupted' if sig == 'SIGINT' else 'terminated'} ({sig})"
    ]
    assert "Traceback" not in err and out == ""
    assert list(tmp_path.iterdir()) == []
    time.sleep(0.2)
    assert [k for k in kids if _alive(k)] == []


# The table and the plot -------------------------------------------------------


@pytest.fixture(scope="module")
def small_report():  # type: ignore[no-untyped-def]
    import attrs

    from blockpool.replay.config import ReplayConfig
    from blockpool.replay.run import replay
    from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace

    rep = replay(
        synthetic_trace(SyntheticSpec(num_requests=40)),
        "exact,step-event,blind",
        ReplayConfig(num_blocks=1024),
    )
    no_loads = attrs.evolve(rep.result("step-event"), loads=0, loads_empty_fence=0, load_delays_ms=())
    return attrs.evolve(rep, results=(rep.results[0], no_loads, rep.results[2]))


def test_table_labels_the_control_the_mean_and_simulated_versus_measured(small_report) -> None:  # type: ignore[no-untyped-def]
    from blockpool.replay.report import format_table

    lines = format_table(small_report).splitlines()
    head = re.split(r"\s{2,}", lines[0].strip())
    kind = dict(zip(reversed(head), reversed(re.split(r"\s{2,}", lines[1].strip()))))
    assert head[:2] == ["policy", "races"] and "mean ms" in head
    assert {c for c, k in kind.items() if k == "sim"} == {"mean ms", "p99 ms", "makespan s", "tok/s"}
    assert {c for c, k in kind.items() if k == "meas"} == {"wall s"}
    rows = {re.split(r"\s{2,}", x)[0]: re.split(r"\s{2,}", x) for x in lines[3:6]}
    assert "blind (negative control)" in rows and "blind" not in rows
    assert rows["step-event"][2:6] == ["0", "n/a", "n/a", "n/a"]
    assert rows["exact"][3] != "n/a"
    assert any("negative control" in x or "waits on nothing" in x for x in lines[6:])


def test_plot_shows_blind_races_keeps_the_legend_off_the_curves_and_skips_empty_series(small_report) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    from blockpool.replay.plot import figure
    from blockpool.replay.report import plural

    fig = figure(small_report)
    try:
        fig.canvas.draw()
        (ax1,) = fig.axes
        labels = [t.get_text() for t in ax1.get_legend().get_texts()]
        assert len(labels) == 2 and not any(x.startswith("step-event") for x in labels)
        blind = small_report.result("blind")
        assert f"blind (negative control): {plural(blind.races, 'race')}" in labels[1]
        assert "no loads: step-event" in ax1.get_title()
        renderer = fig.canvas.get_renderer()
        assert not ax1.get_legend().get_window_extent(renderer).overlaps(ax1.get_window_extent(renderer))
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


# The plot says it is cumulative, shows 0 ms, explains the 0 ms step ------------


def test_plot_is_cumulative_shows_zero_delay_and_explains_the_zero_step(small_report) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    from blockpool.replay.plot import ZERO_LINTHRESH_MS, figure

    fig = figure(small_report)
    try:
        (ax1,) = fig.axes
        assert "cumulative" in ax1.get_ylabel() and "cumulative" in ax1.get_title()
        assert ax1.get_xscale() == "symlog" and ax1.get_xlim()[0] < 0.0  # 0 ms is inside the axis
        exact = small_report.result("exact")
        (line,) = [ln for ln in ax1.get_lines() if ln.get_label().startswith("exact")]
        xs, ys = line.get_xdata(), line.get_ydata()
        at_zero = max((y for x, y in zip(xs, ys) if x == 0.0), default=0.0)
        caption = " ".join(t.get_text() for t in fig.texts)
        assert "step at 0 ms" in caption
        if abs(100.0 * at_zero - exact.loads_empty_fence_pct) >= 0.05:
            assert f"exact: {100.0 * at_zero:.1f}% start at 0 ms" in caption  # says why not
        assert ZERO_LINTHRESH_MS > 0
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


# Never clobber what is not a regular file -------------------------------------


def _kind(path: Path) -> str:
    import stat

    mode = path.lstat().st_mode
    for name in ("S_ISLNK", "S_ISFIFO", "S_ISCHR", "S_ISSOCK", "S_ISREG"):
        if getattr(stat, name)(mode):
            return name[4:].lower()
    return "other"


def _char_device(tmp_path: Path, name: str, minor: int) -> Path:
    """A character device node in ``tmp_path`` (Linux memory devices: 3 null, 7 full); skips without CAP_MKNOD."""
    import os
    import stat

    dev = tmp_path / name
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except (PermissionError, AttributeError):
        pytest.skip("cannot make a device node here")
    return dev


def test_json_into_a_fifo_is_written_through_and_the_fifo_stays_a_fifo(tmp_path: Path) -> None:
    import os
    import threading

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["replay", *SMALL, "--policy", "exact", "--json", str(fifo)]) == 0
    reader.join(30)
    assert _kind(fifo) == "fifo"
    assert list(json.loads(got[0])["policies"]) == ["exact"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.fifo"]


def test_json_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "new.jsonl")
    assert main(["replay", *SMALL, "--policy", "exact", "--json", str(link), "--events", str(dangling)]) == 0
    assert _kind(link) == "lnk" and link.readlink() == target
    assert _kind(dangling) == "lnk" and _kind(tmp_path / "new.jsonl") == "reg"
    assert list(json.loads(target.read_text())["policies"]) == ["exact"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dangling.jsonl",
        "link.json",
        "new.jsonl",
        "real.json",
    ]


def test_outputs_into_a_character_device_are_written_through_and_it_stays_a_device(tmp_path: Path) -> None:
    null = _char_device(tmp_path, "null", 3)
    assert main(["replay", *SMALL, "--policy", "exact", "--json", str(null)]) == 0
    assert main(["replay", *SMALL, "--policy", "exact", "--events", str(null)]) == 0
    assert _kind(null) == "chr"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]  # no part file beside it


def test_a_full_device_fails_the_write_and_stays_a_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = _char_device(tmp_path, "full", 7)
    assert main(["replay", *SMALL, "--policy", "exact", "--json", str(full)]) == 3
    assert "No space left on device" in capsys.readouterr().err
    assert _kind(full) == "chr" and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_a_symlink_to_a_device_writes_the_device(tmp_path: Path) -> None:
    null = _char_device(tmp_path, "null", 3)
    link = tmp_path / "out.json"
    link.symlink_to(null)
    assert main(["replay", *SMALL, "--policy", "exact", "--json", str(link)]) == 0
    assert _kind(link) == "lnk" and _kind(null) == "chr"


def test_output_that_is_a_socket_is_refused_before_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    import blockpool.replay.run as run_mod

    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: pytest.fail("the replay started"))
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert main(["replay", *SMALL, "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"blockpool replay: error: cannot write --json {path}: it is a socket"]
    assert _kind(path) == "sock"


def test_write_atomic_refuses_what_output_kind_refuses(tmp_path: Path) -> None:
    from blockpool.core.errors import InvalidArgumentError
    from blockpool.replay.run import OUTPUT_FILE, output_kind, write_atomic

    with pytest.raises(InvalidArgumentError, match="it is a directory"):
        write_atomic(tmp_path, lambda tmp: Path(tmp).write_text("x"))
    assert list(tmp_path.iterdir()) == []
    assert output_kind(tmp_path / "new") == (str(tmp_path / "new"), OUTPUT_FILE)


# --version, exit statuses in --help, --quiet, sweep's interrupt line ----------


def test_version_prints_the_package_version_and_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    import blockpool

    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    build = "core compiled (mypyc)" if blockpool.__compiled__ else "core pure Python"
    assert capsys.readouterr().out.strip() == f"blockpool {blockpool.__version__}, {build}"


@pytest.mark.parametrize(
    ("argv", "codes"),
    [
        ([], ["0 done", "1 the exact policy showed a race", "2 bad usage", "3 the run failed", "130", "143"]),
        (
            ["replay"],
            [
                "0    done",
                "1    the exact policy",
                "2    bad usage",
                "3    the replay failed",
                "130  ",
                "143  ",
            ],
        ),
        (
            ["sweep"],
            ["0    done", "1    an exact cell", "2    bad usage", "3    a cell failed", "130  ", "143  "],
        ),
    ],
)
def test_help_lists_the_exit_statuses(
    argv: list[str], codes: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    tail = out[out.index("exit status") :]
    assert all(c in tail for c in codes), tail


def test_quiet_help_says_it_drops_the_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--quiet no progress on stderr: neither the bar (a terminal) nor the progress lines" in out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.usefixtures("sigint_as_in_a_terminal")
def test_ctrl_c_during_sweep_says_blockpool_sweep_interrupted(tmp_path: Path) -> None:
    import os
    import signal
    import time

    proc = subprocess.Popen(
        # Cells of 30,000 requests: minutes each, so a Ctrl-C that waited for
        # the running cells (forked workers inherited the CLI's SIGTERM
        # handler and ran on) cannot end within the 20 s allowed below.
        [
            sys.executable,
            "-m",
            "blockpool",
            "sweep",
            "--seed",
            "0,1,2,3",
            "--limit",
            "30000",
            "--jobs",
            "2",
            "--quiet",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's Ctrl-C reaches the whole process group
    )
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)  # the cells are running
    assert proc.poll() is None, "the sweep ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("Ctrl-C did not stop the running cells: the sweep was still running 20 s later")
    assert proc.returncode == 130, err
    assert err.splitlines() == ["blockpool sweep: error: interrupted (SIGINT)"]
    assert out == ""


# A pool too small for any request ----------------------------------------------


def test_pool_too_small_for_any_request_exits_two_before_the_replay(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import blockpool.replay.run as run_mod

    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: pytest.fail("the replay started"))
    assert main(["replay", "--num-blocks", "3", "--limit", "5", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        (
            "blockpool replay: error: --num-blocks 3 is too small for any of the 5 requests: the pool hands out 2 "
            "blocks (the null block is never handed out) and the smallest request needs 146 blocks of 16 tokens"
        )
    ]


def test_pool_that_fits_some_requests_replays_and_counts_the_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = json.dumps({**GOOD, "timestamp": 5000, "input_length": 3000, "hash_ids": [9, 10, 11, 12, 13, 14]})
    trace = _trace(tmp_path, big)
    assert main(["replay", str(trace), "--num-blocks", "128", "--policy", "exact", "--quiet"]) == 0
    assert "rejected 1," in capsys.readouterr().out


def test_check_fits_refuses_only_when_no_request_fits() -> None:
    from blockpool.core.errors import InvalidArgumentError
    from blockpool.replay.config import ReplayConfig, check_fits, request_blocks
    from blockpool.replay.traces import TraceRequest

    reqs = [TraceRequest(i, 0.0, 31, 2, ((1, 31),), 2) for i in range(2)]
    assert request_blocks(31, 2, 16) == 3
    check_fits(reqs, ReplayConfig(num_blocks=4))  # 3 blocks handed out: fits
    check_fits([], ReplayConfig(num_blocks=2))
    with pytest.raises(InvalidArgumentError, match="too small for any of the 2 requests"):
        check_fits(reqs, ReplayConfig(num_blocks=3))


# --plot without matplotlib is found before the replay -------------------------


def test_plot_without_matplotlib_is_refused_before_the_replay_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import blockpool.replay.run as run_mod

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: pytest.fail("the replay started"))
    rc = main(["replay", *SMALL, "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    assert rc == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        len(err) == 1 and "--plot needs matplotlib" in err[0] and "pip install 'blockpool[replay]'" in err[0]
    )
    assert list(tmp_path.iterdir()) == []  # no JSON written either


# sweep checks a trace like replay does -----------------------------------------


def test_sweep_refuses_a_bad_line_past_the_first_before_any_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import blockpool.replay.sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "sweep", lambda *a, **k: pytest.fail("a cell ran"))
    trace = _trace(tmp_path, "{not json")  # line 13
    assert main(["sweep", str(trace), "--num-blocks", "1024", "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("blockpool sweep: error: ") and f"{trace}:13" in err[0]


def test_sweep_skip_bad_lines_replays_and_counts_them_per_row(tmp_path: Path) -> None:
    trace = _trace(tmp_path, "{not json")
    out = tmp_path / "s.json"
    rc = main(
        [
            "sweep",
            str(trace),
            "--num-blocks",
            "1024",
            "--skip-bad-lines",
            "--json",
            str(out),
            "--quiet",
            "--jobs",
            "1",
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(r["requests"], r["skipped"]) for r in doc["rows"]] == [(12, 1)]
    assert doc["grid"]["skip_bad_lines"] is True


# A verdict line, 100 columns, progress in requests, plurals --------------------


def test_the_report_ends_with_a_verdict_line_and_the_table_fits_100_columns(small_report) -> None:  # type: ignore[no-untyped-def]
    from blockpool.replay.report import format_table, plural

    lines = format_table(small_report).splitlines()
    ex, blind = small_report.result("exact"), small_report.result("blind")
    assert blind.races > 0
    assert lines[-1] == (
        f"exact: 0 races in {ex.oracle_accesses:,} checked accesses; blind (no waits): {plural(blind.races, 'race')}"
    )
    assert max(len(x) for x in lines[:6]) <= 100  # the table
    assert max(len(x) for x in lines) <= 100


def test_plurals_read_right() -> None:
    from blockpool.replay.report import plural

    assert [plural(1, "time"), plural(2, "time"), plural(1234, "race"), plural(0, "race")] == [
        "1 time",
        "2 times",
        "1,234 races",
        "0 races",
    ]
    assert plural(1, "copy-on-write copy", "copy-on-write copies") == "1 copy-on-write copy"


def test_a_verdict_names_a_racing_exact_policy_as_a_bug(small_report) -> None:  # type: ignore[no-untyped-def]
    import attrs

    from blockpool.replay.report import verdict

    bad = attrs.evolve(small_report, results=(attrs.evolve(small_report.results[0], races=1),))
    assert verdict(bad).startswith("exact: 1 race in ") and verdict(bad).endswith(
        ": the exact policy raced (a bug)"
    )


def test_progress_lines_count_requests_as_the_summary_does() -> None:
    import io

    from blockpool.cli import _ProgressLines

    buf, now = io.StringIO(), [0.0]
    p = _ProgressLines(1600, buf, 5.0, lambda: now[0], runs=4)
    now[0] = 5.0
    p.update(864)
    assert buf.getvalue().startswith("replay: 216/400 requests x 4 runs (54%), ")


# Block lists as runs ----------------------------------------------------------


def test_event_block_lists_are_written_as_runs_and_read_back_exactly() -> None:
    from blockpool.replay.eventlog import decode_runs, encode_runs, iter_runs

    assert encode_runs([5, 1, 2, 3, 3, 9, 10, 12]) == [[1, 3], 5, [9, 10], 12]
    assert decode_runs(encode_runs(range(1, 5000))) == list(range(1, 5000))
    assert encode_runs(range(1, 5000)) == [[1, 4999]]
    assert encode_runs([]) == [] and decode_runs([]) == []
    with pytest.raises(ValueError, match="not a block run"):
        list(iter_runs([[3, 1]]))


def test_an_events_file_is_a_fraction_of_the_old_size(tmp_path: Path) -> None:
    from blockpool.replay.eventlog import decode_runs

    out = tmp_path / "ev.jsonl"
    assert main(["replay", *SMALL, "--policy", "exact", "--events", str(out)]) == 0
    body = [json.loads(x) for x in out.read_text().splitlines()[1:-1]]
    ids = sum(len(decode_runs(e["blocks"])) for e in body if "blocks" in e)
    items = sum(len(e["blocks"]) for e in body if "blocks" in e)
    assert items * 4 < ids  # runs: far fewer items than ids


# The first hour: --help, --plot names and empty plots, traces named for the other format ----


def test_replay_help_promises_only_what_the_plot_draws() -> None:
    from blockpool.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")  # type: ignore[attr-defined]
    text = " ".join(sub.choices["replay"].format_help().split())  # type: ignore[union-attr]
    assert "timeline" not in text and "cumulative load-start delays per policy" in text


def test_plot_named_other_than_png_is_refused_before_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import blockpool.replay.run as run_mod

    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: pytest.fail("the replay started"))
    out = tmp_path / "out.jpg"
    assert main(["replay", *SMALL, "--plot", str(out)]) == 2
    assert (
        f"cannot write --plot {out}: the plot is a PNG; give a name ending in .png" in capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []


def test_plot_of_a_run_without_loads_draws_the_empty_axes_says_so_and_warns_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    pytest.importorskip("matplotlib")
    out = tmp_path / "r.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["replay", "--limit", "3", "--jobs", "1", "--quiet", "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.splitlines()[-1] == f"wrote {out}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jsonl_trace_named_csv_is_refused_naming_what_it_looks_like(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "t.csv"
    p.write_text(_trace(tmp_path).read_text())
    assert main(["replay", str(p), *SMALL]) == 2
    assert "it looks like a Mooncake JSONL trace; rename it .jsonl" in capsys.readouterr().err


def test_csv_trace_named_jsonl_is_refused_naming_what_it_looks_like(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    assert main(["replay", str(p), *SMALL]) == 2
    assert "it looks like an Azure CSV trace; rename it .csv" in capsys.readouterr().err


def test_output_in_a_missing_directory_says_how_to_create_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out" / "trace.json"
    assert main(["replay", *SMALL, "--json", str(out)]) == 2
    assert f"(create it first: mkdir -p {tmp_path / 'out'})" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
