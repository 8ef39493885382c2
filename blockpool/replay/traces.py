"""Trace readers: Mooncake JSONL and Azure CSV into :class:`TraceRequest` s.

Formats:

- **Mooncake** (``.jsonl``; kvcache-ai/Mooncake, ``FAST25-release/traces/``):
  one JSON object per line with ``timestamp`` (ms from the start),
  ``input_length`` and ``output_length`` (tokens), and ``hash_ids``: one id
  per 512-token prefix block (equal ids = equal prefix content; the last one
  covers the partial rest of the prompt, so there are
  ``ceil(input_length / 512)`` of them).
- **Azure** (``.csv``; Azure/AzurePublicDataset, LLM inference trace 2023):
  columns ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS[.fraction]``, or seconds as a
  number), ``ContextTokens``, ``GeneratedTokens``. No prefix information:
  every request gets content ids of its own, so nothing is shared.

A bad line (malformed JSON or CSV row, a missing field, a wrong type, a
length ``< 1``, a negative or non-finite timestamp, a ``hash_ids`` count
that does not match ``input_length``) raises :class:`TraceFormatError`
naming the file and the line; with ``skip_bad_lines=True`` it is skipped and
listed in :attr:`Trace.skipped` instead. Blank lines are ignored.

Content ids: Mooncake hash ids are used as they are (``>= 0``); ids made up
for content without prefix information are negative, so they never meet a
trace's own ids: Mooncake output of request ``i`` is ``-(i + 1)``; Azure
request ``i`` has prompt ``-(2i + 1)`` and output ``-(2i + 2)``.

>>> import io, json, pathlib, tempfile
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> p = d / "t.jsonl"
>>> _ = p.write_text(json.dumps({"timestamp": 5, "input_length": 600,
...     "output_length": 3, "hash_ids": [4, 8]}) + "\\n")
>>> tr = read_trace(p)
>>> r = tr.requests[0]
>>> tr.format, r.arrival_s, r.segments, r.output_id
('mooncake', 0.005, ((4, 512), (8, 88)), -1)
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from blockpool.core.errors import BlockPoolError, InvalidArgumentError

__all__ = [
    "MOONCAKE_HASH_BLOCK_TOKENS",
    "SkippedLine",
    "Trace",
    "TraceFormatError",
    "TraceNotFoundError",
    "TraceRequest",
    "read_azure",
    "read_mooncake",
    "read_trace",
]

MOONCAKE_HASH_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_ids`` entry (Mooncake FAST'25 trace release)."""


class TraceFormatError(BlockPoolError, ValueError):
    """A trace line (or the whole file) cannot be read as a request.

    Attributes:
        path: The file.
        line: 1-based line number, or ``None`` for a whole-file problem.
        reason: What is wrong.
    """

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.path, self.line, self.reason))


class TraceNotFoundError(BlockPoolError, FileNotFoundError):
    """The trace file does not exist or cannot be opened."""


@attrs.frozen(slots=True)
class TraceRequest:
    """One request of a trace (a value object).

    Attributes:
        request_id: Position in the trace (0-based, in file order).
        arrival_s: Arrival time in seconds from the trace's start (``>= 0``).
        prompt_tokens: Prompt length in tokens (``>= 1``).
        output_tokens: Tokens the request generates (``>= 1``).
        segments: The prompt as ``(content_id, num_tokens)`` pairs summing to
            ``prompt_tokens`` (see :mod:`blockpool.replay.keys`).
        output_id: Content id of the generated tokens (a later turn of the
            same conversation may reuse it in its prompt).
        line: Source line (0 for generated requests).

    Raises:
        InvalidArgumentError: lengths ``< 1``, a negative arrival, or
            segments that do not sum to ``prompt_tokens``.
    """

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    segments: tuple[tuple[int, int], ...]
    output_id: int
    line: int = 0

    def __attrs_post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or not self.arrival_s >= 0:
            raise InvalidArgumentError(f"bad request {self!r}: lengths must be >= 1, arrival >= 0")
        if sum(n for _, n in self.segments) != self.prompt_tokens:
            raise InvalidArgumentError(f"segments of request {self.request_id} do not sum to its prompt")

    def key_segments(self) -> tuple[tuple[int, int], ...]:
        """Prompt and output as one segment list (what the request's KV
        holds at the end). O(len(segments))."""
        return (*self.segments, (self.output_id, self.output_tokens))


@attrs.frozen(slots=True)
class SkippedLine:
    """A bad line skipped with ``skip_bad_lines=True``."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@attrs.frozen(slots=True)
class Trace:
    """Requests read from one source, in file order.

    Attributes:
        source: File path, or ``"synthetic"``.
        format: ``"mooncake"``, ``"azure"`` or ``"synthetic"``.
        requests: The requests (``request_id`` = position).
        skipped: Lines skipped as bad (only with ``skip_bad_lines``).
    """

    source: str
    format: str
    requests: tuple[TraceRequest, ...]
    skipped: tuple[SkippedLine, ...] = ()


def _open(path: Path) -> Iterator[str]:
    """The lines of ``path`` (newlines kept), with typed errors."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            yield from f
    except FileNotFoundError:
        raise TraceNotFoundError(f"trace file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise TraceFormatError(str(path), None, f"not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise TraceNotFoundError(f"cannot read trace file {path}: {e.strerror}") from None


def _count(obj: dict[str, object], field: str) -> int:
    if field not in obj:
        raise ValueError(f"missing field {field!r}")
    v = obj[field]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{field} must be an integer, got {v!r}")  # noqa: TRY004 (a bad line)
    if v < 0:
        raise ValueError(f"{field} is negative ({v})")
    if v < 1:
        raise ValueError(f"{field} must be >= 1, got {v}")
    return v


def _timestamp(v: object, field: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"{field} must be a finite number, got {v!r}")
    if v < 0:
        raise ValueError(f"{field} is negative ({v})")
    return float(v)


def _mooncake_request(obj: object, index: int, line: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")  # noqa: TRY004 (a bad line)
    if "timestamp" not in obj:
        raise ValueError("missing field 'timestamp'")
    ts = _timestamp(obj["timestamp"], "timestamp")
    n_in = _count(obj, "input_length")
    n_out = _count(obj, "output_length")
    if "hash_ids" not in obj:
        raise ValueError("missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError("hash_ids must be a list of integers")
    if any(h < 0 for h in ids):
        raise ValueError("hash_ids holds a negative id")
    blk = MOONCAKE_HASH_BLOCK_TOKENS
    if len(ids) != -(-n_in // blk):
        raise ValueError(f"{len(ids)} hash_ids for input_length {n_in} (expected {-(-n_in // blk)})")
    segs = tuple((h, min(blk, n_in - k * blk)) for k, h in enumerate(ids))
    return TraceRequest(index, ts / 1000.0, n_in, n_out, segs, -(index + 1), line)


def read_mooncake(
    path: str | os.PathLike[str], *, limit: int | None = None, skip_bad_lines: bool = False
) -> Trace:
    """Read a Mooncake JSONL trace (see the module docstring).

    Args:
        path: The file.
        limit: Stop after this many requests (``None``: all).
        skip_bad_lines: Skip bad lines (listed in ``Trace.skipped``) instead
            of raising.

    Returns:
        A :class:`Trace` in file order; arrival = ``timestamp / 1000`` s.

    Raises:
        TraceNotFoundError: the file cannot be opened.
        TraceFormatError: a bad line (without ``skip_bad_lines``), or the
            file is not UTF-8 text.
        InvalidArgumentError: ``limit`` is not an int ``>= 0`` or ``None``.

    Runtime complexity: O(lines + hash ids read).
    """
    p = Path(path)
    limit = _check_limit(limit)
    out: list[TraceRequest] = []
    skipped: list[SkippedLine] = []
    for lineno, raw in enumerate(_open(p), 1):
        if limit is not None and len(out) >= limit:
            break
        s = raw.strip()
        if not s:
            continue
        try:
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise ValueError(f"malformed JSON ({e.msg} at column {e.colno})") from None
            out.append(_mooncake_request(obj, len(out), lineno))
        except ValueError as e:
            if not skip_bad_lines:
                raise TraceFormatError(str(p), lineno, str(e)) from None
            skipped.append(SkippedLine(str(p), lineno, str(e)))
    return Trace(str(p), "mooncake", tuple(out), tuple(skipped))


_AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _azure_time(v: str | None) -> tuple[int, float]:
    """``(whole seconds, fraction)`` kept apart so that differences of
    epoch-sized times stay exact to the microsecond."""
    if v is None or not v.strip():
        raise ValueError("missing field 'TIMESTAMP'")
    v = v.strip()
    try:
        x = float(v)
    except ValueError:
        pass
    else:
        x = _timestamp(x, "TIMESTAMP")
        return int(x), x - int(x)
    whole, _, frac = v.partition(".")
    try:
        dt = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
        if frac and not frac.isdigit():
            raise ValueError
    except ValueError:
        raise ValueError(f"TIMESTAMP {v!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]' or a number") from None
    return int(dt.timestamp()), (int(frac) / 10 ** len(frac) if frac else 0.0)


def _azure_count(row: dict[str, str | None], field: str) -> int:
    v = row.get(field)
    if v is None or not v.strip():
        raise ValueError(f"missing field {field!r}")
    try:
        n = int(v.strip())
    except ValueError:
        raise ValueError(f"{field} must be an integer, got {v!r}") from None
    return _count({field: n}, field)


def read_azure(
    path: str | os.PathLike[str], *, limit: int | None = None, skip_bad_lines: bool = False
) -> Trace:
    """Read an Azure LLM inference CSV trace (see the module docstring).

    Arrival = seconds after the earliest ``TIMESTAMP`` read. Each request
    gets content ids of its own (no prefix sharing).

    Args:
        path, limit, skip_bad_lines: As for :func:`read_mooncake`.

    Raises:
        TraceNotFoundError: the file cannot be opened.
        TraceFormatError: the header lacks a required column (never
            skipped), or a bad row (without ``skip_bad_lines``).
        InvalidArgumentError: bad ``limit``.

    Runtime complexity: O(rows).
    """
    p = Path(path)
    limit = _check_limit(limit)
    rows: list[tuple[int, tuple[int, float], int, int]] = []
    skipped: list[SkippedLine] = []
    reader = csv.DictReader(_open(p))
    try:
        fields = reader.fieldnames
    except csv.Error as e:
        raise TraceFormatError(str(p), 1, f"malformed CSV header ({e})") from None
    missing = [f for f in _AZURE_FIELDS if f not in (fields or ())]
    if missing:
        raise TraceFormatError(str(p), 1, f"header lacks column(s) {missing}; found {fields}")
    while limit is None or len(rows) < limit:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            row, err = None, f"malformed CSV row ({e})"
        lineno = reader.line_num
        try:
            if row is None:
                raise ValueError(err)
            if None in row:
                raise ValueError(f"{len(row[None]) + len(fields or ())} fields, expected {len(fields or ())}")  # type: ignore[arg-type, index]
            ts = _azure_time(row.get("TIMESTAMP"))
            rows.append(
                (lineno, ts, _azure_count(row, "ContextTokens"), _azure_count(row, "GeneratedTokens"))
            )
        except ValueError as e:
            if not skip_bad_lines:
                raise TraceFormatError(str(p), lineno, str(e)) from None
            skipped.append(SkippedLine(str(p), lineno, str(e)))
    s0, f0 = min((r[1] for r in rows), default=(0, 0.0))
    reqs = tuple(
        TraceRequest(
            i, round((ts[0] - s0) + (ts[1] - f0), 7), n_in, n_out, ((-(2 * i + 1), n_in),), -(2 * i + 2), line
        )
        for i, (line, ts, n_in, n_out) in enumerate(rows)
    )
    return Trace(str(p), "azure", reqs, tuple(skipped))


def _check_limit(limit: object) -> int | None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise InvalidArgumentError(f"limit must be an int >= 0 or None, got {limit!r}")
    return limit  # type: ignore[return-value]


def read_trace(
    path: str | os.PathLike[str], *, limit: int | None = None, skip_bad_lines: bool = False
) -> Trace:
    """Read a trace, telling the format by the file name (``.jsonl``/``.json``:
    Mooncake, ``.csv``: Azure) or else by its first non-blank character
    (``{``: Mooncake, anything else: Azure CSV). A regular file whose name
    and first line disagree (a JSON object in a ``.csv``, a comma-separated
    line in a ``.jsonl``) is refused with an error naming what it looks like.

    Raises:
        TraceNotFoundError, TraceFormatError, InvalidArgumentError: as for
            :func:`read_mooncake` / :func:`read_azure`; TraceFormatError
            also for a name that contradicts the content.

    Runtime complexity: that of the reader.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".csv") and p.is_file():
        _check_name_matches_content(p, suffix)
    if suffix in (".jsonl", ".json"):
        return read_mooncake(p, limit=limit, skip_bad_lines=skip_bad_lines)
    if suffix == ".csv":
        return read_azure(p, limit=limit, skip_bad_lines=skip_bad_lines)
    first = _first_line(p)[:1]
    if first == "{":
        return read_mooncake(p, limit=limit, skip_bad_lines=skip_bad_lines)
    return read_azure(p, limit=limit, skip_bad_lines=skip_bad_lines)


def _first_line(p: Path) -> str:
    """The first non-blank line of ``p``, stripped (``""`` for a blank file). O(that line)."""
    for raw in _open(p):
        if raw.strip():
            return raw.strip()
    return ""


def _check_name_matches_content(p: Path, suffix: str) -> None:
    """Refuse a trace whose name says one format and whose first line
    another: a JSON object in a ``.csv`` (a Mooncake trace), or a line of
    comma-separated fields in a ``.jsonl``/``.json`` (an Azure CSV).
    O(the first line).

    Raises:
        TraceFormatError: naming the format the content looks like.
    """
    first = _first_line(p)
    if suffix == ".csv" and first.startswith("{"):
        raise TraceFormatError(
            str(p), None, "named .csv (Azure CSV) but its first line is a JSON object: it looks like a "
            "Mooncake JSONL trace; rename it .jsonl",
        )  # fmt: skip
    if suffix != ".csv" and first and first[0] not in "{[" and "," in first:
        raise TraceFormatError(
            str(p), None, f"named {suffix} (Mooncake JSONL) but its first line is comma-separated fields: "
            "it looks like an Azure CSV trace; rename it .csv",
        )  # fmt: skip
