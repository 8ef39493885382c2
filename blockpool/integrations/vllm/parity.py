"""What vLLM's own unit tests need from our pool and deployments do not.

Installed only by the parity harness's pytest plugin
(:mod:`blockpool.integrations.vllm.pytest_plugin`, "plugin on"):
:func:`install` makes vLLM build :class:`ParityBlockPool` where
:func:`blockpool.integrations.vllm.register` bound
:class:`~blockpool.integrations.vllm.pool.VllmBlockPool`.

vLLM's unit tests build ``KVCacheBlock(block_id=i)`` by hand (``block.pool
is None``) and hand them to the pool: to cache them, move or evict their
keys, or free them; vLLM's pool takes them as its own. A deployment never
makes such blocks and :class:`VllmBlockPool` refuses them
(``ForeignBlockError``). :class:`ParityBlockPool` handles every block that
is not the pool's as vLLM does, with vLLM's own code on the shared key map
(such blocks never reach the core), except in ``free_blocks``: blocks of no
pool are left alone there and reported once (vLLM would take their ref
count below zero and link them into its free queue). It also keeps the
pools built while :func:`track_new_pools` is on (the plugin checks their
invariants after each test).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from blockpool.integrations.vllm.events import VLLM_BLOCK_POOL
from blockpool.integrations.vllm.pool import VllmBlockPool

__all__ = ["LOOSE_BLOCKS", "ParityBlockPool", "install", "track_new_pools"]

logger = logging.getLogger("vllm.plugins.blockpool")

LOOSE_BLOCKS = {"ignored": 0}
"""Blocks of no pool that ``free_blocks`` left alone, in this process."""

_TRACKED: list[Any] | None = None


def track_new_pools(on: bool = True) -> list[Any]:
    """Start (or stop) keeping the core (:class:`~blockpool.HazardAwareBlockPool`)
    of every :class:`ParityBlockPool` built from now on; returns those kept
    since the last call. The cores, not the pools: a test may check that a
    pool and what it references are collected once dropped (vLLM 0.34's
    HiSparse teardown test), and the pool's blocks hold only a weak
    reference to it there. O(1)."""
    global _TRACKED
    kept = _TRACKED or []
    _TRACKED = [] if on else None
    return kept


def install() -> list[str]:
    """Rebind ``BlockPool`` to :class:`ParityBlockPool` in every vLLM module
    that binds :class:`VllmBlockPool` (after ``register()``; modules
    imported later bind ours from ``vllm.v1.core.block_pool``). Returns the
    modules rebound, sorted; idempotent. O(modules loaded)."""
    rebound = []
    for name, mod in list(sys.modules.items()):
        if (name == "vllm" or name.startswith("vllm.")) and getattr(mod, "BlockPool", None) is VllmBlockPool:
            mod.BlockPool = ParityBlockPool  # type: ignore[attr-defined]
            rebound.append(name)
    return sorted(rebound)


class ParityBlockPool(VllmBlockPool):
    """:class:`VllmBlockPool` that also takes blocks of no pool, as vLLM's
    unit tests hand them (see the module docstring). Same arguments, errors
    and complexity; a call naming a block that is not this pool's costs
    O(blocks) more for the scan."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._warned_loose = False
        # Blocks of no pool were put in the key map (vLLM's code on them):
        # lookups then go through vLLM's own code on the map view, the path
        # vLLM's tests of such blocks exercise (the same answer: the map
        # holds block ids, each read back as the pool's block of that id).
        self._loose_keys = False
        if _TRACKED is not None:
            _TRACKED.append(self.core)

    def _foreign(self, *blocks: Any) -> bool:
        return any(b.pool is not self._pool_ref and not b.is_null for b in blocks)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[Any] | None:
        """As :meth:`VllmBlockPool.get_cached_block`; once blocks of no pool
        were put in the key map, vLLM's own lookup on the map view (the
        same answer: the pool's block of each mapped id). O(groups)."""
        if self._loose_keys:
            return VLLM_BLOCK_POOL.get_cached_block(self, block_hash, kv_cache_group_ids)  # type: ignore[no-any-return]
        return super().get_cached_block(block_hash, kv_cache_group_ids)

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """As :meth:`VllmBlockPool.free_blocks` (``evict_first`` too), blocks
        of no pool left alone (counted in :data:`LOOSE_BLOCKS`, one warning
        per pool)."""
        blocks = list(ordered_blocks)
        kept = [b for b in blocks if b.pool is not None or b.is_null]
        if len(kept) < len(blocks):
            n = len(blocks) - len(kept)
            LOOSE_BLOCKS["ignored"] += n
            if not self._warned_loose:
                self._warned_loose = True
                logger.warning("blockpool: free_blocks ignored %d block(s) that belong to no pool", n)
        super().free_blocks(kept, evict_first)

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        args = (
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        if num_cached_blocks < num_full_blocks and self._foreign(*blocks[num_cached_blocks:num_full_blocks]):
            self._loose_keys = True
            return VLLM_BLOCK_POOL.cache_full_blocks(self, *args)  # type: ignore[no-any-return]
        return super().cache_full_blocks(*args)

    def cache_partial_block(
        self,
        request: Any,
        block: Any,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Any:
        args = (request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes)
        if self._foreign(block):
            self._loose_keys = True
            return VLLM_BLOCK_POOL.cache_partial_block(self, *args)
        return super().cache_partial_block(*args)

    def move_block_hashes(self, src_block: Any, dst_block: Any) -> None:
        if src_block.pool is not self._pool_ref or dst_block.pool is not self._pool_ref:
            self._loose_keys = True
            return VLLM_BLOCK_POOL.move_block_hashes(self, src_block, dst_block)  # type: ignore[no-any-return]
        return super().move_block_hashes(src_block, dst_block)

    def _maybe_evict_cached_block(self, block: Any) -> bool:
        if block.pool is self._pool_ref:
            return super()._maybe_evict_cached_block(block)
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(block)
        removed = VLLM_BLOCK_POOL._remove_cached_block_hashes(self, block)
        self._emit_block_removed_events(removed)
        return bool(removed)

    def _insert_block_hash(self, block_hash_with_group_id: bytes, block: Any, num_tokens: int | None) -> None:
        if block.pool is self._pool_ref:
            return super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        self._loose_keys = True
        return VLLM_BLOCK_POOL._insert_block_hash(self, block_hash_with_group_id, block, num_tokens)  # type: ignore[no-any-return]

    def _remove_cached_block_hashes(self, block: Any) -> list[Any]:
        """vLLM's private removal (no events; its own code on blocks of no
        pool calls it): the keys that were mapped to the block. O(keys)."""
        if block.pool is self._pool_ref:
            return self.core.prefix_cache.remove(block)
        return VLLM_BLOCK_POOL._remove_cached_block_hashes(self, block)  # type: ignore[no-any-return]
