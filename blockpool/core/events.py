"""KV cache events, in the shape of vLLM's ``vllm.distributed.kv_events``.

The core is request-agnostic, so :class:`BlockStored` carries the block keys
and sizes but no token ids; the vLLM adapter turns these into vLLM's own
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections.abc import Hashable

import attr
import attrs

__all__ = ["MEDIUM_GPU", "REMOVAL_REASONS", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]

MEDIUM_GPU = "GPU"

REMOVAL_REASONS = ("evicted", "promoted", "replaced", "load_failed")
"""The values of :attr:`BlockRemoved.reason`."""


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
    """Keys withdrawn from the prefix cache: sent when the last block holding
    a key loses it (while another block still holds the key, it stays
    published and nothing is sent).

    Attributes:
        block_hashes: Keys withdrawn.
        medium: Storage medium (``"GPU"``).
        reason: Why: ``"evicted"`` (the block was handed out again, or
            ``evict_blocks``), ``"promoted"`` (a longer key of the same block
            replaced it), ``"replaced"`` (new content: ``replace_existing_hashes``,
            or a load or copy began writing the block) or ``"load_failed"``
            (the write that last wrote the block -- a load, copy or step --
            failed); ``None`` when unknown. Informational: not part of
            equality, so events compare as before.
    """

    block_hashes: tuple[Hashable, ...]
    medium: str = MEDIUM_GPU
    reason: str | None = attr.ib(default=None, eq=False)


@attrs.frozen(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    medium: str = MEDIUM_GPU


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
