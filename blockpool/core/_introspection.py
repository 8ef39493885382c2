"""Queries, counters, invariants and snapshots of the pool."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, cast

from blockpool.core._base import _HOST, PoolBase, _as_list
from blockpool.core._mypyc import mypyc_attr
from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import (
    InvalidArgumentError,
    InvariantError,
    RefCountError,
)
from blockpool.core.generations import Generations
from blockpool.core.hazards import Token
from blockpool.core.shadows import _UNSET, shadow_ready, shadow_tokens
from blockpool.core.stats import PoolSnapshot, PoolStats

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgBlock, ArgStr, ArgToken

__all__ = ["IntrospectionOps"]


@mypyc_attr(allow_interpreted_subclasses=True)
class IntrospectionOps(PoolBase):
    """Queries and invariant checks of the pool."""

    # ------------------------------------------------------------------
    # queries
    # ------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (held blocks excluded). O(1) plus queued
        completions."""
        if self._due:  # hot call (vLLM's scheduler: ~30 a step): _apply_completions' own test, hoisted
            self._apply_completions()
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks not free (held count as used), in [0, 1]. O(1)."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / total

    def is_block_writable(self, block: ArgBlock) -> bool:
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
        self._apply_completions()
        block_list = self._own_all(blocks)
        gens = self._gens
        if gens is None:
            gens = self._gens = Generations(self.num_gpu_blocks)
        return gens.of(block_list)

    def allocatable_if_freed(self, blocks: Iterable[KVCacheBlock]) -> list[bool]:
        """Whether freeing ``blocks`` now (one reference per listing, as
        :meth:`free_blocks`) would make each allocatable at once: its ref
        count reaches 0 and no host-engine access on it is pending (else
        :meth:`free_blocks` would hold it back). One answer per listed
        block, in order; the null block is never allocatable. A device
        access still in flight does not prevent it (the next user gets a
        fence instead). Changes nothing (it applies queued completions
        first, like every call). O(len(blocks)).

        Raises:
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``blocks`` is not iterable.
            RefCountError: a block is listed more often than it is
                referenced (:meth:`free_blocks` would refuse the call).
        """
        self._apply_completions()
        block_list = self._own_all(blocks)
        listed: dict[int, int] = {}
        for b in block_list:
            if b is not self.null_block:
                listed[b.block_id] = listed.get(b.block_id, 0) + 1
        for bid, n in listed.items():
            if self.blocks[bid].ref_cnt < n:
                rc = self.blocks[bid].ref_cnt
                raise RefCountError(
                    f"block {bid} is listed {'once' if n == 1 else f'{n} times'} but referenced "
                    f"{'once' if rc == 1 else f'{rc} times'}"
                )
        check_host = self.track_hazards and self.tracker.host_pending()
        out = []
        for b in block_list:
            if b is self.null_block or b.ref_cnt != listed[b.block_id]:
                out.append(False)
            elif check_host:
                ended = self.tracker.is_ended
                out.append(not any(t.kind is _HOST and not ended(t) for t in shadow_tokens(b)))
            else:
                out.append(True)
        return out

    def num_ready_free_blocks(self, stream: ArgStr) -> int:
        """Free blocks a write on ``stream`` could begin on without waiting:
        every access on them ended, or ``stream`` is already ordered after
        it (their fence for ``stream`` would be empty). Held blocks are not
        free. With ``track_hazards=False``, every free block. The figure
        ready-first placement works with: a load of ``n`` blocks can have
        an empty fence only if this is at least ``n`` when it is placed.
        O(free blocks); readiness is decided once per distinct shadow.

        Raises:
            UnknownStreamError: ``stream`` is not registered.
        """
        self._apply_completions()
        st = self.tracker.state(stream)
        if not self.track_hazards:
            return self.free_block_queue.num_free_blocks
        tracker = self.tracker
        lw: object = _UNSET
        lr: object = _UNSET
        ok = True
        count = 0
        for b in self.free_block_queue:
            if b.block_id < 0:
                continue  # a policy queue's divider
            w, r = b.writer, b.readers
            if w is not lw or r is not lr:
                lw, lr = w, r
                ok = shadow_ready(w, r, st, tracker)
            count += ok
        return count

    def held_block_ids(self) -> list[int]:
        """Blocks held back for pending host-engine accesses, sorted. O(h log h)."""
        self._apply_completions()
        return self.holdback.held_ids()

    def reclaimable_after(self, tokens: ArgToken | Iterable[ArgToken]) -> int:
        """How many held blocks would come back to the free queue once
        ``tokens`` complete: ``get_num_free_blocks()`` would rise by exactly
        this much if ``complete`` were reported for each of them and for
        nothing else. ``tokens``: one token or an iterable of them (a
        :class:`Fence` will do); any stream, any pool token not of another
        pool.

        A block is held while a host-engine access on it has not ended
        (:meth:`held_block_ids`), and it is released only when **every**
        such access has ended: a block that two transfers touch (a store
        and a load of the same block on two engines) comes back only when
        both have ended, so it counts here only when ``tokens`` end both. A
        completion ends what the completed work had waited on, so a token
        also releases the blocks held on the host tokens it waited on (a
        load that waited on an earlier load of the same blocks; a step
        whose forward host-waited on a load: ``fence_for(...,
        token=eN)``). A token that has ended releases nothing more (0). A
        *failure* (:meth:`fail`, :meth:`abandon`) ends the token alone, so
        it releases at most this many: only the blocks whose sole pending
        access is the token's own.

        A scheduler that would preempt requests to make room can ask how
        many blocks the transfers it is about to see end will bring back
        (vLLM #49674: frees parked behind in-flight work made the free count
        look permanently short, and preemption cascaded). Changes nothing
        (queued completions are applied first, as by every call).
        O(len(tokens) + host tokens they waited on + blocks held on those
        tokens); the decision is made once per run of blocks held together.

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(8, streams={"compute": StreamKind.DEVICE, "rdma": StreamKind.HOST})
        >>> blocks = pool.get_new_blocks(3)
        >>> store, _ = pool.begin_store(blocks, "rdma")   # a NIC still reads them...
        >>> pool.free_blocks(blocks)                     # ...when the request ends
        >>> pool.get_num_free_blocks(), pool.reclaimable_after(store)
        (4, 3)
        >>> pool.complete(store); pool.get_num_free_blocks()
        7

        Raises:
            InvalidArgumentError: ``tokens`` is neither a token nor an
                iterable of tokens, or a token's kind is not its stream's.
            UnknownStreamError, UnknownTokenError: the pool never issued a token.
            ForeignTokenError: a token of another pool.
        """
        self._apply_completions()
        # Items typed object until validated: the compiled build would
        # otherwise refuse a non-token with its own TypeError.
        listed: list[object] = [tokens] if isinstance(tokens, Token) else _as_list(tokens, "tokens")
        tracker = self.tracker
        for t in listed:
            tracker.validate(t)
        ends: set[Token] = set()
        for t in listed:
            ends |= tracker.completion_ends(cast(Token, t))
        if not ends or not len(self.holdback):
            return 0
        return self.holdback.released_by(ends, tracker.is_ended)

    def held_until(self) -> dict[Token, int]:
        """For each host-engine token some held block waits on, how many
        held blocks its completion alone would bring back to the free queue
        (:meth:`reclaimable_after` of that token), in order of stream and
        seq. A block that several tokens hold is released only when all of
        them have ended: it counts under a token only when that token's
        completion ends the others too (they are tokens it waited on), so a
        token may map to 0 (every block it holds is held by another as
        well), a block may count under several tokens (a load and the
        earlier load of the same blocks it waited on), and the values need
        not add up to the blocks held (``stats().held``,
        :meth:`held_block_ids`); to ask about several tokens ending
        together, pass them all to :meth:`reclaimable_after`. ``{}`` when
        nothing is held. Changes nothing (queued completions are applied
        first). O(Σ over the tokens of the blocks held on what each
        ends): O(held blocks + tokens log tokens) when no host token waited
        on another.

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(8, streams={"compute": StreamKind.DEVICE, "rdma": StreamKind.HOST})
        >>> a, b = pool.get_new_blocks(2), pool.get_new_blocks(3)
        >>> sa, _ = pool.begin_store(a, "rdma"); sb, _ = pool.begin_store(b, "rdma")
        >>> pool.free_blocks(a + b)
        >>> {str(t): n for t, n in pool.held_until().items()}
        {'rdma:1': 2, 'rdma:2': 3}
        """
        self._apply_completions()
        hb = self.holdback
        if not len(hb):
            return {}
        tracker = self.tracker
        is_ended = tracker.is_ended
        return {t: hb.released_by(tracker.completion_ends(t), is_ended) for t in hb.pending_tokens()}

    def invalid_block_ids(self, token: ArgToken | None = None) -> list[int]:
        """Blocks whose content is known bad, sorted: a write into them (a
        load, a copy's destination, a step's write with ``tag(...,
        WRITE)``) failed, whether reported on time or after the token had
        ended, or a write was recorded after its token had failed; and
        nothing has written them since. These are the blocks
        :meth:`begin_store` and :meth:`begin_copy` (as a source) refuse with
        :class:`InvalidContentError` and ``cache_full_blocks`` /
        ``cache_partial_block`` do not publish: the ones an engine must
        rewrite, recompute or zero (vLLM's ``invalid_block_ids`` recovery).

        A block leaves the list when it is written again: a write begun on
        it by a token that has not ended (:meth:`begin_load`, a copy's
        destination, :meth:`tag` or a free with ``WRITE``; if that write
        fails too, the block is listed again), when an allocation hands it
        out again (its old content is gone for its new owner), or by
        :meth:`reset_prefix_cache` with every block free. A write recorded
        after its token had completed does not clear it (whether it ran
        before or after the failed write is unknown; the mark only
        withholds publication, the safe side). Free blocks are listed too
        until they are handed out.

        ``token``: only the blocks whose mark that token's failure left (a
        block failed by several writes in turn carries the latest), or the
        blocks :meth:`fail_blocks` listed for it; ``[]`` for a token that
        did neither.

        Changes nothing (queued completions are applied first, as by every
        call: a failure reported since the last call is applied and its
        blocks listed). O(m log m), m = blocks marked.

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(8, streams={"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE})
        >>> blocks = pool.get_new_blocks(2)
        >>> load, _ = pool.begin_load(blocks, "h2d")
        >>> pool.fail(load)
        >>> pool.invalid_block_ids(), pool.invalid_block_ids(load)
        ([1, 2], [1, 2])
        >>> _ = pool.begin_load(blocks[:1], "h2d")   # a new load rewrites block 1
        >>> pool.invalid_block_ids()
        [2]

        Raises:
            InvalidArgumentError: ``token`` is not a Token, or its kind is
                not its stream's.
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
        """
        self._apply_completions()
        if token is not None:
            self.tracker.validate(token)
        return self.writes.invalid_ids(token)

    def expired_leases(self) -> list[int]:
        """Held blocks whose lease expired (still quarantined), sorted.
        O(h log h), h = expired held blocks."""
        self._apply_completions()
        return self.holdback.expired_ids()

    def _all_counters(self) -> dict[str, int]:
        pc = self.prefix_cache
        return {
            **self._counters,
            "fences": self._n_fences,
            "empty_fences": self._n_empty_fences,
            "lookups": self._hits + self._misses,
            "hits": self._hits,
            "evictions": pc.evictions,
            "leases_expired": self.holdback.leases_expired,
        }

    def stats(self) -> PoolStats:
        """Counters and occupancy. O(num_gpu_blocks)."""
        self._apply_completions()
        free = self.free_block_queue.num_free_blocks
        held = len(self.holdback)
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
        the null block, none past the allocation serial; the tracker's busy
        streams and write marks agree with its tokens and every writer; the
        fill marks (blocks allocated and neither written nor published
        since, blocks announced) are this pool's data blocks, each in one
        set at most. O(num_gpu_blocks + cached keys + held + pending
        writes).

        Raises:
            InvariantError: an invariant is broken (the first one found).
        """
        free_list = self.free_block_queue.check()
        free_ids = [b.block_id for b in free_list]
        free_set = set(free_ids)
        if len(free_set) != len(free_ids):
            raise InvariantError("a block appears twice in the free queue")
        null = self.null_block
        held = self.holdback
        if 0 in free_set or null.ref_cnt != 0 or null.block_hash is not None or null in held:
            raise InvariantError("the null block is free, held, referenced or cached")
        if null.writer is not None or null.readers is not None:
            raise InvariantError("the null block has a shadow")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise InvariantError(f"block {b.block_id} has ref count {b.ref_cnt}")
            if b.block_id in free_set and b.ref_cnt != 0:
                raise InvariantError(f"free block {b.block_id} has ref count {b.ref_cnt}")
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        zero_not_free = sum(1 for b in self.blocks[1:] if b.ref_cnt == 0 and b.block_id not in free_set)
        if zero_not_free != len(held):
            raise InvariantError(
                f"{zero_not_free} unreferenced blocks are outside the free queue but {len(held)} are held"
            )
        if len(free_set) + len(held) + used != self.num_gpu_blocks - 1:
            raise InvariantError("free + held + used != total")
        self.prefix_cache._check(self.blocks)
        held._check(self.tracker, self.blocks, free_set)
        self.writes._check(self.tracker, self.blocks)
        self.load_groups._check(self.tracker)
        self.tracker._check(self._writers())
        if self._gens is not None:
            self._gens._check(self.num_gpu_blocks)
        for b in (*self._fresh, *self._announced):
            if b.is_null or self.blocks[b.block_id] is not b:
                raise InvariantError(
                    f"block {b.block_id} is marked for a fill but is not this pool's data block"
                )
        if not self._fresh.isdisjoint(self._announced):
            raise InvariantError("a block is marked both unpublished and announced")

    def _writers(self) -> Iterator[Token | None]:
        """Every writer a shadow holds or a pending write saved. O(blocks + saved groups)."""
        yield from (b.writer for b in self.blocks)
        yield from self.writes.saved_writers()

    def snapshot(self) -> PoolSnapshot:
        """A comparable picture of all observable state (tests: take one
        before a failing call, compare after). O(num_gpu_blocks)."""
        pc = self.prefix_cache
        tr = self.tracker
        return PoolSnapshot(
            ref_counts=tuple(b.ref_cnt for b in self.blocks),
            free_queue=tuple(b.block_id for b in self.free_block_queue),
            held=self.holdback.snapshot(),
            cache=tuple(
                (b.block_id, repr(k), b.block_hash_num_tokens if k == b.block_hash else None)
                for b in self.blocks
                for k in pc.keys_of(b)
            ),
            shadows=tuple(
                (b.block_id, str(b.writer), tuple(sorted(map(str, shadow_tokens(b)))))
                for b in self.blocks
                if b.writer is not None or b.readers is not None
            ),
            events=tuple(self.kv_event_queue),
            marks=tuple(
                (n, s.last_seq, s.mark, s.last_write, tuple(s.done)) for n, s in sorted(tr.streams.items())
            ),
            clocks=tuple(
                (n, tuple(sorted(s.clock.dev.items())), tuple(sorted(map(str, s.clock.host))))
                for n, s in sorted(tr.streams.items())
            ),
            counters=tuple(sorted(self._all_counters().items())) + (("invalid", self.writes.num_invalid()),),
        )
