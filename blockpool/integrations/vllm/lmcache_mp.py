"""LMCache's multi-process vLLM connector (``LMCacheMPConnector``) on the
pool: its retrieves and stores begin on the pool with the blocks they
touch, the LMCache server's copies are ordered after exactly their fences,
and each transfer ends when its own completion comes back from every rank.

vLLM's ``lmcache_mp_connector`` module (0.32 to 0.34) resolves
``LMCacheMPConnector`` to LMCache's own class,
``lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector``,
whenever that module imports, and to vLLM's builtin
``LMCacheMPConnectorUpstream`` otherwise (or with
``LMCACHE_USE_UPSTREAM_MP`` set). LMCache's class is the one wired (the
wiring was reviewed against lmcache 0.5.6); vLLM's builtin copy stays as
vLLM built it and is reported unwired when a scheduler binds it. What one
step does, and what this wiring adds:

- **scheduler** (``build_connector_meta``): LMCache plans one
  ``LMCacheMPRequestMetadata`` per transfer, ``direction`` ``"RETRIEVE"``
  or ``"STORE"``, whose ``op`` (a ``LoadStoreOp``) holds the tokens
  ``[start, end)`` (whole LMCache chunks) and ``block_ids``, one list per
  KV cache group. A retrieve writes every block of its range but the
  first ``skip_first_n_tokens`` tokens' (the prefix-cache blocks the
  server leaves alone); a store reads every block of its range. Each
  begins on the pool (:data:`LOAD_STREAM`, :data:`STORE_STREAM`, both
  ``HOST``: the server's copies complete per transfer, reported through
  futures) and its :class:`Transfer` goes on the request metadata
  (``META_LOAD`` / ``META_STORE``; a store also carries its op key,
  :data:`META_STORE_KEY`);
- **refusal**: a retrieve or store the pool refuses runs as LMCache runs
  it without the plugin: not begun on the pool, left in the step as
  LMCache planned it, the server's copy ordered by LMCache's own IPC event
  alone. vLLM serves the request as in stock (no failed load it would not
  have had), and the server consumes the lookup's locks as in stock.
  Counted in :data:`~blockpool.integrations.vllm.wiring.FALLBACKS`, one
  warning per kind;
- **worker fence wait** (:func:`wire_worker`): ``start_load_kv`` and
  ``wait_for_save`` record one IPC event (LMCache's
  ``create_recorded_event``) that the server's copies wait on. While the
  step's transfers have a fence, that event is recorded on a side stream
  ordered after the current stream (everything LMCache's own event covers)
  and after the fence: never weaker than stock, and the server's copy
  waits on exactly the fence besides;
- **ending**: a retrieve is an asynchronous load (its request waits in
  ``WAITING_FOR_REMOTE_KVS``): ``finished_recving`` ends it,
  ``failed_recving`` and ``invalid_block_ids`` fail it
  (:meth:`StepHazards.on_connector_output`, by request id). LMCache keeps
  one store future per request (a later store of the request replaces
  it), so the worker keeps its own future per store op (wrapping
  ``submit_store_request``), and ``build_connector_worker_meta`` returns
  :class:`MPWorkerMeta` on every rank that has anything to report (the
  ops whose future finished since the last step, around LMCache's own
  worker metadata), ``None`` on a rank with nothing: one type across the
  ranks, whichever rank vLLM's aggregator starts from. vLLM sums it over the ranks
  (``aggregate``); the scheduler takes it off the output before LMCache's
  ``update_connector_output`` reads ``kv_connector_worker_meta`` (LMCache
  sees exactly what it would without the plugin) and ends each store op
  once every rank reported it. A store op a rank did not submit (a rank
  that writes no KV, a server LMCache marked unhealthy) is reported at
  once, as LMCache reports its own.

The scheduler half imports neither vLLM, LMCache nor torch at import time;
the worker half (:func:`wire_worker`) is installed by
:mod:`blockpool.integrations.vllm.worker`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from blockpool.core.hazards import StreamKind
from blockpool.integrations.vllm.wiring import (
    META_LOAD,
    META_STORE,
    ConnectorSpec,
    ConnectorWiring,
    Patcher,
    _binder,
    _planner,
    config_block_size,
    fall_back,
    register_connector,
    register_worker_half,
    wiring_of,
)

__all__ = [
    "LMCACHE_MP",
    "LOAD_STREAM",
    "META_STORE_KEY",
    "MODULE",
    "STORE_STREAM",
    "STREAMS",
    "MPWorkerMeta",
    "op_block_ids",
    "patch_scheduler",
    "wire_worker",
]

logger = logging.getLogger("vllm.plugins.blockpool")

LMCACHE_MP = "lmcache_mp"
"""The connector's name in :data:`~blockpool.integrations.vllm.wiring.CONNECTORS`."""
LOAD_STREAM = "lmcache_mp_load"
"""The LMCache server's retrieves (``HOST``: completed per transfer)."""
STORE_STREAM = "lmcache_mp_store"
"""The LMCache server's stores (``HOST``)."""
STREAMS: dict[str, StreamKind] = {LOAD_STREAM: StreamKind.HOST, STORE_STREAM: StreamKind.HOST}
MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
"""LMCache's module holding ``LMCacheMPConnector`` (the class vLLM's
``lmcache_mp_connector`` module resolves to when it imports)."""
META_STORE_KEY = "blockpool_store_key"
"""Attribute of a store's ``LMCacheMPRequestMetadata``: ``(n, request
id)``, ``n`` counting the stores the scheduler began (unique per op), the
key its completion is reported under."""


def op_block_ids(
    block_ids: Sequence[Any], tokens_per_block: Sequence[int], first_token: int, num_tokens: int
) -> list[int]:
    """The block ids of a ``LoadStoreOp`` (``block_ids``: one list per KV
    cache group, starting at the op's first token; a flat list of ints is
    one group) that hold the op's tokens ``[first_token, num_tokens)``,
    counted from the op's start: in a group whose block covers ``b``
    tokens (``tokens_per_block``; ``0``: a group LMCache never moves),
    indices ``first_token // b`` on. O(blocks).

    >>> op_block_ids([[4, 5, 6, 7]], [16], 16, 64)
    [5, 6, 7]
    >>> op_block_ids([4, 5, 6, 7], [16], 0, 64)
    [4, 5, 6, 7]
    >>> op_block_ids([[4, 5], [9]], [16, 0], 0, 32)
    [4, 5]
    """
    if not block_ids:
        return []
    groups = [block_ids] if isinstance(block_ids[0], int) else block_ids
    out: list[int] = []
    for g, ids in enumerate(groups):
        b = tokens_per_block[g] if g < len(tokens_per_block) else 0
        if b > 0:
            out.extend(int(i) for i in ids[first_token // b : -(-num_tokens // b)])
    return list(dict.fromkeys(out))


class MPWorkerMeta:
    """The worker metadata of a wired ``LMCacheMPConnector``: LMCache's own
    (``inner``: ``None`` or an ``LMCacheMPWorkerMetadata``) and the store
    ops whose server copy ended on the reporting ranks (``done``: ``{(n,
    request id): ranks}``, keys as :data:`META_STORE_KEY`). vLLM aggregates the ranks' metadata of
    a step with :meth:`aggregate`.

    Args:
        inner: LMCache's worker metadata, or ``None``.
        done: Store op keys and their count of reporting ranks.
    """

    __slots__ = ("done", "inner")

    def __init__(self, inner: Any, done: dict[tuple[int, str], int]) -> None:
        self.inner = inner
        self.done = done

    def aggregate(self, other: Any) -> MPWorkerMeta:
        """This rank's report merged with ``other``'s (an
        :class:`MPWorkerMeta`, or LMCache's metadata alone): counts summed
        per op, LMCache's metadata merged by its own ``aggregate``. O(ops)."""
        if not isinstance(other, MPWorkerMeta):
            other = MPWorkerMeta(other, {})
        done = dict(self.done)
        for key, n in other.done.items():
            done[key] = done.get(key, 0) + n
        if self.inner is None or other.inner is None:
            inner = self.inner if other.inner is None else other.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return MPWorkerMeta(inner, done)

    def __repr__(self) -> str:
        return f"MPWorkerMeta(inner={self.inner!r}, done={self.done!r})"


# ----------------------------------------------------------------------
# scheduler half
# ----------------------------------------------------------------------


def _tokens_per_block(conn: Any, w: ConnectorWiring) -> list[int]:
    sizes = conn._group_tokens_per_block
    return [int(s) for s in sizes] if sizes else list(w.block_sizes)


def _plan(conn: Any, w: ConnectorWiring, meta: Any, _: Any) -> None:
    """Begin the retrieves and stores LMCache planned in ``meta`` (see the
    module docstring)."""
    from blockpool.core.errors import UnsafeTransferError

    requests = meta.requests
    if not requests:
        return
    hz = w.hazards
    sizes = _tokens_per_block(conn, w)
    for rm in requests:
        op = rm.op
        span = int(op.end) - int(op.start)
        if rm.direction == "RETRIEVE":
            skip = max(0, int(op.skip_first_n_tokens or 0))
            ids = op_block_ids(op.block_ids, sizes, skip, span)
            blocks = hz.blocks_of(ids)
            if blocks:
                try:
                    # Keyed by request: finished_recving / failed_recving /
                    # invalid_block_ids end or fail it.
                    t = hz.begin_load(rm.request_id, blocks, LOAD_STREAM)
                except UnsafeTransferError as exc:
                    # Run as LMCache runs it without the plugin: the server's
                    # copy waits on LMCache's own event only, and the server
                    # consumes the lookup's locks as it does in stock.
                    fall_back(w.name, "load refused by the pool", f"request {rm.request_id!r}: {exc}")
                    continue
                setattr(rm, META_LOAD, t.to_wire())
        elif rm.direction == "STORE":
            n = conn.__dict__.get("_blockpool_stores_begun", 0) + 1
            conn._blockpool_stores_begun = n
            key = (n, rm.request_id)
            wire_form = w.store(
                rm.request_id, op_block_ids(op.block_ids, sizes, 0, span), STORE_STREAM, key=_key(key)
            )
            if wire_form is not None:
                setattr(rm, META_STORE, wire_form)
                setattr(rm, META_STORE_KEY, key)


def _key(op_key: tuple[int, str]) -> tuple[str, int, str]:
    return (LMCACHE_MP, *op_key)


def _ranks(conn: Any) -> int:
    cfg = getattr(conn, "_vllm_config", None)  # None: a connector built without a config
    n = cfg.parallel_config.world_size if cfg is not None else 1
    return n if isinstance(n, int) and n > 0 else 1


def _stores_done(conn: Any, w: ConnectorWiring, done: dict[tuple[int, str], int]) -> None:
    needed = _ranks(conn)
    for op_key, count in done.items():
        w.report(_key((int(op_key[0]), str(op_key[1]))), count, needed)


def _updater(orig: Any) -> Any:
    @functools.wraps(orig)
    def update_connector_output(self: Any, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, MPWorkerMeta):
            # LMCache reads its own metadata, as without the plugin.
            connector_output.kv_connector_worker_meta = meta.inner
            w = wiring_of(self)
            if w is not None and meta.done:
                try:
                    _stores_done(self, w, meta.done)
                except Exception as exc:  # noqa: BLE001  (never out of vLLM's scheduler)
                    w.faults += 1
                    if w.faults == 1:
                        logger.error(
                            "blockpool: %s: ending the reported stores failed (%r); they stay pending in "
                            "the pool (further faults are counted in the wiring, not logged)",
                            w.name, exc,
                        )  # fmt: skip
        return orig(self, connector_output)

    return update_connector_output


def patch_scheduler(mod: Any, patch: Patcher) -> None:
    """Install the scheduler half on LMCache's ``LMCacheMPConnector``
    (module ``mod``): ``bind_gpu_block_pool`` attaches the wiring,
    ``build_connector_meta`` begins the step's transfers,
    ``update_connector_output`` ends the store ops every rank reported."""
    cls = mod.LMCacheMPConnector
    patch(cls, "bind_gpu_block_pool", _binder(LMCACHE_MP, None, "_kv_cache_config", config_block_size))
    patch(cls, "build_connector_meta", _planner(_plan))
    patch(cls, "update_connector_output", _updater)


# ----------------------------------------------------------------------
# worker half
# ----------------------------------------------------------------------


def _transfers(meta: Any, direction: str, attr: str) -> list[tuple[Any, Any]]:
    from blockpool.integrations.vllm.hazards import Transfer

    out = []
    for rm in meta.requests if meta is not None else ():
        wire_form = getattr(rm, attr, None)
        if rm.direction == direction and wire_form is not None:
            out.append((rm, Transfer.from_wire(wire_form)))
    return out


def _side_stream(conn: Any, current: Any) -> Any:
    """The connector's side stream for its IPC events (made once, on the
    current stream's device)."""
    side = conn.__dict__.get("_blockpool_side_stream")
    if side is None:
        from blockpool.worker.standins import StandInStream

        if isinstance(current, StandInStream):
            side = current.device.new_stream("lmcache_mp_events")
        else:
            import torch

            side = torch.cuda.Stream(device=current.device)
        conn._blockpool_side_stream = side
    return side


@contextmanager
def _current(wh: Any, stream: Any) -> Iterator[None]:
    """``stream`` is the current stream while inside (torch's, and the
    rank's :class:`WorkerHazards` view of it)."""
    from blockpool.worker.standins import StandInStream

    saved = wh.current_stream
    wh.current_stream = lambda: stream
    try:
        if isinstance(stream, StandInStream):
            yield
        else:
            import torch

            with torch.cuda.stream(stream):
                yield
    finally:
        wh.current_stream = saved


@contextmanager
def _swapped(obj: Any, name: str, fn: Any) -> Iterator[None]:
    """While inside: ``obj.name`` is ``fn`` (set on the instance); then the
    instance's own attribute comes back, or none when it had none."""
    own = obj.__dict__.get(name)
    setattr(obj, name, fn)
    try:
        yield
    finally:
        if own is None:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, own)


@contextmanager
def _fenced_event(conn: Any, transfers: list[Any], what: str) -> Iterator[None]:
    """While inside: the worker adapter's ``create_recorded_event`` (the
    IPC event the server's copies wait on) records on the side stream,
    ordered after the current stream and after the fences of
    ``transfers``; in audit mode the transfers are counted instead
    (LMCache's event as stock). Where the side stream cannot be made or
    ordered, LMCache's own event is recorded as stock (counted in
    ``stock_fallbacks``, logged once)."""
    from blockpool.integrations.vllm import worker as vw

    wh = vw.current()
    adapter = getattr(conn, "worker_adapter", None)
    if wh is None or adapter is None or not transfers:
        yield
        return
    if wh.audit is not None:
        # LMCache's own event is recorded on the current (compute) stream:
        # the compute tokens recorded so far are ordered before the copy.
        for t in transfers:
            wh.observe_transfer(LMCACHE_MP, t, covered=frozenset({"compute"}))
        yield
        return
    fence = tuple(dict.fromkeys(tok for t in transfers for tok in wh.waitable(t.fence)))
    if not fence:
        yield
        return
    orig = adapter.create_recorded_event

    @functools.wraps(orig)
    def create_recorded_event() -> Any:
        try:
            current = wh.current_stream()
            side = _side_stream(conn, current)
            side.wait_stream(current)  # everything LMCache's own event covers
        except Exception as exc:  # noqa: BLE001  (never out of vLLM's worker: LMCache's own event)
            wh.fell_back(what, exc)
            return orig()
        if wh.wait_device_or_stock(fence, side, what):
            wh.waits += 1
        with _current(wh, side):
            return orig()

    with _swapped(adapter, "create_recorded_event", create_recorded_event):
        yield


def _ops_of(conn: Any) -> dict[tuple[int, str], tuple[Any, Any]]:
    """The connector's store ops not reported yet: ``{key: (transfer,
    future or None)}``."""
    ops = conn.__dict__.get("_blockpool_store_ops")
    if ops is None:
        ops = conn._blockpool_store_ops = {}
    return ops


@contextmanager
def _store_futures_kept(conn: Any, stores: list[tuple[Any, Any]]) -> Iterator[None]:
    """While inside: each ``submit_store_request`` of a store op in
    ``stores`` keeps the future LMCache made for it (``store_futures[request
    id]`` right after the call), or ``None`` when LMCache submitted nothing."""
    adapter = getattr(conn, "worker_adapter", None)
    if adapter is None or not stores:
        yield
        return
    queue = {id(rm.op): (tuple(getattr(rm, META_STORE_KEY)), t) for rm, t in stores}
    ops = _ops_of(conn)
    orig = adapter.submit_store_request

    @functools.wraps(orig)
    def submit_store_request(request_id: str, op: Any, *args: Any, **kwargs: Any) -> Any:
        entry = queue.pop(id(op), None)
        if entry is None:
            return orig(request_id, op, *args, **kwargs)
        before = adapter.store_futures.get(request_id)
        try:
            return orig(request_id, op, *args, **kwargs)
        finally:
            after = adapter.store_futures.get(request_id)
            ops[entry[0]] = (entry[1], after if after is not before else None)

    try:
        with _swapped(adapter, "submit_store_request", submit_store_request):
            yield
    finally:
        for key, t in queue.values():  # not submitted (an empty batch): nothing runs
            ops[key] = (t, None)


_UNREADABLE_LOGGED = False


def _ended(future: Any) -> bool:
    """Whether a store op's future says its server copy ended. A future
    that cannot be read (its ``query`` raises) counts as not ended: the op
    stays pending until its lease ends it (LMCache's ``mq_timeout``); one
    WARNING per process. Never raises. O(1)."""
    global _UNREADABLE_LOGGED
    try:
        return bool(future.query())
    except Exception as exc:  # noqa: BLE001  (never out of vLLM's output path)
        if not _UNREADABLE_LOGGED:
            _UNREADABLE_LOGGED = True
            logger.warning(
                "blockpool: lmcache_mp: a store's future cannot be read (%r); its op stays pending until "
                "LMCache's mq_timeout (further ones are not logged)",
                exc,
            )
        return False


def wire_worker(patch: Patcher) -> None:
    """Install the worker half on LMCache's ``LMCacheMPConnector``: the IPC
    event of ``start_load_kv`` and ``wait_for_save`` ordered after the
    step's fences, and the per-op store completions in
    ``build_connector_worker_meta`` (an :class:`MPWorkerMeta`, or ``None``
    where neither LMCache nor the wiring reports anything)."""
    from blockpool.integrations.vllm import worker as vw

    cls = importlib.import_module(MODULE).LMCacheMPConnector

    def wrap_start(orig: Any) -> Any:
        @functools.wraps(orig)
        def start_load_kv(self: Any, forward_context: Any, **kwargs: Any) -> None:
            meta = self._connector_metadata
            loads = [t for _, t in _transfers(meta, "RETRIEVE", META_LOAD)]
            with _fenced_event(self, loads, "an LMCache MP load"):
                return orig(self, forward_context, **kwargs)

        return start_load_kv

    def wrap_wait_for_save(orig: Any) -> Any:
        @functools.wraps(orig)
        def wait_for_save(self: Any) -> None:
            stores = _transfers(self._connector_metadata, "STORE", META_STORE)
            with (
                _fenced_event(self, [t for _, t in stores], "an LMCache MP store"),
                _store_futures_kept(self, stores),
            ):
                return orig(self)

        return wait_for_save

    def wrap_worker_meta(orig: Any) -> Any:
        @functools.wraps(orig)
        def build_connector_worker_meta(self: Any) -> Any:
            inner = orig(self)
            ops = self.__dict__.get("_blockpool_store_ops")
            if not ops:
                # One type on every rank: vLLM's KVOutputAggregator calls the
                # first rank's aggregate with the others', and LMCache's
                # asserts its own type.
                return None if inner is None else MPWorkerMeta(inner, {})
            adapter = self.worker_adapter
            healthy = bool(adapter.is_healthy)
            done: dict[tuple[int, str], int] = {}
            wh = vw.current()
            for key, (t, future) in list(ops.items()):
                # A rank LMCache submitted nothing for, or a server LMCache
                # gave up on (it drops its futures then), reports at once.
                if future is None or not healthy or _ended(future):
                    del ops[key]
                    done[key] = 1
                    if wh is not None:
                        wh.ended(t)
            return MPWorkerMeta(inner, done) if done or inner is not None else None

        return build_connector_worker_meta

    patch(cls, "start_load_kv", wrap_start)
    patch(cls, "wait_for_save", wrap_wait_for_save)
    patch(cls, "build_connector_worker_meta", wrap_worker_meta)


register_connector(LMCACHE_MP, ConnectorSpec(MODULE, STREAMS, patch_scheduler))
register_worker_half(LMCACHE_MP, wire_worker)
