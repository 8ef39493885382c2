"""End to end: vLLM's plugin loader installs our pool (needs vLLM and this
package installed, editable is fine, in the same environment; skipped
otherwise). Each check runs in a fresh interpreter, because the loader and
the plugin act once per process."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm.v1.core.block_pool")

if not any(ep.name == "blockpool" for ep in importlib.metadata.entry_points(group="vllm.general_plugins")):
    pytest.skip("blockpool is not installed in this environment (pip install -e .)", allow_module_level=True)

# Build a KVCacheManager the way vLLM's scheduler does, after the loader ran.
PROBE = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("vllm.plugins.blockpool").addHandler(Keep())
    logging.getLogger("vllm.plugins.blockpool").setLevel(logging.INFO)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    {extra}
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    manager = KVCacheManager(config, max_model_len=128, scheduler_block_size=16, hash_block_size=16)
    pool = manager.block_pool
    pool.get_new_blocks(3)
    core = getattr(pool, "core", None)
    print(json.dumps({{
        "pool": type(pool).__module__ + "." + type(pool).__name__,
        "core_used": core.stats().used if core is not None else None,
        "log": [m for m in records if m.startswith("blockpool")],
    }}))
    """
)


def probe(extra: str = "", **env: str) -> dict[str, object]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "BLOCKPOOL_VLLM_PLUGIN")}
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(extra=extra)],
        check=False,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


OURS = "blockpool.integrations.vllm.pool.VllmBlockPool"
VLLMS = "vllm.v1.core.block_pool.BlockPool"


def test_loader_makes_a_new_kv_cache_manager_hold_our_pool_and_logs_once() -> None:
    import blockpool
    from blockpool.integrations import vllm as plugin

    got = probe("load_general_plugins.__globals__['plugins_loaded'] = False; load_general_plugins()")
    assert got["pool"] == OURS and got["core_used"] == 3
    assert len(got["log"]) == 1  # type: ignore[arg-type]
    line = got["log"][0]  # type: ignore[index]
    assert line.startswith(  # type: ignore[union-attr]
        f"blockpool {blockpool.__version__}: vLLM {plugin.vllm_version()}'s BlockPool is now {OURS} "
        f"(HazardAwareBlockPool core, {'compiled (mypyc)' if blockpool.__compiled__ else 'pure Python'}; "
        "hazard tracking on) in "
    )
    assert "; KV connectors wired: mooncake_store, offloading, simple_cpu_offload, nixl; " in line  # type: ignore[operator]


def test_vllm_plugins_allowlist_without_blockpool_keeps_vllms_pool() -> None:
    got = probe(VLLM_PLUGINS="some_other_plugin")
    assert got["pool"] == VLLMS and got["log"] == []


def test_blockpool_vllm_plugin_0_keeps_vllms_pool_and_says_so() -> None:
    got = probe(BLOCKPOOL_VLLM_PLUGIN="0")
    assert got["pool"] == VLLMS
    assert len(got["log"]) == 1 and "disabled" in got["log"][0]  # type: ignore[index, arg-type]
