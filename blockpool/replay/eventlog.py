"""The replay event log: every token issue, wait, block access, fence and
completion as JSON lines, so an external checker can verify a replay.

Schema ``blockpool.core.events/2`` (documented in ``docs/replay.md``): the first
line is a header object with ``"schema": "blockpool.core.events/2"``; the last
line is the trailer ``{"trailer": "blockpool.core.events/2", "lines": N,
"counts": {ev: n}}`` (``N`` lines before it, header included; ``counts``
per ``ev``), so a truncated log is detectable; every other line is one
event object with an ``"ev"`` field:

- ``issue``: ``policy, token, stream, seq, kind ("device"|"host"), what,
  t (enqueued, s), start (s), end (s), failed``
- ``wait``: ``policy, token, on (list of tokens), host (bool: a host wait)``
- ``access``: ``policy, token, stream, blocks (ids), access ("read"|"write"), what``:
  the accesses the race oracle judged (a step's block-table reads once per
  block, by the last step that used it, when the block is freed)
- ``table``: ``policy, token, stream, blocks (ids)``: the block-table reads
  of every step (the context of every request it computes), for a checker
  that judges each step's reads
- ``fence``: ``policy, call, stream, blocks (ids), tokens, needs_host_wait``:
  a fence the pool handed out (``call``: ``allocate_for``, ``fence_for``,
  ``begin_load``, ``begin_store``, ``begin_copy``), before the policy
  turned it into waits
- ``end``: ``policy, token, t (s), failed``: a completed token ends what it
  waited on; a failed one ends only itself

Tokens are written as ``"stream:seq"``. Events of one policy appear in the
order the replay made them; a ``wait`` follows the ``issue`` of its token.

>>> import io
>>> buf = io.StringIO()
>>> log = EventLog(buf, {"source": "synthetic"})
>>> log.end("exact", "h2d:3", 0.25, False)
>>> log.close()
>>> print(buf.getvalue(), end="")
{"schema": "blockpool.core.events/2", "source": "synthetic"}
{"ev": "end", "policy": "exact", "token": "h2d:3", "t": 0.25, "failed": false}
{"trailer": "blockpool.core.events/2", "lines": 2, "counts": {"end": 1}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TextIO

__all__ = ["EVENTS_SCHEMA", "EventLog"]

EVENTS_SCHEMA = "blockpool.core.events/2"
"""Name and version of the event-log schema."""


class EventLog:
    """Writes the events of a replay to a text stream, one JSON object a line.

    Args:
        fp: An open text stream (the caller closes it).
        header: Extra fields of the header line (``schema`` is added first).

    Each method writes one line: O(size of the event). :meth:`close`
    writes the trailer (the caller still closes ``fp``).

    Attributes:
        lines: Lines written so far (header included).
        counts: Events written so far, per ``ev``.
    """

    __slots__ = ("_dumps", "_fp", "counts", "lines")

    def __init__(self, fp: TextIO, header: Mapping[str, object]) -> None:
        self._fp = fp
        self._dumps = json.JSONEncoder(separators=(", ", ": ")).encode
        self.lines = 0
        self.counts: dict[str, int] = {}
        self._fp.write(self._dumps({"schema": EVENTS_SCHEMA, **header}))
        self._fp.write("\n")
        self.lines = 1

    def _write(self, obj: Mapping[str, object]) -> None:
        self._fp.write(self._dumps(obj))
        self._fp.write("\n")
        self.lines += 1
        ev = str(obj["ev"])
        self.counts[ev] = self.counts.get(ev, 0) + 1

    def copy_events(self, fp: TextIO) -> None:
        """Append the event lines of another log read from ``fp`` (its header
        and trailer skipped), counting them. O(size of the log)."""
        fp.readline()  # its header
        counts = self.counts
        out = self._fp
        for line in fp:
            if line.startswith('{"trailer"'):
                continue
            out.write(line)
            self.lines += 1
            ev = line[8 : line.index('"', 8)]  # '{"ev": "<ev>"...'
            counts[ev] = counts.get(ev, 0) + 1

    def close(self) -> None:
        """Write the trailer line: the lines before it and the counts per ``ev``."""
        self._fp.write(
            self._dumps({"trailer": EVENTS_SCHEMA, "lines": self.lines, "counts": dict(sorted(self.counts.items()))})
        )
        self._fp.write("\n")

    def issue(
        self,
        policy: str,
        token: str,
        stream: str,
        seq: int,
        kind: str,
        what: str,
        t: float,
        start: float,
        end: float,
        failed: bool,
    ) -> None:
        """A token was issued and its work enqueued at ``t``; it runs ``start..end``."""
        self._write(
            {
                "ev": "issue",
                "policy": policy,
                "token": token,
                "stream": stream,
                "seq": seq,
                "kind": kind,
                "what": what,
                "t": t,
                "start": start,
                "end": end,
                "failed": failed,
            }
        )

    def wait(self, policy: str, token: str, on: Iterable[str], host: bool) -> None:
        """``token``'s work waited on ``on`` (a stream wait, or a host wait)."""
        self._write({"ev": "wait", "policy": policy, "token": token, "on": list(on), "host": host})

    def access(self, policy: str, token: str, stream: str, blocks: Iterable[int], access: str, what: str) -> None:
        """``token``'s work reads or writes ``blocks``."""
        self._write(
            {
                "ev": "access",
                "policy": policy,
                "token": token,
                "stream": stream,
                "blocks": list(blocks),
                "access": access,
                "what": what,
            }
        )

    def table(self, policy: str, token: str, stream: str, blocks: Iterable[int]) -> None:
        """The step ``token`` reads the block table ``blocks`` (every step)."""
        self._write({"ev": "table", "policy": policy, "token": token, "stream": stream, "blocks": list(blocks)})

    def fence(
        self, policy: str, call: str, stream: str, blocks: Iterable[int], tokens: Iterable[str], needs_host_wait: bool
    ) -> None:
        """The pool handed out a fence for ``call`` on ``stream`` over ``blocks``."""
        self._write(
            {
                "ev": "fence",
                "policy": policy,
                "call": call,
                "stream": stream,
                "blocks": list(blocks),
                "tokens": list(tokens),
                "needs_host_wait": needs_host_wait,
            }
        )

    def end(self, policy: str, token: str, t: float, failed: bool) -> None:
        """The scheduler observed at ``t`` that ``token`` ended."""
        self._write({"ev": "end", "policy": policy, "token": token, "t": t, "failed": failed})
