"""Linked loads: the transfers that make up one load, withdrawn together.

On a hybrid model (full attention, sliding window, Mamba: several KV cache
groups, one block table each) a request's load is often posted as one
transfer per group, each with its own token. The content of the request's
prefix is valid only if every group's part arrived: when one part fails,
the keys the other parts' blocks were published under name a prefix the
request does not have, and an engine that recovers by recomputing the
request rewrites those blocks anyway. :class:`LoadGroups` records which
tokens were linked as one load (``HazardAwareBlockPool.link_loads``); when
a failure of one of them is applied, :func:`withdraw_linked` marks the
blocks whose write in effect is another linked token's invalid, so the pool
withdraws their keys and publishes them no more until they are rewritten.

Only keys and invalid marks follow the link. Fences, shadows, holds and the
other tokens' status do not: a linked transfer that did not fail still
writes (or wrote) its blocks, and what waits on it waits on that write.

>>> from blockpool.core.hazards import Token
>>> groups = LoadGroups()
>>> a, b, c = Token("h2d", 1), Token("h2d", 2), Token("h2d", 3)
>>> [str(t) for t in groups.link([a, b])]
['h2d:1', 'h2d:2']
>>> [str(t) for t in groups.link([c, b])]
['h2d:1', 'h2d:2', 'h2d:3']
>>> [str(t) for t in groups.members(c)], groups.members(Token("h2d", 4))
(['h2d:1', 'h2d:2', 'h2d:3'], [])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvariantError
from blockpool.core.hazards import Token
from blockpool.core.pending_writes import PendingWrites
from blockpool.core.tracker import HazardTracker

__all__ = ["LoadGroups", "withdraw_linked"]

_Key = tuple[str, int]


def _key(t: Token) -> _Key:
    # (stream, seq), not the Token: its __hash__ is a Python function in the pure build
    return (t.stream, t.seq)


class LoadGroups:
    """The links between tokens: token -> the list of every token linked
    with it (one list object per load, shared by its members; a merge
    appends the smaller loads' tokens to the largest's). Forgotten once nothing is left to withdraw
    (:meth:`prune`)."""

    __slots__ = ("_kept", "_of")

    MIN_PRUNE = 64
    """Linked tokens below which :meth:`prune_due` never asks for a pass."""

    def __init__(self) -> None:
        self._of: dict[_Key, list[Token]] = {}
        self._kept = 0  # linked tokens the last prune kept

    def __len__(self) -> int:
        """Linked tokens recorded. O(1)."""
        return len(self._of)

    def members(self, token: Token) -> list[Token]:
        """Every token linked with ``token``, itself included; ``[]`` when
        it is not linked. O(1) (the shared list)."""
        return self._of.get(_key(token), [])

    def link(self, tokens: list[Token]) -> list[Token]:
        """Link ``tokens`` (and every token already linked with one of
        them) into one load; returns its members. O(len(tokens) + members
        of the smaller loads merged)."""
        of = self._of
        group: list[Token] | None = None
        for t in tokens:  # keep the largest existing list, move the others into it
            g = of.get(_key(t))
            if g is not None and (group is None or len(g) > len(group)):
                group = g
        if group is None:
            group = []
        seen = {_key(t) for t in group}
        for t in tokens:
            g = of.get(_key(t))
            for u in [t] if g is None or g is group else g:
                k = _key(u)
                if k not in seen:
                    seen.add(k)
                    group.append(u)
                    of[k] = group
        return group

    def prune_due(self, num_blocks: int) -> bool:
        """Whether :meth:`prune` should run: the linked tokens reached twice
        what the last pass kept, and at least ``max(MIN_PRUNE, num_blocks //
        8)``, so a pass (O(num_blocks)) is paid for by as many links. O(1)."""
        return len(self._of) >= max(self.MIN_PRUNE, 2 * self._kept, num_blocks // 8)

    def prune(self, live: Callable[[Token], bool]) -> None:
        """Forget every load none of whose members is ``live`` (a failure of
        a member could still withdraw something). O(linked tokens)."""
        of = self._of
        drop = [k for k, g in of.items() if not any(live(t) for t in g)]
        for k in drop:
            del of[k]
        self._kept = len(of)

    def _check(self, tracker: HazardTracker) -> None:
        """Assert: every linked token was issued on a registered stream,
        and each load's list holds its members once, each mapped to that
        list. O(linked tokens).

        Raises:
            InvariantError: the first broken invariant.
        """
        for (stream, seq), group in self._of.items():
            st = tracker.streams.get(stream)
            if st is None or not 0 < seq <= st.last_seq:
                raise InvariantError(f"linked token {stream}:{seq} was never issued")
            keys = [_key(t) for t in group]
            if (stream, seq) not in keys or len(set(keys)) != len(keys):
                raise InvariantError(f"the load of {stream}:{seq} does not list it exactly once")
            for k in keys:
                if self._of.get(k) is not group:
                    raise InvariantError(
                        f"{k[0]}:{k[1]} is listed in the load of {stream}:{seq} but not linked to it"
                    )


def withdraw_linked(
    failed: Token,
    others: Iterable[Token],
    writes: PendingWrites,
    blocks: Iterable[KVCacheBlock],
) -> list[KVCacheBlock]:
    """``failed`` failed: of ``blocks`` (every block of the pool), those
    whose write in effect is one of ``others`` (tokens linked with it) get
    an invalid mark naming ``failed`` and are returned (their keys must
    go). Shadows are left as they are. O(len(blocks) + len(others))."""
    keys = {_key(t) for t in others}
    out: list[KVCacheBlock] = []
    if not keys:
        return out
    for b in blocks:
        w = b.writer
        if w is not None and (w.stream, w.seq) in keys:
            out.append(b)
    writes.mark_invalid(out, failed)
    return out
