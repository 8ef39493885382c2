"""The hold-back part of the pool: free blocks kept out of the free queue
while a host-engine access on them has not ended, and their leases.

A device consumer waits for a device token with an enqueued event wait, so
a block whose last access is on a device stream is freed at once and its
next user gets a fence. A host engine (an RDMA queue, a transfer thread)
cannot be waited on by a device stream, so a block with a pending host
access is *held* until every such access ends, then freed. With a lease
timeout, a block held longer is reported once (its lease expired) and stays
held (quarantined) until the engine's tokens end or are abandoned.

>>> from blockpool.core.block import KVCacheBlock
>>> from blockpool.core.hazards import StreamKind, Token
>>> hb = HoldBack()
>>> t = Token("rdma", 1, StreamKind.HOST)
>>> b = KVCacheBlock(3); b.writer = t
>>> hb.hold_back([b], lambda tok: False), hb.held_ids()
([], [3])
>>> [x.block_id for x in hb.release(t)], len(hb)
([3], 0)
"""

from __future__ import annotations

from collections.abc import Callable

from sortedcontainers import SortedList

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvariantError
from blockpool.core.hazards import StreamKind, Token
from blockpool.core.shadows import pending_host
from blockpool.core.tracker import HazardTracker

__all__ = ["HoldBack", "HoldMark"]

_UNSET = object()


class HoldMark(KVCacheBlock):
    """What a held block's ``next_free_block`` link holds while it is held:
    the host tokens still pending on it (``pending``, an immutable set).
    A held block is outside the free queue, so its queue links are free;
    blocks held together share one mark (and one set), as they share their
    shadow objects. A mark is not a block of any pool (``block_id`` -1, as
    the queue's sentinels) and is never linked into a queue.

    Attributes:
        pending: The host tokens the blocks carrying this mark wait on.
    """

    __slots__ = ("pending",)

    def __init__(self, pending: frozenset[Token]) -> None:
        super().__init__(-1)
        self.pending = pending


def _same_objects(a: list[Token], b: list[Token]) -> bool:
    """Whether ``a`` and ``b`` hold the same token objects in the same
    order (identity: Token's own ``__eq__`` is a Python function). O(k)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is not y:
            return False
    return True


def _mark_of(b: KVCacheBlock) -> HoldMark | None:
    """``b``'s hold mark, or ``None`` when ``b`` is not held (a block in the
    free queue links to a block or a sentinel, an allocated one to
    nothing). O(1)."""
    m = b.next_free_block
    if type(m) is HoldMark:
        return m
    return None


class HoldBack:
    """Owns the held blocks: for each, the host tokens still pending on it
    (an immutable set in a :class:`HoldMark` that the block's
    ``next_free_block`` link holds: blocks freed together share one mark
    until a token ends for them, then each run gets its own smaller set, so
    no set is mutated under another block); for each pending token, the
    blocks held on it; how many blocks are held; each held block's lease
    (deadline) and the leases that expired; the held blocks freed with
    ``evict_first`` (they go to the free queue's front when released); the
    ``leases_expired`` counter.

    The hold lives in the block's own (otherwise unused) queue link rather
    than in a map keyed by the block: holding, testing and releasing a
    block is one attribute store or read, with no hashing and no map entry
    to make or delete.

    Args:
        lease_timeout: Seconds a block may stay held before its lease
            expires (``None``: no leases).
        clock: Time source of the leases (seconds).
    """

    __slots__ = (
        "_clock",
        "_deadline",
        "_evict_first",
        "_expired",
        "_held_by",
        "_leases",
        "_n_held",
        "leases_expired",
        "timeout",
    )

    def __init__(self, lease_timeout: float | None = None, clock: Callable[[], float] | None = None) -> None:
        self._n_held = 0  # blocks carrying a hold mark
        self._held_by: dict[Token, list[KVCacheBlock]] = {}  # pending token -> blocks held on it
        # (deadline, block id): ids, not blocks, so that equal deadlines never compare blocks
        self._leases: SortedList = SortedList()
        self._deadline: dict[int, tuple[float, KVCacheBlock]] = {}  # block id -> its lease, the block
        self._expired: set[int] = set()  # ids of held blocks whose lease expired
        self._evict_first: set[KVCacheBlock] = set()  # held blocks freed with evict_first
        self.timeout = lease_timeout
        self._clock = clock
        self.leases_expired = 0

    def __len__(self) -> int:
        """Blocks held. O(1)."""
        return self._n_held

    @property
    def tracking(self) -> bool:
        """Whether some token still lists blocks (held ones, or ones a touch
        took back, dropped from the list when the token ends): the pool
        calls :meth:`release` for an ended host token only then. O(1)."""
        return bool(self._held_by)

    def __contains__(self, block: object) -> bool:
        """Whether the block (a block record, not an id) is held. O(1)."""
        return isinstance(block, KVCacheBlock) and _mark_of(block) is not None

    def _held_blocks(self) -> list[KVCacheBlock]:
        """The held blocks, each once, in no particular order: those listed
        under some token that carry a hold mark (each held block is listed
        under every token it waits on). O(listed blocks)."""
        seen: set[KVCacheBlock] = set()
        out: list[KVCacheBlock] = []
        b: KVCacheBlock
        for blocks in self._held_by.values():
            for b in blocks:
                if b not in seen and _mark_of(b) is not None:
                    seen.add(b)
                    out.append(b)
        return out

    def held_ids(self) -> list[int]:
        """Held block ids, sorted. O(listed blocks + h log h)."""
        return sorted([b.block_id for b in self._held_blocks()])

    def expired_ids(self) -> list[int]:
        """Held blocks whose lease expired, sorted. O(e log e)."""
        return sorted(self._expired)

    def pending_of(self, block: KVCacheBlock) -> set[Token]:
        """The host tokens the held block waits on (a copy). O(k).

        Raises:
            KeyError: the block is not held.
        """
        m = _mark_of(block)
        if m is None:
            raise KeyError(block)
        return set(m.pending)

    def pending_tokens(self) -> list[Token]:
        """The host tokens some held block waits on, sorted by stream and
        seq. O(listed blocks + t log t)."""
        out = []
        b: KVCacheBlock
        for t, blocks in self._held_by.items():
            for b in blocks:
                m = _mark_of(b)
                if m is not None and t in m.pending:
                    out.append(t)
                    break
        out.sort(key=lambda t: (t.stream, t.seq))
        return out

    def released_by(self, ends: set[Token], ended: Callable[[Token], bool]) -> int:
        """How many held blocks would leave the held set for the free queue
        if the host tokens ``ends`` ended now and nothing else did: those
        every pending token of which is in ``ends``, and whose shadow has
        no host token pending besides (freeing one would hold it again, as
        :meth:`hold_back` would). ``ended`` tells which tokens have ended
        already. Changes nothing. O(blocks listed under ``ends``); the
        decision is made once per distinct pending set and shadow."""
        held_by = self._held_by
        seen: set[KVCacheBlock] = set()

        def gone(t: Token) -> bool:
            return t in ends or ended(t)

        count = 0
        last: object = None  # blocks held together share their pending set
        covered = False
        lw: object = _UNSET  # ... and, freed together, their shadow objects
        lr: object = _UNSET
        free = False
        b: KVCacheBlock
        for t in ends:
            blocks = held_by.get(t)
            if blocks is None:
                continue
            for b in blocks:
                m = _mark_of(b)
                if m is None or b in seen:
                    continue  # released already (a touch took it), or counted
                pending = m.pending
                if pending is not last:
                    last = pending
                    covered = pending <= ends
                if not covered or t not in pending:
                    continue  # another token holds it too (or it was held anew since)
                seen.add(b)
                w, r = b.writer, b.readers
                if w is not lw or r is not lr:
                    lw, lr = w, r
                    free = pending_host(w, r, gone) is None
                count += free
        return count

    def hold_back(
        self, blocks: list[KVCacheBlock], ended: Callable[[Token], bool], evict_first: bool = False
    ) -> list[KVCacheBlock]:
        """Blocks that just reached ref count 0: hold those whose shadow has
        a host token that has not ended (``ended`` tells), starting their
        leases (with ``evict_first``, remembered as such: :meth:`evict_first`);
        return the others, in order. The decision is made once per run of
        blocks with the same ``(writer, readers)`` objects (blocks freed
        together share them); runs whose pending host tokens are the same
        objects as the last held run's, with no other held run between,
        join it, and each held run is held in one batch with one pending
        set (immutable) and one mark. O(len(blocks))."""
        free: list[KVCacheBlock] = []
        runs: list[tuple[list[Token], list[KVCacheBlock]]] = []
        run: list[KVCacheBlock] = free
        held: list[KVCacheBlock] = free  # the last held run
        last: list[Token] = []  # its pending tokens
        lw: object = _UNSET
        lr: object = _UNSET
        host = StreamKind.HOST
        for b in blocks:
            w = b.writer
            r = b.readers
            if w is lw and r is lr:
                run.append(b)  # the previous block's shadow objects: its decision
                continue
            lw, lr = w, r
            if w is not None and w.kind is not host:
                w = None  # a device writer never holds a block
            run = free
            if w is not None or (r is not None and (len(r) > 1 or r[0].kind is host)):
                pend = [t for t in (r or ()) if t.kind is host and not ended(t)]
                if w is not None and not ended(w):
                    pend.insert(0, w)
                if pend:
                    if held is not free and _same_objects(pend, last):
                        run = held  # the same pending tokens (objects) as the last held run: one run
                    else:
                        run = held = []
                        last = pend
                        runs.append((pend, run))
            run.append(b)
        if runs:
            held_by = self._held_by
            n = 0
            for toks, run in runs:
                pending = frozenset(toks)
                mark = HoldMark(pending)
                for b in run:
                    b.next_free_block = mark
                n += len(run)
                for t in pending:
                    lst = held_by.get(t)
                    if lst is None:
                        held_by[t] = run[:]
                    else:
                        lst.extend(run)
                if self.timeout is not None:
                    for b in run:
                        self._lease(b)
                if evict_first:
                    self._evict_first.update(run)
            self._n_held += n
        return free

    def evict_first(self, released: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Of ``released`` (just returned by :meth:`release`), those held
        with ``evict_first``, in order; they are forgotten as such. O(1)
        when none is held so, else O(len(released))."""
        marked = self._evict_first
        if not marked:
            return []
        out = [b for b in released if b in marked]
        marked.difference_update(out)
        return out

    def _lease(self, block: KVCacheBlock) -> None:
        assert self.timeout is not None and self._clock is not None
        deadline = self._clock() + self.timeout
        self._deadline[block.block_id] = (deadline, block)
        self._leases.add((deadline, block.block_id))

    def _drop_leases(self, blocks: list[KVCacheBlock]) -> None:
        """The leases of ``blocks``, which just left the held set, go
        (their entries in the sorted lease list are skipped lazily by
        :meth:`expire`). O(len(blocks)); nothing when no lease exists."""
        if self._deadline or self._expired:
            deadline, expired = self._deadline, self._expired
            for b in blocks:
                bid = b.block_id
                deadline.pop(bid, None)
                expired.discard(bid)

    def release(self, token: Token) -> list[KVCacheBlock]:
        """``token`` ended: it stops holding its blocks; returns those that
        no pending token holds any more (they leave the held set), in the
        order they were held. O(blocks held on ``token``)."""
        out: list[KVCacheBlock] = []
        last: object = None  # blocks held together share their mark:
        mine = False  # decide once per distinct mark (a token hash is a Python call)
        rest: HoldMark | None = None
        blocks = self._held_by.pop(token, None)
        if blocks is None:
            return out
        b: KVCacheBlock
        for b in blocks:
            m = b.next_free_block
            if type(m) is not HoldMark:
                continue  # released already (a touch took it)
            if m is not last:
                last = m
                pending = m.pending
                mine = token in pending
                rest = HoldMark(pending - {token}) if mine and len(pending) > 1 else None
            if not mine:
                continue  # held anew since, on other tokens
            if rest is None:
                b.next_free_block = None  # its lease goes below, for all at once
                out.append(b)
            else:
                b.next_free_block = rest
        self._n_held -= len(out)
        self._drop_leases(out)
        return out

    def unhold_n(self, blocks: list[KVCacheBlock]) -> None:
        """``blocks`` (held) were taken back by a touch: they leave the held
        set (their tokens' lists drop them lazily). O(len(blocks))."""
        dropped: list[KVCacheBlock] = []
        for b in blocks:
            if type(b.next_free_block) is HoldMark:
                b.next_free_block = None
                dropped.append(b)
        self._n_held -= len(dropped)
        self._drop_leases(dropped)
        if self._evict_first:
            self._evict_first.difference_update(dropped)

    def expire(self) -> list[tuple[int, frozenset[Token]]]:
        """Check the leases: each held block whose deadline passed (and not
        reported yet) is marked expired and returned with its pending
        tokens; counted in ``leases_expired``. O(expired log h)."""
        if not self._leases:
            return []
        assert self._clock is not None
        now = self._clock()
        leases = self._leases
        expired: list[tuple[int, frozenset[Token]]] = []
        while leases and leases[0][0] <= now:
            deadline, bid = leases.pop(0)
            lease = self._deadline.get(bid)
            if lease is not None and lease[0] == deadline and bid not in self._expired:
                self._expired.add(bid)
                m = _mark_of(lease[1])
                if m is None:
                    raise InvariantError(f"block {bid} has a lease but is not held")
                expired.append((bid, m.pending))
        self.leases_expired += len(expired)
        return expired

    def snapshot(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """``(block id, sorted pending tokens as str)`` per held block,
        sorted. O(h log h)."""
        items = sorted([(b.block_id, _pending(b)) for b in self._held_blocks()], key=lambda it: it[0])
        return tuple((bid, tuple(sorted(map(str, toks)))) for bid, toks in items)

    def _check(self, tracker: HazardTracker, blocks: list[KVCacheBlock], free: set[int]) -> None:
        """Assert: each held block is a data block of the pool (the pool's
        block of its id), unreferenced, not free, and waits on host-engine
        tokens that have not ended, each listing it; a token lists held
        blocks only while some host token is pending; leases exist exactly
        for held blocks (all of them when leases are on), each naming its
        block; expired leases are of held blocks; the held count is the
        number of the pool's blocks carrying a hold mark. O(num_gpu_blocks +
        listed blocks).

        Raises:
            InvariantError: the first broken invariant.
        """
        host = StreamKind.HOST
        held_ids: set[int] = set()
        for b in self._evict_first:
            if _mark_of(b) is None:
                raise InvariantError(f"block {b.block_id} is marked held with evict_first but is not held")
        for b in self._held_blocks():
            bid = b.block_id
            if not 0 < bid < len(blocks) or blocks[bid] is not b:
                raise InvariantError(f"held block {bid} is not the pool's block of that id")
        held = [b for b in blocks if _mark_of(b) is not None]
        if len(held) != self._n_held:
            raise InvariantError(f"{len(held)} blocks carry a hold mark but {self._n_held} are counted held")
        for b in held:
            pending = _pending(b)
            bid = b.block_id
            if bid == 0:
                raise InvariantError("the null block is free, held, referenced or cached")
            held_ids.add(bid)
            if bid in free or b.ref_cnt != 0 or not pending:
                raise InvariantError(f"held block {bid} is free, referenced or has no pending token")
            for t in pending:
                st = tracker.streams.get(t.stream)
                if st is None or st.kind is not host or t.kind is not host:
                    raise InvariantError(f"held block {bid} waits on {t}, not a host-engine token")
                if tracker.is_ended(t):
                    raise InvariantError(f"held block {bid} still waits on {t}, which has ended")
                if not any(x is b for x in self._held_by.get(t, ())):
                    raise InvariantError(f"held block {bid} is not listed under its pending token {t}")
        for t in self._held_by:
            if tracker.is_ended(t):
                raise InvariantError(f"blocks still listed under {t}, which has ended")
        if self._held_by and not tracker.host_pending():
            live = [t for t, bs in self._held_by.items() if any(_mark_of(x) is not None for x in bs)]
            if live:
                raise InvariantError(f"blocks held on {live[0]} with no host token pending")
        if self.timeout is not None:
            for bid in held_ids:
                if bid not in self._deadline:
                    raise InvariantError(f"held block {bid} has no lease")
        for bid, (_, b) in self._deadline.items():
            if bid not in held_ids or blocks[bid] is not b:
                raise InvariantError(f"block {bid} has a lease but is not held")
        for bid in self._expired:
            if bid not in held_ids:
                raise InvariantError(f"block {bid} has an expired lease but is not held")


def _pending(b: KVCacheBlock) -> frozenset[Token]:
    """The pending set of held block ``b``. O(1).

    Raises:
        InvariantError: ``b`` is not held.
    """
    m = _mark_of(b)
    if m is None:
        raise InvariantError(f"block {b.block_id} is not held")
    return m.pending
