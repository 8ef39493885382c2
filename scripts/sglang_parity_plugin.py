"""A pytest plugin for scripts/sglang_parity.sh: loads SGLang's plugins the
way SGLang's processes do (``load_plugins()`` with ``SGLANG_PLUGINS=blockpool``)
before SGLang's own tests are collected, so the blockpool plugin's hooks
wrap the classes those tests build. ``BLOCKPOOL_SGLANG`` picks the mode
(``0``: the plugin is loaded and installs nothing). At the end it prints one
line: the mode, whether the hooks were armed, and the fence counters.

SGLang's test base class, ``sglang.test.test_utils.CustomTestCase``, lives in
a module whose imports reach its benchmark tooling (``datasets`` and more),
which .venv-sglang does not install; where that import fails, the module is
stood in by one whose ``CustomTestCase`` is ``unittest.TestCase`` (SGLang's
adds retries on CI only).
"""

from __future__ import annotations

import os
import sys
import types
import unittest
from typing import Any


def _stand_in_test_utils() -> None:
    try:
        import sglang.test.test_utils  # noqa: F401
    except ImportError:
        mod = types.ModuleType("sglang.test.test_utils")
        mod.CustomTestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["sglang.test.test_utils"] = mod


def pytest_configure(config: Any) -> None:
    _stand_in_test_utils()
    os.environ["SGLANG_PLUGINS"] = "blockpool"
    from sglang.srt.plugins import load_plugins

    load_plugins()


def pytest_unconfigure(config: Any) -> None:
    from blockpool.integrations.sglang import hooks

    rt = hooks.runtime()
    mode = os.environ.get("BLOCKPOOL_SGLANG", "audit")
    if rt is None:
        print(f"\nsglang-parity: BLOCKPOOL_SGLANG={mode}: plugin not installed")
    else:
        print(f"\nsglang-parity: BLOCKPOOL_SGLANG={mode}: armed={rt.armed} counters={rt.counters.as_dict()}")
