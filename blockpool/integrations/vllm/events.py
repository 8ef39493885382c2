"""vLLM's KV cache events for :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`.

The core queues request-agnostic events (:mod:`blockpool.core.events`: keys
and block ids); vLLM's carry the request's token ids, extra keys, LoRA and
session. :class:`VllmEvents`, a part of the pool, turns the one into the
other: removals one per key (vLLM 0.33's events, by vLLM's own helper),
resets one for one, and for each of the core's ``BlockStored`` vLLM's own,
built by vLLM's own helpers (borrowed as functions) for the blocks the
core's event lists, so the events are byte-for-byte vLLM's. This is the one
module that depends on vLLM's private event helpers.

vLLM 0.33 added lookahead hashing (``num_hash_lookahead_tokens``: each
block's hash and event cover tokens after it, the events carry
``lookahead_token_ids``) with two helpers of its pool, which 0.34 renamed;
vLLM 0.32 has neither: its events take the extra keys from
``generate_block_hash_extra_keys`` and its ``_build_block_stored_event``
has no ``lookahead_token_ids`` argument. Which helpers a line has is
declared in its surface (:attr:`~blockpool.integrations.vllm.surface.Surface.event_extra_keys`,
:attr:`~blockpool.integrations.vllm.surface.Surface.lookahead_token_ids`;
:data:`HAS_LOOKAHEAD` tells which).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import KVCacheEvent as VllmKVCacheEvent
from vllm.multimodal.utils import get_mm_features_in_window
from vllm.v1.core import block_pool as _vllm_block_pool_module
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash

from blockpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from blockpool.core.pool import HazardAwareBlockPool
from blockpool.integrations.vllm.surface import active as active_surface

__all__ = ["HAS_LOOKAHEAD", "VLLM_BLOCK_POOL", "VllmEvents"]

# vLLM's own class, whatever the module binds after register(): vLLM's pure
# helpers are borrowed from it (events, partial-hash arithmetic).
VLLM_BLOCK_POOL: type = getattr(
    _vllm_block_pool_module, "_blockpool_vllm_BlockPool", _vllm_block_pool_module.BlockPool
)

_SURFACE = active_surface()

HAS_LOOKAHEAD: bool = _SURFACE.lookahead_token_ids is not None
"""vLLM's pool has lookahead hashing (vLLM 0.33 and later; not 0.32), as
the active surface declares."""


def _no_lookahead_token_ids(self: Any, request: Any, block_end: int) -> list[int]:  # pragma: no cover
    # Unreachable: on vLLM 0.32 the pool refuses num_hash_lookahead_tokens != 0.
    raise AssertionError("this vLLM has no lookahead hashing")


def _lookahead_arg(token_ids: list[list[int]] | None) -> dict[str, Any]:
    """``_build_block_stored_event``'s ``lookahead_token_ids`` argument:
    vLLM 0.33 requires it, vLLM 0.32 has none. O(1)."""
    return {"lookahead_token_ids": token_ids} if HAS_LOOKAHEAD else {}


class VllmEvents:
    """The event part of :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`:
    ``take_events``, ``emit_cached_block_events`` and the translation of
    the core's events (the pool calls :meth:`_pull_events` after each core
    call that may queue some). Reads the pool's attributes below."""

    core: HazardAwareBlockPool
    _due: Any  # the core's _due, bound once (VllmBlockPool.__init__)
    _core_events: list[Any]  # the core's kv_event_queue, bound once (VllmBlockPool.__init__)
    medium: str
    hash_block_size: int
    num_hash_lookahead_tokens: int
    enable_kv_cache_events: bool
    kv_event_queue: list[VllmKVCacheEvent]

    def take_events(self) -> list[VllmKVCacheEvent]:
        """Take and clear the queued vLLM events (``[]`` when disabled),
        after moving the core's (a failed load's removals). O(events)."""
        if not self.enable_kv_cache_events:
            return []
        if self._core_events or self._due:  # _pull_events' own test, hoisted (once a step)
            self._pull_events()
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def _pull_events(self) -> BlockStored | None:
        """Move the core's events to ``kv_event_queue`` as vLLM's (a removal
        per key, by vLLM's own helper); nothing when events are off. Returns
        the core's last ``BlockStored`` among them, or ``None``: the caller
        queues vLLM's, which carries token ids. O(events)."""
        core = self.core
        # Several times a step (after each core call that may queue one):
        # nothing to move unless the core queued an event or has completions
        # to apply (a failed load's removals), tested here without a call.
        if not self.enable_kv_cache_events or not (self._core_events or self._due):
            return None
        stored = None
        removed: list[Any] = []  # a run of removals: one call of vLLM's helper (an event per key)
        for ev in core.take_events():
            if type(ev) is BlockRemoved:
                removed += ev.block_hashes
                continue
            if removed:
                self._emit_block_removed_events(removed)
                removed = []
            if type(ev) is AllBlocksCleared:
                self.kv_event_queue.append(VllmAllBlocksCleared())
            elif type(ev) is BlockStored:
                stored = ev
        if removed:
            self._emit_block_removed_events(removed)
        return stored

    def _queue_full_blocks_stored(
        self,
        request: Any,
        block_hashes: Any,
        published: list[int],
        lo: int,
        hi: int,
        block_size: int,
        group_id: int,
    ) -> None:
        """After the core's ``publish_full_blocks(..., lo, hi, ...)``, events
        on: queue vLLM's ``BlockStored`` (vLLM's code) for the positions
        ``published`` returned, in order (one is queued, possibly empty, as
        vLLM does). Positions the core did not publish (null, masked out, a
        failed load, a key the block already held) are not in it.
        O(len(published))."""
        new_hashes = []
        extra_keys_list = []
        lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        curr_mm_idx = 0
        for i in published:
            new_hashes.append(maybe_convert_block_hash(block_hashes[i]))  # type: ignore[arg-type]
            start = i * block_size
            extra_keys, curr_mm_idx = self._generate_event_extra_keys(
                request, start, start + block_size, curr_mm_idx
            )
            extra_keys_list.append(extra_keys)
            if lookahead is not None:
                lookahead.append(self._lookahead_token_ids(request, start + block_size))
        self.kv_event_queue.append(
            self._build_block_stored_event(
                request,
                block_hashes=new_hashes,
                parent_block_hash=maybe_convert_block_hash(block_hashes[lo - 1]) if lo > 0 else None,  # type: ignore[arg-type]
                start_token_idx=lo * block_size,
                end_token_idx=hi * block_size,
                block_size=block_size,
                kv_cache_group_id=group_id,
                extra_keys_list=extra_keys_list,
                **_lookahead_arg(lookahead),
            )
        )

    def _queue_partial_block_stored(
        self, request: Any, block_hash: bytes, num_tokens: int, group_id: int
    ) -> None:
        """After ``cache_partial_block``: move the core's events, then, if
        the core stored the key, queue vLLM's ``BlockStored`` for it
        (vLLM's code). O(events + multimodal features)."""
        if self._pull_events() is None:
            return
        parent, start = self._get_partial_block_parent_hash_and_start(request, num_tokens)
        mm_idx = 0
        mm = request.mm_features
        if start > 0 and mm and mm[-1].mm_position.offset + mm[-1].mm_position.length > start:
            mm_idx, _ = get_mm_features_in_window(mm, start, num_tokens)
        extra_keys, _ = self._generate_event_extra_keys(request, start, num_tokens, mm_idx)
        self.kv_event_queue.append(
            self._build_block_stored_event(
                request,
                block_hashes=[maybe_convert_block_hash(block_hash)],  # type: ignore[arg-type]
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),  # type: ignore[arg-type]
                start_token_idx=start,
                end_token_idx=num_tokens,
                block_size=num_tokens - start,
                kv_cache_group_id=group_id,
                extra_keys_list=[extra_keys],
                **_lookahead_arg(
                    [self._lookahead_token_ids(request, num_tokens)]
                    if self.num_hash_lookahead_tokens
                    else None
                ),
            )
        )

    # vLLM's pure helpers (event shapes, partial-hash arithmetic), borrowed
    # so the events are byte-for-byte vLLM's. They read only the attributes
    # declared above (each is declared, with its body's fingerprint, in the
    # surface of every line). On vLLM 0.32, 0.32's own computation of the
    # extra keys.
    emit_cached_block_events = VLLM_BLOCK_POOL.emit_cached_block_events
    _build_block_stored_event = VLLM_BLOCK_POOL._build_block_stored_event
    _generate_event_extra_keys = (
        getattr(VLLM_BLOCK_POOL, _SURFACE.event_extra_keys)
        if _SURFACE.event_extra_keys is not None
        else staticmethod(
            generate_block_hash_extra_keys
        )  # 0.32's own computation, no frame of ours per block
    )
    _lookahead_token_ids = (
        getattr(VLLM_BLOCK_POOL, _SURFACE.lookahead_token_ids)
        if _SURFACE.lookahead_token_ids is not None
        else _no_lookahead_token_ids
    )
    _get_partial_block_hash = VLLM_BLOCK_POOL._get_partial_block_hash
    _get_partial_block_parent_hash_and_start = VLLM_BLOCK_POOL._get_partial_block_parent_hash_and_start
    _emit_block_removed_events = VLLM_BLOCK_POOL._emit_block_removed_events


# The same helpers under this line's own names, which vLLM's code calls on
# its pool (0.34's cache_full_blocks calls self.generate_event_extra_keys).
for _helper in (_SURFACE.event_extra_keys, _SURFACE.lookahead_token_ids):
    if _helper is not None and _helper not in VllmEvents.__dict__:
        setattr(VllmEvents, _helper, getattr(VLLM_BLOCK_POOL, _helper))
