"""The replay event log: every token issue, wait, block access and completion
as JSON lines, so an external checker can verify a replay.

Schema ``blockpool.events/1`` (documented in ``docs/replay.md``): the first
line is a header object with ``"schema": "blockpool.events/1"``; every other
line is one event object with an ``"ev"`` field:

- ``issue``: ``policy, token, stream, seq, kind ("device"|"host"), what,
  t (enqueued, s), start (s), end (s), failed``
- ``wait``: ``policy, token, on (list of tokens), host (bool: a host wait)``
- ``access``: ``policy, token, stream, blocks (ids), access ("read"|"write"), what``
- ``end``: ``policy, token, t (s), failed``

Tokens are written as ``"stream:seq"``. Events of one policy appear in the
order the replay made them; a ``wait`` follows the ``issue`` of its token.

>>> import io
>>> buf = io.StringIO()
>>> log = EventLog(buf, {"source": "synthetic"})
>>> log.end("exact", "h2d:3", 0.25, False)
>>> print(buf.getvalue(), end="")
{"schema": "blockpool.events/1", "source": "synthetic"}
{"ev": "end", "policy": "exact", "token": "h2d:3", "t": 0.25, "failed": false}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TextIO

__all__ = ["EVENTS_SCHEMA", "EventLog"]

EVENTS_SCHEMA = "blockpool.events/1"
"""Name and version of the event-log schema."""


class EventLog:
    """Writes the events of a replay to a text stream, one JSON object a line.

    Args:
        fp: An open text stream (the caller closes it).
        header: Extra fields of the header line (``schema`` is added first).

    Each method writes one line: O(size of the event).
    """

    __slots__ = ("_dumps", "_fp", "lines")

    def __init__(self, fp: TextIO, header: Mapping[str, object]) -> None:
        self._fp = fp
        self._dumps = json.JSONEncoder(separators=(", ", ": ")).encode
        self.lines = 0
        self._write({"schema": EVENTS_SCHEMA, **header})

    def _write(self, obj: Mapping[str, object]) -> None:
        self._fp.write(self._dumps(obj))
        self._fp.write("\n")
        self.lines += 1

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

    def end(self, policy: str, token: str, t: float, failed: bool) -> None:
        """The scheduler observed at ``t`` that ``token`` ended."""
        self._write({"ev": "end", "policy": policy, "token": token, "t": t, "failed": failed})
