"""Queries, counters, invariants and snapshots of the pool."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from blockpool._base import (
    PoolBase,
    _shadow_tokens,
)
from blockpool.block import KVCacheBlock
from blockpool.errors import (
    InvalidArgumentError,
    InvariantError,
)
from blockpool.events import KVCacheEvent
from blockpool.hazards import StreamKind
from blockpool.stats import PoolSnapshot, PoolStats

__all__ = ["IntrospectionOps"]


class IntrospectionOps(PoolBase):
    """Queries and invariant checks of the pool."""

    # ------------------------------------------------------------------
    # queries
    # ------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (held blocks excluded). O(1) plus queued
        completions."""
        if self._inbox or self._leases_on:
            self._apply_completions()
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks not free (held count as used), in [0, 1]. O(1)."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Whether the sole owner may write ``block`` in place (not null, ref
        count 1, no key). O(1).

        Raises:
            InvalidArgumentError: ``block`` is not a block record.
        """
        try:
            return not block.is_null and block.ref_cnt == 1 and block.block_hash is None
        except AttributeError:
            raise InvalidArgumentError(f"expected a KVCacheBlock, got {block!r}") from None

    def generations(self, blocks: Iterable[KVCacheBlock]) -> tuple[int, ...]:
        """The allocation generation of each block of a block table, to pass
        as ``generations=`` to :meth:`begin_load`, :meth:`begin_store`,
        :meth:`begin_copy` and :meth:`cache_full_blocks` (or one of them as
        ``generation=`` to :meth:`cache_partial_block`) while the table may
        be stale: a copy kept by a connector after the scheduler freed some
        of its blocks (e.g. a sliding window's middle). Those calls then
        refuse the table with :class:`StaleBlockError`, changing nothing,
        once one of its blocks was freed and allocated again (it holds
        another request's data), and accept it as long as none was (a block
        freed and taken back as a prefix hit keeps its generation: same
        content).

        Take it when the table is built (after the allocation that filled
        it). A generation is the serial of the allocation that last handed
        the block out; the null block's is always 0. The first call turns
        generations on for the pool (one 8-byte word per block from then
        on; allocations stamp their blocks, one store per block); until
        then no allocation pays anything. O(len(blocks)) (O(num_gpu_blocks)
        for the first call).

        Raises:
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``blocks`` is not an iterable of blocks.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        block_list = self._own_all(blocks)
        gens = self._gens
        if gens is None:
            gens = self._gens = array("Q", (0,)) * self.num_gpu_blocks  # exactly sized (frombytes over-allocates 1/16)
        return tuple([gens[b.block_id] for b in block_list])

    def held_block_ids(self) -> list[int]:
        """Blocks held back for pending host-engine accesses, sorted. O(h log h)."""
        self._apply_completions()
        return sorted(self._held)

    def expired_leases(self) -> list[int]:
        """Held blocks whose lease expired (still quarantined), sorted.
        O(h log h), h = expired held blocks."""
        self._apply_completions()
        return sorted(self._expired)

    def take_events(self) -> list[KVCacheEvent]:
        """Take and clear the queued KV cache events (``[]`` when disabled),
        after applying queued completions (a failed load's removed events).
        O(1)."""
        if self._inbox:
            self._apply_completions()
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def _all_counters(self) -> dict[str, int]:
        return {**self._counters, "lookups": self._lookups, "hits": self._hits}

    def stats(self) -> PoolStats:
        """Counters and occupancy. O(num_gpu_blocks)."""
        self._apply_completions()
        free = self.free_block_queue.num_free_blocks
        held = len(self._held)
        usable = self.num_gpu_blocks - 1
        cached = sum(1 for b in self.blocks if b.block_hash is not None)
        return PoolStats(
            num_blocks=usable,
            free=free,
            held=held,
            used=usable - free - held,
            cached_blocks=cached,
            cached_keys=len(self.prefix_cache),
            failed_tokens=sum(s.failed for s in self.tracker.streams.values()),
            **self._all_counters(),
        )

    # ------------------------------------------------------------------
    # invariants and snapshots
    # ------------------------------------------------------------------

    def check(self) -> None:
        """Assert every invariant; raises :class:`InvariantError` naming the
        first one broken.

        Checked: the null block is never free, held, referenced or cached;
        the free queue's links and count agree; free blocks have ref count 0
        and are not held; held blocks have ref count 0 and a pending host
        token; ref counts >= 0; free + held + used = total; no block is
        counted twice; key map <-> block keys agree both ways. The hazard
        half: every held block waits on host-engine tokens that have not
        ended and is listed under each; leases exist exactly for held
        blocks; saved shadows of pending writes belong to tokens that have
        not ended and to this pool's data blocks; invalid marks name data
        blocks; block generations (once on) have one entry per block, 0 for
        the null block, none past the allocation serial.
        O(num_gpu_blocks + cached keys + held + pending writes).

        Raises:
            InvariantError: an invariant is broken (the first one found).
        """
        free_list = self.free_block_queue.check()
        free_ids = [b.block_id for b in free_list]
        free_set = set(free_ids)
        if len(free_set) != len(free_ids):
            raise InvariantError("a block appears twice in the free queue")
        null = self.null_block
        if 0 in free_set or null.ref_cnt != 0 or null.block_hash is not None or 0 in self._held:
            raise InvariantError("the null block is free, held, referenced or cached")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise InvariantError(f"block {b.block_id} has ref count {b.ref_cnt}")
            if b.block_id in free_set and b.ref_cnt != 0:
                raise InvariantError(f"free block {b.block_id} has ref count {b.ref_cnt}")
        for bid, pending in self._held.items():
            if bid in free_set or self.blocks[bid].ref_cnt != 0 or not pending:
                raise InvariantError(f"held block {bid} is free, referenced or has no pending token")
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        zero_not_free = sum(
            1 for b in self.blocks[1:] if b.ref_cnt == 0 and b.block_id not in free_set
        )
        if zero_not_free != len(self._held):
            raise InvariantError(
                f"{zero_not_free} unreferenced blocks are outside the free queue but "
                f"{len(self._held)} are held"
            )
        if len(free_set) + len(self._held) + used != self.num_gpu_blocks - 1:
            raise InvariantError("free + held + used != total")
        seen_pairs = set()
        for key, blocks in self.prefix_cache.items():
            if not blocks:
                raise InvariantError(f"key {key!r} maps to no block")
            for b in blocks:
                if self.blocks[b.block_id] is not b or b.is_null:
                    raise InvariantError(f"key {key!r} maps to a foreign or null block")
                if key not in self.prefix_cache.keys_of(b):
                    raise InvariantError(f"key {key!r} maps to block {b.block_id} which lacks it")
                seen_pairs.add((key, b.block_id))
        for b in self.blocks:
            for key in self.prefix_cache.keys_of(b):
                if (key, b.block_id) not in seen_pairs:
                    raise InvariantError(f"block {b.block_id} holds key {key!r} the map lacks")
        for bid, extra in self.prefix_cache.extra_keys().items():
            if extra and self.blocks[bid].block_hash is None:
                raise InvariantError(f"block {bid} has extra keys but no primary key")
        self._check_hazards()

    def _check_hazards(self) -> None:
        """The hazard half of :meth:`check`: held sets, leases, pending
        writes, invalid marks. O(held + pending write entries + invalid)."""
        tracker = self.tracker
        host = StreamKind.HOST
        for bid, pending in self._held.items():
            for t in pending:
                st = tracker.streams.get(t.stream)
                if st is None or st.kind is not host or t.kind is not host:
                    raise InvariantError(f"held block {bid} waits on {t}, not a host-engine token")
                if tracker.is_ended(t):
                    raise InvariantError(f"held block {bid} still waits on {t}, which has ended")
                if not any(b.block_id == bid for b in self._held_by.get(t, ())):
                    raise InvariantError(f"held block {bid} is not listed under its pending token {t}")
        if self._held_by and not tracker.host_pending():
            live = [t for t, blocks in self._held_by.items() if any(b.block_id in self._held for b in blocks)]
            if live:
                raise InvariantError(f"blocks held on {live[0]} with no host token pending")
        if self._leases_on:
            for bid in self._held:
                if bid not in self._deadline:
                    raise InvariantError(f"held block {bid} has no lease")
        for bid in self._deadline:
            if bid not in self._held:
                raise InvariantError(f"block {bid} has a lease but is not held")
        for bid in self._expired:
            if bid not in self._held:
                raise InvariantError(f"block {bid} has an expired lease but is not held")
        for stream, per_seq in self._writes.items():
            st = tracker.streams.get(stream)
            if st is None:
                raise InvariantError(f"pending writes on unknown stream {stream!r}")
            for seq, entries in per_seq.items():
                if st.is_ended(seq):
                    raise InvariantError(f"saved shadows of {stream}:{seq}, which has ended")
                for b, _w, _r in entries:
                    if self.blocks[b.block_id] is not b or b.is_null:
                        raise InvariantError(f"{stream}:{seq} saved the shadow of a foreign or null block")
        for bid in self._invalid:
            if not (isinstance(bid, int) and 0 < bid < self.num_gpu_blocks):
                raise InvariantError(f"invalid mark on {bid!r}, not a data block")
        gens = self._gens
        if gens is not None and (
            len(gens) != self.num_gpu_blocks or gens[0] != 0 or max(gens) > self._alloc_serial
        ):
            raise InvariantError(
                "the generation array is not one entry per block, 0 for the null block, "
                "none past the allocation serial"
            )

    def snapshot(self) -> PoolSnapshot:
        """A comparable picture of all observable state (tests: take one
        before a failing call, compare after). O(num_gpu_blocks)."""
        pc = self.prefix_cache
        tr = self.tracker
        return PoolSnapshot(
            ref_counts=tuple(b.ref_cnt for b in self.blocks),
            free_queue=tuple(b.block_id for b in self.free_block_queue),
            held=tuple(
                (bid, tuple(sorted(map(str, toks)))) for bid, toks in sorted(self._held.items())
            ),
            cache=tuple(
                (b.block_id, repr(k), b.block_hash_num_tokens if k == b.block_hash else None)
                for b in self.blocks
                for k in pc.keys_of(b)
            ),
            shadows=tuple(
                (b.block_id, str(b.writer), tuple(sorted(map(str, _shadow_tokens(b)))))
                for b in self.blocks
                if b.writer is not None or b.readers is not None
            ),
            events=tuple(self.kv_event_queue),
            marks=tuple(
                (n, s.last_seq, s.mark, tuple(s.done)) for n, s in sorted(tr.streams.items())
            ),
            clocks=tuple(
                (n, tuple(sorted(s.clock.dev.items())), tuple(sorted(map(str, s.clock.host))))
                for n, s in sorted(tr.streams.items())
            ),
            counters=tuple(sorted(self._all_counters().items())) + (("invalid", len(self._invalid)),),
        )
