"""One source, two builds: ``blockpool.__compiled__`` tells them
apart, and the build switch ``BLOCKPOOL_MYPYC`` is read as documented."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

import blockpool

ROOT = Path(__file__).resolve().parents[1]


def test_compiled_says_whether_every_core_module_is_an_extension_module() -> None:
    core = {n: m for n, m in sys.modules.items() if n == "blockpool.core" or n.startswith("blockpool.core.")}
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    compiled = {n for n, m in core.items() if str(m.__file__).endswith(suffixes)}
    assert "blockpool.core.pool" in core
    assert blockpool.__compiled__ is (compiled == set(core))
    assert compiled in (set(), set(core)), f"a partly compiled core: {sorted(compiled)}"


def _backend():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("blockpool_build", ROOT / "_build" / "blockpool_build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("yes", True), ("0", False), ("", False), (None, False)]
)
def test_the_switch_asks_for_mypy_only_when_set(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    pytest.importorskip("setuptools")
    backend = _backend()
    if value is None:
        monkeypatch.delenv("BLOCKPOOL_MYPYC", raising=False)
    else:
        monkeypatch.setenv("BLOCKPOOL_MYPYC", value)
    assert backend.compiled_requested() is on
    assert backend.compiling() is on


def test_editable_hooks_turn_the_switch_off_and_restore_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("setuptools")
    backend = _backend()
    monkeypatch.setenv("BLOCKPOOL_MYPYC", "1")
    seen = []
    hook = backend._pure(lambda: seen.append(backend.compiling()))
    hook()
    assert seen == [False] and backend.compiling()
