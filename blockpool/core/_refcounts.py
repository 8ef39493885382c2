"""Ref counts of the pool: taking free blocks, prefix hits and pins
(``touch``), and frees. The only module that writes ``ref_cnt``."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from blockpool.core._base import _HOST, _READ, _WRITE, _as_list
from blockpool.core._mypyc import mypyc_attr
from blockpool.core._tokens import TokenOps
from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvalidArgumentError, RefCountError
from blockpool.core.hazards import LAST_STEP, AccessKind, FreeTag
from blockpool.core.shadows import _UNSET, Readers, with_read

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgAccess, ArgBool, ArgToken

__all__ = ["RefCountOps"]


@mypyc_attr(allow_interpreted_subclasses=True)
class RefCountOps(TokenOps):
    """Taking blocks off the free queue (ref count 1), touching them (+1)
    and freeing them (-1; at 0 they go back to the free queue or are held
    back)."""

    def _take(self, n: int, keys_out: list[Hashable] | None = None) -> list[KVCacheBlock]:
        """Pop ``n`` free blocks from the queue's front and :meth:`_claim`
        them (``keys_out``: as there). O(n)."""
        return self._claim(self.free_block_queue.popleft_n(n), keys_out)

    def _claim(
        self, blocks: list[KVCacheBlock], keys_out: list[Hashable] | None = None
    ) -> list[KVCacheBlock]:
        """Blocks just taken off the free queue: evict their keys (removed
        events, or with ``keys_out`` and events on, the removed keys
        appended there and no event), give each ref count 1, forget the old
        content's marks. Returns ``blocks``. One pass over the blocks, and
        one over those that held a key. O(len(blocks))."""
        keyed: list[KVCacheBlock] = []
        for x in blocks:
            b: KVCacheBlock = x  # typed: native reads in the compiled build
            b.ref_cnt = 1
            if b.block_hash is not None:
                keyed.append(b)
        pc = self.prefix_cache
        if keyed:
            report = self.enable_kv_cache_events
            if keys_out is not None and report:
                pc.evict_for_reuse(keyed, True, keys_out)
            else:
                dropped = pc.evict_for_reuse(keyed, report)
                if dropped:
                    writes = self.writes
                    if writes.has_invalid():  # a failed load's keys: their own reason
                        for b, keys in dropped:
                            self._removed(keys, "load_failed" if writes.is_invalid(b.block_id) else "evicted")
                    else:  # the same events, queued in one call
                        self._removed([k for _, keys in dropped for k in keys], "evicted")
        pc.forget_marks(blocks)
        self.writes.rewritten(blocks)
        if self._track_fills:  # new content: unwritten, unpublished (a fill's target once published)
            if self._announced:
                self._announced.difference_update(blocks)
            self._fresh.update(blocks)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix hit or pin); a block with ref
        count 0 leaves the free queue (or the held set). The null block is
        skipped. O(len(blocks)).

        Raises:
            ForeignBlockError: a block is not of this pool (nothing changes).
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        self._touch(self._own_all(blocks))

    def _touch(self, blocks: list[KVCacheBlock]) -> None:
        q = self.free_block_queue
        if self._policy:
            q.on_hit(blocks)
        null = self.null_block
        zero: list[KVCacheBlock] = []
        for b in blocks:
            if b is null:
                continue
            if b.ref_cnt == 0:
                zero.append(b)
            b.ref_cnt += 1
        if zero:
            held = q.remove_n(zero)
            if held:
                self.holdback.unhold_n(held)

    def free_blocks(
        self,
        ordered_blocks: Iterable[KVCacheBlock],
        token: ArgToken | FreeTag | None = LAST_STEP,
        access: ArgAccess = AccessKind.READ,
        *,
        to_tail: ArgBool = False,
        evict_first: ArgBool = False,
    ) -> None:
        """Drop one reference per listed block, in eviction order (first =
        evicted first). A block reaching ref count 0 goes to the front of the
        free queue if it has no key (reused first) or caching is off, to the
        back if cached (LRU), or into the held set while a host-engine access
        on it has not ended. Null blocks are skipped. A block may repeat as
        often as it is referenced. O(len(ordered_blocks)).

        ``token``: the last enqueued access to the blocks, recorded as an
        ``access`` in their shadows, so the next user of the blocks waits for
        it. Safe by default: the default, :data:`~blockpool.core.hazards.LAST_STEP`,
        is the newest token issued on the pool's ``compute`` stream (the last
        enqueued step, as the hazard model asks), or nothing when no token
        was issued there, no ``compute`` stream is registered, or hazards are
        off. Pass the token explicitly to tag another access, or
        ``token=None`` to record none (opt-out: the caller knows nothing in
        flight touches the blocks). A ``WRITE`` is undone if ``token`` fails,
        as for :meth:`tag`. ``to_tail``: blocks that become free go to the
        back of the free queue whatever their keys (reused last; vLLM's
        ``unpin_blocks``); blocks held back go as usual once released.
        ``evict_first``: blocks that become free go to the front of the
        free queue whatever their keys, in the listed order (evicted before
        every other cached block; vLLM 0.34's ``free_blocks(...,
        evict_first=True)``, for blocks whose content another tier already
        holds); they keep their keys until reused; a block held back for a
        host-engine access goes to the front when its hold ends. Ignored
        with ``to_tail``. Both flags are read by their truth.

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(4)
        >>> blocks = pool.get_new_blocks(3)
        >>> pool.free_blocks(blocks[::-1])        # last block first: evicted first
        >>> [b.block_id for b in pool.free_block_queue]
        [3, 2, 1]

        Raises:
            ForeignBlockError: a block of another pool.
            RefCountError: a ref count would go below zero (whole call rejected).
            UnknownStreamError, UnknownTokenError: a token the pool never issued.
            ForeignTokenError: a token issued by another pool.
            InvalidArgumentError: ``access`` is not an :class:`AccessKind`,
                ``blocks`` is not iterable, or a ``WRITE`` is recorded after
                an access ordered after ``token`` (as for :meth:`tag`).
        """
        if to_tail is not False or evict_first is not False:
            # Any truthy value counts, as in vLLM; the compiled build's
            # placement takes bools, so they are made bools before any change.
            to_tail, evict_first = bool(to_tail), bool(evict_first)
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        blocks = (
            ordered_blocks
            if isinstance(ordered_blocks, (list, tuple))
            else _as_list(ordered_blocks, "blocks")
        )
        record = False
        if access is not _READ and access is not _WRITE:
            self._check_access(access)
        if token is LAST_STEP:
            st = self.tracker.streams.get("compute") if self.track_hazards else None
            token = st.last_token if st is not None else None
        if token is not None:
            st = self.tracker.validate(token)
            # Record the access unless the token has ended (tracker.is_ended, inline).
            record = self.track_hazards and not (
                token.seq <= st.mark or (st.kind is _HOST and token.seq in st.done)
            )
        own = self.blocks
        null = self.null_block
        cls = self._block_cls
        # Blocks reaching ref count 0, placed in the same pass when nothing
        # can be held back (no host-engine token pending: a host token that
        # tags them here is pending already) and the placement is the
        # default one: unkeyed to ``zero`` (the queue's front), keyed to
        # ``last`` (its back). Otherwise ``last`` is ``zero`` and
        # :meth:`_enqueue_free` places them.
        zero: list[KVCacheBlock] = []
        last = zero
        placed = not (to_tail or evict_first or not self.enable_caching) and not (
            self.track_hazards and self.tracker.host_pending()
        )
        if placed:
            last = []
        # A read is recorded in the same pass (shadows.tag, inline): the new
        # readers are computed once per run of blocks sharing their readers
        # object, and each run's start and old readers are kept (``runs``)
        # so that a refused call puts every shadow back.
        reading = record and access is _READ
        ended = self.tracker.is_ended
        runs: list[tuple[int, Readers]] = []
        last_in: object = _UNSET
        last_out: Readers = None
        i = 0
        try:
            for i, x in enumerate(blocks):
                b: KVCacheBlock = x  # typed: native reads in the compiled build (a TypeError otherwise)
                if type(b) is not cls and own[b.block_id] is not b:
                    self._own(b)
                if b is null:
                    continue
                rc = b.ref_cnt - 1
                if rc < 0:
                    n = sum(1 for x in blocks if x is b)
                    raise RefCountError(
                        f"free_blocks would take block {b.block_id}'s ref count below zero "
                        f"(listed {'once' if n == 1 else f'{n} times'})"
                    )
                if reading:
                    r = b.readers
                    if r is not last_in:
                        last_out = with_read(r, token, ended)  # type: ignore[arg-type]
                        last_in = r
                        runs.append((i, r))
                    b.readers = last_out
                b.ref_cnt = rc
                if rc == 0:
                    if b.block_hash is None:
                        zero.append(b)
                    else:
                        last.append(b)
        except Exception as exc:
            for b in blocks[:i]:
                if b is not null:
                    b.ref_cnt += 1
            end = i
            for start, old in reversed(runs):  # newest first: a block listed twice gets its first value
                for b in blocks[start:end]:
                    if b is not null:
                        b.readers = old
                end = start
            if isinstance(exc, (IndexError, AttributeError, TypeError)):
                self._own(blocks[i])  # raises the typed error
            raise
        if record and access is _WRITE:
            try:
                self._check_write_order(blocks, token)  # type: ignore[arg-type]
            except InvalidArgumentError:
                for b in blocks:  # every block was counted down: count them up again
                    if b is not null:
                        b.ref_cnt += 1
                raise
        if record:
            if not reading:
                self._tag(blocks, token, access)  # type: ignore[arg-type]
        elif access is _WRITE and token is not None:
            self._ended_write(blocks, token)  # type: ignore[arg-type]
        if placed:
            q = self.free_block_queue
            if zero:
                q.prepend_n(zero)
            if last:
                q.append_n(last)
        elif zero:
            self._enqueue_free(zero, to_tail, evict_first)
