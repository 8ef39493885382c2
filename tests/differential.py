"""Differential run: every fence the pool hands out, on many random
sequences with failures, against the independent happens-before model.

The sequences are the stateful test's (``tests/test_stateful.py``:
allocate with prefix hits / free with READ or WRITE / tag / load / store /
copy / cache / complete / fail of every writer kind, late failures
included); the expectation is :class:`tests.hb_model.HBModel`'s, which
shares no code with the pool's fence computation. Instead of stopping at
the first wrong fence, the run *counts*:

``fences``
    fences judged (every ``allocate_for``, ``fence_for``, ``begin_load``,
    ``begin_store``, ``begin_copy`` of the sequences, empty ones included);
``missed``
    tokens the model requires that no token of the fence covers (is, or
    happens after);
``redundant``
    fence tokens whose removal leaves every required token covered;
``host_mark_wrong``
    fences whose ``needs_host_wait`` differs from the model's;
``unsafe``
    blocks handed out (new or prefix hit of ``allocate_for``) while an
    access the model says may still run on them conflicts and is not
    covered by the fence; ``unsafe_accesses`` the same over every call's
    blocks.

Run ``python benchmarks/differential.py --sequences 20000`` (one JSON
object on stdout); the always-run test (``tests/test_differential.py``)
runs a few hundred. When a count is not zero, :func:`smallest_failing_case`
re-runs the asserting stateful machine with shrinking and returns the
minimal failing sequence.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import initialize, invariant, run_state_machine_as_test

from blockpool import AccessKind, Fence, HazardAwareBlockPool, StreamKind, Token
from tests.hb_model import HBModel
from tests.test_stateful import STREAMS, PoolMachine

READ, WRITE = AccessKind.READ, AccessKind.WRITE

COUNTS: Counter[str] = Counter()


class CountingModel(HBModel):
    """The same model; :meth:`judge` counts instead of asserting, and
    :meth:`report` tallies the failure kinds."""

    writer_kinds: dict[Token, str]

    def _covered(self, t: Token, by: Iterable[Token]) -> bool:
        return any(t == f or self.hb(t, f) for f in by)

    def judge(self, fence: Fence, groups: list[tuple[list[int], AccessKind]], stream: str) -> None:
        tokens = list(fence)
        req = self.required(groups, stream)
        COUNTS["fences"] += 1
        COUNTS["fence_tokens"] += len(tokens)
        COUNTS["required_tokens"] += len(req)
        COUNTS["missed"] += sum(1 for t in req if not self._covered(t, tokens))
        for f in tokens:
            rest = [g for g in tokens if g != f]
            if all(self._covered(t, rest) for t in req):
                COUNTS["redundant"] += 1
        want_host = bool(tokens) and (
            self.kinds[stream] is StreamKind.HOST
            or any(self.kinds[t.stream] is StreamKind.HOST for t in tokens)
        )
        if fence.needs_host_wait != want_host:
            COUNTS["host_mark_wrong"] += 1
        handout = getattr(self, "_handout", False)
        for block_ids, access in groups:
            for b in block_ids:
                uncovered = any(not self._covered(t, tokens) for t in self.required([([b], access)], stream))
                COUNTS["unsafe_accesses"] += uncovered
                if handout:
                    COUNTS["handed_out"] += 1
                    COUNTS["unsafe"] += uncovered

    def report(self, token: Token, failed: bool) -> bool:
        late = token in self.known_ended()
        if failed:
            kind = self.writer_kinds.get(token, "step")
            COUNTS[f"fail {kind}{' (late)' if late else ''}"] += 1
        else:
            COUNTS["complete"] += 1
        return super().report(token, failed)


class DifferentialMachine(PoolMachine):
    @initialize()
    def setup(self) -> None:
        super().setup()
        self.hb = CountingModel(STREAMS)
        self.hb.writer_kinds = self.kinds
        COUNTS["sequences"] += 1
        # allocate_for's fence is followed at once by its judgement: mark
        # its blocks (prefix hits READ, new WRITE) as hand-outs.
        allocate_for = self.pool.allocate_for

        def marked(*a, **kw):  # type: ignore[no-untyped-def]
            out = allocate_for(*a, **kw)
            self.hb._handout = True  # type: ignore[attr-defined]
            return out

        self.pool.allocate_for = marked  # type: ignore[method-assign]

    def judge_and_wait(self, fence: Fence, groups: list[tuple[list[int], AccessKind]], stream: str) -> None:
        super().judge_and_wait(fence, groups, stream)
        self.hb._handout = False  # type: ignore[attr-defined]

    @invariant()
    def agrees_with_model(self) -> None:
        super().agrees_with_model()
        if hasattr(self, "pool"):
            COUNTS["checks"] += 1


FIGURES = ("missed", "redundant", "unsafe", "unsafe_accesses", "host_mark_wrong")


class _MarkablePool(HazardAwareBlockPool):
    """The pool as a Python subclass, whose instances take the per-instance
    ``allocate_for`` that ``DifferentialMachine.setup`` sets: a compiled
    pool is a native class without an instance dict. Set outside the
    machine's class body, which Hypothesis hashes into the seed of its
    derandomized sequences (the figures in ``docs/guarantees.md``)."""


DifferentialMachine.pool_cls = _MarkablePool


def run(sequences: int, steps: int = 50) -> dict[str, object]:
    """Run ``sequences`` random sequences of up to ``steps`` operations;
    return the counts (``operations`` is rules executed)."""
    COUNTS.clear()
    t0 = time.perf_counter()
    with _no_local_constants():
        run_state_machine_as_test(
            DifferentialMachine, settings=_settings(sequences, steps, phases=[Phase.generate])
        )
    wall = time.perf_counter() - t0
    counts = dict(COUNTS)
    # the invariant runs once after setup and once after every rule
    counts["operations"] = counts.pop("checks", 0) - counts.get("sequences", 0)
    out: dict[str, object] = {k: counts.get(k, 0) for k in ("sequences", "operations", "fences", *FIGURES)}
    out["handed_out"] = counts.get("handed_out", 0)
    out["fence_tokens"] = counts.get("fence_tokens", 0)
    out["reports"] = {k: v for k, v in sorted(counts.items()) if k.startswith(("fail", "complete"))}
    out["wall_s"] = round(wall, 1)
    return out


@contextlib.contextmanager
def _no_local_constants() -> Iterator[None]:
    """Hypothesis (6.131 on) also draws constants found in the source of
    every local module the process has imported, so the same derandomized
    run drew other sequences in a process that had imported other modules
    (a test session; ``blockpool.replay.synthetic`` alone) or after a
    literal changed anywhere in them. Within this block it draws from its
    own constants only: the sequences depend on the seed, the sequence
    count and the hypothesis version. A hypothesis without the (private)
    hook runs as it is."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover
        yield
        return
    saved = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if saved is None or cache is None:  # pragma: no cover
        yield
        return
    empty = Constants()
    cache.cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = saved
        cache.cache.clear()


def _settings(sequences: int, steps: int, **extra: object) -> settings:
    """Fixed-seed, database-free settings for ``sequences`` runs of
    ``steps`` rules each."""
    return settings(
        max_examples=sequences,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        **extra,  # type: ignore[arg-type]
    )


def smallest_failing_case(sequences: int = 2000, steps: int = 50) -> str | None:
    """Re-run the asserting stateful machine with shrinking; the shrunk
    failure's text, or ``None`` when it finds none."""
    try:
        run_state_machine_as_test(PoolMachine, settings=_settings(sequences, steps, print_blob=False))
    except Exception as e:  # noqa: BLE001 (the shrunk failure, whatever its type)
        notes = "\n".join(getattr(e, "__notes__", []))
        return f"{type(e).__name__}: {e}\n{notes}"
    return None
