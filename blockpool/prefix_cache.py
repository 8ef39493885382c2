"""The block-hash -> block map of the prefix cache.

vLLM's key model (``vllm/v1/core/block_pool.py``, ``BlockHashToBlockMap``):
a key may map to several blocks (vLLM does not de-duplicate identical full
blocks, so block tables stay append-only), and a block may hold several keys
(a partial-block key plus, after promotion, its full-block key). The primary
key lives on the block record (``block.block_hash``); extra keys live in a
side table so the common one-key block costs no extra object.

A key maps to one block directly, or to a ``{block_id: block}`` dict when
shared (the dict is created only then, which keeps GC pressure low, as in
vLLM).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from blockpool.block import KVCacheBlock

__all__ = ["PrefixCache"]


class PrefixCache:
    """Key -> block(s) map plus the block -> extra keys table. Every method is
    O(1) per key touched."""

    __slots__ = ("_map", "_extra")

    def __init__(self) -> None:
        self._map: dict[Hashable, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._extra: dict[int, set[Hashable]] = {}

    def __len__(self) -> int:
        """Number of distinct keys."""
        return len(self._map)

    def blocks_of(self, key: Hashable) -> list[KVCacheBlock]:
        v = self._map.get(key)
        if v is None:
            return []
        return list(v.values()) if type(v) is dict else [v]  # type: ignore[list-item, union-attr]

    def contains(self, key: Hashable, block: KVCacheBlock) -> bool:
        v = self._map.get(key)
        if v is None:
            return False
        if type(v) is dict:
            return block.block_id in v  # type: ignore[operator]
        return v is block

    def keys_of(self, block: KVCacheBlock) -> list[Hashable]:
        """Every key the block holds, primary first."""
        keys: list[Hashable] = []
        if block.block_hash is not None:
            keys.append(block.block_hash)
        extra = self._extra.get(block.block_id)
        if extra:
            keys.extend(extra)
        return keys

    def insert(self, key: Hashable, block: KVCacheBlock, num_tokens: int | None) -> bool:
        """Make ``block`` reachable under ``key``; returns False if it already was."""
        if block.block_hash == key or self.contains(key, block):
            return False
        if block.block_hash is None:
            block.block_hash = key
            block.block_hash_num_tokens = num_tokens
        else:
            self._extra.setdefault(block.block_id, set()).add(key)
        v = self._map.get(key)
        if v is None:
            self._map[key] = block
        elif type(v) is dict:
            v[block.block_id] = block  # type: ignore[index]
        else:
            self._map[key] = {v.block_id: v, block.block_id: block}  # type: ignore[union-attr, dict-item]
        return True

    def remove_block(self, block: KVCacheBlock) -> list[Hashable]:
        """Withdraw every key of ``block``; returns the keys that actually
        mapped to it (primary first), as vLLM reports removals. The block
        forgets all its keys either way. O(keys of the block)."""
        keys = self.keys_of(block)
        if not keys:
            return keys
        self._extra.pop(block.block_id, None)
        m = self._map
        bid = block.block_id
        removed: list[Hashable] = []
        for key in keys:
            v = m.get(key)
            if v is block:
                del m[key]
                removed.append(key)
            elif type(v) is dict:
                if v.pop(bid, None) is not None:  # type: ignore[union-attr]
                    removed.append(key)
                if len(v) == 1:  # type: ignore[arg-type]
                    m[key] = next(iter(v.values()))  # type: ignore[union-attr]
                elif not v:
                    del m[key]
        block.block_hash = None
        block.block_hash_num_tokens = None
        return removed

    def clear(self) -> None:
        self._map.clear()
        self._extra.clear()

    def items(self) -> Iterator[tuple[Hashable, list[KVCacheBlock]]]:
        for key in self._map:
            yield key, self.blocks_of(key)

    def extra_keys(self) -> dict[int, set[Hashable]]:
        return self._extra
