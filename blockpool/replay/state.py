"""Runtime state of a replay: requests in flight, the external KV store, and
a timing wrapper around the pool.

>>> store = ExternalStore(capacity_blocks=2)
>>> store.add("a"); store.add("b"); store.add("c")
>>> "a" in store, "c" in store, len(store)
(False, True, 2)
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvalidArgumentError
from blockpool.core.hazards import Token
from blockpool.replay.keys import BlockKeys
from blockpool.replay.traces import TraceRequest

__all__ = ["POOL_OPS", "ExternalStore", "Phase", "Request", "TimedPool"]


class Phase(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # arrived (or preempted), holds no blocks
    LOADING = "loading"  # holds its prefix; a host-engine load is in flight
    READY = "ready"  # its host-engine load ended; waits for compute
    RUNNING = "running"  # scheduled in steps
    DONE = "done"  # finished, aborted or rejected


class Request:
    """Mutable scheduler-side state of one replayed request.

    Attributes:
        trace: The trace record.
        phase: :class:`Phase`.
        keys: Block keys of prompt + output (made at first admission).
        blocks: The block table.
        num_computed: Tokens whose KV is in ``blocks`` (or being loaded).
        generated: Output tokens scheduled so far (async scheduling may run
            one step past the last one).
        num_cached: Leading blocks already published in the prefix cache.
        last_step: Token of the last enqueued step that read the block table.
        epoch: Bumped on every preemption; outputs of older steps are dropped.
        remote: The external tier is the remote store (host engines
            ``rdma``/``xfer``) rather than CPU offload (``h2d``/``d2h``).
        load_token, load_lo, load_hi: The load in flight into
            ``blocks[load_lo:load_hi]``.
        refetch: Blocks whose host-engine load failed; the next step rewrites them.
        abort_at: Simulated time of the planned abort (``None``: none yet).
        abort_plan: ``"queue"``, ``"load"``, ``"decode"`` or ``None``.
        abort_frac: Where in the load (fraction of its duration) or the
            answer (fraction of its tokens) the abort comes.
    """

    __slots__ = (
        "abort_at",
        "abort_frac",
        "abort_plan",
        "blocks",
        "epoch",
        "finished_at",
        "generated",
        "keys",
        "last_step",
        "load_hi",
        "load_lo",
        "load_token",
        "num_cached",
        "num_computed",
        "phase",
        "refetch",
        "remote",
        "trace",
    )

    def __init__(self, trace: TraceRequest, remote: bool, abort_plan: str | None, abort_frac: float) -> None:
        self.trace = trace
        self.phase = Phase.WAITING
        self.keys: BlockKeys | None = None
        self.blocks: list[KVCacheBlock] = []
        self.num_computed = 0
        self.generated = 0
        self.num_cached = 0
        self.last_step: Token | None = None
        self.epoch = 0
        self.remote = remote
        self.load_token: Token | None = None
        self.load_lo = 0
        self.load_hi = 0
        self.refetch: list[KVCacheBlock] = []
        self.abort_at: float | None = None
        self.abort_plan = abort_plan
        self.abort_frac = abort_frac
        self.finished_at: float | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far: prompt + scheduled output."""
        return self.trace.prompt_tokens + self.generated

    def __repr__(self) -> str:
        return (
            f"Request({self.trace.request_id}, {self.phase.value}, computed={self.num_computed}, "
            f"gen={self.generated}/{self.trace.output_tokens}, blocks={len(self.blocks)})"
        )


class ExternalStore:
    """The external KV tier (CPU memory or a remote store): the set of block
    keys whose content was stored, LRU-bounded.

    Args:
        capacity_blocks: Keys kept (``None``: unbounded); the least recently
            added or hit key is dropped first.

    Raises:
        InvalidArgumentError: ``capacity_blocks`` is not an int ``>= 1`` or ``None``.

    Every operation is O(1).
    """

    __slots__ = ("_keys", "capacity", "dropped")

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and (not isinstance(capacity_blocks, int) or capacity_blocks < 1):
            raise InvalidArgumentError(
                f"capacity_blocks must be an int >= 1 or None, got {capacity_blocks!r}"
            )
        self.capacity = capacity_blocks
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self.dropped = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable) -> None:
        """Store ``key`` (or refresh it), dropping the LRU key when full."""
        keys = self._keys
        if key in keys:
            keys.move_to_end(key)
            return
        keys[key] = None
        if self.capacity is not None and len(keys) > self.capacity:
            keys.popitem(last=False)
            self.dropped += 1

    def hit(self, key: Hashable) -> None:
        """Refresh ``key``'s LRU position (a load read it)."""
        if key in self._keys:
            self._keys.move_to_end(key)


POOL_OPS: tuple[str, ...] = (
    "issue",
    "complete",
    "fail",
    "get_cached_block",
    "get_num_free_blocks",
    "allocate_for",
    "get_new_blocks",
    "touch",
    "free_blocks",
    "fence_for",
    "tag",
    "begin_copy",
    "begin_load",
    "begin_store",
    "cache_full_blocks",
    "cache_partial_block",
)
"""The pool operations a replay calls (and times)."""


class TimedPool:
    """Calls a pool's operations and adds up their wall time per operation.

    Each name in ``ops`` becomes an attribute that calls the pool's method
    between two ``time.perf_counter_ns()`` reads; :attr:`ns` and
    :attr:`calls` hold the totals. Other attributes are not reachable: the
    replay uses only the public operations it times.

    Args:
        pool: The pool (any object with those methods).
        ops: Operation names.

    Raises:
        InvalidArgumentError: the pool lacks one of ``ops``.
    """

    def __init__(self, pool: Any, ops: tuple[str, ...] = POOL_OPS) -> None:
        self.pool = pool
        self.ns: dict[str, int] = dict.fromkeys(ops, 0)
        self.calls: dict[str, int] = dict.fromkeys(ops, 0)
        for op in ops:
            fn = getattr(pool, op, None)
            if fn is None:
                raise InvalidArgumentError(f"the pool has no operation {op!r}")
            setattr(self, op, self._timed(op, fn))

    def _timed(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        ns, calls, clock = self.ns, self.calls, time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[op] += clock() - t0
                calls[op] += 1

        timed.__name__ = op
        return timed

    def __getattr__(self, name: str) -> Any:  # only reached for names not set in __init__
        raise AttributeError(f"TimedPool times {sorted(self.ns)}; {name!r} is not one of them")
