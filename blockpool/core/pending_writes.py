"""The pending-writes part of the pool: writes in flight and invalid marks.

Every write the pool records (``tag``, a free with ``WRITE``,
``begin_load``, ``begin_copy``) replaces its blocks' shadows. It may fail
before its own waits ran, so the accesses it replaced may still run: until
the write's token ends, what it replaced is kept here, and if the token
*fails* it is put back (:func:`blockpool.core.shadows.restore`) and the blocks'
content is marked invalid: not what their keys name, never published until
rewritten.

>>> from blockpool.core.block import KVCacheBlock
>>> from blockpool.core.hazards import StreamKind
>>> from blockpool.core.shadows import write
>>> from blockpool.core.tracker import HazardTracker
>>> tr = HazardTracker(); tr.add_stream("h2d", StreamKind.DEVICE)
>>> pw, b = PendingWrites(), KVCacheBlock(1)
>>> t = tr.issue("h2d"); pw.began(t, write([b], t, None))
>>> undone = pw.ended(t, True, tr.end(t, True), tr.is_ended)
>>> [x.block_id for x in undone], b.writer, pw.is_invalid(1)
([1], None, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvariantError
from blockpool.core.hazards import Token
from blockpool.core.shadows import Readers, Replaced, merge_readers, restore
from blockpool.core.tracker import HazardTracker, StreamState

__all__ = ["PendingWrites"]

Saved = list[tuple[int, Replaced]]
"""What a token's writes replaced: per write, in the order they were made,
its serial (a counter of the pool's writes) and its groups
(:data:`blockpool.core.shadows.Replaced`). The serial orders writes across
tokens, so the undo of a failed write hands its replaced shadow to the
write that directly followed it on a block (:meth:`PendingWrites._resave`)."""


class PendingWrites:
    """Owns the writes in flight (stream -> seq -> :data:`Saved`: what
    each write replaced, kept until its token ends), the destinations of
    the loads and copies in flight (until their tokens end) and the
    invalid marks (block id -> the token whose failed write, or failed
    part of a load or copy, left the block's content invalid, until
    rewritten), with the undo of failed writes. Every method is O(blocks
    touched) unless it says otherwise."""

    __slots__ = ("_dests", "_invalid", "_serial", "_writes")

    def __init__(self) -> None:
        self._writes: dict[str, dict[int, Saved]] = {}
        # stream -> seq -> the destination blocks of a load or copy in flight
        self._dests: dict[str, dict[int, list[KVCacheBlock]]] = {}
        self._invalid: dict[int, Token] = {}  # block id -> the failed write's token
        self._serial = 0  # writes saved so far: orders them across tokens

    # -- invalid marks -------------------------------------------------------

    def is_invalid(self, block_id: int) -> bool:
        """Whether the block's content is invalid (a failed write). O(1)."""
        return block_id in self._invalid

    def has_invalid(self) -> bool:
        """Whether any block is marked invalid. O(1)."""
        return bool(self._invalid)

    def num_invalid(self) -> int:
        """Blocks marked invalid. O(1)."""
        return len(self._invalid)

    def invalid_ids(self, token: Token | None = None) -> list[int]:
        """The block ids marked invalid, sorted; with ``token``, only those
        whose mark that token's failure left (the latest failure marks a
        block). O(m log m), m = marks."""
        if token is None:
            return sorted(self._invalid)
        stream, seq = token.stream, token.seq
        return sorted(bid for bid, t in self._invalid.items() if t.seq == seq and t.stream == stream)

    def mark_invalid(self, blocks: Iterable[KVCacheBlock], token: Token) -> None:
        """``blocks`` hold no valid content because of ``token``: a write
        by ``token`` recorded after it had failed (it never happened), or
        the blocks a load or copy ``token`` failed to write while its
        other blocks were written (``fail_blocks``). O(len(blocks))."""
        self._invalid.update({b.block_id: token for b in blocks})

    def rewritten(self, blocks: Iterable[KVCacheBlock]) -> None:
        """``blocks`` get new content (a write, or they are handed out):
        their invalid marks go. O(len(blocks)), nothing when none is marked."""
        invalid = self._invalid
        if invalid:
            for b in blocks:
                invalid.pop(b.block_id, None)

    def clear_invalid(self) -> None:
        """Forget every invalid mark (every block is free: each is rewritten
        before it is published). O(marks)."""
        self._invalid.clear()

    # -- writes in flight ------------------------------------------------------

    def began_transfer(self, token: Token, dsts: list[KVCacheBlock]) -> None:
        """A load or copy ``token`` began writing ``dsts`` (kept, not
        copied, until ``token`` ends: :meth:`destinations`). O(1)."""
        per_stream = self._dests.get(token.stream)
        if per_stream is None:
            per_stream = self._dests[token.stream] = {}
        per_stream[token.seq] = dsts

    def destinations(self, token: Token) -> list[KVCacheBlock] | None:
        """The destination blocks of the load or copy ``token`` while it is
        in flight, ``None`` for any other token. O(1)."""
        per_stream = self._dests.get(token.stream)
        return None if per_stream is None else per_stream.get(token.seq)

    def began(self, token: Token, replaced: Replaced) -> None:
        """``token`` began writing: keep what it ``replaced`` (from
        :func:`blockpool.core.shadows.write`) until ``token`` ends, and
        clear the invalid marks of the blocks it wrote (those in
        ``replaced``; a block it had written already keeps its mark).
        O(len(replaced)), plus O(blocks replaced) when some block is marked
        invalid."""
        if replaced:
            per_stream = self._writes.get(token.stream)
            if per_stream is None:
                per_stream = self._writes[token.stream] = {}
            self._serial += 1
            saved = per_stream.get(token.seq)
            if saved is None:
                per_stream[token.seq] = [(self._serial, replaced)]
            else:
                saved.append((self._serial, replaced))
        if self._invalid:
            for _w, _r, group in replaced:
                self.rewritten(group)

    def ended(
        self,
        token: Token,
        failed: bool,
        ended: list[tuple[StreamState, list[int]]],
        is_ended: Callable[[Token], bool],
    ) -> list[KVCacheBlock]:
        """Tokens ``ended`` (per stream, the seqs that ended, as the tracker
        reports when ``token`` ended): forget what their writes replaced,
        except that a ``failed`` ``token``'s writes are undone: each block
        it still is the writer of gets its replaced shadow back (with the
        reads recorded since) and an invalid mark, and is returned (its keys
        must go, and a free one may need holding back); a block rewritten
        since hands the replaced shadow to the write that replaced it.
        O(entries of the ended writes)."""
        undone: list[KVCacheBlock] = []
        dests = self._dests
        for st, seqs in ended:
            if dests:
                per_stream = dests.get(st.name)
                if per_stream:
                    for seq in seqs:
                        per_stream.pop(seq, None)
            writes = self._writes.get(st.name)
            if not writes:
                continue
            for seq in seqs:
                before = writes.pop(seq, None)
                if before is not None and failed and seq == token.seq and st.name == token.stream:
                    undone.extend(self._undo(token, before, is_ended))
        return undone

    def _undo(self, token: Token, before: Saved, is_ended: Callable[[Token], bool]) -> list[KVCacheBlock]:
        """Undo the failed ``token``'s writes, ``before`` being what they
        replaced. Newest write first: a block the token wrote twice, with
        another write in between, gets back what the token's *last* write
        replaced, and each earlier write's replaced shadow goes to the write
        that followed it on the block (:meth:`_resave`). Returns the blocks
        restored, in the order of the writes. O(blocks in ``before``)."""
        out: list[KVCacheBlock] = []
        done: set[int] = set()
        for serial, groups in reversed(before):
            for writer, readers, group in reversed(groups):
                for b in reversed(group):
                    w = b.writer
                    if w is None or w.stream != token.stream or w.seq != token.seq:
                        # Rewritten since: the write that followed saved this
                        # failed one as what it replaced; hand it what the
                        # failed write replaced.
                        self._resave(b, token, serial, writer, readers, is_ended)
                        continue
                    restore(b, writer, readers, is_ended)
                    self._invalid[b.block_id] = token
                    if b.block_id not in done:  # returned once, if restored twice
                        done.add(b.block_id)
                        out.append(b)
        out.reverse()
        return out

    def _resave(
        self,
        b: KVCacheBlock,
        failed: Token,
        serial: int,
        writer: Token | None,
        readers: Readers,
        is_ended: Callable[[Token], bool],
    ) -> None:
        """The failed write ``serial`` of ``failed`` to ``b`` was followed by
        another pending write of ``b``, which saved it as what it replaced:
        the first such write after it (the smallest later serial) gets what
        the failed write replaced instead (``writer``, ``readers``, plus the
        reads since). ``b`` leaves its group for a group of its own in its
        place, so the later write's blocks keep their order. Nothing when
        that write has ended already. O(pending writes); failures are rare."""
        found: tuple[Replaced, int, int, int] | None = None  # groups, index, position of b, serial
        for per_stream in self._writes.values():
            for entries in per_stream.values():
                for s, groups in entries:
                    if s <= serial or (found is not None and s >= found[3]):
                        continue
                    for gi, (w, _r, group) in enumerate(groups):
                        if w is not None and w.stream == failed.stream and w.seq == failed.seq:
                            for k, blk in enumerate(group):
                                if blk is b:
                                    found = (groups, gi, k, s)
                                    break
        if found is None:
            return
        groups, gi, k, _ = found
        w, r, group = groups[gi]
        groups[gi : gi + 1] = [
            g
            for g in (
                (w, r, group[:k]),
                (writer, merge_readers(readers, r, is_ended), [b]),
                (w, r, group[k + 1 :]),
            )
            if g[2]
        ]

    def late_failure(self, token: Token, blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """``token`` failed after it had already ended: of ``blocks`` (every
        block of the pool), those whose write in effect is still ``token``'s
        get an invalid mark and are returned (their keys must go).
        O(len(blocks)); failures are rare."""
        stream, seq = token.stream, token.seq
        out = []
        for b in blocks:
            w = b.writer
            if w is not None and w.seq == seq and w.stream == stream:
                self._invalid[b.block_id] = token
                out.append(b)
        return out

    def saved_writers(self) -> Iterator[Token | None]:
        """The writers the pending writes saved (what they replaced), for
        the tracker's check. O(saved groups)."""
        for per_seq in self._writes.values():
            for entries in per_seq.values():
                for _serial, groups in entries:
                    for w, _r, _group in groups:
                        yield w

    def _check(self, tracker: HazardTracker, blocks: list[KVCacheBlock]) -> None:
        """Assert: saved shadows belong to tokens of known streams that have
        not ended, and to the pool's data blocks; invalid marks name data
        blocks. O(pending write entries + marks).

        Raises:
            InvariantError: the first broken invariant.
        """
        for stream, per_seq in self._writes.items():
            st = tracker.streams.get(stream)
            if st is None:
                raise InvariantError(f"pending writes on unknown stream {stream!r}")
            for seq, entries in per_seq.items():
                if st.is_ended(seq):
                    raise InvariantError(f"saved shadows of {stream}:{seq}, which has ended")
                for serial, groups in entries:
                    if not 0 < serial <= self._serial:
                        raise InvariantError(f"{stream}:{seq} saved a write with serial {serial}")
                    for _w, _r, group in groups:
                        for b in group:
                            if not 0 <= b.block_id < len(blocks) or blocks[b.block_id] is not b or b.is_null:
                                raise InvariantError(
                                    f"{stream}:{seq} saved the shadow of a foreign or null block"
                                )
        for stream, per_dest in self._dests.items():
            st = tracker.streams.get(stream)
            if st is None:
                raise InvariantError(f"transfer destinations on unknown stream {stream!r}")
            for seq in per_dest:
                if st.is_ended(seq):
                    raise InvariantError(f"destinations of {stream}:{seq} kept, which has ended")
        for bid, t in self._invalid.items():
            if not (isinstance(bid, int) and 0 < bid < len(blocks)):
                raise InvariantError(f"invalid mark on {bid!r}, not a data block")
            if t.stream not in tracker.streams or not tracker.is_ended(t):
                raise InvariantError(f"block {bid} is marked invalid by {t}, which has not ended")
