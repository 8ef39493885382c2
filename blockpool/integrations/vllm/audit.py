"""Audit mode: measure, in a live vLLM deployment, whether stock vLLM's own
waits let a KV transfer start while a conflicting access still runs --
without changing what vLLM does.

With ``BLOCKPOOL_VLLM_HAZARDS=audit`` the plugin installs our pool and the
scheduler wiring as with hazards on (every fence is computed, every token
issued and recorded), but the worker adds **no** wait: vLLM's own waits run
exactly as stock (MooncakeStore's ``current_event``, Offloading's
``wait_stream(compute)``, NIXL posting at once, LMCache's copies on its
load and store streams, which wait on no ``compute`` work, the LMCache
multi-process server's copies after one IPC event recorded on the compute
stream). At the moment each wired
transfer is about to touch GPU memory, the worker asks, without blocking,
whether every token of its fence has ended (:meth:`Audit.observe`): a
device token's event is queried (``Event.query()``, through the ledger's
:meth:`~blockpool.worker.torch_events.EventLedger.poll`), a host engine's
token is looked up. A token still running then, and not ordered before the
transfer by vLLM's own wait, is a transfer that "would have raced under
stock vLLM's waits".

What counts as ordered by vLLM's own wait: a device consumer enqueued after
``wait_stream(compute)`` (Offloading's copy streams) is ordered after every
``compute`` token recorded before it (``covered``); a host consumer that
synchronized vLLM's event (MooncakeStore's send thread) is checked after
that synchronize, so the forward it covers has ended by then; the LMCache
multi-process server's copies wait on an event recorded on ``compute``, so
they are ordered after the ``compute`` tokens recorded before it. Everything
else must have ended by itself.

The report: per ``(connector, kind)`` the transfers started, those whose
fence was non-empty, and those that started while a fence token was still
running, with the first :attr:`Audit.max_examples` of the last in full
(request, block ids, the transfer's token, the tokens still running: their
stream says what work it is, ``compute`` a forward or block copy,
``offload_d2h`` an offload store, ``mooncake_store`` a GET or PUT,
``lmcache_load`` / ``lmcache_store`` an LMCache load or store,
``lmcache_mp_load`` / ``lmcache_mp_store`` an LMCache server's retrieve or
store, ...).
Logged as one line every :data:`ENV_AUDIT_INTERVAL` seconds (default 60)
when counts changed and once at exit, and written as JSON to
:data:`ENV_AUDIT_FILE` when set (a file per rank: ``{rank}`` in the name is
replaced by the rank).

Cost: no device synchronisation, no wait; a ledger poll (one
``Event.query()`` per pending event up to the first incomplete one, per
stream) and a dict update per transfer with a non-empty fence.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from blockpool.core.hazards import StreamKind, Token

__all__ = [
    "ENV_AUDIT_FILE",
    "ENV_AUDIT_INTERVAL",
    "MODE_AUDIT",
    "Audit",
    "AuditCounts",
    "RaceExample",
    "device_covered_by",
]

logger = logging.getLogger("vllm.plugins.blockpool")

MODE_AUDIT = "audit"
"""The value of ``BLOCKPOOL_VLLM_HAZARDS`` that turns audit mode on."""
ENV_AUDIT_FILE = "BLOCKPOOL_VLLM_AUDIT_FILE"
"""Path of the JSON report (``{rank}`` is replaced by the worker's rank);
unset: no file."""
ENV_AUDIT_INTERVAL = "BLOCKPOOL_VLLM_AUDIT_INTERVAL"
"""Seconds between report lines (and file writes) while counts change; default 60."""


@attrs.define
class AuditCounts:
    """Transfers of one ``(connector, kind)`` seen in audit mode.

    Attributes:
        started: Transfers that started.
        fenced: Those whose fence (less scheduler-only streams) was non-empty.
        raced: Those that started while a fence token was still running and
            not ordered before them by vLLM's own wait.
    """

    started: int = 0
    fenced: int = 0
    raced: int = 0


@attrs.frozen
class RaceExample:
    """One transfer that would have raced under stock vLLM's waits.

    Attributes:
        connector: The connector (``mooncake_store``, ``offloading``,
            ``nixl``; ``compute`` for a step's forward).
        kind: ``load``, ``store`` or ``forward``.
        request_id: The request it served (``""`` when per job or step).
        block_ids: The blocks it touches.
        token: Its own token.
        running: The fence tokens still running when it started: the
            conflicting accesses (their stream names the work).
        at: ``time.time()`` when it started.
    """

    connector: str
    kind: str
    request_id: str
    block_ids: tuple[int, ...]
    token: Token
    running: tuple[Token, ...]
    at: float

    def to_json(self) -> dict[str, Any]:
        """Plain data for the JSON report."""
        return {
            "connector": self.connector,
            "kind": self.kind,
            "request_id": self.request_id,
            "block_ids": list(self.block_ids),
            "token": str(self.token),
            "running": [{"token": str(t), "stream": t.stream, "kind": t.kind.value} for t in self.running],
            "at": self.at,
        }


class Audit:
    """The audit counters of one worker process (one rank).

    Args:
        rank: The rank, in the report.
        max_examples: Races kept in full (the first ones).
        interval: Seconds between report lines while counts change.
        path: JSON report path (``{rank}`` replaced), or ``None``.
        clock: Monotonic clock (tests).

    Thread safety: :meth:`observe` may be called from any thread (the
    worker's main thread, MooncakeStore's transfer threads); one lock
    guards the counters.
    """

    def __init__(
        self,
        rank: int = 0,
        *,
        max_examples: int = 8,
        interval: float = 60.0,
        path: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.max_examples = max_examples
        self.interval = interval
        self.path = path.replace("{rank}", str(rank)) if path else None
        self.counts: dict[tuple[str, str], AuditCounts] = {}
        self.examples: list[RaceExample] = []
        self._clock = clock
        self._lock = threading.Lock()
        self._last_report = clock()
        self._reported: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_env(cls, rank: int = 0, environ: Any = None) -> Audit:
        """An :class:`Audit` configured by :data:`ENV_AUDIT_FILE` and
        :data:`ENV_AUDIT_INTERVAL` (a bad interval falls back to 60 s).

        Raises:
            Nothing.
        """
        env = os.environ if environ is None else environ
        try:
            interval = float(env.get(ENV_AUDIT_INTERVAL, "60"))
        except ValueError:
            interval = 60.0
        return cls(rank, interval=interval if interval > 0 else 60.0, path=env.get(ENV_AUDIT_FILE) or None)

    def observe(
        self,
        connector: str,
        kind: str,
        fence: Iterable[Token],
        is_complete: Callable[[Token], bool],
        *,
        token: Token,
        request_id: str = "",
        block_ids: Iterable[int] = (),
        covered: Callable[[Token], bool] = lambda t: False,
    ) -> tuple[Token, ...]:
        """A wired transfer is about to touch GPU memory: count it, and, if
        a token of its ``fence`` has not ended (``is_complete`` false) and
        vLLM's own wait does not order it first (``covered`` false), count
        it as a would-be race and keep it as an example. Never blocks.
        Returns the tokens still running. O(fence size).
        """
        tokens = tuple(fence)
        running = tuple(t for t in tokens if not covered(t) and not is_complete(t))
        with self._lock:
            c = self.counts.setdefault((connector, kind), AuditCounts())
            c.started += 1
            c.fenced += bool(tokens)
            if running:
                c.raced += 1
                if len(self.examples) < self.max_examples:
                    self.examples.append(
                        RaceExample(
                            connector, kind, request_id, tuple(block_ids), token, running, time.time()
                        )
                    )
        self.maybe_report()
        return running

    def totals(self) -> tuple[int, int, int]:
        """``(started, fenced, raced)`` over every connector and kind. O(kinds)."""
        with self._lock:
            return (
                sum(c.started for c in self.counts.values()),
                sum(c.fenced for c in self.counts.values()),
                sum(c.raced for c in self.counts.values()),
            )

    def to_json(self) -> dict[str, Any]:
        """The report as plain data: rank, totals, per connector and kind,
        the examples."""
        started, fenced, raced = self.totals()
        with self._lock:
            by_kind = {f"{c}/{k}": attrs.asdict(v) for (c, k), v in sorted(self.counts.items())}
            examples = [e.to_json() for e in self.examples]
        return {
            "rank": self.rank,
            "started": started,
            "fenced": fenced,
            "would_have_raced": raced,
            "by_connector_and_kind": by_kind,
            "examples": examples,
        }

    def line(self) -> str:
        """One log line: the totals and each ``connector/kind``'s counts."""
        started, fenced, raced = self.totals()
        with self._lock:
            parts = [f"{c}/{k} {v.raced}/{v.fenced}/{v.started}" for (c, k), v in sorted(self.counts.items())]
        return (
            f"blockpool audit (rank {self.rank}): {raced} of {started} wired transfers started while a "
            f"conflicting access still ran under stock vLLM's waits ({fenced} had a non-empty fence); "
            f"raced/fenced/started: {', '.join(parts) or 'none'}"
        )

    def maybe_report(self) -> None:
        """Log :meth:`line` (and write the file) when :attr:`interval`
        passed since the last report and the counts changed. O(kinds)."""
        now = self._clock()
        if now - self._last_report < self.interval:
            return
        self._last_report = now
        if self.totals() != self._reported:
            self.report()

    def report(self) -> None:
        """Log :meth:`line` and write the JSON file (if configured) now;
        called at exit too. A file that cannot be written is logged once
        per call, never raised."""
        self._reported = self.totals()
        logger.info("%s", self.line())
        if self.path:
            try:
                tmp = f"{self.path}.tmp"
                with open(tmp, "w") as f:
                    json.dump(self.to_json(), f, indent=1)
                os.replace(tmp, self.path)
            except OSError as exc:
                logger.warning("blockpool audit: cannot write %s (%r)", self.path, exc)


def device_covered_by(streams: frozenset[str], recorded: Callable[[str], int]) -> Callable[[Token], bool]:
    """The ``covered`` predicate of a device consumer enqueued after vLLM's
    own ``wait_stream`` on ``streams``: a ``DEVICE`` token of one of them
    recorded before now (``token.seq <= recorded(stream)``) is ordered
    before the consumer. O(1) per call."""

    def covered(t: Token) -> bool:
        return t.kind is StreamKind.DEVICE and t.stream in streams and t.seq <= recorded(t.stream)

    return covered
