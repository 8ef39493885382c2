"""Streams, tokens and completions of the pool: issue, complete, fail,
abandon. What applying a completion does (held blocks released, failed
writes undone, leases checked) is :meth:`PoolBase._apply_completions`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from blockpool.core._fences import FenceOps
from blockpool.core._mypyc import mypyc_attr
from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvalidArgumentError
from blockpool.core.hazards import StreamKind, Token, TokenStatus

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgStr, ArgStreamKind, ArgToken

__all__ = ["TokenOps"]


@mypyc_attr(allow_interpreted_subclasses=True)
class TokenOps(FenceOps):
    """Token issue and completion handling of the pool."""

    # ------------------------------------------------------------------
    # streams, tokens, completions
    # ------------------------------------------------------------------

    def add_stream(self, name: ArgStr, kind: ArgStreamKind = StreamKind.DEVICE) -> None:
        """Register a stream (idempotent for the same kind). O(1).

        The fill rule (:meth:`begin_load`) tracks blocks from the second
        stream on: blocks allocated while the pool had one stream are not
        fill targets (a load into them while shared is refused), so add the
        streams transfers run on before allocating.

        Raises:
            InvalidArgumentError: empty name, bad kind, or the name is already
                registered with another kind.
        """
        self._apply_completions()
        self.tracker.add_stream(name, kind)
        self._track_fills = self.enable_caching and len(self.tracker.streams) > 1

    @property
    def streams(self) -> dict[str, StreamKind]:
        """Registered streams and their kinds."""
        return {n: s.kind for n, s in self.tracker.streams.items()}

    def issue(self, stream: ArgStr) -> Token:
        """Issue the next token of ``stream`` (e.g. step N's "forward done"
        on ``compute``). The token is ordered after everything the stream has
        waited on so far. O(#streams).

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(4)
        >>> [str(pool.issue("compute")) for _ in range(2)]
        ['compute:1', 'compute:2']

        Raises:
            UnknownStreamError: ``stream`` was never registered.
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        return self.tracker.issue(stream)

    def last_token(self, stream: ArgStr) -> Token | None:
        """The newest token issued on ``stream`` (``None`` before the first).
        With async scheduling, this is what a free must be tagged with: step
        N+1 may already be enqueued when step N's output frees a request.
        O(1).

        Raises:
            UnknownStreamError: ``stream`` is not registered.
        """
        if self._due:  # hot call (every free): _apply_completions' own test, hoisted
            self._apply_completions()
        return self.tracker.state(stream).last_token

    def complete(self, token: ArgToken) -> None:
        """The work up to ``token`` finished. Callable from any thread; applied
        at the start of the pool's next call (or :meth:`poll`). For a
        ``DEVICE`` stream this ends every earlier token too; for a ``HOST``
        engine only ``token``. Idempotent. O(1) here; applying it releases
        the blocks held on it.

        >>> from blockpool import HazardAwareBlockPool
        >>> pool = HazardAwareBlockPool(4)
        >>> t = pool.issue("compute")
        >>> pool.complete(t); pool.is_ended(t)
        True

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self.tracker.submit(token, False)

    def fail(self, token: ArgToken) -> None:
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

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE})
        >>> blocks = pool.get_new_blocks(1)
        >>> token, _ = pool.begin_load(blocks, "h2d")
        >>> pool.cache_full_blocks(blocks, ["h0"], 0, 1, 16)   # published on begin (a DMA load)
        >>> pool.fail(token)                       # the load's write is undone, its key withdrawn
        >>> pool.get_cached_block("h0"), pool.stats().failed_tokens
        (None, 1)

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self.tracker.submit(token, True)

    def fail_blocks(self, token: ArgToken, blocks: Iterable[KVCacheBlock]) -> None:
        """The load or copy ``token`` ended having written only some of its
        destinations: ``blocks`` (some of them) hold no valid content, its
        other destinations hold what it wrote. For ordering ``token``
        counts as completed (its work ran, so its waits had happened: what
        it waited on ends, the blocks held on it are released,
        :meth:`token_status` is ``COMPLETED``, a fence naming it is
        passed). Each listed block is left as a failed load leaves it:
        marked invalid by ``token`` (:meth:`invalid_block_ids` with
        ``token`` lists exactly them), its prefix-cache keys withdrawn
        (removed events, reason ``load_failed``), not published, stored
        or copied from until written again; a listed block already written
        again by a later write recorded after ``token``'s keeps that
        write's content and keys. The other destinations keep their keys
        and are published as on completion. Loads linked with ``token``
        (:meth:`link_loads`) are not touched: this is not a failure of the
        part, only of those blocks. A failure reported for ``token`` later
        (:meth:`fail`) is a late failure. Null blocks are skipped; an
        empty ``blocks`` is :meth:`complete`, applied now.
        O(len(blocks) + destinations + keys withdrawn + blocks released).

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(8, streams={"rdma": StreamKind.HOST})
        >>> blocks = pool.get_new_blocks(4)
        >>> get, _ = pool.begin_load(blocks, "rdma")
        >>> pool.cache_full_blocks(blocks, ["k0", "k1", "k2", "k3"], 0, 4, 16)
        >>> pool.fail_blocks(get, blocks[3:])       # the last block did not arrive
        >>> pool.invalid_block_ids(get), pool.get_cached_block("k3"), pool.token_status(get).value
        ([4], None, 'completed')
        >>> pool.get_cached_block("k2") is blocks[2]  # the valid prefix stays
        True

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is
                not its stream's, or it is not a load or copy in flight
                (:meth:`begin_load`, :meth:`begin_copy`; not ended); or
                ``blocks`` is not iterable, or names a block that is not
                one of ``token``'s destinations. Nothing changes.
            ForeignBlockError: a block of another pool; nothing changes.
        """
        self._apply_completions()
        tracker = self.tracker
        tracker.validate(token)
        block_list = self._own_all(blocks)
        dests = None if tracker.is_ended(token) else self.writes.destinations(token)
        if dests is None:
            raise InvalidArgumentError(
                f"fail_blocks: {token} is not a load or copy in flight (begin_load / begin_copy, not ended)"
            )
        null = self.null_block
        bad = [b for b in block_list if b is not null]
        if bad:
            ids = {b.block_id for b in dests}
            for b in bad:
                if b.block_id not in ids:
                    raise InvalidArgumentError(
                        f"fail_blocks: block {b.block_id} is not a destination of {token}"
                    )
        ended = tracker.end(token, False)
        self._on_ended(token, False, ended)
        if self.track_hazards:
            # A block written again since keeps that write's content.
            seq, stream = token.seq, token.stream
            bad = [
                b for b in bad if b.writer is not None and b.writer.seq == seq and b.writer.stream == stream
            ]
        self.writes.mark_invalid(bad, token)
        for b in bad:
            self._drop_keys(b)

    def link_loads(self, tokens: Iterable[ArgToken]) -> None:
        """Declare ``tokens`` the parts of one load: on a hybrid model, a
        request's load posted as one transfer per KV cache group (one
        :meth:`begin_load` each). Once a failure of any part is applied
        (:meth:`fail`, on time or late, or :meth:`abandon`; also one applied
        before the link), every block whose write in effect is another
        part's loses its prefix-cache keys (removed events, reason
        ``load_failed``) and is not published until rewritten, as the
        failed part's own blocks: the request's prefix is not there in
        every group. Marked invalid by the failed part
        (:meth:`invalid_block_ids` lists them under its token). The other
        parts do not fail: their :meth:`token_status`, shadows, fences and
        holds are unchanged (their transfers still write). Links add up: a
        token linked twice joins both loads into one. Links are forgotten
        once every linked token has ended and none is the write in effect
        of a block (nothing is left to withdraw); a write recorded by a
        linked token after that is its own. O(len(tokens) + the loads
        merged), plus O(num_gpu_blocks) when a part already failed;
        amortized O(1) more for forgetting old links. A linked token's
        failure costs O(num_gpu_blocks) to apply.

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(4, streams={"rdma": StreamKind.HOST})
        >>> full, window = pool.get_new_blocks(1), pool.get_new_blocks(1)
        >>> t_full, _ = pool.begin_load(full, "rdma")
        >>> t_window, _ = pool.begin_load(window, "rdma")
        >>> pool.link_loads([t_full, t_window])
        >>> pool.cache_full_blocks(full, ["full-0"], 0, 1, 16)
        >>> pool.cache_full_blocks(window, ["window-0"], 0, 1, 16)
        >>> pool.fail(t_window)              # one group's part failed
        >>> pool.get_cached_block("full-0"), pool.token_status(t_full).value
        (None, 'pending')

        Raises:
            InvalidArgumentError: ``tokens`` is not an iterable of Tokens, is
                empty, or a token's kind is not its stream's.
            UnknownStreamError, UnknownTokenError: the pool never issued a token.
            ForeignTokenError: a token was issued by another pool.
        """
        self._apply_completions()
        try:
            given: list[object] = list(tokens)
        except TypeError:
            raise InvalidArgumentError(f"tokens must be an iterable of Tokens, got {tokens!r}") from None
        if not given:
            raise InvalidArgumentError("link_loads needs at least one token")
        tracker = self.tracker
        toks: list[Token] = []
        for t in given:
            tracker.validate(t)  # raises unless t is a Token this pool issued
            toks.append(t)  # type: ignore[arg-type]
        groups = self.load_groups
        if groups.prune_due(len(self.blocks)):
            groups.prune(self._linkable())
        members = groups.link(toks)
        for t in members:
            if tracker.has_failed(t):
                self._withdraw_linked(t)
                break

    def _linkable(self) -> Callable[[Token], bool]:
        """Whether a failure of a token could still withdraw keys through a
        link: it has not ended, or it is the write in effect of a block, or
        a pending write saved it (its undo may restore it). O(num_gpu_blocks
        + pending writes)."""
        writers: set[tuple[str, int]] = set()
        for b in self.blocks:
            w = b.writer
            if w is not None:
                writers.add((w.stream, w.seq))
        for w in self.writes.saved_writers():
            if w is not None:
                writers.add((w.stream, w.seq))
        ended = self.tracker.is_ended
        return lambda t: (t.stream, t.seq) in writers or not ended(t)

    def linked_loads(self, token: ArgToken) -> list[Token]:
        """The tokens linked with ``token`` as one load (:meth:`link_loads`),
        itself included, each once (a merge keeps the larger load's order
        first); ``[token]`` when it is not linked (or its links were
        forgotten). Applies queued completions first. O(linked tokens).

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self._apply_completions()
        self.tracker.validate(token)
        members = self.load_groups.members(token)
        return list(members) if members else [token]

    def abandon(self, token: ArgToken) -> list[int]:
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
        before = set(self.holdback.held_ids())
        ended = self.tracker.end(token, True)
        if ended:
            self._count("abandoned")
        self._on_ended(token, True, ended)
        return sorted(before - set(self.holdback.held_ids()))

    def poll(self) -> None:
        """Apply queued completions and check leases now. O(completions)."""
        self._apply_completions()

    def is_ended(self, token: ArgToken) -> bool:
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

    def token_status(self, token: ArgToken) -> TokenStatus:
        """Whether ``token`` is pending, completed or failed: what
        :meth:`is_ended` cannot tell (it is true for both). A consumer that
        took a prefix hit on a load's blocks, or waits on a fence by its own
        means rather than through the worker's ``EventLedger``, proceeds
        only past tokens that are ``COMPLETED`` (docs/hazard-model.md,
        "Failure and coverage"). ``FAILED`` wins over an earlier
        completion: a failure reported after the token ended (a late
        failure: its content was found bad) makes it ``FAILED`` from then
        on. Applies queued completions first (a queued ``fail`` counts);
        changes nothing else. O(1) after them.

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(4, streams={"h2d": StreamKind.DEVICE})
        >>> load, _ = pool.begin_load(pool.get_new_blocks(1), "h2d")
        >>> pool.token_status(load).value
        'pending'
        >>> pool.fail(load)
        >>> pool.is_ended(load), pool.token_status(load).value
        (True, 'failed')

        Raises:
            UnknownStreamError, UnknownTokenError: the pool never issued ``token``.
            ForeignTokenError: ``token`` was issued by another pool.
            InvalidArgumentError: ``token`` is not a Token, or its kind is not its stream's.
        """
        self._apply_completions()
        tracker = self.tracker
        tracker.validate(token)
        if tracker.has_failed(token):
            return TokenStatus.FAILED
        return TokenStatus.COMPLETED if tracker.is_ended(token) else TokenStatus.PENDING
