"""The public serving traces, fetched and verified (``blockpool fetch-trace NAME``).

:data:`TRACES` names each trace the replay reads with the URL it is
published at (a raw file of its repository, pinned to a commit) and the
SHA-256 of the file as published there. :func:`fetch` keeps one copy per
trace in a cache directory (:func:`default_dir`): a copy already there is
verified and used; otherwise the file is downloaded beside it, verified,
and moved into place whole, so a download never leaves a partial or
altered file in the cache. Offline, place the file at the path :func:`fetch` names (downloaded
from the URL by hand) and it is verified instead of downloaded.

Uses only the standard library (``urllib.request``, imported when a
download starts, and ``hashlib``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import attrs

from blockpool.core.errors import BlockPoolError, InvalidArgumentError

__all__ = ["TRACES", "PublicTrace", "TraceFetchError", "default_dir", "fetch", "sha256_of"]

CHUNK = 1 << 20
"""Bytes read and hashed at a time (1 MiB)."""

TIMEOUT_S = 60.0
"""Seconds a download may wait for the server before it fails."""


class TraceFetchError(BlockPoolError, OSError):
    """A trace could not be downloaded, or the file is not the one published
    (its SHA-256 differs); nothing was written to the cache."""


@attrs.frozen
class PublicTrace:
    """A trace as published.

    Attributes:
        name: The name ``blockpool fetch-trace`` takes.
        file: The file's name (in the cache, as in its repository).
        repository: The GitHub repository that publishes it.
        url: Where it is published (a raw file of ``repository`` pinned to
            a commit).
        sha256: Hex SHA-256 of the file as published there.
        size: Its size in bytes.
        source: What it is, and where in ``repository``.
        license: Its license.
    """

    name: str
    file: str
    repository: str
    url: str
    sha256: str
    size: int
    source: str
    license: str


TRACES: dict[str, PublicTrace] = {
    t.name: t
    for t in (
        PublicTrace(
            name="mooncake",
            file="conversation_trace.jsonl",
            repository="github.com/kvcache-ai/Mooncake",
            url=(
                "https://raw.githubusercontent.com/kvcache-ai/Mooncake/"
                "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb/FAST25-release/traces/conversation_trace.jsonl"
            ),
            sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
            size=3_029_533,
            source="Mooncake FAST'25 trace release (FAST25-release/traces/): "
            "12,031 requests of one hour of a chat service, with prefix hash ids",
            license="Apache-2.0",
        ),
        PublicTrace(
            name="azure-code",
            file="AzureLLMInferenceTrace_code.csv",
            repository="github.com/Azure/AzurePublicDataset",
            url=(
                "https://raw.githubusercontent.com/Azure/AzurePublicDataset/"
                "790921015d50dd6aae7f7e47f39ba0e235ad6b08/data/AzureLLMInferenceTrace_code.csv"
            ),
            sha256="54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
            size=320_117,
            source="Azure LLM inference trace 2023 (data/): "
            "8,819 requests of a coding service, no prefix information",
            license="CC-BY-4.0",
        ),
    )
}
"""The public traces by name: ``mooncake`` (Mooncake's conversation trace,
the one the docs replay) and ``azure-code`` (Azure's coding trace)."""


def default_dir() -> Path:
    """The cache directory: ``$XDG_CACHE_HOME/blockpool/traces``, or
    ``~/.cache/blockpool/traces`` when ``XDG_CACHE_HOME`` is unset or empty. O(1)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockpool" / "traces"


def sha256_of(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of the file at ``path``. O(size).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _say(msg: str) -> None:
    print(f"blockpool fetch-trace: {msg}", file=sys.stderr, flush=True)


def fetch(
    name: str,
    directory: str | os.PathLike[str] | None = None,
    *,
    say: Callable[[str], None] = _say,
    opener: Callable[..., IO[bytes]] | None = None,
) -> Path:
    """The path of trace ``name``'s verified copy in ``directory`` (default
    :func:`default_dir`, created if missing), downloading it first if no
    copy with the published SHA-256 is there. A copy with another SHA-256
    is replaced (and ``say`` says so). The download goes to a temporary file
    beside the copy, is hashed as it arrives and moved into place only if
    it matches; on any failure, interruption included, the temporary file
    is removed and the cache is as it was. ``say`` gets one line per step
    (what is downloaded from where, or that the copy was verified).
    ``opener(url, timeout=...)`` opens the URL (default
    ``urllib.request.urlopen``; any ``file://`` or ``https://`` URL).
    O(size of the trace).

    Raises:
        InvalidArgumentError: ``name`` is not in :data:`TRACES`.
        TraceFetchError: the directory cannot be created or written, the
            download failed (the message names the URL and the path to
            place a copy at by hand), or the downloaded file's SHA-256 is
            not the published one.
    """
    trace = TRACES.get(name)
    if trace is None:
        raise InvalidArgumentError(f"unknown trace {name!r}; choose from {', '.join(TRACES)}")
    d = Path(directory) if directory is not None else default_dir()
    path = d / trace.file
    if path.is_file():
        try:
            found = sha256_of(path)
        except OSError as e:
            raise TraceFetchError(f"cannot read {path}: {e.strerror or e}") from None
        if found == trace.sha256:
            say(f"{path}: sha256 verified")
            return path
        say(f"{path}: sha256 {found}, not the published {trace.sha256}: downloading it again")
    if opener is None:
        import urllib.request

        opener = urllib.request.urlopen
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{trace.file}.", suffix=".part", dir=d)
    except OSError as e:
        raise TraceFetchError(f"cannot write into {d}: {e.strerror or e}") from None
    say(f"downloading {trace.url} ({trace.size / 1e6:.1f} MB, {trace.license}) to {path}")
    try:
        with os.fdopen(fd, "wb") as out:
            found = _download(trace, opener, out, path)
        if found != trace.sha256:
            raise TraceFetchError(
                f"{trace.url}: sha256 {found}, not the published {trace.sha256}; nothing written"
            )
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise TraceFetchError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    say(f"{path}: sha256 verified")
    return path


def _download(trace: PublicTrace, opener: Callable[..., Any], out: IO[bytes], path: Path) -> str:
    """Copy ``trace.url`` into ``out``, hashing it; the hex SHA-256.

    Raises:
        TraceFetchError: the URL cannot be opened or read, or ``out`` written.
    """
    h = hashlib.sha256()
    try:
        with opener(trace.url, timeout=TIMEOUT_S) as src:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
    except (OSError, ValueError) as e:  # urllib's URLError and HTTPError are OSErrors
        why = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
        raise TraceFetchError(
            f"cannot download {trace.url}: {why}; download it by hand to {path} "
            f"and run this again to verify it"
        ) from None
    return h.hexdigest()
