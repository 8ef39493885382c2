"""Fences and accesses: computing the fence of an access from the blocks'
shadows, recording accesses, and the ``begin_*`` calls."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from blockpool._base import (
    _DEVICE,
    _HOST,
    _READ,
    _UNSET,
    _WRITE,
    PoolBase,
    _as_list,
    _with_read,
)
from blockpool.block import KVCacheBlock
from blockpool.errors import (
    InvalidArgumentError,
    NullBlockError,
)
from blockpool.hazards import EMPTY_FENCE, AccessKind, Fence, FenceReason, Token
from blockpool.tracker import StreamState

__all__ = ["FenceOps"]


class FenceOps(PoolBase):
    """Fence computation and access recording of the pool."""

    # ------------------------------------------------------------------
    # hazards: fences and accesses
    # ------------------------------------------------------------------

    def fence_for(
        self,
        blocks: Iterable[KVCacheBlock],
        stream: str,
        access: AccessKind = AccessKind.WRITE,
    ) -> Fence:
        """The fence for an ``access`` by ``stream`` to ``blocks`` beginning
        now, and record that ``stream`` waits on it. A write waits for each
        block's writer and readers (WAW, WAR), a read for the writer (RAW);
        minus ended tokens, tokens on ``stream`` itself when it is a device
        stream, tokens ``stream`` is already ordered after, and tokens covered
        by another token of the fence. Null blocks are skipped.
        O(len(blocks) + k^2), k = distinct streams/host tokens found.

        Raises:
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``access`` is not an AccessKind.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        st = self.tracker.state(stream)
        access = self._check_access(access)
        block_list = self._own_all(blocks)
        if not self.track_hazards:
            return EMPTY_FENCE
        return self._fence(((block_list, access),), st)

    def _fence(
        self,
        groups: Iterable[tuple[Sequence[KVCacheBlock], AccessKind]],
        st: StreamState,
    ) -> Fence:
        # Candidates: newest token per device stream, each host token apart
        # (keyed by (stream, seq): Token's own hash is a Python function).
        # Blocks allocated together were mostly freed together and share
        # their shadow objects, so a writer or readers object identical to
        # the previous block's adds nothing and is skipped: per block, the
        # scan is two attribute reads and two identity tests.
        # Tokens on the consumer itself, when it is an in-order device
        # stream, are never waited on (HazardTracker.reduce drops them
        # first); the scan skips them before they become candidates.
        cand: dict[object, Token] = {}
        why: dict[Token, FenceReason] | None = {} if self.debug else None
        get = cand.get
        own = st.name if st.kind is _DEVICE else None
        lw: object = _UNSET
        lr: object = _UNSET
        for blocks, access in groups:
            write = access is _WRITE
            for b in blocks:
                w = b.writer
                if w is not None and w is not lw:
                    lw = w
                    if w.stream != own:
                        k: object = w.stream if w.kind is not _HOST else (w.stream, w.seq)
                        cur = get(k)
                        if cur is None or cur.seq < w.seq:
                            cand[k] = w
                            if why is not None:
                                why[w] = FenceReason(w, b.block_id, "writer", access)
                if write:
                    r = b.readers
                    if r is not None and r is not lr:
                        lr = r
                        for t in (r,) if type(r) is Token else r:  # type: ignore[union-attr]
                            if t.stream == own:
                                continue
                            k = t.stream if t.kind is not _HOST else (t.stream, t.seq)
                            cur = get(k)
                            if cur is None or cur.seq < t.seq:
                                cand[k] = t
                                if why is not None:
                                    why[t] = FenceReason(t, b.block_id, "reader", access)
        c = self._counters
        c["fences"] += 1
        if not cand:
            c["empty_fences"] += 1
            return EMPTY_FENCE
        tokens = self.tracker.reduce(cand.values(), st)
        if not tokens:
            c["empty_fences"] += 1
            return EMPTY_FENCE
        self.tracker.wait(st, tokens)
        host_wait = st.kind is _HOST or any(t.kind is _HOST for t in tokens)
        c["fence_tokens"] += len(tokens)
        if len(tokens) > c["max_fence_size"]:
            c["max_fence_size"] = len(tokens)
        if host_wait:
            c["host_wait_fences"] += 1
        reasons: tuple[FenceReason, ...] = ()
        if why is not None:
            tokens.sort(key=lambda t: (t.stream, t.seq))
            reasons = tuple(why[t] for t in tokens)
        return Fence(tokens, host_wait, reasons)

    def _record(self, blocks: Iterable[KVCacheBlock], token: Token, access: AccessKind) -> None:
        """Write ``token`` into the shadows of ``blocks`` (nulls skipped).

        A write replaces the shadow. A read joins the readers
        (:func:`_with_read`); readers values are immutable and shared, so the
        new value is computed once per distinct old value and assigned to
        every block that had it: one identity test and one store per block."""
        null = self.null_block
        if access is _WRITE:
            # Save what the write replaces, whatever records it (tag, a
            # free with WRITE, begin_load, begin_copy): a failed write may
            # have failed before its waits, so its fail() puts this back
            # (TokenOps._undo_failed_write). Dropped when the token ends.
            per_stream = self._writes.get(token.stream)
            if per_stream is None:
                per_stream = self._writes[token.stream] = {}
            saved = per_stream.get(token.seq)
            if saved is None:
                saved = per_stream[token.seq] = []
            seq = token.seq
            stream = token.stream
            for b in blocks:
                w = b.writer
                if b is not null and (w is None or w.seq != seq or w.stream != stream):
                    saved.append((b, w, b.readers))
                b.writer = token
                b.readers = None
            null.writer = null.readers = None  # the null block never has a shadow
            invalid = self._invalid
            if invalid:
                for b in blocks:
                    invalid.discard(b.block_id)
            return
        ended = self.tracker.is_ended
        last_in: object = _UNSET
        last_out: Token | tuple[Token, ...] | None = None
        for b in blocks:
            r = b.readers
            if r is not last_in:
                last_in = r
                last_out = _with_read(r, token, ended)
            b.readers = last_out
        null.readers = None

    def tag(self, blocks: Iterable[KVCacheBlock], token: Token, access: AccessKind) -> None:
        """Record that ``token``'s work accesses ``blocks`` (e.g. step N's
        forward writes the blocks receiving new tokens). The caller ordered
        that work after the blocks' fences (:meth:`fence_for` /
        :meth:`allocate_for`). A write replaces the shadow (what it replaced
        is kept until ``token`` ends: if ``token`` fails, it is restored and
        the blocks lose their keys, see :meth:`fail`); a read joins it.
        Keys are kept (the scheduler publishes a block's key for the content
        its step writes). Null blocks are skipped. O(len(blocks)).

        Raises:
            ForeignBlockError, UnknownStreamError, UnknownTokenError, ForeignTokenError,
            InvalidArgumentError: as the names say; nothing changes.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        self.tracker.validate(token)
        access = self._check_access(access)
        block_list = self._own_all(blocks)
        if self.track_hazards and not self.tracker.is_ended(token):
            self._record(block_list, token, access)
        elif access is _WRITE:
            if self.tracker.has_failed(token):
                self._unwritten(block_list)  # the write never happened
            elif self._invalid:
                for b in block_list:
                    self._invalid.discard(b.block_id)

    def _unwritten(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A write recorded after its token had failed: it never happened,
        so the blocks' content is not what their keys name: withdraw the
        keys and mark the content invalid (no shadow changes). O(len(blocks))."""
        null = self.null_block
        for b in blocks:
            if b is not null:
                self._invalid.add(b.block_id)
                self._drop_keys(b)

    def _begin(
        self,
        groups: tuple[tuple[list[KVCacheBlock], AccessKind], ...],
        stream: str,
        st: StreamState,
        withdraw_keys: bool = False,
    ) -> tuple[Token, Fence]:
        fence = self._fence(groups, st) if self.track_hazards else EMPTY_FENCE
        token = self.tracker.issue(stream, fence.tokens)
        if withdraw_keys:
            # A load writes new content: the destinations' keys named the
            # content they held before, so they are withdrawn (removed events).
            for blocks, access in groups:
                if access is _WRITE:
                    for b in blocks:
                        if b.block_hash is not None:
                            self._drop_keys(b, "replaced")
        if self.track_hazards:
            for blocks, access in groups:
                self._record(blocks, token, access)
        return token, fence

    def begin_copy(
        self,
        pairs: Iterable[tuple[KVCacheBlock, KVCacheBlock]],
        stream: str = "compute",
        generations: Iterable[tuple[int, int]] | None = None,
    ) -> tuple[Token, Fence]:
        """Begin copy-on-write / block copies ``(src, dst)`` on ``stream``:
        returns the copy's token (a read of every ``src``, a write of every
        ``dst``) and the fence the copy waits on. Keys a ``dst`` is
        published under are kept: as for a step's write, the scheduler
        publishes a copy-on-write destination for the content the copy
        writes (vLLM caches the private copy of a partial hit under the
        prefix it copies). If the copy fails, the destinations' replaced
        accesses are restored and their keys withdrawn (not published until
        rewritten). ``generations``: one ``(src, dst)`` pair of
        generations per pair (from :meth:`generations` of the tables the
        blocks come from); a block allocated again since is refused.
        O(len(pairs)).

        Raises:
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a block of another pool.
            NullBlockError: the null block as a source or destination.
            StaleBlockError: with ``generations``, a block was freed and
                allocated again since they were taken.
            BlockNotAllocatedError: a block with ref count 0.
            InvalidArgumentError: a pair is not a 2-tuple, or
                ``generations`` is not one pair of ints per pair.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        st = self.tracker.state(stream)
        srcs: list[KVCacheBlock] = []
        dsts: list[KVCacheBlock] = []
        for pair in pairs:
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"a copy is a (src, dst) pair, got {pair!r}") from None
            for b in (src, dst):
                self._own(b)
                if b.is_null:
                    raise NullBlockError("the null block cannot be copied from or into")
            srcs.append(src)
            dsts.append(dst)
        if generations is not None:
            src_gens: list[object] = []
            dst_gens: list[object] = []
            for pair in _as_list(generations, "generations"):
                try:
                    g_src, g_dst = pair
                except (TypeError, ValueError):
                    raise InvalidArgumentError(
                        f"copy: generations are (src, dst) pairs, got {pair!r}"
                    ) from None
                src_gens.append(g_src)
                dst_gens.append(g_dst)
            self._check_fresh(srcs + dsts, src_gens + dst_gens, "copy")
        self._data_blocks(srcs + dsts, "copy")
        return self._begin(((srcs, _READ), (dsts, _WRITE)), stream, st)

    def _begin_transfer(
        self, blocks: Iterable[KVCacheBlock], stream: str, access: AccessKind, what: str
    ) -> tuple[Token, Fence]:
        if self._inbox or self._leases_on:
            self._apply_completions()
        st = self.tracker.state(stream)
        return self._begin(((self._data_blocks(blocks, what), access),), stream, st, access is _WRITE)

    def _begin_fresh_transfer(
        self, blocks: Iterable[KVCacheBlock], stream: str, access: AccessKind, what: str, generations: Iterable[int]
    ) -> tuple[Token, Fence]:
        """:meth:`_begin_transfer` of a table checked against its
        ``generations`` first (the fast path stays as it was)."""
        if self._inbox or self._leases_on:
            self._apply_completions()
        st = self.tracker.state(stream)
        block_list = self._own_all(blocks)
        self._check_fresh(block_list, generations, what)
        return self._begin(((self._data_blocks(block_list, what), access),), stream, st, access is _WRITE)

    def begin_load(
        self, blocks: Iterable[KVCacheBlock], stream: str, generations: Iterable[int] | None = None
    ) -> tuple[Token, Fence]:
        """Begin a load (external tier -> GPU) into ``blocks`` on ``stream``
        (a DMA stream or a host engine): returns the load's token (the new
        writer of every block) and the fence it waits on (WAR on the last
        readers, WAW on the last writer). The load replaces the blocks'
        content, so keys they are published under are withdrawn now
        (``BlockRemoved`` events; publish the loaded keys after this call).
        If the load fails, the accesses it replaced are restored and the
        blocks are not published until rewritten. Null placeholders are
        skipped. ``generations`` (aligned with ``blocks``, from
        :meth:`generations` when the table was built): refuse the table if
        one of its blocks was freed and allocated again since (it would
        overwrite another request's data). O(len(blocks) + keys withdrawn).

        Raises:
            UnknownStreamError, ForeignBlockError, BlockNotAllocatedError.
            StaleBlockError: with ``generations``, a block of the table was
                allocated again since they were taken; nothing changes.
            InvalidArgumentError: ``generations`` is not one int per block.
        """
        if generations is None:
            return self._begin_transfer(blocks, stream, _WRITE, "load")
        return self._begin_fresh_transfer(blocks, stream, _WRITE, "load", generations)

    def begin_store(
        self, blocks: Iterable[KVCacheBlock], stream: str, generations: Iterable[int] | None = None
    ) -> tuple[Token, Fence]:
        """Begin a store / offload (GPU -> external tier) from ``blocks`` on
        ``stream``: returns the store's token (a reader of every block; a
        later write waits on it, WAR) and the fence it waits on (RAW on the
        last writer). Null placeholders are skipped. ``generations``
        (aligned with ``blocks``, from :meth:`generations` when the table
        was built): refuse the table if one of its blocks was freed and
        allocated again since (the store would file another request's data
        under this table's keys). O(len(blocks)).

        Raises:
            UnknownStreamError, ForeignBlockError, BlockNotAllocatedError.
            StaleBlockError: with ``generations``, a block of the table was
                allocated again since they were taken; nothing changes.
            InvalidArgumentError: ``generations`` is not one int per block.
        """
        if generations is None:
            return self._begin_transfer(blocks, stream, _READ, "store")
        return self._begin_fresh_transfer(blocks, stream, _READ, "store", generations)
