"""Shared fixtures for the core tests."""

from __future__ import annotations

import pytest

from blockpool import HazardAwareBlockPool, StreamKind

STREAMS = {
    "compute": StreamKind.DEVICE,
    "h2d": StreamKind.DEVICE,
    "d2h": StreamKind.DEVICE,
    "rdma": StreamKind.HOST,
}


def make_pool(num_gpu_blocks: int = 10, **kw: object) -> HazardAwareBlockPool:
    kw.setdefault("streams", STREAMS)
    kw.setdefault("enable_kv_cache_events", True)
    return HazardAwareBlockPool(num_gpu_blocks, **kw)  # type: ignore[arg-type]


@pytest.fixture
def pool() -> HazardAwareBlockPool:
    return make_pool()


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def toks(fence: object) -> set[str]:
    return {str(t) for t in fence}  # type: ignore[attr-defined]
