"""Block shadows: fence computation and access recording, as functions over
the blocks' shadows and the :class:`~blockpool.core.tracker.HazardTracker`.

A block's *shadow* is its ``writer`` (the last write not known to have
ended) and its ``readers`` (the reads since: ``None`` or a tuple of
tokens, the newest read per device stream and each host token apart; one
representation: a single reader is a 1-tuple, not a bare token, which
measured the same on the trace op log).
Readers values are immutable and shared: blocks read or freed together hold
the same object, so the work below is done once per distinct shadow, not
once per block. This module is the only one that writes ``writer`` and
``readers`` (:func:`tag`, :func:`write`, :func:`settle`, :func:`restore`, :func:`clear`;
"tag" is the one verb for recording an access: the pool's ``tag``, the
race oracle's ``tag``; :func:`write` is ``tag`` of a write that also
returns what it replaced).

>>> from blockpool.core.block import KVCacheBlock
>>> from blockpool.core.hazards import AccessKind, Token
>>> b = KVCacheBlock(1)
>>> tag([b], Token("compute", 1), AccessKind.WRITE, lambda t: False)
>>> tag([b], Token("h2d", 2), AccessKind.READ, lambda t: False)
>>> [str(t) for t in shadow_tokens(b)]
['compute:1', 'h2d:2']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from blockpool.core.block import KVCacheBlock
from blockpool.core.hazards import EMPTY_FENCE, AccessKind, Fence, FenceReason, StreamKind, Token
from blockpool.core.tracker import HazardTracker, StreamState

__all__ = [
    "Replaced",
    "fence_of",
    "pending_host",
    "restore",
    "settle",
    "shadow_ready",
    "shadow_tokens",
    "tag",
    "with_read",
    "write",
]

Readers = tuple[Token, ...] | None

Replaced = list[tuple[Token | None, Readers, list[KVCacheBlock]]]
"""What a write replaced (:func:`write`): groups ``(writer before, readers
before, blocks)``, one per distinct ``(writer, readers)`` pair of objects
met in a row (blocks written together were mostly written or read together
before, so they share their shadow objects)."""

_DEVICE = StreamKind.DEVICE
_HOST = StreamKind.HOST
_WRITE = AccessKind.WRITE
_UNSET = object()  # "no previous value" for the per-call identity memos


def _same_key(a: Token, b: Token) -> bool:
    """Whether two tokens share a shadow slot: the same device stream (the
    newer covers the older), or equal host tokens (each host token apart).
    Compares fields, not ``==``: Token's ``__eq__`` is a Python function
    in the pure build, too slow for a per-block path."""
    return a.stream == b.stream and (a.kind is not _HOST or a.seq == b.seq)


def _tokens(w: Token | None, r: Readers) -> list[Token]:
    out: list[Token] = [] if w is None else [w]
    if r is not None:
        out.extend(r)
    return out


def shadow_tokens(b: KVCacheBlock) -> list[Token]:
    """The tokens in ``b``'s shadow, writer first. O(k)."""
    return _tokens(b.writer, b.readers)


def with_read(r: Readers, t: Token, ended: Callable[[Token], bool]) -> tuple[Token, ...]:
    """The readers of a block after a read by ``t``, from its readers ``r``:
    newest token per device stream, each host token apart. A single earlier
    reader that has ended is dropped. The result is a new value (readers are
    shared between blocks and never mutated). O(len(r))."""
    if r is None:
        return (t,)
    if len(r) == 1:
        x = r[0]
        if _same_key(x, t):
            return (t,) if x.seq < t.seq else r
        if ended(x):
            return (t,)
        return (x, t)
    for i, x in enumerate(r):
        if _same_key(x, t):
            return r[:i] + (t,) + r[i + 1 :] if x.seq < t.seq else r
    return r + (t,)


def _merge(base: Readers, extra: Readers, ended: Callable[[Token], bool]) -> Readers:
    for t in () if extra is None else extra:
        base = with_read(base, t, ended)
    return base


def fence_of(
    groups: Iterable[tuple[list[KVCacheBlock], AccessKind]],
    st: StreamState,
    tracker: HazardTracker,
    debug: bool,
) -> Fence:
    """The fence of accesses by stream ``st`` to each group of blocks (a
    write waits for writer and readers, a read for the writer), reduced by
    the tracker (ended, covered, already ordered), and record that ``st``
    waits on it (``tracker.wait``). ``debug``: the fence carries reasons.
    Fast path: the blocks are not scanned at all when no other stream has
    a token that may still run and that ``st`` is not ordered after, and
    the groups ``st`` reads are not when no such token wrote (:func:`_live`):
    the fence is the same, empty or not.
    O(blocks + k^2), k = distinct candidate tokens; O(#streams) on the fast path."""
    # Candidates: newest token per device stream, each host token apart
    # (keyed by (stream, seq): Token's own hash is a Python function).
    # Blocks allocated together were mostly freed together and share
    # their shadow objects, so a writer or readers object identical to
    # the previous block's adds nothing and is skipped: per block, the
    # scan is two attribute reads and two identity tests. Tokens on the
    # consumer itself, when it is an in-order device stream, are never
    # waited on (HazardTracker.reduce drops them first); the scan skips
    # them before they become candidates.
    own = st.name if st.kind is _DEVICE else None
    busy = tracker.busy
    if not busy or (own is not None and len(busy) == 1 and own in busy):
        return EMPTY_FENCE  # no other stream has a token that may still run
    scan_reads, scan_writes = _live(busy, st, own, tracker)
    if not scan_writes:
        return EMPTY_FENCE  # nothing in flight the consumer is not ordered after
    cand: dict[object, Token] = {}
    why: dict[Token, FenceReason] | None = {} if debug else None
    lw: object = _UNSET
    lr: object = _UNSET
    for blocks, access in groups:
        write = access is _WRITE
        if not write and not scan_reads:
            continue  # no write of another stream may still run: RAW waits on nothing
        for b in blocks:
            w = b.writer
            if w is not None and w is not lw:
                lw = w
                if w.stream != own:
                    k: object = w.stream if w.kind is not _HOST else (w.stream, w.seq)
                    cur = cand.get(k)
                    if cur is None or cur.seq < w.seq:
                        cand[k] = w
                        if why is not None:
                            why[w] = FenceReason(w, b.block_id, "writer", access)
            if write:
                r = b.readers
                if r is not None and r is not lr:
                    lr = r
                    for t in r:
                        if t.stream == own:
                            continue
                        k = t.stream if t.kind is not _HOST else (t.stream, t.seq)
                        cur = cand.get(k)
                        if cur is None or cur.seq < t.seq:
                            cand[k] = t
                            if why is not None:
                                why[t] = FenceReason(t, b.block_id, "reader", access)
    if not cand:
        return EMPTY_FENCE
    tokens = tracker.reduce(cand.values(), st)
    if not tokens:
        return EMPTY_FENCE
    tracker.wait(st, tokens)
    host_wait = st.kind is _HOST or any(t.kind is _HOST for t in tokens)
    reasons: tuple[FenceReason, ...] = ()
    if why is not None:
        tokens.sort(key=lambda t: (t.stream, t.seq))
        reasons = tuple(why[t] for t in tokens)
    return Fence(tokens, host_wait, reasons)


def _live(busy: set[str], st: StreamState, own: str | None, tracker: HazardTracker) -> tuple[bool, bool]:
    """Which groups a fence for consumer ``st`` must scan, ``(reads,
    writes)``: a group the consumer reads waits only on writers (RAW), so
    it is scanned when another stream has a *write* that may still run and
    that ``st`` is not ordered after (above the stream's mark and, for a
    device stream, above what ``st``'s clock covers; ``last_write`` tells,
    :meth:`HazardTracker.wrote`); a group it writes (WAR/WAW), when another
    stream has *any* such token. Otherwise every token a shadow could name
    is one the tracker's reduction drops, and the fence is the same without
    the scan. Host engines count as live while a token is above the mark
    (conservative: the scan then decides). ``busy`` is the tracker's set of
    streams with a token above the mark. O(len(busy))."""
    dev = st.clock.dev
    streams = tracker.streams
    writes = False
    for name in busy:
        if name == own:
            continue
        s = streams[name]
        floor = max(s.mark, dev.get(name, 0)) if s.kind is _DEVICE else s.mark
        if s.last_seq > floor:
            if s.last_write > floor:
                return True, True
            writes = True
    return False, writes


def tag(blocks: list[KVCacheBlock], token: Token, access: AccessKind, ended: Callable[[Token], bool]) -> None:
    """Write ``token`` into the shadows of ``blocks`` (the caller left out
    null blocks, or resets theirs). A write replaces the shadow
    (:func:`write`, what it replaced left unkept); a read joins the readers
    (:func:`with_read`), computed once per distinct old readers value and
    assigned to every block that had it: one identity test and one store
    per block. O(len(blocks))."""
    if access is _WRITE:
        write(blocks, token, None)
        return
    last_in: object = _UNSET
    last_out: Readers = None
    for b in blocks:
        r = b.readers
        if r is not last_in:
            last_in = r
            last_out = with_read(r, token, ended)
        b.readers = last_out


def write(blocks: list[KVCacheBlock], token: Token, null: KVCacheBlock | None) -> Replaced:
    """:func:`tag` of a write by ``token`` (``null``, the pool's null block,
    is skipped) that also returns what it replaced, for the undo of a failed
    write (:class:`~blockpool.core.pending_writes.PendingWrites`): a group
    per run of blocks with the same ``(writer, readers)`` objects; blocks
    whose writer is ``token`` already are left out and keep their shadow
    (the same write recorded again changes nothing: reads recorded since
    stay, and a failure of ``token`` still finds them). The caller
    refused a write recorded after an access ordered after it
    (``PoolBase._check_write_order``). One pass: per block, two reads, two
    identity tests and, unless left out, two stores and one append.
    O(len(blocks)).

    >>> from blockpool.core.block import KVCacheBlock
    >>> a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    >>> t1, t2 = Token("compute", 1), Token("compute", 2)
    >>> write([a, b], t1, None)
    [(None, None, [KVCacheBlock(block_id=1, ref_cnt=0, block_hash=None), KVCacheBlock(block_id=2, ref_cnt=0, block_hash=None)])]
    >>> [(str(w), [x.block_id for x in g]) for w, _, g in write([a, b, c], t2, None)]
    [('compute:1', [1, 2]), ('None', [3])]
    """
    replaced: Replaced = []
    seq, stream = token.seq, token.stream
    lw: object = _UNSET
    lr: object = _UNSET
    group: list[KVCacheBlock] | None = None  # None: the run's writer is ``token``
    for b in blocks:
        if b is null:
            continue
        w = b.writer
        r = b.readers
        if w is not lw or r is not lr:
            lw, lr = w, r
            if w is not None and w.seq == seq and w.stream == stream:
                group = None
            else:
                group = []
                replaced.append((w, r, group))
        if group is not None:
            b.writer = token
            b.readers = None
            group.append(b)
    return replaced


def settle(
    blocks: Iterable[KVCacheBlock], token: Token, null: KVCacheBlock, ended: Callable[[Token], bool]
) -> None:
    """A write by ``token``, which has ended, recorded late: ``token``
    becomes the writer of each block (``null`` skipped) whose writer is
    ``None``, or has ended and is not a later token of ``token``'s own
    device stream; readers are kept (a read still running stays waited
    on). A block whose writer may still run, or ran after ``token`` on
    its stream, keeps it (that write is the block's content). No fence
    changes: ``token`` has ended. Then a late failure report of
    ``token`` withdraws the keys of the blocks it is the writer of (a
    writer of another stream that ended is replaced: withdrawing keys is
    the safe side when the order is unknown). O(len(blocks)).

    >>> from blockpool.core.block import KVCacheBlock
    >>> b = KVCacheBlock(1)
    >>> settle([b], Token("compute", 1), KVCacheBlock(0), lambda t: True)
    >>> str(b.writer)
    'compute:1'
    """
    own = token.stream if token.kind is _DEVICE else None
    seq = token.seq
    for b in blocks:
        if b is null:
            continue
        w = b.writer
        if w is None or (ended(w) and not (w.stream == own and w.seq > seq)):
            b.writer = token


def clear(b: KVCacheBlock) -> None:
    """Empty ``b``'s shadow (the null block never keeps one). O(1)."""
    b.writer = b.readers = None


def restore(b: KVCacheBlock, writer: Token | None, readers: Readers, ended: Callable[[Token], bool]) -> None:
    """Undo a failed write of ``b``: its writer goes back to ``writer`` and
    the reads recorded since the failed write join ``readers``. O(k)."""
    b.writer = writer
    b.readers = _merge(readers, b.readers, ended)


def merge_readers(base: Readers, extra: Readers, ended: Callable[[Token], bool]) -> Readers:
    """``base`` with every read of ``extra`` joined (:func:`with_read`). O(k^2)."""
    return _merge(base, extra, ended)


def shadow_ready(w: Token | None, r: Readers, st: StreamState, tracker: HazardTracker) -> bool:
    """Whether a write by ``st`` to a block with shadow ``(w, r)`` waits on
    nothing. O(k^2), k = tokens in the shadow."""
    if w is None and r is None:
        return True
    return not tracker.reduce(_tokens(w, r), st)


def has_host(w: Token | None, r: Readers) -> bool:
    """Whether a shadow ``(writer, readers)`` names a host token. O(k)."""
    if w is not None and w.kind is _HOST:
        return True
    if r is None:
        return False
    return any(t.kind is _HOST for t in r)


def pending_host(w: Token | None, r: Readers, ended: Callable[[Token], bool]) -> frozenset[Token] | None:
    """The host tokens of a shadow ``(writer, readers)`` that have not
    ended, or ``None`` when there are none (the block need not be held).
    O(k)."""
    if (w is None or w.kind is not _HOST) and (r is None or (len(r) == 1 and r[0].kind is not _HOST)):
        return None  # no host token at all: the usual case
    pending = frozenset([t for t in _tokens(w, r) if t.kind is _HOST and not ended(t)])
    return pending or None
