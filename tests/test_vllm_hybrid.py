"""A failed load on a hybrid model, on vLLM's real ``HybridKVCacheCoordinator``.

vLLM's ``KVCacheManager`` for a model with a full-attention group and a
sliding-window group (as vLLM's own hybrid prefix-caching tests build it)
runs on our pool through the plugin. A connector loads a request's prefix
as one transfer per KV cache group; one group's part fails. Every group's
keys of that request's prefix must be withdrawn (none published, removed
events for what was published), no other request's, and vLLM finds no
prefix hit for the request's tokens any more: it recomputes them. Needs
vLLM (skipped otherwise); runs on 0.32, 0.33 and 0.34.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_coordinator")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from blockpool import StreamKind, TokenStatus
from blockpool.core.completions import CompletionReport
from blockpool.integrations import vllm as plugin
from blockpool.integrations.vllm.hazards import StepHazards, Transfer
from blockpool.integrations.vllm.pool import VllmBlockPool
from tests.test_vllm_pool import request

BS = 16
FULL, WINDOW = 0, 1
PREFIX = [t for i in range(3) for t in [i] * BS]  # 3 full blocks
PROMPT = PREFIX + [3] * 7
OTHER = [t + 100 for t in PROMPT]  # another request's prompt


@pytest.fixture
def manager() -> Iterator[KVCacheManager]:
    """vLLM's KVCacheManager for a full-attention + sliding-window model,
    built with the plugin installed (hazards on): its one BlockPool is ours."""
    init_none_hash(sha256)
    plugin.unregister()
    with patch.dict(os.environ, {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "1"}):
        plugin.register()
    try:
        spec: dict[str, Any] = {"block_size": BS, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
        kv = KVCacheConfig(
            num_blocks=32,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["full"], FullAttentionSpec(**spec)),
                KVCacheGroupSpec(["swa"], SlidingWindowSpec(**spec, sliding_window=2 * BS)),
            ],
        )
        yield KVCacheManager(
            kv,
            max_model_len=1024,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
    finally:
        plugin.unregister()


def hazards_of(manager: KVCacheManager) -> StepHazards:
    pool = manager.block_pool
    assert isinstance(pool, VllmBlockPool) and pool.hazards is not None
    assert type(manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    pool.hazards.add_stream("nixl", StreamKind.HOST)
    return pool.hazards


def load_per_group(
    manager: KVCacheManager, hz: StepHazards, rid: str, prompt: list[int] = PROMPT
) -> tuple[Any, list[Transfer]]:
    """A request whose prefix a connector loads (vLLM's async load: blocks
    allocated, cached only once the load ended): one transfer per KV cache
    group, begun under the request's id."""
    req = request(rid, prompt, BS)
    computed, hit = manager.get_computed_blocks(req)[:2]
    assert hit == 0
    assert manager.allocate_slots(req, len(PREFIX), 0, computed, delay_cache_blocks=True) is not None
    groups = manager.get_block_ids(rid)
    assert len(groups) == 2
    parts = [hz.begin_load(rid, hz.blocks_of(ids[:3]), "nixl") for ids in groups]
    return req, parts


def published(manager: KVCacheManager, req: Any) -> dict[int, int]:
    """How many of ``req``'s prefix blocks each group has published."""
    pool = manager.block_pool
    return {
        g: sum(pool.get_cached_block(h, [g]) is not None for h in req.block_hashes[:3])
        for g in (FULL, WINDOW)
    }


def prefix_hit(manager: KVCacheManager, rid: str, prompt: list[int] = PROMPT) -> int:
    """The tokens vLLM's coordinator finds cached for a new request with ``prompt``."""
    return int(manager.get_computed_blocks(request(rid, prompt, BS))[1])


def test_failed_load_on_a_hybrid_model_withdraws_every_groups_prefix(manager: KVCacheManager) -> None:
    hz = hazards_of(manager)
    req, (full, window) = load_per_group(manager, hz, "a")
    other, _ = load_per_group(manager, hz, "b", OTHER)  # another request's load, which succeeds
    assert hz.pool.linked_loads(full.token) == [full.token, window.token]
    # The worker reports the sliding-window part failed, the full-attention part done.
    CompletionReport.of(0, completed=[full.token], failed=[window.token]).apply(hz.pool)
    hz.end_transfers(finished_recving={"b"})
    # vLLM caches what the load computed, as it does once the request stops waiting
    manager.cache_blocks(req, len(PREFIX))
    manager.cache_blocks(other, len(PREFIX))
    assert published(manager, req) == {FULL: 0, WINDOW: 0}
    assert published(manager, other) == {FULL: 3, WINDOW: 3}
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 6  # b's 3 blocks in each group, none of a's
    assert hz.pool.token_status(full.token) is TokenStatus.COMPLETED
    # the full-attention part's blocks are listed as bad content, to be rewritten
    assert set(full.block_ids) <= set(hz.pool.invalid_block_ids(window.token))
    manager.free(other)
    manager.free(req)
    assert prefix_hit(manager, "c") == 0  # vLLM recomputes a's prefix
    assert prefix_hit(manager, "d", OTHER) == len(PREFIX)
    hz.pool.check()


def test_a_late_failure_of_one_groups_part_withdraws_the_published_prefix_and_vllm_recomputes(
    manager: KVCacheManager,
) -> None:
    hz = hazards_of(manager)
    req, (_, window) = load_per_group(manager, hz, "a")
    hz.on_connector_output(SimpleNamespace(finished_recving={"a"}))
    manager.cache_blocks(req, len(PREFIX))
    assert published(manager, req) == {FULL: 3, WINDOW: 3}
    manager.free(req)
    assert prefix_hit(manager, "b") == len(PREFIX)
    manager.take_events()
    hz.pool.fail(window.token)  # the sliding-window part's data is found bad after the fact
    assert published(manager, req) == {FULL: 0, WINDOW: 0}
    removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == 6  # every group's 3 keys
    assert prefix_hit(manager, "c") == 0  # vLLM recomputes the prefix
    hz.pool.check()


def test_failed_recving_fails_every_groups_part_of_the_request(manager: KVCacheManager) -> None:
    hz = hazards_of(manager)
    req, parts = load_per_group(manager, hz, "a")
    hz.on_connector_output(SimpleNamespace(finished_recving={"a"}, failed_recving={"a"}))
    assert [hz.pool.token_status(t.token) for t in parts] == [TokenStatus.FAILED] * 2
    manager.cache_blocks(req, len(PREFIX))
    assert published(manager, req) == {FULL: 0, WINDOW: 0}
    manager.free(req)
    assert prefix_hit(manager, "b") == 0


def test_the_engine_checks_hybrid_model_alternates_sliding_window_and_full_attention(tmp_path: Any) -> None:
    import json

    from blockpool.checking.vllm_engine import WORKLOADS, ModelSpec, _ensure_model

    w = WORKLOADS["hybrid"]
    w.validate(ModelSpec())
    _ensure_model(str(tmp_path / "m"), ModelSpec(sliding_window=w.sliding_window))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma2ForCausalLM"]
    assert cfg["sliding_window"] == w.sliding_window == 64
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
