"""blockpool: a vLLM-compatible KV-cache block pool that hands out exact
hazard fences.

The scheduler-side core (this package's top level) imports neither torch nor
vLLM. Integrations live at the edges: :mod:`blockpool.integrations.vllm`,
:mod:`blockpool.torch_events`, :mod:`blockpool.race_oracle`,
:mod:`blockpool.replay`.
"""

from blockpool.block import FreeBlockQueue, KVCacheBlock
from blockpool.errors import (
    BlockNotAllocatedError,
    BlockPoolError,
    ClusterUnavailableError,
    FenceFailedError,
    ForeignBlockError,
    ForeignTokenError,
    HashConflictError,
    InvalidArgumentError,
    InvariantError,
    LeaseExpiredWarning,
    MissingDependencyError,
    NoFreeBlocksError,
    NullBlockError,
    RefCountError,
    StaleBlockError,
    UnknownStreamError,
    UnknownTokenError,
)
from blockpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from blockpool.hazards import (
    EMPTY_FENCE,
    LAST_STEP,
    AccessKind,
    Fence,
    FenceReason,
    FreeTag,
    StreamKind,
    Token,
)
from blockpool.pool import HazardAwareBlockPool
from blockpool.stats import PoolSnapshot, PoolStats

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "HazardAwareBlockPool",
    "KVCacheBlock",
    "FreeBlockQueue",
    "StreamKind",
    "AccessKind",
    "Token",
    "Fence",
    "FenceReason",
    "EMPTY_FENCE",
    "LAST_STEP",
    "FreeTag",
    "PoolStats",
    "PoolSnapshot",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "BlockPoolError",
    "InvalidArgumentError",
    "NoFreeBlocksError",
    "ForeignBlockError",
    "NullBlockError",
    "RefCountError",
    "BlockNotAllocatedError",
    "StaleBlockError",
    "UnknownStreamError",
    "UnknownTokenError",
    "ForeignTokenError",
    "FenceFailedError",
    "HashConflictError",
    "InvariantError",
    "MissingDependencyError",
    "ClusterUnavailableError",
    "LeaseExpiredWarning",
]
