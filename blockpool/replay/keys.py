"""Prefix-chain block keys for replayed requests.

A replayed request describes its tokens as *segments*: ``(content_id,
num_tokens)`` pairs laid end to end, where equal content ids name equal
token content (a Mooncake ``hash_id``, a synthetic system prompt, one
conversation turn). :class:`BlockKeys` cuts that sequence into blocks of
``block_size`` tokens and gives each full block a prefix-cache key that
names the whole prefix up to the block's end, as vLLM's block hashes do.

Key forms (plain tuples of ints: hashable, picklable, and hashed the same in
every process, since ``hash()`` of ints and tuples of ints does not depend on
``PYTHONHASHSEED``):

- a full block that lies inside one segment at an offset that is a multiple
  of the block size: ``(parent, content_id, sub_index)``; for a Mooncake
  trace this is the sub-block ``sub_index`` (0..31 for 16-token blocks) of
  the 512-token hash block ``content_id``;
- any other full block: ``(parent, id1, offset1, n1, id2, offset2, n2, ...)``,
  one ``(content_id, offset in segment, tokens)`` triple per piece;
- a partial block (the first ``n < block_size`` tokens of a block), used for
  copy-on-write of shared tails: the same piece form, whose token counts sum
  to ``n``, so it never equals a full-block key.

``parent`` is ``hash()`` of the previous block's key (``ROOT_DIGEST`` for the
first block): a 64-bit digest, as vLLM's parent block hash is. Two different
prefixes collide only if their digests do (probability about ``k^2 / 2^65``
for ``k`` keys; about 2e-6 for the whole Mooncake conversation trace).

>>> keys = BlockKeys([(7, 512), (9, 100)], block_size=16)
>>> len(keys), keys.num_tokens
(38, 612)
>>> keys.full[0] == (ROOT_DIGEST, 7, 0), keys.full[31][1:], keys.full[32][1:]
(True, (7, 31), (9, 0))
>>> keys.partial(38, 4)[1:]          # first 4 tokens of the partial tail
(9, 96, 4)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from blockpool.core.errors import InvalidArgumentError

__all__ = ["ROOT_DIGEST", "BlockKeys", "Segment"]

ROOT_DIGEST = 0
"""The ``parent`` of a sequence's first block."""

Segment = tuple[int, int]
"""``(content_id, num_tokens)``: ``num_tokens >= 1`` tokens whose content is
named by the int ``content_id``."""


class BlockKeys:
    """The prefix-cache keys of one token sequence cut into blocks.

    Args:
        segments: The sequence as ``(content_id, num_tokens)`` pairs, in order.
        block_size: Tokens per block (``>= 1``).

    Attributes:
        block_size: Tokens per block.
        num_tokens: Tokens in the sequence (sum of the segment lengths).
        full: One key per *full* block, in chain order
            (``num_tokens // block_size`` keys).

    Raises:
        InvalidArgumentError: ``block_size`` is not an int ``>= 1``, or a
            segment is not an ``(int, int >= 1)`` pair.

    Runtime complexity: O(num_tokens / block_size + len(segments)) time and
    memory.
    """

    __slots__ = ("_segments", "_starts", "block_size", "full", "num_tokens")

    def __init__(self, segments: Sequence[Segment], block_size: int) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        segs: list[Segment] = []
        starts: list[int] = []
        pos = 0
        for seg in segments:
            try:
                cid, n = seg
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"a segment is a (content_id, num_tokens) pair, got {seg!r}"
                ) from None
            if not isinstance(cid, int) or not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise InvalidArgumentError(f"bad segment {seg!r}: need (int, int >= 1)")
            segs.append((cid, n))
            starts.append(pos)
            pos += n
        self.block_size = block_size
        self.num_tokens = pos
        self._segments = segs
        self._starts = starts
        self.full: list[tuple[int, ...]] = self._full_keys()

    def __len__(self) -> int:
        """Number of full blocks."""
        return len(self.full)

    def _full_keys(self) -> list[tuple[int, ...]]:
        bs = self.block_size
        keys: list[tuple[int, ...]] = []
        append = keys.append
        parent = ROOT_DIGEST
        pieces: list[int] = []
        fill = 0
        for cid, length in self._segments:
            off = 0
            while off < length:
                if fill == 0 and length - off >= bs:
                    key: tuple[int, ...] = (
                        (parent, cid, off // bs) if off % bs == 0 else (parent, cid, off, bs)
                    )
                    append(key)
                    parent = hash(key)
                    off += bs
                    continue
                take = min(length - off, bs - fill)
                pieces += (cid, off, take)
                fill += take
                off += take
                if fill == bs:
                    key = (parent, *pieces)
                    append(key)
                    parent = hash(key)
                    pieces = []
                    fill = 0
        return keys

    def parent_digest(self, index: int) -> int:
        """The ``parent`` of block ``index``: ``hash(full[index - 1])``, or
        ``ROOT_DIGEST`` for block 0. O(1).

        Raises:
            InvalidArgumentError: ``index`` is outside ``0 .. len(full)``.
        """
        if not isinstance(index, int) or not 0 <= index <= len(self.full):
            raise InvalidArgumentError(f"block index {index!r} outside 0..{len(self.full)}")
        return hash(self.full[index - 1]) if index else ROOT_DIGEST

    def partial(self, index: int, num_tokens: int) -> tuple[int, ...]:
        """The key of the first ``num_tokens`` tokens of block ``index``
        (a partial block: ``1 <= num_tokens < block_size``). Equal for two
        sequences exactly when they agree on every token up to
        ``index * block_size + num_tokens`` (up to digest collisions).
        O(log(len(segments)) + pieces).

        Raises:
            InvalidArgumentError: ``num_tokens`` outside ``1 .. block_size - 1``,
                or the sequence has fewer than ``index * block_size + num_tokens``
                tokens.
        """
        bs = self.block_size
        if not isinstance(num_tokens, int) or not 1 <= num_tokens < bs:
            raise InvalidArgumentError(f"a partial block holds 1..{bs - 1} tokens, got {num_tokens!r}")
        if not isinstance(index, int) or index < 0 or index * bs + num_tokens > self.num_tokens:
            raise InvalidArgumentError(
                f"block {index!r} with {num_tokens} tokens is beyond the sequence ({self.num_tokens} tokens)"
            )
        out: list[int] = [self.parent_digest(index)]
        pos = index * bs
        end = pos + num_tokens
        i = bisect.bisect_right(self._starts, pos) - 1
        while pos < end:
            cid, length = self._segments[i]
            off = pos - self._starts[i]
            take = min(length - off, end - pos)
            out += (cid, off, take)
            pos += take
            i += 1
        return tuple(out)
