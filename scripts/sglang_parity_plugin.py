"""A pytest plugin for scripts/sglang_parity.sh: loads SGLang's plugins the
way SGLang's processes do (``load_plugins()`` with ``SGLANG_PLUGINS=blockpool``)
before SGLang's own tests are collected, so the blockpool plugin's hooks
wrap the classes those tests build. ``BLOCKPOOL_SGLANG`` picks the mode
(``0``: the plugin is loaded and installs nothing). At the end it prints one
line: the mode, whether the hooks were armed, and the fence counters.
"""

from __future__ import annotations

import os
from typing import Any


def pytest_configure(config: Any) -> None:
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
