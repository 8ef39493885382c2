"""blockpool: a vLLM-compatible KV-cache block pool that hands out exact
hazard fences.

Layout (``docs/architecture.md``):

- the scheduler-side core, whose public names this package re-exports: it
  imports neither torch nor vLLM;
- :mod:`blockpool.worker`: the torch event ledger that waits on fences on
  the worker, and CPU stand-ins for streams and events;
- :mod:`blockpool.checking`: the race oracle, the test harness and the
  pytest plugin;
- :mod:`blockpool.sim`: the stream simulator and its cost model;
- :mod:`blockpool.replay`: trace replay, sweeps;
- :mod:`blockpool.integrations`: vLLM (plugin, pool adapter, connectors).

The top level holds what an engine author uses (``docs/api.md``, "The
top-level namespace"): the pool, its value types, its events, the block
record and statistics it hands out, and every error the pool, its tokens
and the worker's event ledger raise, so that ``except
blockpool.NoFreeBlocksError`` works without knowing where it is defined. Errors only the replay tooling raises
(``MissingDependencyError``, ``ClusterUnavailableError``) and the free
queue, an adapter's seam (``FreeBlockQueue``), stay in their modules
(:mod:`blockpool.core.errors`, :mod:`blockpool.core.block`).
"""

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import (
    BlockNotAllocatedError,
    BlockPoolError,
    FenceFailedError,
    ForeignBlockError,
    ForeignTokenError,
    HashConflictError,
    InvalidArgumentError,
    InvalidContentError,
    InvalidTokenError,
    InvariantError,
    LeaseExpiredWarning,
    NoFreeBlocksError,
    NullBlockError,
    RefCountError,
    SharedBlockError,
    StaleBlockError,
    UnknownStreamError,
    UnknownTokenError,
    UnsafeTransferError,
)
from blockpool.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from blockpool.core.hazards import (
    EMPTY_FENCE,
    LAST_STEP,
    AccessKind,
    Fence,
    FenceReason,
    FreeTag,
    StreamKind,
    Token,
    TokenStatus,
)
from blockpool.core.pool import HazardAwareBlockPool
from blockpool.core.stats import PoolSnapshot, PoolStats

__version__ = "0.1.0"


def _core_compiled() -> bool:
    """Whether every loaded module of :mod:`blockpool.core` is a compiled
    (mypyc) extension module rather than its ``.py`` source."""
    import importlib.machinery
    import sys

    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    core = [
        m for n, m in list(sys.modules.items()) if n == "blockpool.core" or n.startswith("blockpool.core.")
    ]
    return bool(core) and all(str(getattr(m, "__file__", "")).endswith(suffixes) for m in core)


__compiled__: bool = _core_compiled()
"""True when this is the compiled build (every module of :mod:`blockpool.core`
compiled by mypyc: ``BLOCKPOOL_MYPYC=1 pip wheel .``), False for the
pure-Python build. Same behaviour either way; the compiled one is faster."""


__all__ = [
    "EMPTY_FENCE",
    "LAST_STEP",
    "AccessKind",
    "AllBlocksCleared",
    "BlockNotAllocatedError",
    "BlockPoolError",
    "BlockRemoved",
    "BlockStored",
    "Fence",
    "FenceFailedError",
    "FenceReason",
    "ForeignBlockError",
    "ForeignTokenError",
    "FreeTag",
    "HashConflictError",
    "HazardAwareBlockPool",
    "InvalidArgumentError",
    "InvalidContentError",
    "InvalidTokenError",
    "InvariantError",
    "KVCacheBlock",
    "KVCacheEvent",
    "LeaseExpiredWarning",
    "NoFreeBlocksError",
    "NullBlockError",
    "PoolSnapshot",
    "PoolStats",
    "RefCountError",
    "SharedBlockError",
    "StaleBlockError",
    "StreamKind",
    "Token",
    "TokenStatus",
    "UnknownStreamError",
    "UnknownTokenError",
    "UnsafeTransferError",
    "__compiled__",
    "__version__",
]
