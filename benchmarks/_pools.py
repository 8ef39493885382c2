"""The three pools the benchmarks compare, built the same way.

``on``: :class:`~blockpool.HazardAwareBlockPool` tracking hazards (the
default); ``off``: the same with ``track_hazards=False``; ``vllm``: the
installed vLLM's ``vllm.v1.core.block_pool.BlockPool`` (a release of a line
the plugin supports, :data:`blockpool.integrations.vllm.SUPPORTED_VLLM_LINES`;
``vllm_line()`` names it for the reports), imported lazily (importing it
pulls in torch) and only when it imports; otherwise those benchmarks are
skipped with the reason.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Any

from blockpool import HazardAwareBlockPool, StreamKind

__all__ = ["KINDS", "STREAMS", "Request", "hashes", "keys36", "make_pool", "vllm_line", "vllm_missing"]

KINDS = ("on", "off", "vllm")
"""Pool kinds, in report order."""

STREAMS: Mapping[str, StreamKind] = {
    "compute": StreamKind.DEVICE,
    "h2d": StreamKind.DEVICE,
    "d2h": StreamKind.DEVICE,
    "rdma": StreamKind.HOST,
    "xfer": StreamKind.HOST,
}
"""The replay's machine: the streams every blockpool pool registers."""

BLOCK_SIZE = 16
"""Tokens per block (and per hash block) everywhere in the suite."""


@functools.cache
def vllm_missing() -> str | None:
    """``None`` when vLLM's ``BlockPool`` imports, else why not."""
    try:
        import vllm
        from vllm.v1.core.block_pool import BlockPool  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (ImportError, or any error of a broken install)
        return f"vLLM is not importable here ({type(exc).__name__}: {exc}); run with .venv-vllm034"
    from blockpool.integrations.vllm import is_supported_vllm_version, supported_vllm_range

    version = getattr(vllm, "__version__", "")
    if not is_supported_vllm_version(version):
        return f"vLLM {version} is installed; the comparison is against a supported line ({supported_vllm_range()})"
    return None


def vllm_line() -> str:
    """The vLLM the ``vllm`` rows measure (``"vLLM 0.34.0"``), or why none."""
    reason = vllm_missing()
    if reason is not None:
        return f"no vLLM ({reason})"
    import vllm

    return f"vLLM {vllm.__version__}"


def vllm_block_pool() -> Any:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool


def make_pool(kind: str, num_blocks: int, caching: bool = True) -> Any:
    """A fresh pool of ``num_blocks`` blocks (null block included)."""
    if kind == "vllm":
        return vllm_block_pool()(num_blocks, caching, BLOCK_SIZE)
    return HazardAwareBlockPool(
        num_blocks, caching, BLOCK_SIZE, track_hazards=(kind == "on"), streams=STREAMS
    )


def hashes(n: int, salt: str = "") -> list[bytes]:
    """``n`` distinct 32-byte block hashes (SHA-256), as vLLM's ``BlockHash``."""
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


GROUP0 = (0).to_bytes(4, "big")


def keys36(hs: list[bytes]) -> list[bytes]:
    """vLLM's ``BlockHashWithGroupId`` for group 0: hash + 4 big-endian bytes.
    Our pool takes these as opaque keys."""
    return [h + GROUP0 for h in hs]


class Request:
    """Stand-in for ``vllm.v1.request.Request``: with KV cache events off,
    vLLM's ``cache_full_blocks`` and ``cache_partial_block`` read only
    ``block_hashes``."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes
