"""The replay event log: every token issue, wait, block access, fence and
completion as JSON lines, so an external checker can verify a replay.

Schema ``blockpool.core.events/3`` (documented in ``docs/replay.md``): the first
line is a header object with ``"schema": "blockpool.core.events/3"``; the last
line is the trailer ``{"trailer": "blockpool.core.events/3", "lines": N,
"counts": {ev: n}}`` (``N`` lines before it, header included; ``counts``
per ``ev``), so a truncated log is detectable; every other line is one
event object with an ``"ev"`` field:

- ``issue``: ``policy, token, stream, seq, kind ("device"|"host"), what,
  t (enqueued, s), start (s), end (s), failed``
- ``wait``: ``policy, token, on (list of tokens), host (bool: a host wait)``
Block lists (``blocks``) are written as runs (:func:`encode_runs`): the
distinct ids in ascending order, each run of consecutive ids as ``[first,
last]`` and a lone id as itself, e.g. ``[[1, 40], 43, [45, 47]]``
(:func:`decode_runs` gives the ids back, lazily with :func:`iter_runs`). A
step's block table covers whole stretches of the pool, so a line is a few
runs instead of every id (``/2`` wrote every id: about 4.6 MB per request
of the conversation trace).

- ``access``: ``policy, token, stream, blocks (runs), access ("read"|"write"), what``:
  the accesses the race oracle judged (a step's block-table reads once per
  block, by the last step that used it, when the block is freed)
- ``table``: ``policy, token, stream, blocks (runs)``: the block-table reads
  of every step (the context of every request it computes), for a checker
  that judges each step's reads
- ``fence``: ``policy, call, stream, blocks (runs), tokens, needs_host_wait``:
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
{"schema": "blockpool.core.events/3", "source": "synthetic"}
{"ev": "end", "policy": "exact", "token": "h2d:3", "t": 0.25, "failed": false}
{"trailer": "blockpool.core.events/3", "lines": 2, "counts": {"end": 1}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TextIO

__all__ = ["EVENTS_SCHEMA", "EventLog", "decode_runs", "encode_runs", "iter_runs"]

EVENTS_SCHEMA = "blockpool.core.events/3"
"""Name and version of the event-log schema."""


def encode_runs(ids: Iterable[int]) -> list[int | list[int]]:
    """The schema's block list: the distinct ``ids`` ascending, each run of
    consecutive ids as ``[first, last]`` (inclusive), a lone id as itself.
    O(n log n) for ``n`` ids.

    >>> encode_runs([7, 1, 2, 3, 9, 8, 12])
    [[1, 3], [7, 9], 12]
    """
    out: list[int | list[int]] = []
    first = last = None
    for b in sorted(set(ids)):
        if last is not None and b == last + 1:
            last = b
            continue
        if first is not None:
            out.append(first if first == last else [first, last])  # type: ignore[list-item]
        first = last = b
    if first is not None:
        out.append(first if first == last else [first, last])  # type: ignore[list-item]
    return out


def iter_runs(runs: Iterable[object]) -> Iterable[int]:
    """The ids of a block list (:func:`encode_runs`), ascending, one at a
    time (a checker needs no more memory than for one id). O(ids).

    Raises:
        ValueError: an item that is neither an int nor a ``[first, last]``
            pair with ``first <= last``.
    """
    for item in runs:
        if type(item) is int:
            yield item
        elif (
            type(item) is list and len(item) == 2 and all(type(x) is int for x in item) and item[0] <= item[1]
        ):
            yield from range(item[0], item[1] + 1)
        else:
            raise ValueError(f"not a block run: {item!r}")


def decode_runs(runs: Iterable[object]) -> list[int]:
    """:func:`iter_runs` as a list. O(ids).

    >>> decode_runs([[1, 3], [7, 9], 12])
    [1, 2, 3, 7, 8, 9, 12]
    """
    return list(iter_runs(runs))


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
            self._dumps(
                {"trailer": EVENTS_SCHEMA, "lines": self.lines, "counts": dict(sorted(self.counts.items()))}
            )
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

    def access(
        self, policy: str, token: str, stream: str, blocks: Iterable[int], access: str, what: str
    ) -> None:
        """``token``'s work reads or writes ``blocks``."""
        self._write(
            {
                "ev": "access",
                "policy": policy,
                "token": token,
                "stream": stream,
                "blocks": encode_runs(blocks),
                "access": access,
                "what": what,
            }
        )

    def table(self, policy: str, token: str, stream: str, blocks: Iterable[int]) -> None:
        """The step ``token`` reads the block table ``blocks`` (every step)."""
        self._write(
            {"ev": "table", "policy": policy, "token": token, "stream": stream, "blocks": encode_runs(blocks)}
        )

    def fence(
        self,
        policy: str,
        call: str,
        stream: str,
        blocks: Iterable[int],
        tokens: Iterable[str],
        needs_host_wait: bool,
    ) -> None:
        """The pool handed out a fence for ``call`` on ``stream`` over ``blocks``."""
        self._write(
            {
                "ev": "fence",
                "policy": policy,
                "call": call,
                "stream": stream,
                "blocks": encode_runs(blocks),
                "tokens": list(tokens),
                "needs_host_wait": needs_host_wait,
            }
        )

    def end(self, policy: str, token: str, t: float, failed: bool) -> None:
        """The scheduler observed at ``t`` that ``token`` ended."""
        self._write({"ev": "end", "policy": policy, "token": token, "t": t, "failed": failed})
