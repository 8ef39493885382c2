"""KV cache events, in the shape of vLLM's ``vllm.distributed.kv_events``.

The core is request-agnostic, so :class:`BlockStored` carries the block keys
and sizes but no token ids; the vLLM adapter turns these into vLLM's own
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

__all__ = ["KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "MEDIUM_GPU"]

MEDIUM_GPU = "GPU"


@attrs.frozen(slots=True)
class BlockStored:
    """Blocks were published in the prefix cache under ``block_hashes``.

    Attributes:
        block_hashes: Keys published, in chain order.
        parent_block_hash: Key of the block before the first one, or ``None``.
        block_size: Tokens per block (``None`` when the caller did not say).
        block_ids: The blocks, aligned with ``block_hashes``.
        medium: Storage medium (``"GPU"``).
    """

    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    block_size: int | None
    block_ids: tuple[int, ...]
    medium: str = MEDIUM_GPU


@attrs.frozen(slots=True)
class BlockRemoved:
    """Keys withdrawn from the prefix cache (eviction, promotion, failed load)."""

    block_hashes: tuple[Hashable, ...]
    medium: str = MEDIUM_GPU


@attrs.frozen(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    medium: str = MEDIUM_GPU


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
