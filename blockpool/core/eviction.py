"""Eviction policies of the free queue: which free cached block loses its
keys first.

``"lru"`` (the default) is vLLM v1's order exactly: the plain
:class:`~blockpool.core.block.FreeBlockQueue` (unkeyed blocks in front, cached
blocks appended at the back when freed, the front evicted first). The pool
then runs its usual code; no policy object is consulted on any path.

The other policies keep blocks that were hit longer. Both keep the one
intrusive list of :class:`FreeBlockQueue` (so every walk and check of the
pool works unchanged) and add a *divider* record that splits
the cached part into two segments::

    head | unkeyed blocks ... | S (probation) ... | DIVIDER | M (protected) ... | tail

A block's hit count is kept in a side dict (block id -> hits since it was
last handed out, capped at 3), so a block record stays 8 slots. A hit is a
``touch`` (or ``allocate_for(hits=...)``) of a keyed block. Unkeyed free
blocks are handed out first under every policy, as in vLLM.

- ``"s3fifo"``: S3-FIFO (Juncheng Yang, Yazhuo Zhang, Ziyue Qiu, Yao Yue,
  Rashmi Vinayak, "FIFO queues are all you need for cache eviction",
  SOSP 2023). A freed cached block that was never hit enters the small FIFO
  S, unless its key is in the ghost queue G (it was evicted from S
  recently, so it has come back), in which case it enters the main FIFO M;
  a block that was hit enters M. Eviction takes S's head while S holds at
  least 10% of the free cached blocks (or M is empty), recording its key in
  G (G holds at most as many keys as the pool has blocks, FIFO); otherwise
  M's head, which, if it was hit, is reinserted at M's tail with its count
  decremented (lazy promotion, the paper's "second chance" with a 2-bit
  counter) instead of being evicted. O(1) amortised per block: each
  reinsertion spends one of at most 3 hits counted per hit.
- ``"2q"``: never-hit blocks first, the segmented idea of 2Q (Theodore
  Johnson, Dennis Shasha, "2Q: a low overhead high performance buffer
  management replacement algorithm", VLDB 1994: a block seen once sits in
  A1, one re-referenced in Am, and A1 is emptied first) as in SLRU (Karedla,
  Love, Wherry, IEEE Computer 1994). A freed cached block that was never
  hit since it was last handed out goes to the tail of S, one that was hit
  to the tail of M; eviction takes S's head, and M's head only when S is
  empty. LRU within each segment. O(1) per block.

Adding a policy: subclass :class:`PolicyFreeBlockQueue`, implement
``_victim`` and register it in :data:`EVICTION_POLICIES`.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator

from blockpool.core._mypyc import mypyc_attr
from blockpool.core.block import FreeBlockQueue, KVCacheBlock
from blockpool.core.errors import InvalidArgumentError, InvariantError

__all__ = [
    "EVICTION_POLICIES",
    "PolicyFreeBlockQueue",
    "S3FifoFreeBlockQueue",
    "TwoQFreeBlockQueue",
    "UnknownEvictionPolicyError",
    "make_free_queue",
]

_MAX_FREQ = 3
_S_SHARE = 0.1


@mypyc_attr(native_class=False)
class UnknownEvictionPolicyError(InvalidArgumentError):
    """An eviction policy or placement name that is not known."""


class PolicyFreeBlockQueue(FreeBlockQueue):
    """A :class:`FreeBlockQueue` with two cached segments (S before the
    divider, M after it) and per-block hit counts. Subclasses choose the
    victim among S's head and M's head (``_victim``).

    Attributes:
        freq: ``{block_id: hits}`` (capped at 3) since the block was last
            handed out; only blocks hit at least once have an entry.
        seg: ``{block_id: 0 (S) or 1 (M)}`` for blocks linked into a segment.
        n_small, n_main: Blocks in S and M.

    Complexity: every operation O(1) per block (amortised for S3-FIFO);
    memory: two dict entries per cached block at most.
    """

    name = "?"

    def __init__(self, blocks: list[KVCacheBlock], capacity: int) -> None:
        super().__init__(blocks)
        div = KVCacheBlock(-2)
        last = self.tail.prev_free_block
        assert last is not None
        last.next_free_block = div
        div.prev_free_block = last
        div.next_free_block = self.tail
        self.tail.prev_free_block = div
        self.divider = div
        self.freq: dict[int, int] = {}
        self.seg: dict[int, int] = {}
        self.n_small = 0
        self.n_main = 0
        self.capacity = capacity

    # -- hooks the pool calls --------------------------------------------------

    def on_hit(self, blocks: list[KVCacheBlock]) -> None:
        """Count a hit on each keyed block (capped at 3). O(len(blocks))."""
        freq = self.freq
        for b in blocks:
            if b.block_hash is not None:
                bid = b.block_id
                f = freq.get(bid, 0)
                if f < _MAX_FREQ:
                    freq[bid] = f + 1

    def remove_n(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """:meth:`FreeBlockQueue.remove_n`, leaving the blocks' segments
        too. O(len(blocks))."""
        seg = self.seg
        for b in blocks:
            if b.prev_free_block is not None:
                s = seg.pop(b.block_id, None)
                if s is not None:
                    if s:
                        self.n_main -= 1
                    else:
                        self.n_small -= 1
        return super().remove_n(blocks)

    def take_n(self, blocks: list[KVCacheBlock]) -> None:
        """:meth:`remove_n`, forgetting the blocks' hit counts (they are
        handed out). O(len(blocks))."""
        self.remove_n(blocks)
        freq = self.freq
        for b in blocks:
            freq.pop(b.block_id, None)

    # -- queue operations ------------------------------------------------------

    def __iter__(self) -> Iterator[KVCacheBlock]:
        div = self.divider
        for b in super().__iter__():
            if b is not div:
                yield b

    def _unlink(self, b: KVCacheBlock) -> None:
        prev, nxt = b.prev_free_block, b.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        b.prev_free_block = b.next_free_block = None

    def _link_before(self, b: KVCacheBlock, at: KVCacheBlock) -> None:
        prev = at.prev_free_block
        assert prev is not None
        prev.next_free_block = b
        b.prev_free_block = prev
        b.next_free_block = at
        at.prev_free_block = b

    def remove(self, b: KVCacheBlock) -> None:
        """Unlink ``b`` (which must be in the queue). O(1)."""
        s = self.seg.pop(b.block_id, None)
        if s is not None:
            if s:
                self.n_main -= 1
            else:
                self.n_small -= 1
        self._unlink(b)
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert freed cached ``blocks``, each at the tail of its segment
        (``_segment_for``). O(len)."""
        seg, div, tail = self.seg, self.divider, self.tail
        for b in blocks:
            if self._segment_for(b):
                self._link_before(b, tail)
                seg[b.block_id] = 1
                self.n_main += 1
            else:
                self._link_before(b, div)
                seg[b.block_id] = 0
                self.n_small += 1
        self.num_free_blocks += len(blocks)

    def _segment_for(self, b: KVCacheBlock) -> int:
        """0 (S) or 1 (M) for a freed cached block."""
        return 1 if b.block_id in self.freq else 0

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return ``n`` blocks: unkeyed blocks in front first,
        then the policy's victims (``_victim``). O(n) (amortised)."""
        out: list[KVCacheBlock] = []
        head, div, seg, freq = self.head, self.divider, self.seg, self.freq
        while len(out) < n:
            b = head.next_free_block
            assert b is not None
            if b is not div and b.block_id not in seg:
                self._unlink(b)  # an unkeyed block in front
            else:
                b = self._victim()
                s = seg.pop(b.block_id)
                if s:
                    self.n_main -= 1
                else:
                    self.n_small -= 1
                self._unlink(b)
            freq.pop(b.block_id, None)
            out.append(b)
        self.num_free_blocks -= n
        return out

    def _victim(self) -> KVCacheBlock:
        raise NotImplementedError

    def _s_head(self) -> KVCacheBlock | None:
        b = self.head.next_free_block
        while b is not self.divider:
            assert b is not None
            if b.block_id in self.seg:
                return b
            b = b.next_free_block  # unkeyed blocks precede S (only reached if called mid-front)
        return None

    def _m_head(self) -> KVCacheBlock | None:
        b = self.divider.next_free_block
        return None if b is self.tail else b

    def check(self) -> list[KVCacheBlock]:
        """Walk the list: links, the count, the divider, each block in its
        segment and the segment counts. O(n). Raises :class:`InvariantError`."""
        return _check(self)


def _check(q: PolicyFreeBlockQueue) -> list[KVCacheBlock]:
    seen: list[KVCacheBlock] = []
    prev = q.head
    b = q.head.next_free_block
    in_main = False
    small = main = 0
    div_seen = False
    while b is not q.tail:
        if b is None or b.prev_free_block is not prev:
            raise InvariantError("free queue links are broken")
        if b is q.divider:
            div_seen = in_main = True
        else:
            s = q.seg.get(b.block_id)
            if s is not None:
                if s != in_main:
                    raise InvariantError(f"block {b.block_id} is linked outside its segment")
                small += not s
                main += s
            elif in_main:
                raise InvariantError(f"block {b.block_id} is behind the divider with no segment")
            seen.append(b)
            if len(seen) > q.num_free_blocks:
                raise InvariantError("free queue is longer than num_free_blocks")
        prev, b = b, b.next_free_block
    if q.tail.prev_free_block is not prev or not div_seen:
        raise InvariantError("free queue tail link or divider is broken")
    if len(seen) != q.num_free_blocks:
        raise InvariantError(f"num_free_blocks={q.num_free_blocks} but {len(seen)} blocks are linked")
    if (small, main) != (q.n_small, q.n_main) or small + main != len(q.seg):
        raise InvariantError(f"segment counts {q.n_small}/{q.n_main} but {small}/{main} linked")
    return seen


class TwoQFreeBlockQueue(PolicyFreeBlockQueue):
    """``"2q"``: never-hit cached blocks are evicted before hit ones (see the
    module docstring; Johnson & Shasha, VLDB 1994). O(1) per block."""

    name = "2q"

    def _victim(self) -> KVCacheBlock:
        b = self._s_head()
        if b is None:
            b = self._m_head()
        assert b is not None
        return b


class S3FifoFreeBlockQueue(PolicyFreeBlockQueue):
    """``"s3fifo"``: S3-FIFO (Yang et al., SOSP 2023; see the module
    docstring). Ghost keys: at most ``capacity`` (the pool's block count),
    oldest dropped first. O(1) amortised per block."""

    name = "s3fifo"

    def __init__(self, blocks: list[KVCacheBlock], capacity: int) -> None:
        super().__init__(blocks, capacity)
        self.ghost: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    def _segment_for(self, b: KVCacheBlock) -> int:
        if b.block_id in self.freq:
            return 1
        g = self.ghost
        if g and b.block_hash in g:
            del g[b.block_hash]
            return 1
        return 0

    def _victim(self) -> KVCacheBlock:
        freq = self.freq
        while True:
            s = self._s_head()
            m = self._m_head()
            if s is not None and (m is None or self.n_small >= _S_SHARE * (self.n_small + self.n_main)):
                if s.block_id in freq and s.block_hash is not None:
                    # hit while in S (possible after a key move): promote to M
                    self.seg[s.block_id] = 1
                    self.n_small -= 1
                    self.n_main += 1
                    self._unlink(s)
                    self._link_before(s, self.tail)
                    continue
                if s.block_hash is not None:
                    g = self.ghost
                    g[s.block_hash] = None
                    if len(g) > self.capacity:
                        g.popitem(last=False)
                return s
            assert m is not None
            f = freq.get(m.block_id, 0)
            if f > 0 and m.block_hash is not None:
                if f == 1:
                    del freq[m.block_id]
                else:
                    freq[m.block_id] = f - 1
                self._unlink(m)
                self._link_before(m, self.tail)
                continue
            return m


EVICTION_POLICIES: dict[str, type[PolicyFreeBlockQueue] | None] = {
    "lru": None,
    "s3fifo": S3FifoFreeBlockQueue,
    "2q": TwoQFreeBlockQueue,
}
"""Eviction policies by name; ``None``: the plain LRU :class:`FreeBlockQueue`."""


def make_free_queue(policy: object, blocks: list[KVCacheBlock], capacity: int) -> FreeBlockQueue:
    """The free queue for eviction ``policy``. O(len(blocks)).

    Raises:
        UnknownEvictionPolicyError: ``policy`` is not a key of
            :data:`EVICTION_POLICIES`.
    """
    try:
        cls = EVICTION_POLICIES[policy]  # type: ignore[index]
    except (KeyError, TypeError):
        raise UnknownEvictionPolicyError(
            f"unknown eviction policy {policy!r}; choose from {', '.join(EVICTION_POLICIES)}"
        ) from None
    return FreeBlockQueue(blocks) if cls is None else cls(blocks, capacity)
