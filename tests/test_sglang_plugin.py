"""The blockpool plugin as SGLang loads it: through SGLang's own
``load_plugins()`` (entry point group ``sglang.srt.plugins``, allowlist
``SGLANG_PLUGINS``) in a fresh interpreter, and its refusal of a drifted
SGLang.

Runs in .venv-sglang (scripts/sglang_setup.sh), where blockpool is
installed editable so its entry point is visible; skipped where SGLang is
not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.plugins.hook_registry")

from blockpool.integrations.sglang import surface

PRELUDE = """
import json, logging, os, sys, warnings
warnings.simplefilter("ignore")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
"""

PROBE = """
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
from blockpool.integrations.sglang import hooks
rt = hooks.runtime()
armed = None
if rt is not None:
    import torch
    from unittest.mock import MagicMock
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    a = PagedTokenToKVPoolAllocator(64, 4, torch.int64, "cpu", MagicMock(), False)
    armed = rt.armed
    account = rt.accounts.get(a)
print(json.dumps({
    "patched": sorted(HookRegistry._patched),
    "mode": None if rt is None else rt.mode,
    "armed": armed,
    "account_pages": None if rt is None or account is None else account.free_len,
}))
"""


def run(code: str, env: dict[str, str], tmp_path: Path) -> tuple[dict[str, Any], str]:
    """Run ``code`` in a fresh interpreter of this venv; its last stdout line
    as JSON, and its stderr."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "BLOCKPOOL_SGLANG"))}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PRELUDE + code)],
        check=False,
        env=full_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def declared_targets() -> list[str]:
    entries = surface.surface_for("0.5.23")
    assert entries is not None
    return sorted(e.target for e in entries if e.role == "wrap" and not e.optional)


def test_installed_surface_matches_the_declared_line() -> None:
    assert surface.installed_version() == "0.5.23"
    assert surface.check_surface(surface.SUPPORTED_SGLANG["0.5.23"]) == []


def test_load_plugins_installs_every_hook_and_arms(tmp_path: Path) -> None:
    out, _ = run(PROBE, {"SGLANG_PLUGINS": "blockpool"}, tmp_path)
    assert out["patched"] == declared_targets()
    assert (out["mode"], out["armed"], out["account_pages"]) == ("audit", True, 16)


def test_on_mode_from_the_environment(tmp_path: Path) -> None:
    out, _ = run(PROBE, {"SGLANG_PLUGINS": "blockpool", "BLOCKPOOL_SGLANG": "on"}, tmp_path)
    assert (out["mode"], out["armed"]) == ("on", True)


def test_left_out_of_sglang_plugins_installs_nothing(tmp_path: Path) -> None:
    out, _ = run(PROBE, {"SGLANG_PLUGINS": "someone_else"}, tmp_path)
    assert out == {"patched": [], "mode": None, "armed": None, "account_pages": None}


def test_switched_off_installs_nothing(tmp_path: Path) -> None:
    out, _ = run(PROBE, {"SGLANG_PLUGINS": "blockpool", "BLOCKPOOL_SGLANG": "0"}, tmp_path)
    assert out["patched"] == [] and out["mode"] is None


def test_unknown_mode_installs_nothing_with_one_line(tmp_path: Path) -> None:
    out, err = run(PROBE, {"SGLANG_PLUGINS": "blockpool", "BLOCKPOOL_SGLANG": "maybe"}, tmp_path)
    assert out["patched"] == [] and out["mode"] is None
    assert "BLOCKPOOL_SGLANG='maybe': expected 0, audit or on" in err


def test_drifted_body_refuses_and_names_it(tmp_path: Path) -> None:
    # A start_loading whose body differs (its source in a module file, as a
    # patched SGLang's would be), installed before load_plugins() runs.
    (tmp_path / "drifted.py").write_text(
        textwrap.dedent(
            """
            def start_loading(self) -> int:
                # a finer-grained fence, upstream
                return -1
            """
        )
    )
    code = (
        textwrap.dedent(
            """
        sys.path.insert(0, os.getcwd())
        import drifted
        from sglang.srt.managers.cache_controller import HiCacheController
        HiCacheController.start_loading = drifted.start_loading
        """
        )
        + PROBE
    )
    out, err = run(code, {"SGLANG_PLUGINS": "blockpool"}, tmp_path)
    assert out["patched"] == [] and out["mode"] is None
    lines = [ln for ln in err.splitlines() if "drifted from its declared surface" in ln]
    assert len(lines) == 1
    assert "HiCacheController.start_loading: body" in lines[0]
    assert "installs nothing" in lines[0]


def test_surface_table_rows() -> None:
    rows = surface.surface_table()
    by_target = {r["target"]: r for r in rows}
    assert all(r["line"] == "0.5.23" for r in rows)
    assert by_target["sglang.srt.managers.cache_controller.HiCacheController.start_loading"]["state"] == "ok"
    assert by_target["sglang.srt.managers.scheduler.Scheduler.run_batch"]["state"] == "not loaded"
    assert {r["state"] for r in rows} == {"ok", "not loaded"}


def test_check_sglang_surface_command(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "blockpool", "check-sglang", "--surface"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "SGLang 0.5.23; declared line 0.5.23"
    assert len(lines) == 1 + len(surface.SUPPORTED_SGLANG["0.5.23"])
    run_batch = [line for line in lines if "Scheduler.run_batch" in line]
    assert len(run_batch) == 1 and run_batch[0].endswith("not loaded")
