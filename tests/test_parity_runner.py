"""The parity pass runner (``scripts/vllm_parity_pass.py``): a hung test
costs that test, not the pass.

CI's parity run once lost a whole pass (30 minutes, every outcome) to one of
vLLM's own tests hanging with vLLM's own pool. These tests run the runner on
a small suite of its own: tests that pass, fail, skip, hang once, hang
always, and hang at exit, and check the outcomes it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
RUNNER = SCRIPTS / "vllm_parity_pass.py"
# Tests of a script: the compiled build's run skips them (tests/conftest.py).
pytestmark = pytest.mark.build_independent

SUITE = """
import os, sys, time, threading
from pathlib import Path
import pytest

STATE = Path(os.environ["SUITE_STATE"])

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 + 1 == 3, "one and one"

def test_known_env_failure():
    raise RuntimeError("needs torchvision, not here")

@pytest.mark.skip(reason="not on CPU")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_setup_error(broken):
    pass

def test_hangs_once():
    marker = STATE / "hung-once"
    if not marker.exists():
        marker.write_text("x")
        time.sleep(600)

def test_hangs_always():
    time.sleep(600)

def test_after_the_hangs():
    pass
"""

EXIT_HANG = """
import threading, time

def test_leaves_a_thread_behind():
    # A non-daemon thread: the interpreter waits for it at exit, forever.
    threading.Thread(target=time.sleep, args=(600,)).start()
"""

SERVED_PLUGIN = """
import json, os

def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SUITE_SERVED")
    if path:
        with open(path, "w") as f:
            json.dump({"installed": True, "allocations": 1,
                       "modules": ["a"], "by_file": {"x": {"n": 1}}, "mode": "on"}, f)
"""


def run_runner(tmp_path: Path, files: dict[str, str], *extra: str, env: dict[str, str] | None = None):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        (suite / name).write_text(textwrap.dedent(text))
    state = tmp_path / "state"
    state.mkdir()
    results = tmp_path / "results"
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(suite)]),
        "SUITE_STATE": str(state),
        "KNOWN_MSGS": "needs torchvision",
        **(env or {}),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "--name",
            "p",
            "--results",
            str(results),
            "--cwd",
            str(suite),
            "--stall",
            "5",
            "--grace",
            "2",
            "--budget",
            "120",
            *extra,
            "--",
            "-p",
            "vllm_parity_progress",
            "-p",
            "no:blockpool",
            "-p",
            "no:cacheprovider",
            "-q",
            ".",
        ],
        check=False,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, results


def outcomes(results: Path) -> dict[str, str]:
    lines = (results / "p.outcomes").read_text().splitlines()
    return dict(line.split("\t") for line in lines)


def test_hung_tests_cost_themselves_not_the_pass(tmp_path: Path) -> None:
    proc, results = run_runner(tmp_path, {"test_suite.py": SUITE})
    assert proc.returncode == 0, proc.stderr
    got = outcomes(results)
    assert got == {
        "test_suite.py::test_passes": "passed",
        "test_suite.py::test_fails": "failed",
        "test_suite.py::test_known_env_failure": "failed",
        "test_suite.py::test_skipped": "skipped",
        "test_suite.py::test_setup_error": "error",
        # Hung in the pass, passed when run again on its own.
        "test_suite.py::test_hangs_once": "passed",
        "test_suite.py::test_hangs_always": "hung",
        # The tests after a hang ran, in the resumed attempt.
        "test_suite.py::test_after_the_hangs": "passed",
    }
    # Known by message, and hung: reported, not unexpected.
    unexpected = (results / "p.unexpected").read_text().split()
    assert unexpected == ["test_suite.py::test_fails", "test_suite.py::test_setup_error"]
    assert "p: 3 passed, 4 failed" in proc.stdout
    assert "test_suite.py::test_hangs_once hung" in proc.stderr
    assert "test_suite.py::test_hangs_always hung again on its own" in proc.stderr
    # Every attempt's output is in the one log.
    log = (results / "p.log").read_text()
    assert log.count("==== attempt") == 5  # pass, resume, resume, two retries


def test_a_hang_at_exit_after_the_session_ended_keeps_the_outcomes(tmp_path: Path) -> None:
    proc, results = run_runner(tmp_path, {"test_exit.py": EXIT_HANG})
    assert proc.returncode == 0, proc.stderr
    assert outcomes(results) == {"test_exit.py::test_leaves_a_thread_behind": "passed"}
    assert "killed (its outcomes were all in)" in proc.stderr


def test_an_attempt_that_cannot_collect_fails_the_pass(tmp_path: Path) -> None:
    proc, results = run_runner(tmp_path, {"test_broken.py": "import no_such_module_here\n"})
    assert proc.returncode == 1
    assert "did not complete" in proc.stderr
    assert not (results / "p.outcomes").exists()


def test_json_reports_of_each_attempt_are_merged(tmp_path: Path) -> None:
    served = tmp_path / "served.json"
    proc, _ = run_runner(
        tmp_path,
        {"test_suite.py": SUITE, "conftest.py": SERVED_PLUGIN},
        "--merge-json-env",
        "SUITE_SERVED",
        env={"SUITE_SERVED": str(served)},
    )
    assert proc.returncode == 0, proc.stderr
    # Five attempts; the two killed by a hang wrote nothing, the resumed one
    # that finished the pass and the retry of test_hangs_once wrote one each.
    assert json.loads(served.read_text()) == {
        "installed": True,
        "allocations": 2,
        "modules": ["a"],
        "by_file": {"x": {"n": 2}},
        "mode": "on",
    }
    assert "2 of 5 attempts wrote" in proc.stderr
    assert not list(tmp_path.glob("served.json.*"))


@pytest.mark.parametrize(
    ("values", "merged"),
    [
        ([1, 2, 3], 6),
        ([True, False], False),
        ([["a", "b"], ["b", "c"]], ["a", "b", "c"]),
        (
            [{"x": {"n": 1}, "m": "on"}, {"x": {"n": 2}, "y": 1, "m": "off"}],
            {"x": {"n": 3}, "m": "on", "y": 1},
        ),
    ],
)
def test_merge_json(values: list, merged: object) -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import vllm_parity_pass
    finally:
        sys.path.remove(str(SCRIPTS))
    assert vllm_parity_pass.merge_json(values) == merged


def test_a_stopped_runner_leaves_no_pytest_behind(tmp_path: Path) -> None:
    """SIGTERM to the runner (the script's outer timeout) kills the pytest
    process group it started: a crashed or stopped runner once left its
    pytest (and that pytest's children) running for hours."""
    import signal
    import time

    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    pid_file = tmp_path / "pytest.pid"
    (suite / "test_sleeps.py").write_text(
        textwrap.dedent(
            f"""
            import os, time
            def test_sleeps():
                open({str(pid_file)!r}, "w").write(str(os.getpid()))
                time.sleep(600)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    runner = subprocess.Popen(
        [sys.executable, str(RUNNER), "--name", "p", "--results", str(tmp_path / "results"), "--cwd", str(suite),
         "--stall", "300", "--", "-p", "vllm_parity_progress", "-p", "no:blockpool", "-q", "."],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), "the test never started"
    pytest_pid = int(pid_file.read_text())
    try:
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pytest_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the runner's pytest outlived it")
    finally:  # whatever failed, leave nothing running
        for pid in (pytest_pid, runner.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- scripts/vllm_parity.sh: the version switch refuses before it builds ---

PARITY_SH = SCRIPTS / "vllm_parity.sh"


def run_parity_sh(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Runs the script with settings that make it stop at its input checks:
    the shared dir is an empty temp dir, the venv and results dirs are
    temp paths (nothing of the checkout's is built or touched)."""
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_PARITY_", "VLLM_VENV"))}
    full = {
        **base,
        "VLLM_PARITY_SHARED": str(shared),
        "VLLM_VENV": str(tmp_path / "venv"),
        "VLLM_PARITY_RESULTS": str(tmp_path / "results"),
        **env,
    }
    return subprocess.run(
        ["bash", str(PARITY_SH)], env=full, capture_output=True, text=True, timeout=60, check=False
    )


def test_parity_sh_refuses_an_unknown_version(tmp_path: Path) -> None:
    proc = run_parity_sh(tmp_path, VLLM_PARITY_VERSION="0.99.0")
    assert proc.returncode == 2
    assert "VLLM_PARITY_VERSION=0.99.0 is not one of 0.34.0, 0.33.0, 0.32.0" in proc.stderr


@pytest.mark.parametrize(
    ("version", "missing"),
    [
        ("0.34.0", "requirements file not found: {shared}/vllm-0.34/vllm-0.34.0-cpu-reqs.txt"),
        (None, "requirements file not found: {shared}/vllm-0.34/vllm-0.34.0-cpu-reqs.txt"),
        ("0.33.0", "freeze list not found: {shared}/vllm-0.33.0-cpu-freeze.txt"),
    ],
)
def test_parity_sh_reads_each_versions_requirements(
    tmp_path: Path, version: str | None, missing: str
) -> None:
    """0.34.0 is the default; each version reads its own requirements from
    the shared dir (and stops, here, where they are missing)."""
    env = {"VLLM_PARITY_VERSION": version} if version else {}
    proc = run_parity_sh(tmp_path, **env)
    assert proc.returncode == 2
    assert missing.format(shared=tmp_path / "shared") in proc.stderr
    assert f"vLLM {version or '0.34.0'}: venv {tmp_path / 'venv'}" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_parity_sh_runs_only_our_tests_on_032(tmp_path: Path) -> None:
    proc = run_parity_sh(tmp_path, VLLM_PARITY_VERSION="0.32.0", VLLM_PARITY_PASSES="off on own")
    assert proc.returncode == 2
    assert 'vLLM 0.32.0 runs only the "own" pass' in proc.stderr


def test_parity_sh_keeps_the_033_venv_from_an_unversioned_run(tmp_path: Path) -> None:
    """A caller naming 0.33's venv without a version (written before the
    default became 0.34.0) is refused, not given 0.34 in that venv."""
    proc = run_parity_sh(tmp_path, VLLM_VENV=".venv-vllm")
    assert proc.returncode == 2
    assert "VLLM_VENV=.venv-vllm is another version's venv; set VLLM_PARITY_VERSION" in proc.stderr
