"""Scheduler-side hazard wiring for vLLM: step tokens, CoW copies, connector transfers.

:class:`StepHazards` is the thin layer between vLLM's scheduler and a
:class:`~blockpool.HazardAwareBlockPool`. It imports no vLLM: it reads the
few fields it needs from vLLM's objects by name (``total_num_scheduled_tokens``
of a ``SchedulerOutput``; ``finished_sending``, ``finished_recving``,
``failed_recving`` and ``invalid_block_ids`` of a ``KVConnectorOutput``), so
it is specified by tests with fakes. :mod:`blockpool.integrations.vllm`
wires it into ``Scheduler.schedule``, ``Scheduler.update_from_output`` and
``KVCacheManager.take_kv_cache_block_copies``; the adapter pool
(:mod:`blockpool.integrations.vllm.pool`) tags every free with
:meth:`StepHazards.free_token`.

Where each token comes from (``docs/vllm-design.md``, "Hazard wiring (scheduler side)"):

- every non-empty scheduled step issues one "forward done" token ``eN`` on
  ``compute``; async scheduling and pipeline parallelism only mean several
  steps are outstanding at once;
- the step's block copies (``SchedulerOutput.kv_cache_block_copies``) begin
  as one copy on ``compute`` (a read of each source, a write of each
  destination) when the scheduler drains them, before ``eN``;
- the zeroing of the step's newly allocated blocks
  (``SchedulerOutput.new_block_ids_to_zero``), which vLLM's model runner
  enqueues on ``compute`` just before those copies, is a write of each
  such block by the same token (one is issued for it when the step has no
  copies): a connector's write into a zeroed block waits on it;
- a free is tagged with the newest token issued on ``compute`` (the last
  enqueued step, which with async scheduling may be step N+1);
- step N's model output reaching ``update_from_output`` ends ``eN`` (and,
  ``compute`` being in order, every earlier ``compute`` token);
- a KV connector begins its loads and stores here (:meth:`StepHazards.begin_load`,
  :meth:`StepHazards.begin_store`) and ships :meth:`Transfer.to_wire` to its
  workers; its ``finished_recving`` / ``finished_sending`` end them, and
  ``failed_recving`` / ``invalid_block_ids`` fail the loads (their blocks'
  hashes are dropped, never published), and the blocks the pool marks bad
  for the loads ``invalid_block_ids`` failed join that set, so vLLM's
  recovery recomputes them too (:meth:`StepHazards.on_connector_output`);
- blocks the pool holds back for a host engine's transfer in flight come
  back when it ends: :meth:`StepHazards.defer_preemption` tells the
  scheduler not to preempt for room that is coming, while that room covers
  the need and for a bounded number of steps; a host transfer that never
  reports is given up at its engine's give-up time (a lease,
  :meth:`StepHazards.give_up_after`, checked as each step begins by
  :meth:`StepHazards.begin_schedule`), or once the scheduler has scheduled
  nothing for want of its blocks beyond that bound
  (:meth:`StepHazards.end_schedule`), and its blocks come back.

Example (doctest; the fakes stand for vLLM's outputs)::

    >>> from types import SimpleNamespace as NS
    >>> from blockpool import HazardAwareBlockPool, StreamKind
    >>> pool = HazardAwareBlockPool(8, streams={"compute": StreamKind.DEVICE})
    >>> hz = StepHazards(pool)
    >>> hz.add_stream("nixl", StreamKind.HOST)
    >>> blocks = pool.get_new_blocks(2)
    >>> step1 = NS(total_num_scheduled_tokens=32, new_block_ids_to_zero=None)
    >>> str(hz.step_record(step1).forward)           # e1
    'compute:1'
    >>> pool.free_blocks(blocks, token=hz.free_token())  # step 1 still runs
    >>> again = pool.get_new_blocks(2)
    >>> t = hz.begin_load("req-7", again, "nixl")
    >>> [str(x) for x in t.fence], t.fence.needs_host_wait
    (['compute:1'], True)
    >>> hz.end_step(step1).index
    1
    >>> hz.end_transfers(finished_recving={"req-7"})
    1
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from blockpool.core.block import KVCacheBlock
from blockpool.core.errors import InvalidArgumentError, UnknownStreamError
from blockpool.core.hazards import EMPTY_FENCE, AccessKind, Fence, StreamKind, Token
from blockpool.core.pool import HazardAwareBlockPool
from blockpool.integrations.vllm.served import SERVED

__all__ = [
    "COMPUTE",
    "DEFAULT_DEFER_STEPS",
    "DEFAULT_GIVE_UP_S",
    "ENV_DEFER_STEPS",
    "ENV_TRANSFER_TIMEOUT",
    "StepHazards",
    "StepRecord",
    "Transfer",
    "engine_give_up",
]

COMPUTE = "compute"
"""Name of the stream that runs the forward pass and the block copies."""

logger = logging.getLogger("vllm.plugins.blockpool")

ENV_DEFER_STEPS = "BLOCKPOOL_VLLM_DEFER_STEPS"
"""The most consecutive scheduler steps that may schedule nothing for want
of blocks held back for host transfers: a preemption is deferred for them
(:meth:`StepHazards.defer_preemption`) in fewer steps, and the held
transfers are given up after that many (:meth:`StepHazards.end_schedule`);
``0`` or ``1``: a preemption is never deferred."""
DEFAULT_DEFER_STEPS = 16
"""The default of :data:`ENV_DEFER_STEPS`. A host transfer that reports at
all reports within a few steps (its workers poll it every step, also in a
step that schedules nothing); 16 steps cover that many times over, and a
scheduler that waits longer has, in effect, a stalled transfer, for which
vLLM's preemption is the better answer."""
ENV_TRANSFER_TIMEOUT = "BLOCKPOOL_VLLM_TRANSFER_TIMEOUT"
"""Seconds after which a host-engine transfer that has not reported is
given up (its blocks come back) for a connector without a give-up time of
its own (:meth:`StepHazards.give_up_after`)."""
DEFAULT_GIVE_UP_S = 480.0
"""The default of :data:`ENV_TRANSFER_TIMEOUT`: vLLM's own default abort
timeout for KV a remote engine has not read (``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``)."""


def _env_number(name: str, default: float, *, integer: bool) -> float:
    """The setting ``name`` as a non-negative number (an int where
    ``integer``), or ``default`` when it is unset or empty. A value that is
    not such a number is refused with one ERROR line naming the setting and
    the form it takes, and ``default`` is used: a setting read while vLLM
    builds its scheduler never raises into vLLM. O(len of the value)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = -1
    if not (value >= 0 and math.isfinite(value)) or (not integer and value == 0):
        logger.error(
            "blockpool: %s=%r is not %s; %s is used",
            name,
            raw,
            "a whole number of steps >= 0" if integer else "a number of seconds > 0",
            default,
        )
        return default
    return value


def engine_give_up(connector: str, obj: object) -> float | None:
    """The give-up time (seconds) of KV connector ``connector`` (a name of
    :data:`~blockpool.integrations.vllm.connectors.CONNECTORS`) for a
    transfer that has not reported, read from the connector object ``obj``
    the wiring attaches to, or ``None`` where the connector has none (the
    default, :data:`ENV_TRANSFER_TIMEOUT`, applies then):

    - LMCache MP: its scheduler adapter's ``mq_timeout`` (the
      ``lmcache.mp.mq_timeout`` setting): LMCache's own wait for a request
      to its server;
    - NIXL: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` where it is set (vLLM's
      abort timeout for a remote request on the lines that have it);
    - MooncakeStore, Offloading, SimpleCPUOffload, LMCache in-process: none
      (their transfers carry no deadline of their own).

    Never raises: a value that is not a number > 0 counts as none.
    Imports nothing. O(1)."""
    value: Any = None
    if connector == "lmcache_mp":
        adapter = getattr(obj, "scheduler_adapter", None)
        value = None if adapter is None else adapter._mq_timeout
    elif connector == "nixl":
        raw = os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "")
        try:
            value = float(raw) if raw.strip() else None
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # none, or not a number (a stand-in object)
    return float(value) if value > 0 and math.isfinite(value) else None


_Wire = Any  # plain tuples/lists of str, int, bool (msgspec- and JSON-encodable)


_MANAGER_TABLES = ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids")
_COORDINATOR_TABLES = ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.get_blocks")


def _method_of(fn: object) -> tuple[str, str] | None:
    """``(module, qualified name)`` of a bound method's function, else ``None``."""
    f = getattr(fn, "__func__", None)
    return None if f is None else (getattr(f, "__module__", ""), getattr(f, "__qualname__", ""))


def _live_tables(state: Any) -> tuple[Mapping[str, list[KVCacheBlock]], ...] | None:
    """The live block tables behind a ``KVConnectorBlockState`` (vLLM 0.32
    to 0.34): each KV cache group's ``req_to_blocks`` (request id to its
    blocks), what vLLM's ``KVCacheCoordinator.get_blocks`` reads, when the
    state's ``resolve_block_ids`` is vLLM's own
    ``KVCacheManager.get_block_ids`` (the ids of ``coordinator.get_blocks``'
    blocks, the whole table copied per call) and that ``get_blocks`` is
    vLLM's own; else ``None`` (read the ids). Every name is declared in the
    plugin's vLLM surface (``get_blocks`` with its body's fingerprint).
    O(groups)."""
    resolve = state.resolve_block_ids
    if _method_of(resolve) != _MANAGER_TABLES:
        return None
    coordinator = resolve.__self__.coordinator
    if _method_of(coordinator.get_blocks) != _COORDINATOR_TABLES:
        return None
    return tuple(m.req_to_blocks for m in coordinator.single_type_managers)


def _ref(obj: object) -> Any:
    """A weak reference where the type allows one (vLLM's ``SchedulerOutput``
    does), else a strong one (bounded by ``max_outstanding``)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _check_seconds(value: object, what: str) -> None:
    """Refuse a time that is not a finite number > 0 (bool included)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not (value > 0 and math.isfinite(value)):  # type: ignore[operator,arg-type]
        raise InvalidArgumentError(f"{what} must be a finite number of seconds > 0, got {value!r}")


def _token_or_none(data: _Wire) -> Token | None:
    return None if data is None else Token.from_wire(data)


@attrs.frozen(slots=True)
class StepRecord:
    """The tokens of one scheduled step that runs a forward or block copies.

    Attributes:
        index: 1-based count of such steps this wiring has issued.
        forward: The step's "forward done" token ``eN`` on ``compute``.
        copies: The token of the block copies that run with this step
            (``SchedulerOutput.kv_cache_block_copies``), or ``None``.
        copy_fence: What those copies must wait on before they run.
    """

    index: int
    forward: Token
    copies: Token | None = None
    copy_fence: Fence = EMPTY_FENCE

    def to_wire(self) -> tuple[int, _Wire, _Wire, _Wire]:
        """Plain data for pickle, msgspec or JSON. O(fence size)."""
        return (
            self.index,
            self.forward.to_wire(),
            None if self.copies is None else self.copies.to_wire(),
            self.copy_fence.to_wire(),
        )

    @classmethod
    def from_wire(cls, data: Sequence[_Wire]) -> StepRecord:
        """Inverse of :meth:`to_wire` (lists accepted where tuples were sent).

        Raises:
            ValueError, TypeError: malformed data.
        """
        index, forward, copies, fence = data
        return cls(int(index), Token.from_wire(forward), _token_or_none(copies), Fence.from_wire(fence))


@attrs.frozen(slots=True)
class Transfer:
    """A connector load or store that began, as its workers need it.

    Attributes:
        request_id: The vLLM request the transfer serves.
        kind: ``"load"`` (external tier -> GPU) or ``"store"`` (GPU -> tier).
        token: The transfer's token on the connector's stream or engine; the
            worker records (device stream) or tracks (host engine) it.
        fence: What the transfer must wait on before it touches the blocks
            (``needs_host_wait``: wait on the host, e.g. ``event.synchronize()``
            in a receive thread, before posting).
        block_ids: The blocks, in the order given.
    """

    request_id: str
    kind: str
    token: Token
    fence: Fence
    block_ids: tuple[int, ...]

    def to_wire(self) -> tuple[str, str, _Wire, _Wire, list[int]]:
        """Plain data for pickle, msgspec or JSON. O(blocks + fence size)."""
        return (self.request_id, self.kind, self.token.to_wire(), self.fence.to_wire(), list(self.block_ids))

    @classmethod
    def from_wire(cls, data: Sequence[_Wire]) -> Transfer:
        """Inverse of :meth:`to_wire`.

        Raises:
            ValueError, TypeError: malformed data.
        """
        request_id, kind, token, fence, block_ids = data
        return cls(
            str(request_id), str(kind), Token.from_wire(token), Fence.from_wire(fence), tuple(block_ids)
        )


_Lease = tuple[float, float, int, Hashable, Transfer]  # (deadline, begun at, scheduler call, key, transfer)


class StepHazards:
    """Issue, tag and end the tokens of one vLLM scheduler's steps and
    transfers, on one :class:`~blockpool.HazardAwareBlockPool`.

    Args:
        pool: The scheduler's pool (the adapter passes its core).
        stream: The forward/copy stream; registered as ``DEVICE`` if absent.
        max_outstanding: Step records kept for steps whose output has not
            come back (a bound for callers that schedule without ever
            calling ``update_from_output``, e.g. unit tests); the oldest
            record is dropped beyond it (its token stays live until a later
            step ends).
        defer_steps: Consecutive scheduler steps a preemption may be
            deferred (:meth:`defer_preemption`); ``0``: never. ``None``:
            :data:`ENV_DEFER_STEPS`, else :data:`DEFAULT_DEFER_STEPS`.
        transfer_timeout: Seconds after which a host-engine transfer that
            has not reported is given up, on a stream without a time of its
            own (:meth:`give_up_after`). ``None``:
            :data:`ENV_TRANSFER_TIMEOUT`, else :data:`DEFAULT_GIVE_UP_S`.
        clock: The leases' time source (seconds, monotonic).

    Raises:
        InvalidArgumentError: ``defer_steps`` is not an int >= 0, or
            ``transfer_timeout`` not a finite number > 0 (nothing built).

    Thread safety: scheduler thread only, like the pool. Completions that
    arrive on other threads go to :meth:`HazardAwareBlockPool.complete`.
    """

    def __init__(
        self,
        pool: HazardAwareBlockPool,
        stream: str = COMPUTE,
        max_outstanding: int = 64,
        *,
        defer_steps: int | None = None,
        transfer_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if defer_steps is None:
            defer_steps = int(_env_number(ENV_DEFER_STEPS, DEFAULT_DEFER_STEPS, integer=True))
        if transfer_timeout is None:
            transfer_timeout = _env_number(ENV_TRANSFER_TIMEOUT, DEFAULT_GIVE_UP_S, integer=False)
        if type(defer_steps) is not int or defer_steps < 0:
            raise InvalidArgumentError(f"defer_steps must be an int >= 0, got {defer_steps!r}")
        _check_seconds(transfer_timeout, "transfer_timeout")
        self.defer_steps = defer_steps
        self.transfer_timeout = float(transfer_timeout)
        self.clock = clock
        # Leases of host-engine transfers: per stream, in the order begun
        # (one time per stream: deadlines ascend), (deadline, begun at, step, key, transfer).
        self._give_up: dict[str, float] = {}
        self._leases: dict[str, collections.deque[_Lease]] = {}
        self._leased = 0  # entries in self._leases
        self.schedule_calls = 0
        self.transfers_abandoned = 0
        self.blocks_reclaimed = 0
        self.lease_faults = 0
        self.last_need: int | None = None
        """Blocks vLLM's coordinator last computed a request needs
        (``get_num_blocks_to_allocate``; the scheduler wiring sets it)."""
        self.deferrals_given_up = 0
        self.deferrals_too_small = 0
        self.held_releases = 0  # transfers given up for a scheduler held up by their blocks (end_schedule)
        self._held_up = 0  # consecutive steps that scheduled nothing for want of held blocks
        self._defer_step = -1  # the scheduler call that last deferred
        self._defer_streak = 0  # consecutive scheduler calls that deferred, up to _defer_step
        self._gave_up_step = -1  # the scheduler call that answered as stock after the streak
        self.pool = pool
        self.stream = stream
        self.max_outstanding = max_outstanding
        pool.add_stream(stream, StreamKind.DEVICE)
        self._state = pool.tracker.state(stream)  # the stream's state: the pool never replaces it
        self.steps_issued = 0
        self.steps_ended = 0
        self.copies_begun = 0
        self.copy_pairs_skipped = 0
        # Outstanding issued steps by id of their output: (weak ref, record).
        self._steps: collections.OrderedDict[int, tuple[Any, StepRecord]] = collections.OrderedDict()
        self._pending_copy: tuple[Token, Fence] | None = None
        self.transfer_blocks_skipped = 0
        self._loads: dict[Hashable, list[Transfer]] = {}
        self._stores: dict[Hashable, list[Transfer]] = {}
        self._step_writes: tuple[int, Fence] = (0, EMPTY_FENCE)
        self._ends_with_step: dict[int, list[Hashable]] = {}
        self._frees_after_steps = 0
        self.blocks_zeroed = 0
        self.zeroings_untagged = 0
        self.preemptions_deferred = 0
        self.loads_failed_in_part = 0
        self.blocks_rewritten_on_receive = 0
        self._rewrites_on_receive: set[str] = set()
        self._received: list[int] = []  # blocks of loads whose engine rewrites them, until the next record
        self.step_tokens = True
        """Whether the scheduler wiring issues step tokens and begins block
        copies (this class's own methods always do when called). The plugin
        turns it off for a scheduler whose pool has no stream or engine but
        the compute stream once its connectors are bound (:meth:`has_other_streams`):
        every access is then ordered by that one stream, every fence is
        empty, and a token would be issued, tagged and ended for nothing.
        :meth:`add_stream` turns it on again."""
        self.steps_untokened = 0
        self._untokened_ended = 0  # outputs of steps skip_step counted that end_step saw

    # ------------------------------------------------------------------
    # steps
    # ------------------------------------------------------------------

    def free_token(self) -> Token | None:
        """The token a free is tagged with now: the newest issued on the
        compute stream (the last enqueued step or copy), ``None`` before the
        first, and ``None`` inside :meth:`frees_after_their_steps`. O(1)."""
        if self._frees_after_steps:
            return None
        return self._state.last_token  # pool.last_token(self.stream), without the call (every free)

    def has_other_streams(self) -> bool:
        """Whether the pool has a stream or engine besides this wiring's
        compute stream: something that may have to wait on a step token.
        O(streams)."""
        return any(name != self.stream for name in self.pool.streams)

    def skip_step(self, scheduler_output: object) -> bool:
        """The scheduler wiring's call for a step while :attr:`step_tokens`
        is off: a non-empty step (as :meth:`step_record` counts them) is
        counted in ``steps_untokened``; no token is issued and nothing is
        kept (:meth:`end_step` counts the outputs that come back, for
        :meth:`add_stream`'s warning). Returns whether it counted one. O(1):
        in a real engine this runs every step on cold caches, so it touches
        two counters and nothing else."""
        if not scheduler_output.total_num_scheduled_tokens:
            return False
        self.steps_untokened += 1
        return True

    @contextlib.contextmanager
    def frees_after_their_steps(self) -> Iterator[None]:
        """Frees made inside come after every step that touched their blocks
        ended (vLLM's deferred frees, ``Scheduler._drain_deferred_frees``:
        with overlapping batches vLLM returns a request's blocks only once
        every step scheduled while it ran has produced its output): they are
        tagged with nothing, not with the newest issued step, which never
        touched them (a redundant wait)."""
        self._frees_after_steps += 1
        try:
            yield
        finally:
            self._frees_after_steps -= 1

    def begin_copies(self, pairs: Iterable[tuple[KVCacheBlock, KVCacheBlock]]) -> tuple[Token, Fence] | None:
        """Begin the block copies ``(src, dst)`` that run with the next
        non-empty step, on the compute stream; called while the scheduler
        still holds both ends (``take_kv_cache_block_copies``). Pairs naming
        a block of another pool, the null block or an unreferenced block are
        skipped (counted in ``copy_pairs_skipped``): vLLM never produces
        them. Returns the copy token and fence, or ``None`` if no pair is
        left. O(len(pairs)).
        """
        pool = self.pool
        own = pool.blocks
        kept: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for src, dst in pairs:
            ok = True
            for b in (src, dst):
                bid = b.block_id
                if not (0 < bid < len(own) and own[bid] is b and b.ref_cnt > 0):
                    ok = False
            if ok:
                kept.append((src, dst))
            else:
                self.copy_pairs_skipped += 1
        if not kept:
            return None
        # vLLM's copies run whatever the pool says, and their destinations
        # are private by construction (the scheduler retains both ends until
        # the copy ran, so a published destination has ref count 2): record
        # them, never refuse them (a refusal would raise out of vLLM's
        # take_kv_cache_block_copies).
        token, fence = pool.begin_copy(kept, self.stream, refusals=False)
        self.copies_begun += 1
        if self._pending_copy is not None:
            fence = fence.merge(self._pending_copy[1])
        self._pending_copy = (token, fence)
        return token, fence

    def _begin_zeroing(self, block_ids: Iterable[int]) -> None:
        """Record the zeroing of ``block_ids`` (the step's newly allocated
        blocks) as a write on the compute stream that runs before the
        step's block copies: by the pending copy token, or by a token
        issued for it, which becomes the step record's ``copies`` (the
        worker records it after both). Where the pending copy token cannot
        be ordered after the zeroing's fence any more (something is ordered
        after it already), nothing is tagged (``zeroings_untagged``): a
        connector's write into those blocks keeps only the waits it had
        without the tag. O(len(block_ids))."""
        blocks = self.blocks_of(block_ids)
        if not blocks:
            return
        pool = self.pool
        pending = self._pending_copy
        if pending is None:
            fence = pool.fence_for(blocks, self.stream, AccessKind.WRITE)
            token = pool.issue(self.stream)  # ordered after the fence
            earlier = EMPTY_FENCE
            pool.tag(blocks, token, AccessKind.WRITE)
        else:
            token, earlier = pending
            if pool.tracker.unorderable(token) is not None:
                self.zeroings_untagged += 1
                return
            fence = pool.fence_and_tag(blocks, self.stream, token)  # fence_for(token=) then tag, one call
        self._pending_copy = (token, earlier.merge(fence))
        self.blocks_zeroed += len(blocks)

    def step_record(self, scheduler_output: object) -> StepRecord | None:
        """The record of a scheduled step, issuing its tokens on first call;
        ``None`` for an empty step (``total_num_scheduled_tokens == 0``: no
        forward runs) without block copies. A step with no scheduled token
        but with copies (drained before the connector plans,
        ``take_kv_cache_block_copies``) gets a record too: vLLM's runner
        enqueues the copies before it returns early for the empty step, and
        the worker records the copy token and ``eN`` (after the copies, no
        forward) from it; without a record nothing would record them.
        Idempotent per output object, so a connector may call it from
        ``build_connector_meta`` to ship the step's tokens, before the wiring
        calls it when ``schedule()`` returns.

        The step's zeroing of newly allocated blocks
        (``new_block_ids_to_zero``, vLLM 0.32 to 0.34: enqueued on the
        compute stream by the model runner's state update, V1
        ``_update_states`` and V2 ``update_requests``, before the block
        copies and before the connector binds the step) is begun here as
        a write of those blocks by the record's ``copies`` token (issued for
        it when the step has no copies): the worker records that token when
        the connector binds the step, after the zeroing, so a connector's
        later write into a zeroed block (a GET, a NIXL read) has it in its
        fence (WAW), and a block a failed load left bad counts as written
        again. The blocks of loads completed since the last record on an
        engine whose workers rewrite what they receive
        (:meth:`rewrites_on_receive`) are recorded as written by the new
        record's forward token, and give an otherwise empty step a record.
        O(1), plus O(blocks zeroed or rewritten) on the first call.
        """
        if (
            not scheduler_output.total_num_scheduled_tokens
            and self._pending_copy is None
            and not self._received
        ):
            return None
        key = id(scheduler_output)
        entry = self._steps.get(key)
        if entry is not None and entry[0]() is scheduler_output:
            return entry[1]
        zero_ids = scheduler_output.new_block_ids_to_zero
        if zero_ids:
            self._begin_zeroing(zero_ids)
        copies, copy_fence = self._pending_copy if self._pending_copy is not None else (None, EMPTY_FENCE)
        self._pending_copy = None
        self.steps_issued += 1
        record = StepRecord(self.steps_issued, self.pool.issue(self.stream), copies, copy_fence)
        if self._received:
            self._write_received(record.forward)
        steps = self._steps
        steps[key] = (_ref(scheduler_output), record)
        while len(steps) > self.max_outstanding:  # the oldest goes (the docstring of max_outstanding)
            steps.popitem(last=False)
        return record

    def tag_step_writes(self, scheduler_output: object, block_sizes: int | Sequence[int]) -> Fence:
        """Record that step N's forward writes the blocks receiving its new
        tokens, so that a store of those blocks waits on ``eN`` (RAW) and a
        store of blocks written by an ended step waits on nothing.

        Reads ``num_scheduled_tokens``, the requests' ``num_computed_tokens``
        and their current block tables from ``kv_connector_block_state``
        (vLLM builds it only when a connector is configured); in each KV
        cache group ``g`` of a request's block table, the blocks from index
        ``num_computed_tokens // block_sizes[g]`` on are tagged (one int:
        every group's block size). The blocks are read from the tails of
        the live tables behind the block state (each group's
        ``req_to_blocks``, which vLLM's ``KVCacheCoordinator.get_blocks``
        reads: one dict look-up per request) when its resolver is vLLM's own
        ``KVCacheManager.get_block_ids``, which would copy every scheduled
        request's whole table as ids each step; else from those ids. Once
        per step, however many connectors call it; a step without a block
        state tags nothing.

        Returns the fence the forward must wait on before it writes those
        blocks: empty unless a transfer on another stream or engine still
        reads or writes one of them (say, a store of a partial block the
        step appends to). The worker waits on it when it binds the step's
        connector metadata, before the forward; ``eN`` then stands for those
        accesses too (later fences name ``eN``, which ends after them).
        Later calls for the same step return the same fence. O(blocks tagged
        + requests scheduled) with the live tables, else O(blocks in the
        scheduled requests' tables).
        """
        record = self.step_record(scheduler_output)
        if record is None:
            return EMPTY_FENCE
        if record.index == self._step_writes[0]:
            return self._step_writes[1]
        self._step_writes = (record.index, EMPTY_FENCE)
        state = scheduler_output.kv_connector_block_state
        scheduled = scheduler_output.num_scheduled_tokens
        if state is None or not scheduled:
            return EMPTY_FENCE
        computed: dict[str, int] = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))  # one entry per request
        tables = _live_tables(state)
        if tables is not None:
            blocks = self._tail_blocks(computed.items(), scheduled, state.req_ids, tables, block_sizes)
        else:
            ids: list[int] = []
            for req_id in scheduled:
                c = computed.get(req_id)
                if c is None:
                    continue
                groups = state.get_block_ids(req_id)
                if groups:
                    sizes = [block_sizes] * len(groups) if isinstance(block_sizes, int) else block_sizes
                    for group, bs in zip(groups, sizes):
                        ids.extend(group[c // bs :])
            blocks = self.blocks_of(ids)
        if not blocks:
            return EMPTY_FENCE
        # eN was issued when the step was scheduled; its event is recorded
        # after the forward, which waits on this fence first: eN is ordered
        # after the fence (its completion ends the fence's tokens), unless
        # something is ordered after eN already (then the fence is recorded
        # for the stream only: later waits may be redundant, never missing).
        try:
            fence = self.pool.fence_and_tag(blocks, self.stream, record.forward)  # one call, one pass
        except InvalidArgumentError:  # raised with nothing changed
            if self.pool.tracker.unorderable(record.forward) is None:
                raise
            fence = self.pool.fence_for(blocks, self.stream, AccessKind.WRITE)
            self.pool.tag(blocks, record.forward, AccessKind.WRITE)
        self._step_writes = (record.index, fence)
        return fence

    def _tail_blocks(
        self,
        computed: Iterable[tuple[str, int]],
        scheduled: Container[str],
        req_ids: Container[str],
        tables: tuple[Mapping[str, list[KVCacheBlock]], ...],
        block_sizes: int | Sequence[int],
    ) -> list[KVCacheBlock]:
        """The blocks the step writes, read from the requests' live block
        tables (``tables``: each group's ``req_to_blocks``, what vLLM's
        ``KVCacheCoordinator.get_blocks`` reads): for each scheduled request
        of ``computed`` (request id, ``num_computed_tokens``) in ``req_ids``,
        in each group the blocks from ``num_computed_tokens // block_size``
        on, as :meth:`blocks_of` would give them for their ids (the null
        block, another pool's blocks and blocks with ref count 0 left out,
        counted in ``transfer_blocks_skipped``). Only the tail of each table
        is copied; one dict look-up per request and group. O(blocks tagged +
        requests)."""
        own = self.pool.blocks
        n = len(own)
        out: list[KVCacheBlock] = []
        skipped = 0
        sizes = [block_sizes] * len(tables) if isinstance(block_sizes, int) else block_sizes
        groups = list(zip(tables, sizes))
        for req_id, c in computed:
            if req_id not in scheduled or req_id not in req_ids:
                continue
            for table, bs in groups:
                blocks = table.get(req_id)
                if not blocks:
                    continue
                for b in blocks[c // bs :]:
                    bid = b.block_id
                    if 0 < bid < n and own[bid] is b and b.ref_cnt > 0:
                        out.append(b)
                    else:
                        skipped += 1
        self.transfer_blocks_skipped += skipped
        return out

    def end_step(self, scheduler_output: object) -> StepRecord | None:
        """Step N's model output came back: end ``eN`` (and every earlier
        compute token). Records of earlier steps are dropped too. Returns
        the step's record, or ``None`` for an output this wiring never
        issued (an empty step, one built outside ``schedule()``, or one
        :meth:`skip_step` counted, whose coming back is counted here).
        O(steps dropped).
        """
        steps = self._steps
        if not steps:  # nothing issued is outstanding (the untokened wiring's every step)
            if (
                not self.step_tokens
                and self._untokened_ended < self.steps_untokened  # not an output skip_step never saw
                and scheduler_output.total_num_scheduled_tokens
            ):
                self._untokened_ended += 1
            return None
        key = id(scheduler_output)
        entry = steps.get(key)
        if entry is None or entry[0]() is not scheduler_output:
            return None
        while steps:
            if steps.popitem(last=False)[0] == key:
                break
        record = entry[1]
        self.pool.complete(record.forward)
        self.steps_ended += 1
        if self._ends_with_step:
            for index in [i for i in self._ends_with_step if i <= record.index]:
                for k in self._ends_with_step.pop(index):
                    self.finish(k)
        return record

    def end_with_step(self, key: Hashable) -> None:
        """The transfers begun (and to be begun) under ``key`` end, completed,
        when the output of the newest issued step comes back
        (:meth:`end_step`), or of any later step: for a connector whose
        workers run a step's transfers to their end inside that step (they
        report nothing of their own; vLLM returns a step's output once every
        rank ran it). A failure reported with that output
        (:meth:`on_connector_output`, which the scheduler wiring calls
        first) fails a load before. O(1)."""
        self._ends_with_step.setdefault(self.steps_issued, []).append(key)

    def outstanding_steps(self) -> list[StepRecord]:
        """Records of issued steps whose output has not come back, oldest first."""
        return [rec for _, rec in self._steps.values()]

    # ------------------------------------------------------------------
    # connector transfers
    # ------------------------------------------------------------------

    def add_stream(self, name: str, kind: StreamKind) -> None:
        """Register a connector's stream (``DEVICE``: a DMA stream that
        completes in order) or engine (``HOST``: RDMA NIC, transfer threads;
        completes per transfer). Idempotent for the same kind.

        A stream other than the compute stream turns :attr:`step_tokens` on
        again (a stream added to the pool directly, ``pool.add_stream``,
        does not: register connector streams here). Steps the wiring
        scheduled without tokens whose output has not come back yet (async
        scheduling; :meth:`skip_step`'s count less the outputs
        :meth:`end_step` saw) still read and write their blocks, and no
        token says so: a warning is logged then (vLLM binds its connectors,
        which add their streams here, before the scheduler's first step, so
        it never happens there).

        A ``HOST`` engine's transfers get leases: each is given up once it
        has not reported for the engine's give-up time (:meth:`give_up_after`;
        :attr:`transfer_timeout` until that is called).

        Raises:
            InvalidArgumentError: the name is registered with another kind.
        """
        self.pool.add_stream(name, kind)
        if kind is StreamKind.HOST:
            self._give_up.setdefault(name, self.transfer_timeout)
        if not self.step_tokens and name != self.stream:
            self.step_tokens = True
            live = self.steps_untokened - self._untokened_ended  # >= 0: end_step counts no more
            if live > 0:
                logger.warning(
                    "blockpool: stream %r registered while %d steps scheduled without step tokens are "
                    "outstanding: transfers on it are not fenced on those steps (blocks they read, "
                    "write or freed, and block copies begun without a token)",
                    name,
                    live,
                )

    def blocks_of(self, block_ids: Iterable[int]) -> list[KVCacheBlock]:
        """The pool's blocks for ``block_ids``, in order, as a transfer may
        name them: the null block, ids outside the pool and blocks with ref
        count 0 are left out (counted in ``transfer_blocks_skipped``; vLLM's
        connectors never name them for a real transfer, its unit tests
        sometimes do). O(len(block_ids)).
        """
        own = self.pool.blocks
        n = len(own)
        out: list[KVCacheBlock] = []
        for bid in block_ids:
            if type(bid) is int and 0 < bid < n and own[bid].ref_cnt > 0:
                out.append(own[bid])
            else:
                self.transfer_blocks_skipped += 1
        return out

    def begin_load(
        self, request_id: str, blocks: Iterable[KVCacheBlock], stream: str, *, key: Hashable = None
    ) -> Transfer:
        """A connector begins loading ``blocks`` of ``request_id`` (call it
        from ``update_state_after_alloc``, where the blocks are allocated,
        and ship ``transfer.to_wire()`` from ``build_connector_meta``). The
        load token becomes the blocks' writer: the step that reads them gets
        it in its fence (RAW); a failed load drops their hashes. ``key``
        (default: ``request_id``) is what :meth:`finish` ends it by; loads
        are also ended by request id through :meth:`end_transfers`. Loads
        pending under one key are one load (a hybrid model's request loaded
        as one transfer per KV cache group): each is linked with the others
        (``HazardAwareBlockPool.link_loads``), so that a failure of any of
        them, however it reaches the pool, withdraws every part's keys.
        O(len(blocks)), plus O(loads pending under ``key``).

        Raises:
            UnknownStreamError: ``stream`` was not added.
            ForeignBlockError, BlockNotAllocatedError: as the core's ``begin_load``.
        """
        block_list = list(blocks)
        token, fence = self.pool.begin_load(block_list, stream)
        t = Transfer(request_id, "load", token, fence, tuple([b.block_id for b in block_list]))
        k = request_id if key is None else key
        parts = self._loads.setdefault(k, [])
        parts.append(t)
        if stream in self._give_up:
            self._lease(stream, k, t)
        if len(parts) > 1:
            self.pool.link_loads([p.token for p in parts])
        self._count_begun(t)
        return t

    def begin_store(
        self, request_id: str, blocks: Iterable[KVCacheBlock], stream: str, *, key: Hashable = None
    ) -> Transfer:
        """A connector begins storing (offloading, sending) ``blocks`` of
        ``request_id``: the store token is a reader of each block, so a later
        write into them waits for it (WAR). ``key`` (default:
        ``request_id``) is what :meth:`finish` ends it by. O(len(blocks)).

        Raises:
            UnknownStreamError: ``stream`` was not added.
            ForeignBlockError, BlockNotAllocatedError: as the core's ``begin_store``.
        """
        block_list = list(blocks)
        token, fence = self.pool.begin_store(block_list, stream)
        t = Transfer(request_id, "store", token, fence, tuple([b.block_id for b in block_list]))
        k = request_id if key is None else key
        self._stores.setdefault(k, []).append(t)
        if stream in self._give_up:
            self._lease(stream, k, t)
        self._count_begun(t)
        return t

    def _count_begun(self, t: Transfer) -> None:
        """A transfer begun (:meth:`begin_load`, :meth:`begin_store`), added
        to the process's :data:`~blockpool.integrations.vllm.served.SERVED`
        (``transfers_fenced``, ``fences_nonempty``), which the connector
        wirings read instead of counting their own. The pool counted it
        already (its stats' ``loads_begun``, ``stores_begun``,
        ``transfer_fences_nonempty``); :attr:`transfers_begun` and
        :attr:`fences_nonempty` read that count. O(1)."""
        SERVED.transfers_fenced += 1
        SERVED.fences_nonempty += bool(t.fence.tokens)

    @property
    def transfers_begun(self) -> int:
        """Loads and stores begun on this pool (the pool's own count). O(1)."""
        c = self.pool._counters
        return c["loads_begun"] + c["stores_begun"]

    @property
    def fences_nonempty(self) -> int:
        """Of :attr:`transfers_begun`, those whose fence named a token. O(1)."""
        return self.pool._counters["transfer_fences_nonempty"]

    def finish(self, key: Hashable, *, failed: bool = False) -> int:
        """End every load and store begun under ``key`` (for connectors that
        report completions by job id rather than request id): ``failed``
        fails loads (their blocks lose their keys) and stores alike. Unknown
        keys are ignored. Returns the number of transfers ended. O(transfers
        under ``key``).
        """
        pool = self.pool
        n = 0
        for table in (self._loads, self._stores):
            for t in table.pop(key, ()):
                if failed:
                    pool.fail(t.token)
                else:
                    pool.complete(t.token)
                n += 1
        return n

    def end_transfers(
        self,
        finished_recving: Iterable[str] | None = (),
        finished_sending: Iterable[str] | None = (),
        failed_recving: Iterable[str] | None = (),
        invalid_block_ids: Iterable[int] | None = (),
    ) -> int:
        """End the transfers the connector reported (the fields of vLLM's
        ``KVConnectorOutput``, already aggregated over every worker), in
        this order:

        - the loads of ``failed_recving`` requests fail
          (:meth:`HazardAwareBlockPool.fail`: every block they wrote is
          bad and loses its keys);
        - a pending load that wrote some of ``invalid_block_ids`` ends with
          exactly those blocks bad (:meth:`HazardAwareBlockPool.fail_blocks`):
          its other blocks hold what it wrote and keep their keys, as vLLM
          keeps them (it recomputes a request from its first invalid block
          on); a load all of whose blocks are named fails as above (a
          connector names every block of a load that never ran);
        - ``finished_recving`` completes the loads and ``finished_sending``
          the stores of those requests. The blocks of a completed load on
          an engine that rewrites what it receives
          (:meth:`rewrites_on_receive`) are written by the next step
          record's forward token (:meth:`step_record`).

        Unknown request ids, and invalid blocks no pending load wrote, are
        ignored. Returns the number of transfers ended. O(reported ids),
        plus O(blocks of the pending loads) when blocks are invalid.
        """
        return self._end_transfers(finished_recving, finished_sending, failed_recving, invalid_block_ids)

    def _end_transfers(
        self,
        finished_recving: Iterable[str] | None,
        finished_sending: Iterable[str] | None,
        failed_recving: Iterable[str] | None,
        invalid_block_ids: Iterable[int] | None,
    ) -> int:
        """:meth:`end_transfers`."""
        pool = self.pool
        loads = self._loads
        n = 0
        for req in set(failed_recving or ()):
            for t in loads.pop(req, ()):
                pool.fail(t.token)
                n += 1
        bad = set(invalid_block_ids or ())
        if bad and loads:
            n += self._fail_invalid(bad)
        rewritten = self._rewrites_on_receive
        for req in finished_recving or ():
            for t in loads.pop(req, ()):
                pool.complete(t.token)
                n += 1
                if t.token.stream in rewritten:
                    self._received.extend(t.block_ids)
        for req in finished_sending or ():
            for t in self._stores.pop(req, ()):
                pool.complete(t.token)
                n += 1
        return n

    def _fail_invalid(self, bad: set[int]) -> int:
        """End every pending load that wrote some of the ``bad`` block ids:
        with exactly those blocks bad, or failed when they are all its
        blocks (or it ended already: a late failure, the safe side).
        Parts of a load under the same key that wrote none of them stay
        pending. Returns the number ended. O(blocks of the pending loads)."""
        pool = self.pool
        own = pool.blocks
        n = 0
        hit_keys = [
            k for k, parts in self._loads.items() if any(not bad.isdisjoint(t.block_ids) for t in parts)
        ]
        for key in hit_keys:
            keep = []
            for t in self._loads.pop(key):
                hit = [b for b in t.block_ids if b in bad]
                if not hit:
                    keep.append(t)
                    continue
                n += 1
                if len(hit) == len(t.block_ids) or pool.is_ended(t.token):
                    pool.fail(t.token)
                else:
                    pool.fail_blocks(t.token, [own[b] for b in hit])
                    self.loads_failed_in_part += 1
            if keep:
                self._loads[key] = keep
        return n

    def on_connector_output(self, kv_connector_output: object) -> int:
        """:meth:`end_transfers` with the fields of a vLLM
        ``KVConnectorOutput`` (``None`` is allowed). The output is left as
        the connector made it: vLLM's recovery
        (``Scheduler._handle_invalid_blocks``) reads exactly the blocks the
        connector reported, and the pool holds exactly those blocks bad.
        Under ``kv_load_failure_policy="recompute"`` vLLM then keeps each
        affected request's valid prefix (its computed tokens end where its
        first reported block starts) and recomputes the rest; under
        ``"fail"`` it fails exactly the requests stock vLLM fails. Returns
        the number of transfers ended. O(as :meth:`end_transfers`).
        """
        if kv_connector_output is None:
            return 0
        get = getattr
        return self._end_transfers(
            get(kv_connector_output, "finished_recving", None),
            get(kv_connector_output, "finished_sending", None),
            get(kv_connector_output, "failed_recving", None),
            get(kv_connector_output, "invalid_block_ids", None),
        )

    def rewrites_on_receive(self, stream: str) -> None:
        """Declare that the workers of engine ``stream`` rewrite a load's
        blocks on the compute stream when they report it finished, before
        the next step runs (NIXL: ``get_finished`` enqueues the block-size
        and layout conversion, the zeroing of the sub-blocks the read did
        not cover, the heterogeneous-attention packing, or the copy from
        the host buffer, on the current stream, after the step's forward).
        The blocks of each load on ``stream`` completed through
        ``finished_recving`` are then recorded as written by the forward
        token of the next step record (:meth:`step_record`), which every
        worker records after that step's forward, so after those writes: a
        later store of the blocks (a MooncakeStore PUT) or load into them
        waits for that step, as vLLM's own after-forward event does.
        Idempotent. O(1).

        Raises:
            UnknownStreamError: ``stream`` was not added; nothing changes.
        """
        if stream not in self.pool.streams:
            raise UnknownStreamError(f"rewrites_on_receive: stream {stream!r} was not added")
        self._rewrites_on_receive.add(stream)

    def _write_received(self, token: Token) -> None:
        """Record the blocks gathered for :meth:`rewrites_on_receive` as
        written by ``token`` (a step's forward token, just issued: nothing
        is ordered after it yet), freed ones too (the rewrite runs
        whatever the scheduler did since; a block handed out again keeps
        the write in its shadow, so its next user's transfers wait for
        it). A block another write began on since (a block handed out
        again and loaded in the same ``schedule()``) keeps that write as
        its writer: replacing it would let the block's next user skip a
        transfer still in flight; that load runs unordered with the
        rewrite, as in stock vLLM, and everything after it waits for it.
        O(blocks)."""
        ids, self._received = self._received, []
        pool = self.pool
        own = pool.blocks
        n = len(own)
        blocks = []
        for b in dict.fromkeys(ids):
            if 0 < b < n:
                block = own[b]
                w = block.writer
                if w is None or pool.is_ended(w):
                    blocks.append(block)
        if blocks:
            self.pool.tag(blocks, token, AccessKind.WRITE)
            self.blocks_rewritten_on_receive += len(blocks)

    def blocks_on_their_way(self) -> int:
        """Blocks the pool holds back (neither free nor allocatable,
        ``get_num_free_blocks()`` excludes them) until a host engine's
        transfer on them ends: they return to the free queue when the
        connector reports it finished or failed (or its lease ends), which
        no preemption can hasten. :meth:`defer_preemption` weighs it
        against the need of the request that did not fit
        (``docs/vllm-plugin.md``, "Preemption, bad blocks and new blocks").
        Completions reported
        since the pool's last call are applied first (as by
        ``get_num_free_blocks``). O(1) plus those completions."""
        pool = self.pool
        pool.get_num_free_blocks()  # applies queued completions (they may release held blocks)
        return len(pool.holdback)

    def pending_transfers(self) -> list[Transfer]:
        """Transfers begun and not yet ended, loads first."""
        return [t for ts in self._loads.values() for t in ts] + [
            t for ts in self._stores.values() for t in ts
        ]

    # ------------------------------------------------------------------
    # availability: bounded deferral, leases
    # ------------------------------------------------------------------

    def begin_schedule(self) -> int:
        """The scheduler wiring's call as each ``schedule()`` begins: counts
        the call (the step index of :meth:`defer_preemption`'s bound) and
        gives up the transfers whose lease ended (:meth:`expire_transfers`),
        so that their blocks serve this step. Never raises (a fault is
        counted in ``lease_faults`` and logged once). Returns the number of
        transfers given up. O(1) when no lease ended, else as
        :meth:`expire_transfers`."""
        self.schedule_calls += 1
        self.last_need = None  # this step's allocations set it again
        if not self._leased:
            return 0
        try:
            return self.expire_transfers()
        except Exception as exc:  # noqa: BLE001  (never into vLLM's scheduler)
            return self._lease_fault("checking the leases of host transfers", exc)

    def _lease_fault(self, what: str, exc: BaseException) -> int:
        """Count a fault of the leases' wiring in ``lease_faults`` and log the
        first one (one ERROR line). Returns 0 (nothing given up). O(1)."""
        self.lease_faults += 1
        if self.lease_faults == 1:
            logger.error(
                "blockpool: %s failed (%r); the blocks held back stay held until their transfers report "
                "or their leases end (further faults counted in lease_faults)",
                what,
                exc,
            )
        return 0

    def end_schedule(self, scheduled: bool) -> int:
        """The scheduler wiring's call as each ``schedule()`` returns,
        ``scheduled`` telling whether the step scheduled any token. A step
        that scheduled nothing while blocks are held back for host transfers
        and an allocation was refused (a running request waited for them,
        :meth:`defer_preemption`, or the step asked for :attr:`last_need`
        blocks and got none) counts as held up, whatever the refusal's
        arithmetic: vLLM also subtracts its watermark and the blocks it
        reserves (prefills in flight, speculative decoding) from the free
        count, and stock vLLM would have had the held blocks free on top
        of it; at the end of the :attr:`defer_steps`-th
        such step in a row (the first, where it is 0), every transfer blocks
        are held back for is given up (:meth:`release_held`): stock vLLM
        would have reused those blocks at once, and the requests that need
        them would otherwise wait for the transfers' leases.
        Any other step ends the count. Never raises (a fault is counted in
        ``lease_faults`` and logged once). Returns the number of transfers
        given up. O(1) unless the step scheduled nothing."""
        if scheduled:
            self._held_up = 0
            return 0
        try:
            need = self.last_need
            pool = self.pool
            if need is None or not len(pool.holdback):
                self._held_up = 0
                return 0
            pool.get_num_free_blocks()  # applies completions (they may release held blocks)
            if not len(pool.holdback):
                self._held_up = 0
                return 0
            self._held_up += 1
            if self._held_up < max(self.defer_steps, 1):
                return 0
            self._held_up = 0
            return self.release_held()
        except Exception as exc:  # noqa: BLE001  (never into vLLM's scheduler)
            return self._lease_fault("releasing held blocks for a stalled scheduler", exc)

    def release_held(self) -> int:
        """Give up every host transfer that blocks are held back for, oldest
        first, each as at the end of its lease (:meth:`expire_transfers`:
        its token abandoned, its blocks back, its late report ignored, one
        WARNING), counted in ``held_releases``. Returns the number given up.
        O(leases + held blocks).

        Raises:
            BlockPoolError: from the pool (a token it does not know).
        """
        pool = self.pool
        held = set(pool.holdback.pending_tokens())
        if not held:
            return 0
        entries = [(stream, e) for stream, q in self._leases.items() for e in q if e[4].token in held]
        entries.sort(key=lambda se: se[1][1])  # oldest first (the time each began)
        given_up = 0
        why = f"the scheduler scheduled nothing for {max(self.defer_steps, 1)} steps for want of the blocks held for it"
        for stream, entry in entries:
            given_up += self._give_up_transfer(stream, entry, why)  # first: a fault leaves the lease in place
            self.held_releases += 1
            self._leases[stream].remove(entry)
            self._leased -= 1
        return given_up

    def give_up_after(self, stream: str, seconds: float | None) -> None:
        """The give-up time of host engine ``stream``: a transfer on it that
        has not reported ``seconds`` after it began is abandoned
        (:meth:`expire_transfers`). ``None``: :attr:`transfer_timeout` (the
        connector has no time of its own). Transfers begun before the call
        keep the time they began with. A connector calls it where it
        registers the stream (:meth:`add_stream`). O(1).

        Raises:
            UnknownStreamError: ``stream`` is not a ``HOST`` engine added
                with :meth:`add_stream`.
            InvalidArgumentError: ``seconds`` is not a finite number > 0.
        """
        if seconds is not None:
            _check_seconds(seconds, "seconds")
        if stream not in self._give_up:
            raise UnknownStreamError(
                f"{stream!r} is not a host engine added with add_stream (host engines: {sorted(self._give_up)})"
            )
        self._give_up[stream] = self.transfer_timeout if seconds is None else float(seconds)

    def give_up_time(self, stream: str) -> float | None:
        """The give-up time of ``stream`` in seconds, ``None`` for a device
        stream or an unknown name (no lease). O(1)."""
        return self._give_up.get(stream)

    def _lease(self, stream: str, key: Hashable, t: Transfer) -> None:
        """Start the lease of host transfer ``t`` begun under ``key``. O(1)."""
        q = self._leases.get(stream)
        if q is None:
            q = self._leases[stream] = collections.deque()
        now = self.clock()
        q.append((now + self._give_up[stream], now, self.schedule_calls, key, t))
        self._leased += 1

    def expire_transfers(self) -> int:
        """Give up every host transfer whose lease ended: begun more than
        its engine's give-up time ago (:meth:`give_up_after`) and not
        reported. The engine itself has given up on it by then, and stock
        vLLM would already have reused its blocks: its token is abandoned
        (``HazardAwareBlockPool.abandon``: ended as failed, a load's blocks
        lose their keys), the blocks held back for it return to the free
        queue, and the connector's later report of it is ignored. One
        WARNING per transfer names the engine, the request and key, its age
        and the block ids. Leases of transfers that ended are dropped as
        they reach the front of their engine's queue. Returns the number of
        transfers given up. O(leases dropped + blocks released); O(streams)
        when none ended.

        Raises:
            BlockPoolError: from the pool (a token it does not know); the
                scheduler wiring calls it through :meth:`begin_schedule`,
                which never raises.
        """
        pool = self.pool
        now = self.clock()
        given_up = 0
        for stream, q in self._leases.items():
            while q:
                deadline, _, _, _, t = q[0]
                if pool.is_ended(t.token):
                    q.popleft()
                    self._leased -= 1
                    continue
                if deadline > now:
                    break
                given_up += self._give_up_transfer(stream, q[0], "the engine gives up on it")
                q.popleft()
                self._leased -= 1
        return given_up

    def _give_up_transfer(self, stream: str, entry: _Lease, why: str) -> int:
        """Abandon the lease ``entry``'s transfer (its token failed, its held
        blocks back), forget it, count it and log one WARNING saying
        ``why``. Returns 1. O(blocks held on it).

        Raises:
            BlockPoolError: from the pool; nothing is forgotten then.
        """
        _, begun, step, key, t = entry
        released = self.pool.abandon(t.token)  # first: a fault leaves the lease in place
        self._forget(key, t)
        self.transfers_abandoned += 1
        self.blocks_reclaimed += len(released)
        logger.warning(
            "blockpool: %s: %s of request %r (key %r) did not report within %.0f s (%d scheduler steps): "
            "given up, as %s; its token is failed, its blocks %s are no longer held for it (returned to "
            "the free queue: %s); stock vLLM would already have reused them",
            stream, t.kind, t.request_id, key, self.clock() - begun, self.schedule_calls - step, why,
            list(t.block_ids), released or "none",
        )  # fmt: skip
        return 1

    def _forget(self, key: Hashable, t: Transfer) -> None:
        """Drop transfer ``t`` from the pending ones under ``key``, so that a
        late report of it ends nothing. O(transfers under ``key``)."""
        table = self._loads if t.kind == "load" else self._stores
        parts = table.get(key)
        if parts is None:
            return
        kept = [p for p in parts if p is not t]
        if kept:
            table[key] = kept
        else:
            del table[key]

    def defer_preemption(self) -> bool:
        """vLLM's question, when a running request did not fit, whether
        blocks coming back make a preemption unnecessary
        (``has_pending_block_frees()``): ``True`` only while (a) the blocks
        held back for host transfers in flight (:meth:`blocks_on_their_way`)
        could cover the shortfall of that request (:attr:`last_need`, the
        coordinator's count, less the free blocks), and (b) fewer than
        :attr:`defer_steps` - 1 consecutive ``schedule()`` calls before this
        one deferred. The call after such a run, the :attr:`defer_steps`-th,
        answers ``False`` for the whole of its step (vLLM preempts as stock,
        counted in ``deferrals_given_up``; if that step still schedules
        nothing, :meth:`end_schedule` gives the held transfers up) and starts
        the count again: at most :attr:`defer_steps` steps in a row schedule
        nothing for want of held blocks. A shortfall the
        held blocks cannot cover answers ``False`` (``deferrals_too_small``),
        as does an unknown need. Deferrals are counted in
        ``preemptions_deferred``. O(1) plus the completions applied.
        """
        if self.defer_steps <= 0:
            return False
        step = self.schedule_calls
        if step == self._gave_up_step:
            return False
        held = self.blocks_on_their_way()
        need = self.last_need
        if not held or need is None:
            return False
        if need - self.pool.get_num_free_blocks() > held:
            self.deferrals_too_small += 1
            return False
        if step != self._defer_step:
            streak = self._defer_streak + 1 if step == self._defer_step + 1 else 1
            if streak >= self.defer_steps:
                self._gave_up_step = step
                self._defer_streak = 0
                self.deferrals_given_up += 1
                return False
            self._defer_step = step
            self._defer_streak = streak
        self.preemptions_deferred += 1
        return True

    def leases_pending(self) -> int:
        """Leases not yet dropped (transfers that ended are dropped lazily,
        as they reach the front of their engine's queue). O(1)."""
        return self._leased
