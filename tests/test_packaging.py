"""Packaging: the wheel the README tells vLLM users to build
declares the vLLM plugin, the pytest plugin and the console script, and the
README gives no install command that needs a package index."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_gives_no_install_from_an_index() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not re.search(r"pip install blockpool\b", readme)
    assert "pip wheel . --no-deps -w dist" in readme and "pip install dist/blockpool-*.whl" in readme


def test_ci_builds_and_checks_the_wheel_after_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [x.strip() for x in ci.splitlines() if x.strip() and not x.lstrip().startswith("#")]
    first_test = commands.index("python -m pytest -q")
    assert not any("pytest" in c for c in commands[:first_test])
    wheel = next(i for i, c in enumerate(commands) if c.startswith("python -m pip wheel"))
    assert wheel > first_test
    for needle in (
        "--no-deps dist/blockpool-*.whl",
        "attrs sortedcontainers",
        "vllm.general_plugins",
        "pytest11",
        "console_scripts",
    ):
        assert needle in ci
    assert "torch==" not in " ".join(commands[wheel:])


def test_wheel_declares_both_plugins_and_the_console_script(tmp_path: Path) -> None:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement)")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    (whl,) = tmp_path.glob("blockpool-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        text = z.read(ep).decode()
    sections: dict[str, dict[str, str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = {}
        elif "=" in line:
            k, v = (x.strip() for x in line.split("=", 1))
            sections[current][k] = v
    assert sections["vllm.general_plugins"] == {"blockpool": "blockpool.integrations.vllm:register"}
    assert sections["pytest11"] == {"blockpool": "blockpool.checking.pytest_plugin"}
    assert sections["console_scripts"] == {"blockpool": "blockpool.cli:main"}
    assert "blockpool/py.typed" in names and not any(n.startswith("tests/") for n in names)
