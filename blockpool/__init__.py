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
"""

from blockpool.core.block import FreeBlockQueue, KVCacheBlock
from blockpool.core.errors import (
    BlockNotAllocatedError,
    BlockPoolError,
    ClusterUnavailableError,
    FenceFailedError,
    ForeignBlockError,
    ForeignTokenError,
    HashConflictError,
    InvalidArgumentError,
    InvalidContentError,
    InvalidTokenError,
    InvariantError,
    LeaseExpiredWarning,
    MissingDependencyError,
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


__all__ = [
    "EMPTY_FENCE",
    "LAST_STEP",
    "AccessKind",
    "AllBlocksCleared",
    "BlockNotAllocatedError",
    "BlockPoolError",
    "BlockRemoved",
    "BlockStored",
    "ClusterUnavailableError",
    "Fence",
    "FenceFailedError",
    "FenceReason",
    "ForeignBlockError",
    "ForeignTokenError",
    "FreeBlockQueue",
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
    "MissingDependencyError",
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
    "__version__",
]
