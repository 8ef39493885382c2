"""Block generations: which allocation last handed each block out.

A connector may keep a copy of a block table after the scheduler freed some
of its blocks (a sliding window's middle, say); a block freed and allocated
again since holds another request's data. :class:`Generations` numbers
allocations and remembers, per block, the serial of the one that last
handed it out; a table taken with its generations can then be checked
before a transfer uses it (:func:`check_fresh`). Off until the pool's
``generations()`` is first called: until then no allocation pays anything.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvalidArgumentError, InvariantError, StaleBlockError

__all__ = ["Generations", "check_fresh"]


class Generations:
    """One unsigned 64-bit word per block (8 B/block), the serial of the
    allocation that last handed the block out; 0 for a block never handed
    out since generations were turned on, and always for the null block
    (block 0). Owns the array and the serial; changed only by
    :meth:`stamp`.

    >>> from blockpool.core.block import KVCacheBlock
    >>> g = Generations(4)
    >>> blocks = [KVCacheBlock(1), KVCacheBlock(2)]
    >>> _ = g.stamp(blocks); _ = g.stamp(blocks[:1])
    >>> g.of(blocks)
    (2, 1)
    """

    __slots__ = ("_gens", "_serial")

    def __init__(self, num_blocks: int) -> None:
        self._gens = array("Q", (0,)) * num_blocks  # exactly sized (frombytes over-allocates 1/16)
        self._serial = 0

    def of(self, blocks: Iterable[KVCacheBlock]) -> tuple[int, ...]:
        """The generation of each block, in order. O(len(blocks))."""
        gens = self._gens
        return tuple([gens[b.block_id] for b in blocks])

    def stamp(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Give newly allocated ``blocks`` the next serial; returns
        ``blocks``. O(len(blocks))."""
        self._serial = serial = self._serial + 1
        gens = self._gens
        for b in blocks:
            gens[b.block_id] = serial
        return blocks

    def _check(self, num_blocks: int) -> None:
        """Raise :class:`InvariantError` unless there is one entry per block,
        0 for the null block, none past the serial. O(num_blocks)."""
        gens = self._gens
        if len(gens) != num_blocks or gens[0] != 0 or max(gens) > self._serial:
            raise InvariantError(
                "the generation array is not one entry per block, 0 for the null block, "
                "none past the allocation serial"
            )


def check_fresh(
    now: Generations | None,
    blocks: Sequence[KVCacheBlock],
    generations: Sequence[object],
    null: KVCacheBlock,
    what: str,
) -> None:
    """Raise :class:`StaleBlockError` if a block of ``blocks`` (the null
    block skipped) has a generation other than the one ``generations``
    (aligned with ``blocks``, as the pool's ``generations()`` returned it)
    records: it was allocated again since. ``now`` is ``None`` while
    generations are off (every block's is 0). Changes nothing.
    O(len(blocks)).

    Raises:
        InvalidArgumentError: ``generations`` is not as long as ``blocks``,
            or holds something other than ints.
        StaleBlockError: the first stale block.
    """
    if len(generations) != len(blocks):
        raise InvalidArgumentError(
            f"{what}: {len(generations)} generations for {len(blocks)} blocks; "
            "pass the tuple pool.generations(blocks) returned for this table"
        )
    gens = now._gens if now is not None else None
    if (
        gens is not None
        and [gens[b.block_id] for b in blocks] == list(generations)
        and set(map(type, generations)) <= {int}
    ):
        return  # the usual answer, in one pass and two C-level comparisons
    for b, g in zip(blocks, generations):
        if type(g) is not int:
            raise InvalidArgumentError(f"{what}: a generation must be an int, got {g!r}")
        if b is null:
            continue
        cur = gens[b.block_id] if gens is not None else 0
        if cur != g:
            raise StaleBlockError(
                f"{what}: block {b.block_id} was freed and allocated again since the block "
                f"table was taken (generation {cur} now, the table has {g}): it holds "
                "another request's data",
                b.block_id,
                cur,
                g,
            )
