"""Fences and accesses of the pool: ``fence_for``, ``tag`` and the
``begin_*`` calls (the computation is :mod:`blockpool.core.shadows`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from blockpool.core._base import _READ, _WRITE, _as_list
from blockpool.core._caching import CacheOps
from blockpool.core._mypyc import mypyc_attr
from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvalidArgumentError, NullBlockError
from blockpool.core.hazards import EMPTY_FENCE, AccessKind, Fence, Token
from blockpool.core.tracker import StreamState

if TYPE_CHECKING:  # the public parameters' annotations (blockpool/core/_args.py)
    from blockpool.core._args import ArgAccess, ArgBool, ArgStr, ArgToken

__all__ = ["FenceOps"]


@mypyc_attr(allow_interpreted_subclasses=True)
class FenceOps(CacheOps):
    """Fence computation and access recording of the pool."""

    # ------------------------------------------------------------------
    # hazards: fences and accesses
    # ------------------------------------------------------------------

    def fence_for(
        self,
        blocks: Iterable[KVCacheBlock],
        stream: ArgStr,
        access: ArgAccess = AccessKind.WRITE,
        *,
        token: ArgToken | None = None,
    ) -> Fence:
        """The fence for an ``access`` by ``stream`` to ``blocks`` beginning
        now, and record that ``stream`` waits on it. A write waits for each
        block's writer and readers (WAW, WAR), a read for the writer (RAW);
        minus ended tokens, tokens on ``stream`` itself when it is a device
        stream, tokens ``stream`` is already ordered after, and tokens covered
        by another token of the fence. Null blocks are skipped.
        O(len(blocks) + k^2), k = distinct streams/host tokens found.

        ``token``: the access is the work of ``token``, already issued on
        ``stream`` but whose event is recorded after the wait (step N's
        token, issued when the step was scheduled, for the forward that
        waits on this fence first). ``token`` is then ordered after the
        fence and every earlier wait of ``stream``, as a token issued after
        the wait (:meth:`issue`): its completion ends the fence's tokens.
        It must be the newest token of ``stream``, a ``DEVICE`` stream, not
        ended, with nothing ordered after it yet
        (:meth:`HazardTracker.unorderable` says why not).

        >>> from blockpool import HazardAwareBlockPool, StreamKind, AccessKind
        >>> pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE, "d2h": StreamKind.DEVICE})
        >>> blocks = pool.get_new_blocks(1)
        >>> step = pool.issue("compute")
        >>> pool.tag(blocks, step, AccessKind.WRITE)         # the step writes the block
        >>> [str(t) for t in pool.fence_for(blocks, "d2h", AccessKind.READ)]   # a store reads it: RAW
        ['compute:1']

        Raises:
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``access`` is not an AccessKind, or
                ``token`` is not a token of ``stream`` or cannot be ordered
                after the fence (see above); nothing changes.
            UnknownTokenError, ForeignTokenError: ``token`` was not issued
                by this pool.
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        st = self.tracker.state(stream)
        access = self._check_access(access)
        if token is not None:
            if self.tracker.validate(token) is not st:
                raise InvalidArgumentError(f"token {token} is not a token of stream {stream!r}")
            why = self.tracker.unorderable(token) if self.track_hazards else None
            if why is not None:
                raise InvalidArgumentError(f"cannot order {token} after a fence: {why}")
        block_list = self._own_all(blocks)
        if not self.track_hazards:
            return EMPTY_FENCE
        fence = self._fence(((block_list, access),), st)
        if token is not None:
            self.tracker.order_after(token)  # the stream's clock holds the fence now
        return fence

    def fence_and_tag(self, blocks: Iterable[KVCacheBlock], stream: ArgStr, token: ArgToken) -> Fence:
        """The fence of a write by ``token``'s work to ``blocks``, with
        ``token`` ordered after it, and that write recorded: what
        ``fence_for(blocks, stream, AccessKind.WRITE, token=token)`` then
        ``tag(blocks, token, AccessKind.WRITE)`` do, the same fence
        returned and the same state left, in one call with one ownership
        pass over ``blocks`` (step N's forward: its token issued when the
        step was scheduled, its fence taken and its write recorded before
        the forward runs). ``blocks`` is read once (an iterator is
        consumed once, not once per call). ``token`` must be as for
        :meth:`fence_for`: the newest token of ``stream``, a ``DEVICE``
        stream, not ended, with nothing ordered after it yet; then no
        access is ordered after it either, so the write order that
        :meth:`tag` checks holds. With hazards off: no fence
        (``EMPTY_FENCE``), and the write is recorded as :meth:`tag`
        records one then. Null blocks are skipped.
        O(len(blocks) + k^2), k = distinct streams/host tokens found;
        O(len(blocks) + #streams) when nothing in flight could be in the
        fence.

        Raises:
            UnknownStreamError: ``stream`` is not registered (or
                ``token``'s stream is not).
            ForeignBlockError: a block of another pool.
            InvalidArgumentError: ``stream`` is not a str, ``token`` is not
                a Token, not a token of ``stream`` or cannot be ordered
                after the fence (:meth:`HazardTracker.unorderable` says
                why), or a block is not a KVCacheBlock.
            UnknownTokenError, ForeignTokenError: ``token`` was not issued
                by this pool.
            On any error nothing changes: the error :meth:`fence_for`
            raises for the same arguments.
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        st = self.tracker.state(stream)
        if self.tracker.validate(token) is not st:
            raise InvalidArgumentError(f"token {token} is not a token of stream {stream!r}")
        if not self.track_hazards:
            block_list = self._own_all(blocks)
            self._ended_write(block_list, token)  # tag's write with hazards off
            return EMPTY_FENCE
        why = self.tracker.unorderable(token)
        if why is not None:
            raise InvalidArgumentError(f"cannot order {token} after a fence: {why}")
        block_list = self._own_all(blocks)
        fence = self._fence(((block_list, _WRITE),), st)
        self.tracker.order_after(token)  # the stream's clock holds the fence now
        # tag's write order check passes without its pass over the blocks:
        # unorderable found no token clock covering token (nothing ordered
        # after it) and token the newest of its device stream, so no shadow
        # holds an access ordered after it; the fence and order_after only
        # joined the stream's clock and token's own.
        self._tag(block_list, token, _WRITE)
        return fence

    def tag(self, blocks: Iterable[KVCacheBlock], token: ArgToken, access: ArgAccess) -> None:
        """Record that ``token``'s work accesses ``blocks`` (e.g. step N's
        forward writes the blocks receiving new tokens). The caller ordered
        that work after the blocks' fences (:meth:`fence_for` /
        :meth:`allocate_for`). A write replaces the shadow (what it replaced
        is kept until ``token`` ends: if ``token`` fails, it is restored and
        the blocks lose their keys, see :meth:`fail`); a read joins it.
        Keys are kept (the scheduler publishes a block's key for the content
        its step writes). Null blocks are skipped. Accesses are recorded in
        the order they run: a write by ``token`` to a block that an access
        ordered after ``token`` already touched (a later token of its
        device stream, or one that waited on it) is refused; the same write
        recorded again changes nothing. O(len(blocks)).

        Raises:
            ForeignBlockError, UnknownStreamError, UnknownTokenError, ForeignTokenError,
            InvalidArgumentError: as the names say, or a write recorded
                after an access ordered after it; nothing changes.
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        st = self.tracker.validate(token)
        access = self._check_access(access)
        block_list = self._own_all(blocks)
        if self.track_hazards and not st.is_ended(token.seq):
            if access is _WRITE:
                self._check_write_order(block_list, token)
            self._tag(block_list, token, access)
        elif access is _WRITE:
            self._ended_write(block_list, token)

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
            # content they held before, so they are withdrawn (removed
            # events); a fill keeps them (the keys announce what it loads).
            announced = self._announced
            for blocks, access in groups:
                if access is _WRITE:
                    for b in blocks:
                        if b.block_hash is not None and not (announced and b in announced):
                            self._drop_keys(b, "replaced")
        if self.track_hazards:
            for blocks, access in groups:
                self._tag(blocks, token, access)
        elif self._fresh or self._announced:
            for blocks, access in groups:
                if access is _WRITE:
                    self._written(blocks)
        for blocks, access in groups:
            if access is _WRITE and blocks:
                self.writes.began_transfer(token, blocks)  # its destinations, for fail_blocks
        return token, fence

    def begin_copy(
        self,
        pairs: Iterable[tuple[KVCacheBlock, KVCacheBlock]],
        stream: ArgStr = "compute",
        generations: Iterable[tuple[int, int]] | None = None,
        *,
        refusals: ArgBool = True,
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
        ``refusals=False`` skips the two refusals of unsafe copies
        (``SharedBlockError``, ``InvalidContentError``) for a caller that
        records a copy that runs anyway and whose destinations are private
        by construction though held twice: vLLM's copy-on-write (the
        scheduler retains both ends until the copy ran, and may have
        published the destination's key already). O(len(pairs)).

        Raises:
            UnknownStreamError: ``stream`` is not registered.
            ForeignBlockError: a block of another pool.
            NullBlockError: the null block as a source or destination.
            StaleBlockError: with ``generations``, a block was freed and
                allocated again since they were taken.
            BlockNotAllocatedError: a block with ref count 0.
            SharedBlockError: a cached destination more than one holder
                holds (ref count above 1 and a key): their reads cannot be
                fenced (not with ``refusals=False``); the fill exception of
                :meth:`begin_load` is a load's, not a copy's.
            InvalidContentError: a source whose content is known bad (a
                failed load or copy wrote it, nothing has since; not with
                ``refusals=False``).
            InvalidArgumentError: a pair is not a 2-tuple, or
                ``generations`` is not one pair of ints per pair.
        """
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        st = self.tracker.state(stream)
        srcs: list[KVCacheBlock] = []
        dsts: list[KVCacheBlock] = []
        # object, not the declared pair type: a compiled build would check the
        # type on the loop variable, before the typed error below could.
        item: object
        for item in pairs:
            try:
                src, dst = item  # type: ignore[misc]
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"a copy is a (src, dst) pair, got {item!r}") from None
            for b in (src, dst):
                self._own(b)
                if b.is_null:
                    raise NullBlockError("the null block cannot be copied from or into")
            srcs.append(src)
            dsts.append(dst)
        if generations is not None:
            src_gens: list[object] = []
            dst_gens: list[object] = []
            for gen_pair in _as_list(generations, "generations"):
                try:
                    g_src, g_dst = gen_pair
                except (TypeError, ValueError):
                    raise InvalidArgumentError(
                        f"copy: generations are (src, dst) pairs, got {gen_pair!r}"
                    ) from None
                src_gens.append(g_src)
                dst_gens.append(g_dst)
            self._check_fresh(srcs + dsts, src_gens + dst_gens, "copy")
        self._data_blocks(srcs + dsts, "copy")
        if refusals:
            self._check_exclusive(dsts, "copy")
            self._check_valid_content(srcs, "copy")
        return self._begin(((srcs, _READ), (dsts, _WRITE)), stream, st)

    def _begin_transfer(
        self, blocks: Iterable[KVCacheBlock], stream: str, access: AccessKind, what: str
    ) -> tuple[Token, Fence]:
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        st = self.tracker.state(stream)
        data = self._data_blocks(blocks, what)
        self._check_transfer(data, access, what)
        return self._count_transfer(self._begin(((data, access),), stream, st, access is _WRITE), access)

    def _count_transfer(self, begun: tuple[Token, Fence], access: AccessKind) -> tuple[Token, Fence]:
        """Count a transfer begun: the one count of it that the pool's
        stats and the engine integrations read. O(1)."""
        c = self._counters
        c["loads_begun" if access is _WRITE else "stores_begun"] += 1
        if begun[1].tokens:
            c["transfer_fences_nonempty"] += 1
        return begun

    def _check_transfer(self, data: list[KVCacheBlock], access: AccessKind, what: str) -> None:
        """The refusals of a load (a write: shared cached blocks) or a store
        (a read: content known bad), before anything changes. O(len(data))."""
        if access is _WRITE:
            self._check_exclusive(data, what, True)
        else:
            self._check_valid_content(data, what)

    def _begin_fresh_transfer(
        self,
        blocks: Iterable[KVCacheBlock],
        stream: str,
        access: AccessKind,
        what: str,
        generations: Iterable[int],
    ) -> tuple[Token, Fence]:
        """:meth:`_begin_transfer` of a table checked against its
        ``generations`` first (the fast path stays as it was)."""
        if self._due:  # hot call: _apply_completions' own test, hoisted
            self._apply_completions()
        st = self.tracker.state(stream)
        block_list = self._own_all(blocks)
        self._check_fresh(block_list, generations, what)
        data = self._data_blocks(block_list, what)
        self._check_transfer(data, access, what)
        return self._count_transfer(self._begin(((data, access),), stream, st, access is _WRITE), access)

    def begin_load(
        self, blocks: Iterable[KVCacheBlock], stream: ArgStr, generations: Iterable[int] | None = None
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

        >>> from blockpool import HazardAwareBlockPool, StreamKind
        >>> pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE, "rdma": StreamKind.HOST})
        >>> blocks = pool.get_new_blocks(2)
        >>> token, fence = pool.begin_load(blocks, "rdma")
        >>> str(token), fence.tokens
        ('rdma:1', ())
        >>> pool.complete(token)

        A load into a cached block more than one holder holds (ref count
        above 1 and a key: a prefix hit a running request reads) is
        refused: that holder's reads are recorded only when it frees the
        block, so no fence can order the load after them (LMCache #2206).
        An unpublished block shared only by its own request's holders (a
        connector's pin) is not refused. Nor is the fill a key announces:
        a block whose keys were published before any write since its
        allocation (vLLM publishes a synchronous load's keys when it
        allocates the blocks; another request may hit them before the
        load begins) holds nothing anyone read; the load keeps those keys,
        becomes the writer every holder's later access is fenced after,
        and its failure withdraws the keys from all of them. A block
        written since its allocation (a step's write, a copy into it, a
        load into it, the fill included) is refused when shared.

        Raises:
            UnknownStreamError, ForeignBlockError, BlockNotAllocatedError.
            SharedBlockError: a cached block with ref count above 1
                written since its allocation (not a fill); nothing
                changes.
            StaleBlockError: with ``generations``, a block of the table was
                allocated again since they were taken; nothing changes.
            InvalidArgumentError: ``generations`` is not one int per block.
        """
        if generations is None:
            return self._begin_transfer(blocks, stream, _WRITE, "load")
        return self._begin_fresh_transfer(blocks, stream, _WRITE, "load", generations)

    def begin_store(
        self, blocks: Iterable[KVCacheBlock], stream: ArgStr, generations: Iterable[int] | None = None
    ) -> tuple[Token, Fence]:
        """Begin a store / offload (GPU -> external tier) from ``blocks`` on
        ``stream``: returns the store's token (a reader of every block; a
        later write waits on it, WAR) and the fence it waits on (RAW on the
        last writer). Null placeholders are skipped. ``generations``
        (aligned with ``blocks``, from :meth:`generations` when the table
        was built): refuse the table if one of its blocks was freed and
        allocated again since (the store would file another request's data
        under this table's keys). O(len(blocks)).

        A store of a block whose content is known bad (a load or copy into
        it failed, reported on time or late, and nothing has written it
        since) is refused: it would file garbage under valid keys in the
        other tier (vLLM PR #35092). A store begun before the failure waits
        on the failed write in its fence, and a consumer never runs past a
        failed fence token (``FenceFailedError``).

        Raises:
            UnknownStreamError, ForeignBlockError, BlockNotAllocatedError.
            InvalidContentError: a block whose content is known bad;
                nothing changes.
            StaleBlockError: with ``generations``, a block of the table was
                allocated again since they were taken; nothing changes.
            InvalidArgumentError: ``generations`` is not one int per block.
        """
        if generations is None:
            return self._begin_transfer(blocks, stream, _READ, "store")
        return self._begin_fresh_transfer(blocks, stream, _READ, "store", generations)
