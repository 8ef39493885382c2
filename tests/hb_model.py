"""An independent, brute-force happens-before model of the hazard contract.

It shares no code with the pool's fence computation (``blockpool.core.tracker``,
``HazardAwareBlockPool._fence``): it keeps the *whole* access history of every
block and the explicit happens-before graph of every token (predecessor
edges), and answers reachability by depth-first search. Slow and obviously
right; used by the stateful test to judge every fence the pool hands out.
"""

from __future__ import annotations

from collections.abc import Iterable

from blockpool import AccessKind, Fence, StreamKind, Token

READ, WRITE = AccessKind.READ, AccessKind.WRITE


class HBModel:
    def __init__(self, streams: dict[str, StreamKind]):
        self.kinds = dict(streams)
        self.preds: dict[Token, set[Token]] = {}
        self.last: dict[str, Token | None] = dict.fromkeys(streams)
        # Tokens each DEVICE stream has waited on (persisting waits).
        self.waited: dict[str, set[Token]] = {s: set() for s in streams}
        self.ended_direct: set[Token] = set()  # completed
        self.failed: set[Token] = set()  # failed or abandoned
        self.history: dict[int, list[tuple[Token, AccessKind]]] = {}

    # -- graph ---------------------------------------------------------------

    def issue(self, token: Token, waited: Iterable[Token] = ()) -> None:
        """``token`` was issued on its stream after waiting on ``waited``."""
        preds = set(waited)
        if self.kinds[token.stream] is StreamKind.DEVICE:
            prev = self.last[token.stream]
            if prev is not None:
                preds.add(prev)
            preds |= self.waited[token.stream]
        self.preds[token] = preds
        self.last[token.stream] = token

    def stream_waits(self, stream: str, fence: Iterable[Token]) -> None:
        if self.kinds[stream] is StreamKind.DEVICE:
            self.waited[stream] |= set(fence)

    def ancestors(self, roots: Iterable[Token]) -> set[Token]:
        """Every token happening before (or equal to) one of ``roots``."""
        seen: set[Token] = set()
        stack = list(roots)
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            stack.extend(self.preds.get(t, ()))
        return seen

    def hb(self, t: Token, u: Token) -> bool:
        return t in self.ancestors([u])

    def known_ended(self) -> set[Token]:
        """Completed tokens and everything before them; failed tokens only
        themselves (a transfer may fail before it waited), except that on a
        DEVICE stream the last token before a failed one that did not fail
        itself completed normally.

        "Everything before" a completed token goes through failed tokens
        too: by the protocol (docs/hazard-model.md, "Failure and coverage")
        a consumer proceeds only past fence tokens that completed, so a
        completed token's whole chain of waits completed, and a failure
        reported for a token on that chain speaks of its content only (a
        late failure: it withdraws keys, and restores nothing)."""
        roots = set(self.ended_direct)
        for f in self.failed:
            if self.kinds[f.stream] is not StreamKind.DEVICE:
                continue
            seq = f.seq - 1  # the last token before f that did not fail itself
            while seq >= 1 and Token(f.stream, seq) in self.failed:
                seq -= 1
            if seq >= 1:
                roots.add(Token(f.stream, seq))
        return self.ancestors(roots) | self.failed

    def consumer_position(self, stream: str) -> set[Token]:
        """What a new access on ``stream`` is already ordered after."""
        if self.kinds[stream] is not StreamKind.DEVICE:
            return set()
        roots = set(self.waited[stream])
        if self.last[stream] is not None:
            roots.add(self.last[stream])  # type: ignore[arg-type]
        return self.ancestors(roots)

    # -- accesses ------------------------------------------------------------

    def tag(self, block_ids: Iterable[int], token: Token, kind: AccessKind) -> None:
        for b in block_ids:
            self.history.setdefault(b, []).append((token, kind))

    def required(self, groups: Iterable[tuple[Iterable[int], AccessKind]], stream: str) -> set[Token]:
        ended = self.known_ended()
        before = self.consumer_position(stream)
        device = self.kinds[stream] is StreamKind.DEVICE
        req: set[Token] = set()
        for block_ids, access in groups:
            for b in block_ids:
                for t, k in self.history.get(b, ()):
                    if access is READ and k is READ:
                        continue
                    if t in ended or t in before or (device and t.stream == stream):
                        continue
                    req.add(t)
        return req

    def judge(self, fence: Fence, groups: list[tuple[list[int], AccessKind]], stream: str) -> None:
        """Assert ``fence`` is exact for the access: no missed hazard, no
        redundant wait, and the host-wait mark is right."""
        req = self.required(groups, stream)
        tokens = list(fence)

        def covered(t: Token, by: list[Token]) -> bool:
            return any(t == f or self.hb(t, f) for f in by)

        missed = [t for t in req if not covered(t, tokens)]
        assert not missed, f"missed hazard(s) {sorted(map(str, missed))}; fence {sorted(map(str, tokens))}"
        for f in tokens:
            rest = [g for g in tokens if g != f]
            assert any(not covered(t, rest) for t in req), (
                f"redundant wait on {f}: required {sorted(map(str, req))}, fence {sorted(map(str, tokens))}"
            )
        want_host = bool(tokens) and (
            self.kinds[stream] is StreamKind.HOST
            or any(self.kinds[t.stream] is StreamKind.HOST for t in tokens)
        )
        assert fence.needs_host_wait == want_host, (
            f"needs_host_wait={fence.needs_host_wait}, want {want_host}"
        )

    # -- failures and content ------------------------------------------------

    def report(self, token: Token, failed: bool) -> bool:
        """Apply a completion report; returns whether it is a *late* failure
        (``token`` had already ended, through another token's completion or
        a later token of its in-order stream): that one ends nothing and
        restores nothing, it speaks of ``token``'s content only."""
        if token in self.known_ended():
            return failed
        (self.failed if failed else self.ended_direct).add(token)
        return False

    def write_in_effect(self, block_id: int) -> Token | None:
        """The write whose content the block holds: the last write of its
        history that was not undone (a token that failed before it ended
        restores what it replaced). A late failure undoes nothing."""
        for t, k in reversed(self.history.get(block_id, [])):
            if k is WRITE and t not in self.failed:
                return t
        return None

    def pending_host(self, block_id: int) -> set[Token]:
        """Host tokens that still may access the block: not known to have
        ended and not ordered before a later write of it."""
        ended = self.known_ended()
        hist = self.history.get(block_id, [])
        out = set()
        for i, (t, _) in enumerate(hist):
            if self.kinds[t.stream] is not StreamKind.HOST or t in ended:
                continue
            if any(
                k is WRITE and u != t and u not in self.failed and self.hb(t, u) for u, k in hist[i + 1 :]
            ):
                continue
            out.add(t)
        return out
