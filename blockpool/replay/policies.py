"""Wait policies compared by a replay: what an access actually waits on.

The pool computes the exact fence of every access. A policy decides what the
simulated consumer waits on instead:

- ``exact``: the pool's fence, as it is.
- ``step-event``: each ``DEVICE`` stream the fence names is replaced by the
  newest token issued so far on that stream (one coarse "step done" event per
  stream); a transfer (load, store) also always waits on the newest
  ``compute`` token, i.e. on all compute enqueued before it, as vLLM's
  offload connectors do.
- ``device-sync``: the newest token of every ``DEVICE`` stream (a
  device-wide synchronize).
- ``blind``: nothing (the pool runs with ``track_hazards=False``, so fences
  are empty and no block is held back): the negative control.

``HOST``-engine tokens of a fence are kept as they are by every policy but
``blind``: a newer token of an out-of-order engine does not cover an older
one, and a device synchronize does not wait for a NIC. Tokens already known
to have ended are dropped (waiting on them costs nothing), as is the
consumer's own stream when it is an in-order ``DEVICE`` stream. All policies
but ``blind`` keep the pool's hold-back of blocks with pending host-engine
accesses.

>>> from blockpool.core.hazards import Fence, StreamKind, Token
>>> kinds = {"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE}
>>> newest = {"compute": Token("compute", 9), "h2d": Token("h2d", 4)}
>>> f = Fence((Token("compute", 5),))
>>> def waits(policy, transfer):
...     p = WaitPolicy(policy, kinds, newest, lambda t: False)
...     return [str(t) for t in p.waits(f, "h2d", transfer=transfer)]
>>> waits("exact", True), waits("step-event", True), waits("device-sync", False), waits("blind", True)
(['compute:5'], ['compute:9'], ['compute:9'], [])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from blockpool.core.errors import BlockPoolError
from blockpool.core.hazards import Fence, StreamKind, Token

__all__ = ["POLICIES", "UnknownPolicyError", "WaitPolicy", "parse_policies"]

POLICIES: tuple[str, ...] = ("exact", "step-event", "device-sync", "blind")
"""Every policy, in report order."""


class UnknownPolicyError(BlockPoolError, ValueError):
    """A policy name that is not one of :data:`POLICIES` (or none at all)."""


def parse_policies(spec: str) -> tuple[str, ...]:
    """``"exact,blind"`` -> ``("exact", "blind")``, de-duplicated, in the
    order given. O(len(spec)).

    Raises:
        UnknownPolicyError: an unknown name, or no name.
    """
    names: list[str] = []
    for raw in spec.split(","):
        name = raw.strip()
        if not name:
            continue
        if name not in POLICIES:
            raise UnknownPolicyError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        if name not in names:
            names.append(name)
    if not names:
        raise UnknownPolicyError(f"no policy given; choose from {', '.join(POLICIES)}")
    return tuple(names)


class WaitPolicy:
    """Turns a pool fence into the tokens a consumer waits on.

    Args:
        name: One of :data:`POLICIES`.
        kinds: ``{stream: StreamKind}`` of the machine.
        newest: The newest token issued so far per stream; the caller keeps
            this mapping up to date (it is read, never copied).
        is_ended: Whether a token is known to have ended.

    Raises:
        UnknownPolicyError: an unknown ``name``.
    """

    __slots__ = ("_device", "_ended", "_newest", "name")

    def __init__(
        self,
        name: str,
        kinds: Mapping[str, StreamKind],
        newest: Mapping[str, Token],
        is_ended: Callable[[Token], bool],
    ) -> None:
        if name not in POLICIES:
            raise UnknownPolicyError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        self.name = name
        self._device = tuple(s for s, k in kinds.items() if k is StreamKind.DEVICE)
        self._newest = newest
        self._ended = is_ended

    @property
    def track_hazards(self) -> bool:
        """Whether the pool computes fences and holds blocks back (all but ``blind``)."""
        return self.name != "blind"

    def waits(self, fence: Fence, consumer: str, *, transfer: bool = False) -> tuple[Token, ...]:
        """The tokens the consumer on stream ``consumer`` waits on in place
        of ``fence``; ``transfer``: the access is a load or a store.
        O(#streams + len(fence)).
        """
        name = self.name
        if name == "exact":
            return fence.tokens
        if name == "blind":
            return ()
        host = [t for t in fence.tokens if t.kind is StreamKind.HOST]
        if name == "step-event":
            streams = {t.stream for t in fence.tokens if t.kind is StreamKind.DEVICE}
            if transfer:
                streams.add("compute")
            names = [s for s in self._device if s in streams]
        else:
            names = list(self._device)
        out: list[Token] = []
        newest = self._newest
        for s in names:
            t = newest.get(s)
            if t is not None and s != consumer and not self._ended(t):
                out.append(t)
        out.extend(host)
        return tuple(out)
