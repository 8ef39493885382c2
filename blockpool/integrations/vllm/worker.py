"""Worker-side wiring of vLLM's KV connectors: real events for the step
tokens, and each wired transfer waits on exactly its own fence before it
touches GPU memory.

The scheduler half (:mod:`blockpool.integrations.vllm.connectors`) puts the
step's record on each wired connector's metadata and a transfer's
:class:`~blockpool.integrations.vllm.hazards.Transfer` on the item its
worker reads. Here, in every worker process, a :class:`WorkerHazards`
(one :class:`~blockpool.worker.torch_events.EventLedger` per process, i.e. per
rank) turns them into waits:

- when a connector binds a step's metadata (before the forward, after the
  zeroing of the step's new blocks and its block copies were enqueued on
  the compute stream), the copy token (which stands for both) is recorded
  on the compute stream and the compute stream waits on the forward's
  fence (usually empty);
- after the step's last KV write, the forward token ``eN`` is recorded on
  the compute stream, whichever connectors are wired: right after the
  forward was launched, before the connectors' async loads start
  (``KVConnectorModelRunnerMixin._get_kv_connector_output``; Model Runner
  V2: ``ActiveKVConnector.post_forward``), or, with speculative decoding on
  the rank that drafts, where vLLM finalizes the connector after the draft
  model (``finalize_kv_connector``; V2: ``finalize_step``);
- **MooncakeStore**: the receive thread waits on the host for its load's
  fence before it issues the GETs (:meth:`EventLedger.wait_host`), and the
  send thread, where vLLM synchronizes one event recorded after the whole
  forward (``req_meta.current_event``), waits on the store's own fence
  instead -- or, where the scheduler could not show the fence exact
  (:data:`~blockpool.integrations.vllm.connectors.META_STOCK`), on the
  fence and then on vLLM's event; both threads report their tokens' ends to
  the ledger. Without a fence (hazards off, connector unwired) vLLM's code
  runs unchanged;
- **Offloading**: a job's copy stream waits on the job's fence
  (``stream.wait_event`` per token, no host block) right before its copy
  kernels, after vLLM's own ``wait_stream(compute)`` barrier (kept: never
  weaker than stock; it also orders the zeroing of new blocks, which the
  pool tracks too where the scheduler saw it), and the job's token is
  recorded on that stream after them;
- **NIXL** (pull mode): the worker posts READs from its main thread, which
  must not block; a read whose fence has not ended is deferred and posted
  by the first later ``start_load_kv`` that finds the fence ended.

No wrapper lets an exception out into vLLM: a fence this rank cannot wait
on (a token never recorded here, a host engine past :attr:`WorkerHazards.timeout`,
a failed token) leaves that transfer to vLLM's own waits, as stock, with one
warning (:meth:`WorkerHazards.wait_device_or_stock`). In audit mode
(``BLOCKPOOL_VLLM_HAZARDS=audit``) no wrapper waits at all; each transfer is
checked and counted instead (:mod:`~blockpool.integrations.vllm.audit`).

:func:`install` sets the process's :class:`WorkerHazards` (tests pass CPU
stand-ins, :mod:`blockpool.worker.standins`); without one, the first wired
call builds one on CUDA when CUDA is available, else fences are ignored and
vLLM's own synchronisation runs (a CPU-only worker has no streams to race).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from blockpool.core.errors import BlockPoolError
from blockpool.core.hazards import Fence, StreamKind, Token
from blockpool.integrations.vllm.audit import MODE_AUDIT, Audit, device_covered_by
from blockpool.integrations.vllm.connectors import MOONCAKE, NIXL, OFFLOADING
from blockpool.integrations.vllm.hazards import StepRecord, Transfer
from blockpool.integrations.vllm.wiring import (
    CONNECTORS,
    ENV_HAZARDS,
    META_LOAD,
    META_STEP,
    META_STOCK,
    META_STORE,
    WORKER_HALVES,
    Patcher,
    register_worker_half,
)
from blockpool.worker.torch_events import EventLedger, event_factory

__all__ = [
    "SCHEDULER_ONLY_STREAMS",
    "AuditedEvent",
    "FenceWait",
    "WorkerHazards",
    "current",
    "forward_launched",
    "install",
    "offload_transfer_async",
    "step_of",
    "wire",
]

logger = logging.getLogger("vllm.plugins.blockpool")


class WorkerHazards:
    """The wired connectors' events and waits in one worker process.

    Args:
        ledger: The rank's event ledger.
        current_stream: Returns the calling thread's current device stream
            (``torch.cuda.current_stream`` on CUDA; a stand-in in tests).
        timeout: Seconds a host wait may take before it fails (the
            transfer is then reported failed, never run unordered).
        audit: Audit mode (:mod:`~blockpool.integrations.vllm.audit`): when
            set, no wrapper adds a wait; each transfer is checked and
            counted instead (:meth:`observe`), and vLLM's own waits run as
            stock.

    Thread safety: :meth:`on_bind`, :meth:`forward_done` and the job table
    are used by the worker's main thread; :meth:`wait` and :meth:`ended` by
    transfer threads (the ledger is thread-safe).
    """

    def __init__(
        self,
        ledger: EventLedger,
        current_stream: Callable[[], Any],
        *,
        timeout: float = 60.0,
        audit: Audit | None = None,
    ) -> None:
        self.ledger = ledger
        self.current_stream = current_stream
        self.timeout = timeout
        self.audit = audit
        self.jobs: dict[Any, Transfer] = {}
        self.waits = 0
        self.tokens_waited = 0
        self.deferred = 0
        self.out_of_order = 0
        self.skipped: dict[str, list[int]] = {}
        self.stock_fallbacks = 0
        self.copy_fences_unwaited = 0
        self._recorded: dict[str, int] = {}
        self._fallbacks_logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def record(self, token: Token | None, stream: Any = None) -> bool:
        """Record ``token``'s event on ``stream`` (default: the current
        stream) unless it or a later token of its stream was recorded
        already (several connectors carry the same step). Returns whether
        it recorded. O(1)."""
        if token is None or token.kind is not StreamKind.DEVICE:
            return False
        with self._lock:
            last = self._recorded.get(token.stream, 0)
            if token.seq <= last:
                if token.seq < last:
                    # Recorded after a later token of its stream: a wait on it
                    # would resolve to that earlier point. The scheduler begins
                    # a connector's transfers in the order its worker submits
                    # them, so this means a connector path the wiring does not
                    # know; say so rather than alias silently.
                    self.out_of_order += 1
                    logger.warning(
                        "blockpool: %s recorded after %s:%d; waits on it are not exact",
                        token,
                        token.stream,
                        last,
                    )
                return False
            self._recorded[token.stream] = token.seq
            if token.seq > last + 1:
                # Tokens the scheduler issued for this rank that nothing
                # recorded: a wait on one resolves to this later point (a
                # redundant wait) or, before it, times out. A wiring path
                # that lost a record; tests assert there are none
                # (:meth:`unrecorded`).
                first = token.stream not in self.skipped
                self.skipped.setdefault(token.stream, []).extend(range(last + 1, token.seq))
                if first:
                    logger.warning(
                        "blockpool: %s:%d..%d were never recorded on this rank; waits on them are not exact",
                        token.stream,
                        last + 1,
                        token.seq - 1,
                    )
        self.ledger.record(token, self.current_stream() if stream is None else stream)
        return True

    def was_recorded(self, token: Token) -> bool:
        """Whether ``token``, or a later token of its stream, was recorded
        on this rank. O(1)."""
        with self._lock:
            return token.seq <= self._recorded.get(token.stream, 0)

    def unrecorded(self, last_issued: dict[str, int]) -> dict[str, list[int]]:
        """The ``DEVICE`` tokens the scheduler issued (every seq up to
        ``last_issued[stream]``, e.g. ``pool.last_token(stream).seq``) that
        this rank never recorded: skipped below a recorded one
        (:attr:`skipped`), or above the last recorded. Empty when every
        token was recorded; tests assert that after each scenario, so a
        lost record fails a test instead of timing out a transfer thread.
        O(streams + unrecorded tokens)."""
        with self._lock:
            out = {k: list(v) for k, v in self.skipped.items()}
            for stream, last in last_issued.items():
                recorded = self._recorded.get(stream, 0)
                if last > recorded:
                    out.setdefault(stream, []).extend(range(recorded + 1, last + 1))
        return {k: v for k, v in out.items() if v}

    def on_bind(self, metadata: object) -> StepRecord | None:
        """A connector bound a step's metadata (before the forward): record
        the step's copy token and order the compute stream after the
        forward's fence. Returns the step's record, or ``None`` when the
        metadata carries none. O(fence size)."""
        step = getattr(metadata, META_STEP, None)
        if step is None:
            return None
        record = StepRecord.from_wire(step[0])
        self.ledger.poll()  # recycle the events of ended tokens
        self.record(record.copies)
        copy_fence = self.waitable(record.copy_fence)
        if copy_fence:
            # vLLM's runner enqueued the zeroing and the copies already
            # (_update_states / update_requests, before the bind): nothing
            # can order them now. vLLM keeps copy endpoints
            # free of other-stream accesses (flushes, pins, hold-backs); count
            # any fence that says otherwise.
            if self.audit is not None:
                self.observe("compute", "copy", record.copies, copy_fence, covered=frozenset({"compute"}))
            else:
                self.copy_fences_unwaited += 1
                if self.copy_fences_unwaited == 1:
                    logger.warning(
                        "blockpool: block copies of step %d (or its zeroing of new blocks) had a fence (%s) "
                        "that no wait can order: vLLM enqueues them before the connector binds the step "
                        "(counted in copy_fences_unwaited)",
                        record.index,
                        ", ".join(map(str, copy_fence)),
                    )
        fence = self.waitable(Fence.from_wire(step[1]))
        if self.audit is not None:
            # The forward runs on compute, after every compute token recorded so far.
            self.observe(
                "compute", "forward", record.forward, fence, covered=frozenset({record.forward.stream})
            )
        elif fence:
            self.wait_device_or_stock(fence, self.current_stream(), "the forward")
        return record

    def wait_device_or_stock(self, fence: Iterable[Token], stream: Any, what: str) -> bool:
        """Order ``stream`` after ``fence`` (:meth:`EventLedger.wait_device`,
        host-waiting for ``HOST`` tokens), inside vLLM's worker, where no
        exception may escape: a fence that cannot be waited on here (a token
        never recorded on this rank, a host engine that did not end within
        :attr:`timeout`, a failed token) leaves ``what`` to vLLM's own waits
        alone -- exactly stock vLLM -- with one WARNING per kind of failure
        and ``stock_fallbacks`` counted. Returns whether the fence was waited
        on. O(fence size), plus the host wait."""
        try:
            self.ledger.wait_device(fence, stream, allow_host_wait=True, timeout=self.timeout)
            return True
        except BlockPoolError as exc:
            self.fell_back(what, exc)
            return False

    def fell_back(self, what: str, exc: BaseException) -> None:
        """``what`` could not wait on its fence (``exc``) and runs after
        vLLM's own waits only: count it in ``stock_fallbacks``, one WARNING
        per kind of transfer and failure. O(1)."""
        self.stock_fallbacks += 1
        key = (what, type(exc).__name__)
        if key not in self._fallbacks_logged:
            self._fallbacks_logged.add(key)
            logger.warning(
                "blockpool: %s cannot wait on its fence here (%s); it runs after vLLM's own waits only, "
                "as in stock vLLM",
                what,
                exc,
            )

    def observe(
        self,
        connector: str,
        kind: str,
        token: Token,
        fence: Iterable[Token],
        *,
        request_id: str = "",
        block_ids: Iterable[int] = (),
        covered: frozenset[str] = frozenset(),
    ) -> tuple[Token, ...]:
        """Audit mode: a transfer (or a step's forward) is about to touch GPU
        memory under vLLM's own waits alone. Count it in :attr:`audit`, and
        as a would-be race when a token of its ``fence`` is still running
        and is not a ``DEVICE`` token of ``covered`` recorded before now
        (streams vLLM's own wait orders it after). Never blocks (a ledger
        poll). Returns the tokens still running; ``()`` without an audit.
        O(streams + fence size)."""
        if self.audit is None:
            return ()
        tokens = self.waitable(fence)
        if tokens:
            self.ledger.poll()
        return self.audit.observe(
            connector,
            kind,
            tokens,
            self.ledger.is_complete,
            token=token,
            request_id=request_id,
            block_ids=block_ids,
            covered=device_covered_by(covered, lambda stream: self._recorded.get(stream, 0)),
        )

    def observe_transfer(
        self, connector: str, transfer: Transfer, covered: frozenset[str] = frozenset()
    ) -> None:
        """:meth:`observe` for a connector's :class:`Transfer`."""
        self.observe(
            connector,
            transfer.kind,
            transfer.token,
            transfer.fence,
            request_id=transfer.request_id,
            block_ids=transfer.block_ids,
            covered=covered,
        )

    @staticmethod
    def waitable(fence: Iterable[Token]) -> tuple[Token, ...]:
        """The tokens of ``fence`` a worker can wait on: all but those of
        :data:`SCHEDULER_ONLY_STREAMS`, which no worker records (vLLM's own
        synchronisation orders those transfers, as in stock vLLM; a wait on
        them here would fail or time out). O(fence size)."""
        return tuple(t for t in fence if t.stream not in SCHEDULER_ONLY_STREAMS)

    def forward_done(self, metadata: object) -> StepRecord | None:
        """The step's forward was launched: record ``eN`` on the current
        stream. O(1)."""
        step = getattr(metadata, META_STEP, None)
        if step is None:
            return None
        record = StepRecord.from_wire(step[0])
        self.record(record.forward)
        return record

    def has_ended(self, fence: Iterable[Token]) -> bool:
        """Whether every token of ``fence`` is known complete here (polls
        the ledger first; never blocks). O(streams + fence)."""
        tokens = self.waitable(fence)
        if not tokens:
            return True
        self.ledger.poll()
        return all(self.ledger.is_complete(t) for t in tokens)

    def wait(self, transfer: Transfer) -> tuple[Token, ...]:
        """Block the calling (transfer) thread until ``transfer``'s fence
        ended. Returns the tokens waited on.

        Raises:
            FenceTimeoutError: not within ``timeout``.
        """
        waited = self.ledger.wait_host(self.waitable(transfer.fence), timeout=self.timeout)
        self.waits += 1
        self.tokens_waited += len(waited)
        return waited

    def ended(self, transfer: Transfer, *, failed: bool = False) -> None:
        """A host engine's transfer ended (wakes threads waiting on it)."""
        if transfer.token.kind is StreamKind.HOST:
            self.ledger.mark_host_complete(transfer.token, failed=failed)

    def record_points(self, items: Iterable[object], attr: str) -> None:
        """Record, on the current stream, the token of each item carrying a
        transfer under ``attr`` that this rank does not run (a non-writer
        rank of a replicated store: the job completes at once here), unless
        recorded already. O(items)."""
        for item in items:
            wire_form = getattr(item, attr, None)
            if wire_form is not None:
                token = Transfer.from_wire(wire_form).token
                if token.seq > self._recorded.get(token.stream, 0):
                    self.record(token)

    def add_jobs(self, key: str, jobs: Any, attr: str) -> None:
        """Remember the transfers of ``{job_id: item}`` whose items carry
        ``attr``, under ``(key, job_id)``."""
        for job_id, item in (jobs or {}).items():
            wire_form = getattr(item, attr, None)
            if wire_form is not None:
                self.jobs[(key, job_id)] = Transfer.from_wire(wire_form)


class FenceWait:
    """Stands in for MooncakeStore's ``req_meta.current_event``: its
    ``synchronize()`` waits on the store's exact fence instead of on one
    event recorded after the whole forward, or, where the wiring cannot show
    the fence exact (``keep_stock``, see
    :data:`~blockpool.integrations.vllm.connectors.META_STOCK`), on the
    fence and then on vLLM's event too: never less than vLLM waits for. A
    fence this rank cannot wait on (a token never recorded here, a host
    engine past the timeout, a failed token) falls back to vLLM's event
    alone, as stock, with one warning: nothing raises into vLLM's send
    thread.

    Args:
        hazards: The rank's :class:`WorkerHazards`.
        transfer: The store.
        stock: vLLM's own event for the store (recorded where vLLM records
            it), or ``None`` (tests).
        keep_stock: Wait on ``stock`` after the fence too.
    """

    __slots__ = ("hazards", "keep_stock", "stock", "transfer")

    def __init__(
        self, hazards: WorkerHazards, transfer: Transfer, stock: Any = None, keep_stock: bool = False
    ) -> None:
        self.hazards = hazards
        self.transfer = transfer
        self.stock = stock
        self.keep_stock = keep_stock

    def synchronize(self) -> None:
        """Block until the fence ended (then vLLM's own event, if kept, or
        instead, if the fence cannot be waited on here). Raises nothing of
        its own."""
        try:
            self.hazards.wait(self.transfer)
        except BlockPoolError as exc:
            self.hazards.fell_back("a MooncakeStore PUT", exc)
            if self.stock is not None:
                self.stock.synchronize()
            return
        if self.keep_stock and self.stock is not None:
            self.stock.synchronize()

    def query(self) -> bool:
        """Whether a :meth:`synchronize` now would return at once. Never blocks."""
        if self.keep_stock and self.stock is not None and not self.stock.query():
            return False
        return self.hazards.ledger.is_complete(self.transfer.token) or all(
            self.hazards.ledger.is_complete(t) for t in self.hazards.waitable(self.transfer.fence)
        )


class AuditedEvent:
    """Audit mode's ``req_meta.current_event`` for a MooncakeStore PUT:
    vLLM's own event, exactly as stock; once the send thread's
    ``synchronize()`` returns (the PUT starts reading right after), the
    store's fence is checked (:meth:`WorkerHazards.observe`).

    Args:
        hazards: The rank's :class:`WorkerHazards` (with an audit).
        transfer: The store.
        event: vLLM's event.
    """

    __slots__ = ("event", "hazards", "observed", "transfer")

    def __init__(self, hazards: WorkerHazards, transfer: Transfer, event: Any) -> None:
        self.hazards = hazards
        self.transfer = transfer
        self.event = event
        self.observed = False

    def synchronize(self) -> None:
        """vLLM's ``event.synchronize()``, then the audit's check (once per
        store: the send thread synchronizes again for boundary puts)."""
        self.event.synchronize()
        if not self.observed:
            self.observed = True
            self.hazards.observe_transfer(MOONCAKE, self.transfer)

    def query(self) -> bool:
        """vLLM's ``event.query()``."""
        return bool(self.event.query())


_COMPUTE = frozenset({"compute"})

_CURRENT: WorkerHazards | None = None
_CURRENT_LOCK = threading.Lock()


def install(hazards: WorkerHazards | None) -> None:
    """Set (or, with ``None``, clear) this process's :class:`WorkerHazards`."""
    global _CURRENT
    with _CURRENT_LOCK:
        _CURRENT = hazards


def current() -> WorkerHazards | None:
    """This process's :class:`WorkerHazards`: the installed one, else one
    built on CUDA the first time (when CUDA is available), else ``None``."""
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    if not torch.cuda.is_available():
        return None
    with _CURRENT_LOCK:
        if _CURRENT is None:
            rank = _rank()
            audit = None
            if os.environ.get(ENV_HAZARDS, "").strip().lower() == MODE_AUDIT:
                audit = Audit.from_env(rank)
                atexit.register(audit.report)
            _CURRENT = WorkerHazards(
                EventLedger(event_factory("cuda"), rank=rank), torch.cuda.current_stream, audit=audit
            )
        return _CURRENT


def _rank() -> int:
    try:
        return int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
    except Exception:  # noqa: BLE001  (the rank only labels reports)
        return 0


# ----------------------------------------------------------------------
# the wrappers
# ----------------------------------------------------------------------


def _wire_base(patch: Patcher) -> None:
    base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")

    def wrap_bind(orig: Any) -> Any:
        @functools.wraps(orig)
        def bind_connector_metadata(self: Any, connector_metadata: Any) -> None:
            orig(self, connector_metadata)
            if getattr(connector_metadata, META_STEP, None) is not None:
                wh = current()
                if wh is not None:
                    wh.on_bind(connector_metadata)

        return bind_connector_metadata

    patch(base.KVConnectorBase_V1, "bind_connector_metadata", wrap_bind)


def step_of(metadata: object) -> object | None:
    """The metadata object that carries the step's record: ``metadata``
    itself, or one of a ``MultiConnector``'s per-connector metadata."""
    if getattr(metadata, META_STEP, None) is not None:
        return metadata
    for sub in getattr(metadata, "metadata", None) or ():
        if getattr(sub, META_STEP, None) is not None:
            return sub
    return None


def forward_launched(metadata: object) -> None:
    """The model runner has launched the step's forward: record ``eN`` on
    the compute stream (before the connectors' async loads start, which may
    wait on it). O(1)."""
    carrier = step_of(metadata)
    wh = current() if carrier is not None else None
    if wh is not None:
        wh.forward_done(carrier)


def _defers_finalize(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The ``defer_finalize`` argument of ``_get_kv_connector_output`` /
    ``post_forward`` (the first after the one they share)."""
    return bool(kwargs["defer_finalize"] if "defer_finalize" in kwargs else args[0] if args else False)


def _drafts_here() -> bool:
    """Whether this rank runs the draft model after the target forward: the
    last pipeline-parallel rank (vLLM's runner returns before drafting, and
    before ``finalize_kv_connector``, on the others). True when vLLM's
    pipeline group is not set up (no pipeline parallelism)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return bool(get_pp_group().is_last_rank)
    except Exception:  # noqa: BLE001  (no PP group: a single stage)
        return True


def _wire_runner(patch: Patcher) -> None:
    """Record ``eN`` after the step's last KV write, whichever connector is
    wired: right after the forward was launched (V1 model runners:
    ``KVConnectorModelRunnerMixin._get_kv_connector_output``, whose body is
    the forward and whose exit starts the async loads, then the stores;
    Model Runner V2: ``ActiveKVConnector.post_forward``), or, with
    speculative decoding (``defer_finalize=True``: the draft model writes
    its KV after the target forward, and vLLM saves it too), when the runner
    finalizes the connector after the draft (``finalize_kv_connector``;
    V2: ``finalize_step``), before ``wait_for_save`` runs. Either way before
    any store that reads the step's blocks starts."""
    from blockpool.integrations.vllm.surface import active as active_surface

    surface = active_surface()
    if surface.v1_model_runner:  # 0.32, 0.33 (0.34 removed Model Runner V1)
        _wire_v1_runner(patch)
    v2 = importlib.import_module("vllm.v1.worker.gpu.kv_connector")

    def wrap_post(orig: Any) -> Any:
        @functools.wraps(orig)
        def post_forward(self: Any, finished_req_ids: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._disabled and not _defers_finalize(args, kwargs):
                forward_launched(self.kv_connector._connector_metadata)
            return orig(self, finished_req_ids, *args, **kwargs)

        return post_forward

    def wrap_finalize_step(orig: Any) -> Any:
        @functools.wraps(orig)
        def finalize_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._disabled:
                forward_launched(self.kv_connector._connector_metadata)
            return orig(self, *args, **kwargs)

        return finalize_step

    patch(v2.ActiveKVConnector, "post_forward", wrap_post)
    if surface.declares(
        v2.__name__, "ActiveKVConnector.finalize_step"
    ):  # 0.33 and later (0.32's V2 never defers)
        patch(v2.ActiveKVConnector, "finalize_step", wrap_finalize_step)


def _wire_v1_runner(patch: Patcher) -> None:
    """Model Runner V1's hooks (:func:`_wire_runner`): ``eN`` when the
    forward's connector-output context exits, or at ``finalize_kv_connector``
    with speculative decoding."""
    mixin = importlib.import_module("vllm.v1.worker.kv_connector_model_runner_mixin")

    def wrap_output(orig: Any) -> Any:
        @contextlib.contextmanager
        def _get_kv_connector_output(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            with orig(scheduler_output, *args, **kwargs) as output:
                yield output
                if not _defers_finalize(args, kwargs) or not _drafts_here():
                    forward_launched(scheduler_output.kv_connector_metadata)

        _get_kv_connector_output.__blockpool_wrapped__ = True  # type: ignore[attr-defined]
        return staticmethod(_get_kv_connector_output)

    def wrap_finalize(orig: Any) -> Any:
        def finalize_kv_connector() -> None:
            if mixin.has_kv_transfer_group():
                forward_launched(mixin.get_kv_transfer_group()._connector_metadata)
            return orig()

        finalize_kv_connector.__blockpool_wrapped__ = True  # type: ignore[attr-defined]
        finalize_kv_connector.__wrapped__ = orig  # type: ignore[attr-defined]
        return staticmethod(finalize_kv_connector)

    patch(mixin.KVConnectorModelRunnerMixin, "_get_kv_connector_output", wrap_output)
    patch(mixin.KVConnectorModelRunnerMixin, "finalize_kv_connector", wrap_finalize)


def _wire_mooncake(patch: Patcher) -> None:
    mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker")

    def wrap_wait_for_save(orig: Any) -> Any:
        @functools.wraps(orig)
        def wait_for_save(self: Any, metadata: Any) -> None:
            wh = current() if _carries_hazards(metadata, metadata.requests) else None
            if wh is None:
                return orig(self, metadata)
            wh.forward_done(metadata)
            if self._capacity_only or not self.can_put:
                return None
            stock = bool(getattr(metadata, META_STOCK, False))
            coarse = None
            for request in metadata.requests:
                if not request.can_save:
                    continue
                wire_form = getattr(request, META_STORE, None)
                if coarse is None:
                    # vLLM's own event, where vLLM records it: for a store the
                    # pool did not see, where the fence is not shown exact (on
                    # top of it), in audit mode (instead of it), and as the
                    # fallback of a fence this rank cannot wait on.
                    coarse = torch.cuda.Event()
                    coarse.record()
                if wire_form is None:
                    request.current_event = coarse
                elif wh.audit is not None:  # checked once the send thread passed vLLM's event
                    request.current_event = AuditedEvent(wh, Transfer.from_wire(wire_form), coarse)
                else:
                    request.current_event = FenceWait(
                        wh, Transfer.from_wire(wire_form), coarse, keep_stock=stock
                    )
                self.kv_send_thread.add_request(request)
            return None

        return wait_for_save

    def wrap_recv(orig: Any) -> Any:
        @functools.wraps(orig)
        def _handle_request(self: Any, req_meta: Any) -> Any:
            wire_form = getattr(req_meta, META_LOAD, None)
            wh = current() if wire_form is not None else None
            if wh is None:
                return orig(self, req_meta)
            transfer = Transfer.from_wire(wire_form)
            try:
                if wh.audit is not None:
                    wh.observe_transfer(MOONCAKE, transfer)
                else:
                    wh.wait(transfer)
            except Exception:
                # Never GET into blocks whose earlier accesses may still run:
                # report the load failed, as a failed GET is reported.
                logger.exception("blockpool: load of %s not started: its fence did not end", req_meta.req_id)
                self._report_load_error(req_meta.req_id, list(transfer.block_ids))
                self.set_finished_request(req_meta.req_id)
                self.request_queue.task_done()
                wh.ended(transfer, failed=True)
                return None
            failed = False
            try:
                return orig(self, req_meta)
            except BaseException:
                failed = True
                raise
            finally:
                wh.ended(transfer, failed=failed or req_meta.req_id in _failed_of(self))

        return _handle_request

    def wrap_finish_store(orig: Any) -> Any:
        @functools.wraps(orig)
        def finish_store_job(self: Any, req_meta: Any) -> None:
            orig(self, req_meta)
            wire_form = getattr(req_meta, META_STORE, None)
            wh = current() if wire_form is not None else None
            if wh is not None:
                wh.ended(Transfer.from_wire(wire_form))

        return finish_store_job

    patch(mod.MooncakeStoreWorker, "wait_for_save", wrap_wait_for_save)
    patch(mod.KVCacheStoreRecvingThread, "_handle_request", wrap_recv)
    patch(mod.KVCacheStoreSendingThread, "finish_store_job", wrap_finish_store)


def _carries_hazards(metadata: object, items: Iterable[object]) -> bool:
    """Whether a wired connector's metadata carries a step record, or any of
    its ``items`` a transfer: a step with no scheduled token (vLLM's
    ``kv_connector_no_forward``) has no record, but the loads it planned
    still carry their fences and tokens. O(items)."""
    if getattr(metadata, META_STEP, None) is not None:
        return True
    return any(
        getattr(i, META_LOAD, None) is not None or getattr(i, META_STORE, None) is not None for i in items
    )


def _failed_of(thread: Any) -> Iterable[str]:
    """The requests whose GET failed on MooncakeStore's load thread
    ``thread`` (its ``_failed_requests``, read under its lock). O(failed)."""
    with thread.done_task_lock:
        return set(thread._failed_requests)


def offload_transfer_async(orig: Any) -> Any:
    """Wrap vLLM's ``SingleDirectionOffloadingHandler.transfer_async(job_id,
    ...)`` (``src_spec, dst_spec`` up to 0.33; ``device_ptrs, cpu_spec`` from
    0.34; the arguments after ``job_id`` pass through untouched): when the
    rank's :class:`WorkerHazards` holds a transfer for the job, the job's
    copy stream waits on exactly its fence right before the copy kernels
    (``_swap_blocks_batch`` runs with that stream current, after vLLM's own
    ``wait_stream`` of the compute stream) and the job's token is recorded on
    that stream after them -- also when vLLM caught a failed copy and
    queued the job as failed (0.34: the scheduler then fails the token
    through ``failed_jobs``); otherwise vLLM's code runs unchanged.
    Importable without vLLM (the GPU check uses it). Raises nothing of its
    own: a fence this rank cannot wait on leaves the job to vLLM's waits
    (:meth:`WorkerHazards.wait_device_or_stock`)."""

    @functools.wraps(orig)
    def transfer_async(self: Any, job_id: int, *args: Any, **kwargs: Any) -> bool:
        wh = current()
        transfer = wh.jobs.pop((OFFLOADING, job_id), None) if wh is not None else None
        if wh is None or transfer is None:
            return orig(self, job_id, *args, **kwargs)
        swap = self._swap_blocks_batch
        ordered: list[bool] = []

        def order(stream: Any) -> None:
            ordered.append(True)
            if wh.audit is not None:  # after vLLM's wait_stream(compute): compute tokens recorded are ordered
                wh.observe_transfer(OFFLOADING, transfer, covered=_COMPUTE)
            elif wh.wait_device_or_stock(wh.waitable(transfer.fence), stream, "an offload job"):
                wh.waits += 1

        def fenced_swap(*a: Any, **k: Any) -> Any:
            order(wh.current_stream())
            return swap(*a, **k)

        self._swap_blocks_batch = fenced_swap
        try:
            ok = orig(self, job_id, *args, **kwargs)
        finally:
            self._swap_blocks_batch = swap
        if ok and self._transfers:
            stream = self._transfers[-1].stream
            if not ordered:  # a job with no copy kernels: its token is still ordered after its fence
                order(stream)
            wh.record(transfer.token, stream)
        return ok

    return transfer_async


def _wire_offloading(patch: Patcher) -> None:
    wmod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker")
    gmod = importlib.import_module("vllm.v1.kv_offload.cpu.gpu_worker")

    def wrap_prepare_store(orig: Any) -> Any:
        @functools.wraps(orig)
        def prepare_store_kv(self: Any, metadata: Any) -> None:
            wh = current() if _carries_hazards(metadata, metadata.store_jobs.values()) else None
            if wh is not None:
                wh.forward_done(metadata)
                if self._is_store_writer:
                    wh.add_jobs(OFFLOADING, metadata.store_jobs, META_STORE)
                else:  # this rank copies nothing for these jobs: their points are now
                    wh.record_points(metadata.store_jobs.values(), META_STORE)
            return orig(self, metadata)

        return prepare_store_kv

    def wrap_collect(orig: Any) -> Any:
        @functools.wraps(orig)
        def collect(self: Any, metadata: Any) -> None:
            jobs = (*metadata.load_jobs.values(), *metadata.store_jobs.values())
            wh = current() if _carries_hazards(metadata, jobs) else None
            if wh is not None:
                wh.add_jobs(OFFLOADING, metadata.load_jobs, META_LOAD)
                flushed = {
                    j: metadata.store_jobs[j]
                    for j in metadata.jobs_to_flush or ()
                    if j in metadata.store_jobs
                }
                if self._is_store_writer:
                    wh.add_jobs(OFFLOADING, flushed, META_STORE)
                else:
                    # vLLM's handle_preemptions pops a non-writer's flushed
                    # jobs and completes them at once: their points are now.
                    wh.record_points(flushed.values(), META_STORE)
            return orig(self, metadata)

        return collect

    patch(wmod.OffloadingConnectorWorker, "prepare_store_kv", wrap_prepare_store)
    patch(wmod.OffloadingConnectorWorker, "start_kv_transfers", wrap_collect)
    patch(wmod.OffloadingConnectorWorker, "handle_preemptions", wrap_collect)
    patch(gmod.SingleDirectionOffloadingHandler, "transfer_async", offload_transfer_async)


def _wire_nixl(patch: Patcher) -> None:
    """NIXL's pull worker posts READs from the worker's main thread
    (``start_load_kv``). A read whose fence has not ended is not waited for
    there (that would stall the next step's launch): it is deferred, and
    posted by the first ``start_load_kv`` that finds its fence ended (the
    engine keeps stepping while a request waits for remote KV). A read still
    deferred after ``WorkerHazards.timeout`` seconds is waited for once
    more, then failed as a failed transfer is."""
    mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker")
    deferred: list[tuple[Any, str, Any, Transfer, float]] = []

    def post(
        orig: Any, self: Any, req_id: str, meta: Any, transfer: Transfer | None, wh: WorkerHazards
    ) -> Any:
        if transfer is not None:
            try:
                wh.wait(transfer)
            except Exception:
                # Reported as vLLM reports a read it declines (the request's
                # load fails; the scheduler fails its token): not counted as a
                # transport failure of the remote engine, which did nothing wrong.
                logger.exception("blockpool: NIXL read of %s not posted: its fence did not end", req_id)
                return self._handle_failed_transfer(
                    req_id, None, self._recv_failures, record_failed_transfer=False
                )
        return orig(self, req_id, meta)

    def wrap_read(orig: Any) -> Any:
        @functools.wraps(orig)
        def _read_blocks_for_req(self: Any, req_id: str, meta: Any) -> Any:
            wire_form = getattr(meta, META_LOAD, None)
            wh = current() if wire_form is not None else None
            if wh is None:
                return orig(self, req_id, meta)
            transfer = Transfer.from_wire(wire_form)
            if wh.audit is not None:  # posted at once, as stock vLLM does
                wh.observe_transfer(NIXL, transfer)
                return orig(self, req_id, meta)
            if not wh.has_ended(transfer.fence):
                deferred.append((self, req_id, meta, transfer, time.monotonic() + wh.timeout))
                wh.deferred += 1
                return None
            return post(orig, self, req_id, meta, None, wh)

        return _read_blocks_for_req

    def wrap_start(orig: Any) -> Any:
        @functools.wraps(orig)
        def start_load_kv(self: Any, *args: Any, **kwargs: Any) -> Any:
            wh = current() if deferred else None
            if wh is not None:
                read = type(self)._read_blocks_for_req.__wrapped__
                now = time.monotonic()
                keep = []
                for item in deferred:
                    owner, req_id, meta, transfer, deadline = item
                    if owner is not self:
                        keep.append(item)
                    elif wh.has_ended(transfer.fence):
                        post(read, self, req_id, meta, None, wh)
                    elif now >= deadline:
                        post(read, self, req_id, meta, transfer, wh)
                    else:
                        keep.append(item)
                deferred[:] = keep
            return orig(self, *args, **kwargs)

        return start_load_kv

    patch(mod.NixlPullConnectorWorker, "_read_blocks_for_req", wrap_read)
    patch(mod.NixlPullConnectorWorker, "start_load_kv", wrap_start)


register_worker_half(MOONCAKE, _wire_mooncake)
register_worker_half(OFFLOADING, _wire_offloading)
register_worker_half(NIXL, _wire_nixl)

SCHEDULER_ONLY_STREAMS: frozenset[str] = frozenset(
    stream for name, spec in CONNECTORS.items() if name not in WORKER_HALVES for stream in spec.streams
)
"""Streams of connectors wired on the scheduler only (SimpleCPUOffload's
``simple_cpu_h2d``, ``simple_cpu_d2h``): no worker records their tokens, so
worker-side waits leave them out (:meth:`WorkerHazards.waitable`) and
vLLM's own synchronisation orders those transfers, as in stock vLLM. Read
from the registries when this module is imported: the package's
``__init__`` imports every connector module (each registers its halves)
before anything can import this one."""


def wire(patch: Patcher, connectors: Iterable[str], errors: dict[str, str] | None = None) -> list[str]:
    """Install the worker-side wrappers of the named connectors (those the
    scheduler half wired) and the shared hooks (the step record on
    ``KVConnectorBase_V1.bind_connector_metadata``, ``eN`` after the
    forward), through the plugin's ``patch`` (see
    :func:`blockpool.integrations.vllm.connectors.wire`).

    All or nothing per connector: when one of a connector's wrappers fails,
    its earlier ones are undone and it is left out, with one warning (one
    debug line when a third-party module it needs is missing); when the
    shared hooks fail, they are undone and every connector with a worker
    half is left out. The errors go into ``errors`` by name. Returns the
    names of ``connectors`` that keep their wiring: those whose worker half
    is installed and those that have none (the caller unwires the others'
    scheduler half). O(connectors).
    """
    named = list(connectors)
    names = [n for n in named if n in WORKER_HALVES]
    if not names:
        return named
    failed: set[str] = set()

    def attempt(steps: Iterable[Callable[[Patcher], None]]) -> Exception | None:
        undo: list[Callable[[], None]] = []

        def recording(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
            u = patch(owner, attr, make)
            if u is not None:
                undo.append(u)

        try:
            for step in steps:
                step(recording)
        except Exception as exc:  # noqa: BLE001  (vLLM's code differs: leave it as it is)
            for u in reversed(undo):
                u()
            return exc
        return None

    def left_out(affected: list[str], exc: Exception) -> None:
        failed.update(affected)
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and missing.split(".")[0] != "vllm":
            logger.debug("blockpool: worker half of %s not available here (%r)", ", ".join(affected), exc)
            return
        if errors is not None:
            errors.update(dict.fromkeys(affected, repr(exc)))
        logger.warning(
            "blockpool: cannot wire the worker half of KV connector %s in this vLLM (%r): it runs as vLLM "
            "built it, its transfers are not fenced",
            ", ".join(affected),
            exc,
        )

    shared = attempt((_wire_base, _wire_runner))
    if shared is not None:
        left_out(names, shared)
    else:
        for name in names:
            exc = attempt((WORKER_HALVES[name],))
            if exc is not None:
                left_out([name], exc)
    return [n for n in named if n not in failed]
