"""Streams, tokens and completions of the pool: issue, complete, fail,
abandon, and what applying a completion does (held blocks released, failed
writes undone, leases checked)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

from blockpool._base import (
    _HOST,
    PoolBase,
    _with_read,
    logger,
)
from blockpool.block import KVCacheBlock
from blockpool.errors import (
    LeaseExpiredWarning,
)
from blockpool.hazards import StreamKind, Token
from blockpool.tracker import StreamState

__all__ = ["TokenOps"]


class TokenOps(PoolBase):
    """Token issue and completion handling of the pool."""

    # ------------------------------------------------------------------
    # streams, tokens, completions
    # ------------------------------------------------------------------

    def add_stream(self, name: str, kind: StreamKind = StreamKind.DEVICE) -> None:
        """Register a stream (idempotent for the same kind). O(1).

        Raises:
            InvalidArgumentError: empty name, bad kind, or the name is already
                registered with another kind.
        """
        self.tracker.add_stream(name, kind)

    @property
    def streams(self) -> dict[str, StreamKind]:
        """Registered streams and their kinds."""
        return {n: s.kind for n, s in self.tracker.streams.items()}

    def issue(self, stream: str) -> Token:
        """Issue the next token of ``stream`` (e.g. step N's "forward done"
        on ``compute``). The token is ordered after everything the stream has
        waited on so far. O(#streams).

        Raises:
            UnknownStreamError: ``stream`` was never registered.
        """
        if self._inbox or self._leases_on:
            self._apply_completions()
        return self.tracker.issue(stream)

    def last_token(self, stream: str) -> Token | None:
        """The newest token issued on ``stream`` (``None`` before the first).
        With async scheduling, this is what a free must be tagged with: step
        N+1 may already be enqueued when step N's output frees a request.
        O(1).

        Raises:
            UnknownStreamError: ``stream`` is not registered.
        """
        st = self.tracker.state(stream)
        return Token(st.name, st.last_seq, st.kind, self.pool_id) if st.last_seq else None

    def complete(self, token: Token) -> None:
        """The work up to ``token`` finished. Callable from any thread; applied
        at the start of the pool's next call (or :meth:`poll`). For a
        ``DEVICE`` stream this ends every earlier token too; for a ``HOST``
        engine only ``token``. Idempotent. O(1) here; applying it releases
        the blocks held on it.

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self.tracker.submit(token, False)

    def fail(self, token: Token) -> None:
        """The work of ``token`` ended without doing its job (a failed
        transfer or step). Like :meth:`complete`, except that it ends only
        ``token`` (and, on a ``DEVICE`` stream, the tokens before it), not
        what ``token`` waited for: it may have failed before its waits. Every
        write ``token`` made, however it was recorded (:meth:`tag`,
        :meth:`free_blocks` with ``WRITE``, :meth:`begin_load`,
        :meth:`begin_copy`), is undone: the accesses it replaced are put
        back in the blocks' shadows (a free block whose restored access is a
        pending host-engine one is held again), and the blocks lose their
        prefix-cache keys (removed events) and are never published until
        rewritten. A failure reported after ``token`` already ended
        (through another token's completion) still withdraws the keys of
        the blocks it was the last write of. O(1) here; applying it is
        O(blocks it wrote), or O(num_gpu_blocks) for a late report.

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self.tracker.submit(token, True)

    def abandon(self, token: Token) -> list[int]:
        """The operator's or connector's word that the engine behind ``token``
        stopped: the token is ended as failed now, and the blocks held on it
        are released. Returns the block ids released. O(blocks held on it).

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self._apply_completions()
        self.tracker.validate(token)
        before = set(self._held)
        ended = self.tracker.end(token, True)
        if ended:
            self._counters["abandoned"] += 1
        self._on_ended(token, True, ended)
        return sorted(before - set(self._held))

    def poll(self) -> None:
        """Apply queued completions and check leases now. O(completions)."""
        self._apply_completions()

    def is_ended(self, token: Token) -> bool:
        """Whether ``token`` is known to have ended (completed or failed).
        Applies queued completions first. O(1) after them.

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self._apply_completions()
        self.tracker.validate(token)
        return self.tracker.is_ended(token)

    def _apply_completions(self) -> None:
        """Apply the completions and failures queued by ``complete``/``fail``
        (any thread) and check expired leases: ended tokens release their
        held blocks, failed writes are undone. Never blocks (not a "sync":
        that word is kept for blocking waits). O(queued + newly ended +
        blocks released)."""
        tracker = self.tracker
        if tracker._inbox:
            for token, failed, ended in tracker.drain():
                if failed and not ended:
                    self._late_failure(token)
                else:
                    self._on_ended(token, failed, ended)
        if self._leases:
            self._check_leases()

    def _on_ended(
        self, token: Token, failed: bool, ended: list[tuple[StreamState, list[int]]]
    ) -> None:
        for st, seqs in ended:
            writes = self._writes.get(st.name)
            if writes:
                for seq in seqs:
                    before = writes.pop(seq, None)
                    if before is not None and failed and seq == token.seq and st.name == token.stream:
                        self._undo_failed_write(token, before)
            if st.kind is _HOST and self._held_by:
                for seq in seqs:
                    self._release_held(Token(st.name, seq, _HOST))

    def _release_held(self, token: Token) -> None:
        # Blocks held together share one pending set (see _enqueue_free), so
        # the set is usually the same object block after block: discard once.
        held = self._held
        leases = self._leases_on
        release: list[KVCacheBlock] = []
        last = None
        for b in self._held_by.pop(token, ()):
            pending = held.get(b.block_id)
            if pending is None:
                continue  # released already (a touch took it)
            if pending is not last:
                last = pending
                pending.discard(token)
            if not pending:
                if leases:
                    self._unhold(b.block_id)
                else:
                    del held[b.block_id]
                release.append(b)
        if release:
            self._enqueue_free(release)

    def _late_failure(self, token: Token) -> None:
        """``token`` failed after it had already ended (through another
        token's completion, or a later token of its in-order stream): the
        accesses it replaced had ended, but its content was never written.
        Every block whose write in effect is still ``token``'s loses its keys
        and is not published until rewritten. O(num_gpu_blocks); failures
        are rare."""
        stream, seq = token.stream, token.seq
        invalid = self._invalid
        for b in self.blocks:
            w = b.writer
            if w is not None and w.seq == seq and w.stream == stream:
                invalid.add(b.block_id)
                self._drop_keys(b)

    def _undo_failed_write(
        self, token: Token, before: list[tuple[KVCacheBlock, Token | None, Token | tuple[Token, ...] | None]]
    ) -> None:
        """A write (tag, free with WRITE, load, copy) failed: it may have
        failed before its own waits, so
        the accesses it replaced in each block's shadow may still run; put
        them back (with the reads recorded since), mark the content invalid
        and withdraw the blocks' keys."""
        ended = self.tracker.is_ended

        def merge(base: object, extra: object) -> object:
            for t in () if extra is None else ((extra,) if type(extra) is Token else extra):  # type: ignore[attr-defined]
                base = _with_read(base, t, ended)  # type: ignore[arg-type]
            return base

        for b, writer, readers in before:
            w = b.writer
            if w is None or w.stream != token.stream or w.seq != token.seq:
                # Rewritten since: the newer write saved this failed one as
                # what it replaced; hand it what the failed write replaced.
                self._resave_replaced(b, token, writer, readers, merge)
                continue
            b.writer = writer
            b.readers = merge(readers, b.readers)  # type: ignore[assignment]
            self._invalid.add(b.block_id)
            self._drop_keys(b)
            if b.ref_cnt == 0 and b.prev_free_block is not None:
                # Free again, but the restored accesses may need a hold.
                self.free_block_queue.remove(b)
                self._enqueue_free([b])

    def _resave_replaced(
        self,
        b: KVCacheBlock,
        failed: Token,
        writer: Token | None,
        readers: Token | tuple[Token, ...] | None,
        merge: Callable[[object, object], object],
    ) -> None:
        """In the saved shadow of every later pending write of ``b`` that
        replaced the failed write ``failed``, put back what ``failed`` had
        replaced. O(pending writes); failures are rare."""
        for per_stream in self._writes.values():
            for entries in per_stream.values():
                for i, (blk, w, r) in enumerate(entries):
                    if blk is b and w is not None and w.stream == failed.stream and w.seq == failed.seq:
                        entries[i] = (blk, writer, merge(readers, r))  # type: ignore[assignment]

    def _check_leases(self) -> None:
        now = self._clock()
        leases = self._leases
        expired: list[int] = []
        while leases and leases[0][0] <= now:
            deadline, bid = leases.pop(0)
            if self._deadline.get(bid) == deadline and bid not in self._expired:
                self._expired.add(bid)
                expired.append(bid)
        if expired:
            self._counters["leases_expired"] += len(expired)
            tokens = sorted({str(t) for bid in expired for t in self._held[bid]})
            msg = (
                f"lease expired for held blocks {expired}: host transfers {tokens} "
                "have not ended; the blocks stay quarantined until abandon()"
            )
            logger.warning(msg)
            warnings.warn(msg, LeaseExpiredWarning, stacklevel=3)
