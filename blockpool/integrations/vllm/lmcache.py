"""LMCache's in-process vLLM connector (``LMCacheConnectorV1``) on the pool:
its loads and stores begin on the pool with the blocks they touch, their
fences ride in LMCache's own per-request metadata, and LMCache's copy
streams wait on exactly those fences.

vLLM's ``LMCacheConnectorV1`` (vLLM 0.32 to 0.34, the same module in each)
drives LMCache's adapter ``lmcache.integration.vllm.vllm_v1_adapter``
(``use_native`` in the connector's extra config selects vLLM's vendored
copy of it instead: not wired, one warning). What one step does, and what
this wiring adds:

- **scheduler** (``build_connector_meta``): LMCache plans one ``ReqMeta``
  per request, with ``token_ids`` and a ``slot_mapping`` (``block_id *
  block_size + offset`` per token). A load (``load_spec.can_load``) writes
  tokens ``[vllm_cached_tokens, lmcache_cached_tokens)``: LMCache moves
  256-token chunks, but its paged copy skips the tokens vLLM's prefix cache
  already holds (``skip_prefix_n_tokens``); the layerwise and blending
  paths rewrite whole chunks, from ``vllm_cached_tokens`` rounded down to
  the chunk size. A store (``save_spec.can_save``; always for a
  ``kv_producer``) reads tokens from ``skip_leading_tokens`` rounded down
  to the chunk size up to the last token it saves. Each begins on the pool
  (:data:`LOAD_STREAM`, :data:`STORE_STREAM`, both ``DEVICE``) with the
  blocks of those tokens, and its :class:`Transfer` goes on the
  ``ReqMeta`` (``META_LOAD`` / ``META_STORE``);
- **refusal**: a load the pool refuses (say, a whole-chunk layerwise load
  over a prefix another request computed and still holds) runs as LMCache
  runs it without the plugin: not begun on the pool, no fence of ours,
  LMCache's plan of the step unchanged, so vLLM serves the request as it
  does in stock; counted in :data:`FALLBACKS`, one warning per kind. The
  step's forward token ``eN`` becomes the writer of the load's blocks
  whose earlier accesses all lie on the compute stream or ended (the
  forward reads every loaded token, so LMCache orders it after the
  copies): a later fence of those blocks names ``eN``;
- **worker** (:func:`wire_worker`): in ``start_load_kv``, right before each
  request's ``retrieve`` (whose ``batched_to_gpu`` runs on LMCache's
  ``load_stream`` and synchronises it), the load stream waits on the
  load's fence, and the load's token is recorded on it once ``retrieve``
  returns. In ``wait_for_save``, right before each ``store`` (whose
  ``from_gpu`` runs on the ``store_stream``), the store stream waits on the
  store's fence, and the store's token is recorded after it. The layerwise
  and blending loads (``retrieve_layer``, called without the request's id,
  and ``blend``) copy layer by layer during the forward: before LMCache's
  ``start_load_kv`` the load stream and the current stream wait on the
  fences of every such load of the step, and their tokens are recorded
  when ``wait_for_save`` returns, on a side stream ordered after the
  current stream and the load stream (after the last layer: never the
  early point where ``start_load_kv`` returns). The layerwise store waits
  before ``store_layer`` (``save_kv_layer`` at the first layer) and its
  token is recorded when ``wait_for_save`` returns. LMCache's own
  synchronisation (``load_stream.synchronize()`` after every batch, the
  store stream's ``synchronize()``, the layerwise ``wait_stream``) is
  untouched: the fence is added on top;
- **ending**: LMCache runs a step's loads and stores to their end inside
  that step (its ``get_finished`` reports nothing), and vLLM returns a
  step's output only once every rank ran it, so the step's transfers end
  with the step's output (:meth:`StepHazards.end_with_step`); loads of
  blocks LMCache reports failed (``invalid_block_ids``) fail first, and
  their blocks lose their keys.

The scheduler half imports neither vLLM, LMCache nor torch at import time;
the worker half (:func:`wire_worker`) is installed by
:mod:`blockpool.integrations.vllm.worker`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from blockpool.core.hazards import StreamKind
from blockpool.integrations.vllm.wiring import (
    FALLBACKS,
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
)

__all__ = [
    "ADAPTER",
    "FALLBACKS",
    "LMCACHE",
    "LOAD_STREAM",
    "MODULE",
    "STORE_STREAM",
    "STREAMS",
    "fall_back",
    "load_tokens",
    "patch_scheduler",
    "store_tokens",
    "wire_worker",
]

logger = logging.getLogger("vllm.plugins.blockpool")

LMCACHE = "lmcache"
"""The connector's name in :data:`~blockpool.integrations.vllm.wiring.CONNECTORS`."""
LOAD_STREAM = "lmcache_load"
"""LMCache's ``load_stream`` (CUDA copy stream of its GPU connector)."""
STORE_STREAM = "lmcache_store"
"""LMCache's ``store_stream``."""
STREAMS: dict[str, StreamKind] = {LOAD_STREAM: StreamKind.DEVICE, STORE_STREAM: StreamKind.DEVICE}
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
"""vLLM's module holding ``LMCacheConnectorV1``."""
ADAPTER = "lmcache.integration.vllm.vllm_v1_adapter"
"""LMCache's adapter module, the one the wiring was reviewed against."""


_NATIVE_LOGGED = False


def load_tokens(load_spec: Any, chunk_size: int, whole_chunks: bool) -> tuple[int, int]:
    """Tokens ``[start, end)`` a load with ``load_spec`` writes: from
    ``vllm_cached_tokens`` (rounded down to ``chunk_size`` when LMCache
    rewrites whole chunks: the layerwise and blending paths) to
    ``lmcache_cached_tokens``. O(1).

    >>> from types import SimpleNamespace as NS
    >>> spec = NS(vllm_cached_tokens=320, lmcache_cached_tokens=768)
    >>> load_tokens(spec, 256, False), load_tokens(spec, 256, True)
    ((320, 768), (256, 768))
    """
    start = int(load_spec.vllm_cached_tokens)
    if whole_chunks:
        start = start // chunk_size * chunk_size
    return start, int(load_spec.lmcache_cached_tokens)


def store_tokens(req_meta: Any, chunk_size: int, producer: bool) -> tuple[int, int]:
    """Tokens ``[start, end)`` a store of ``req_meta`` reads, as LMCache's
    ``wait_for_save`` computes them: from ``save_spec.skip_leading_tokens``
    (``0`` for a ``kv_producer``, a superset of its disaggregated sends)
    rounded down to ``chunk_size``, to the end of ``token_ids`` (a partial
    last chunk only on the request's last prefill). O(1).

    >>> from types import SimpleNamespace as NS
    >>> rm = NS(token_ids=list(range(600)), save_spec=NS(skip_leading_tokens=300), is_last_prefill=False)
    >>> store_tokens(rm, 256, False)
    (256, 512)
    """
    n = len(req_meta.token_ids)
    skip = 0 if producer else int(req_meta.save_spec.skip_leading_tokens)
    end = n if req_meta.is_last_prefill else n // chunk_size * chunk_size
    return skip // chunk_size * chunk_size, end


def _block_ids(slot_mapping: Any, start: int, end: int, block_size: int) -> list[int]:
    """Distinct block ids of the slots of tokens ``[start, end)``, in order."""
    if end <= start:
        return []
    slots = slot_mapping[start:end]
    slots = slots.tolist() if hasattr(slots, "tolist") else list(slots)
    return list(dict.fromkeys(int(s) // block_size for s in slots if s >= 0))


# ----------------------------------------------------------------------
# scheduler half
# ----------------------------------------------------------------------


def _plan(conn: Any, w: ConnectorWiring, meta: Any, _: Any) -> None:
    """Begin the loads and stores LMCache planned in ``meta`` (see the
    module docstring); they end with the step's output."""
    from blockpool.core.errors import UnsafeTransferError

    impl = conn._lmcache_engine
    requests = meta.requests
    if not requests:
        return
    if type(impl).__module__ != ADAPTER:
        # vLLM's vendored copy (``use_native``): not reviewed, left as it is.
        global _NATIVE_LOGGED
        if not _NATIVE_LOGGED:
            _NATIVE_LOGGED = True
            logger.warning(
                "blockpool: %s: LMCache adapter %s is not wired: its transfers are not fenced",
                w.name, type(impl).__module__,
            )  # fmt: skip
        return
    hz = w.hazards
    bs = int(impl._block_size)
    chunk = int(impl._lmcache_chunk_size)
    config = impl.config
    whole_chunks = bool(getattr(config, "use_layerwise", False) or getattr(config, "enable_blending", False))
    role = impl.kv_role
    begun = []
    for rm in requests:
        # One key per request and step: a failure LMCache reports for one
        # request's blocks fails that request's load alone.
        key = (LMCACHE, hz.steps_issued, rm.req_id)
        ls = rm.load_spec
        if ls is not None and ls.can_load:
            start, end = load_tokens(ls, chunk, whole_chunks)
            blocks = hz.blocks_of(_block_ids(rm.slot_mapping, start, end, bs))
            if blocks:
                try:
                    t = hz.begin_load(rm.req_id, blocks, LOAD_STREAM, key=key)
                except UnsafeTransferError as exc:
                    _run_as_stock(hz, w, rm.req_id, blocks, exc)
                else:
                    begun.append(key)
                    setattr(rm, META_LOAD, t.to_wire())
        ss = rm.save_spec
        if role == "kv_consumer" or not (role == "kv_producer" or (ss is not None and ss.can_save)):
            continue
        start, end = store_tokens(rm, chunk, role == "kv_producer")
        blocks = hz.blocks_of(_block_ids(rm.slot_mapping, start, end, bs))
        if not blocks:
            continue
        try:
            t = hz.begin_store(rm.req_id, blocks, STORE_STREAM, key=key)
        except UnsafeTransferError as exc:
            # Content a failed load left bad: not carried into LMCache.
            logger.warning("blockpool: %s: store of request %r not run: %s", w.name, rm.req_id, exc)
            if ss is not None:
                ss.can_save = False
            continue
        begun.append(key)
        setattr(rm, META_STORE, t.to_wire())
    for key in dict.fromkeys(begun):
        hz.end_with_step(key)


def _run_as_stock(hz: Any, w: ConnectorWiring, req_id: str, blocks: list[Any], exc: Exception) -> None:
    """A load the pool refused runs as LMCache runs it without the plugin
    (:func:`fall_back`): not begun on the pool, no fence of ours, its
    ``can_load`` and the request's store left as LMCache planned them, so
    vLLM sees what it sees in stock. What the pool can still learn without
    a claim it cannot show: the load ends before step ``N``'s forward ends
    (the forward reads every loaded token, so LMCache orders it after the
    copies: a synchronised load stream on the paged path, the compute
    stream's waits on the load stream layer by layer on the layerwise
    path), so each of the load's blocks whose earlier accesses all lie on
    the compute stream or ended gets ``eN`` as its writer, and a later
    fence of that block names ``eN``. A block with another engine's access
    still pending keeps its record (``eN`` is not ordered after that
    access), and so do all of them where the pool refuses ``eN`` as their
    writer (an access ordered after ``eN`` touched one already). Never
    raises. O(blocks)."""
    fall_back(w.name, "load refused by the pool", f"request {req_id!r}: {exc}")
    steps = hz.outstanding_steps()
    if not steps or steps[-1].index != hz.steps_issued or steps[-1].forward is None:
        return
    forward = steps[-1].forward
    pool = hz.pool

    def on_compute_or_ended(t: Any) -> bool:
        return t is None or t.stream == forward.stream or pool.is_ended(t)

    covered = [
        b
        for b in blocks
        if on_compute_or_ended(b.writer) and all(on_compute_or_ended(r) for r in b.readers or ())
    ]
    if covered:
        from blockpool.core.errors import BlockPoolError
        from blockpool.core.hazards import AccessKind

        try:
            pool.tag(covered, forward, AccessKind.WRITE)
        except BlockPoolError as tag_exc:  # eN not orderable after them: the blocks keep their record
            logger.debug("blockpool: %s: eN not recorded as the writer of %r: %s", w.name, req_id, tag_exc)


def patch_scheduler(mod: Any, patch: Patcher) -> None:
    """Install the scheduler half on vLLM's ``LMCacheConnectorV1`` (module
    ``mod``): ``bind_gpu_block_pool`` attaches the wiring,
    ``build_connector_meta`` begins the step's transfers."""
    cls = mod.LMCacheConnectorV1
    patch(cls, "bind_gpu_block_pool", _binder(LMCACHE, None, "_kv_cache_config", config_block_size))
    patch(cls, "build_connector_meta", _planner(_plan))


# ----------------------------------------------------------------------
# worker half
# ----------------------------------------------------------------------


def _transfers(meta: Any, attr: str) -> dict[str, Any]:
    from blockpool.integrations.vllm.hazards import Transfer

    out = {}
    for rm in meta.requests if meta is not None else ():
        wire_form = getattr(rm, attr, None)
        if wire_form is not None:
            out[rm.req_id] = Transfer.from_wire(wire_form)
    return out


@contextmanager
def _fenced(
    engine: Any,
    methods: Iterable[str],
    transfers: dict[str, Any],
    stream_attr: str,
    what: str,
    *,
    record_rest: bool,
) -> Iterator[None]:
    """While inside: each of ``engine``'s ``methods`` called for a request
    with a transfer in ``transfers`` (by its ``req_id`` keyword) first
    orders the GPU connector's ``stream_attr`` stream after the transfer's
    fence; the transfer's token is recorded on that stream once the call
    returns (``retrieve``, ``store``: their copies are enqueued by then),
    or, for the layerwise ``*_layer`` calls (their copies run layer by
    layer), by the step's last call (``wait_for_save``). With
    ``record_rest``, the transfers not begun inside and not recorded
    before are recorded on leaving (their points are then)."""
    from blockpool.integrations.vllm import worker as vw

    wh = vw.current()
    if wh is None or not transfers or engine is None:
        yield
        return
    gpu = engine.gpu_connector
    stream = getattr(gpu, stream_attr, None) or wh.current_stream()
    pending = {r: t for r, t in transfers.items() if not wh.was_recorded(t.token)}
    methods = [m for m in methods if callable(getattr(engine, m, None))]
    saved = {m: engine.__dict__.get(m) for m in methods}

    def wrap(orig: Any, layerwise: bool) -> Any:
        @functools.wraps(orig)
        def fenced(*args: Any, **kwargs: Any) -> Any:
            t = pending.pop(kwargs.get("req_id"), None)
            if t is None:
                return orig(*args, **kwargs)
            if wh.audit is not None:
                wh.observe_transfer(LMCACHE, t)
            elif wh.wait_device_or_stock(wh.waitable(t.fence), stream, what):
                wh.waits += 1
            try:
                return orig(*args, **kwargs)
            finally:
                if not layerwise:
                    wh.record(t.token, stream)

        return fenced

    for m in methods:
        setattr(engine, m, wrap(getattr(engine, m), m.endswith("_layer")))
    try:
        yield
    finally:
        for m, own in saved.items():
            if own is None:
                engine.__dict__.pop(m, None)
            else:
                setattr(engine, m, own)
        if record_rest:
            for t in sorted(pending.values(), key=lambda t: t.token.seq):
                wh.record(t.token, stream)


def _engine(conn: Any) -> Any:
    impl = conn._lmcache_engine
    return None if impl is None else impl.lmcache_engine


def _whole_chunks(impl: Any) -> bool:
    """Whether LMCache's adapter ``impl`` loads layer by layer (its
    ``use_layerwise``) or blends (``enable_blending``)."""
    return bool(getattr(impl, "use_layerwise", False) or getattr(impl, "enable_blending", False))


def _load_stream(engine: Any) -> Any:
    """The load stream of LMCache's engine ``engine``'s GPU connector, or
    ``None`` (no engine, no GPU connector, or one without a load stream).
    O(1)."""
    gpu = None if engine is None else engine.gpu_connector
    return getattr(gpu, "load_stream", None)


def _wait_before_layerwise(engine: Any, loads: dict[str, Any]) -> None:
    """Before LMCache's ``start_load_kv`` begins the step's layerwise or
    blending loads: the GPU connector's load stream (the layer copies) and
    the current stream (where the blending connector writes the paged
    cache) wait on the fences of every load of the step. LMCache calls
    ``retrieve_layer`` without the request's id, so the waits are not
    matched per request: each load waits on the others' fences too (never
    less than its own). In audit mode the loads are counted instead. Never
    raises: a failure leaves the loads to LMCache's own ordering, counted
    in ``stock_fallbacks`` and logged once."""
    from blockpool.integrations.vllm import worker as vw

    wh = vw.current()
    if wh is None or engine is None:
        return
    if wh.audit is not None:
        for t in loads.values():
            wh.observe_transfer(LMCACHE, t)
        return
    what = "an LMCache layerwise load"
    try:
        fence = tuple(dict.fromkeys(tok for t in loads.values() for tok in wh.waitable(t.fence)))
        if not fence:
            return
        current = wh.current_stream()
        load = _load_stream(engine)
        waited = wh.wait_device_or_stock(fence, current, what)
        if load is not None and load is not current:
            waited = wh.wait_device_or_stock(fence, load, what) and waited
        wh.waits += waited
    except Exception as exc:  # noqa: BLE001  (never out of vLLM's worker: LMCache's own ordering stays)
        wh.fell_back(what, exc)


def _record_layerwise(conn: Any, engine: Any, loads: dict[str, Any]) -> None:
    """When ``wait_for_save`` returns (the forward ran, its per-layer
    ``wait_for_layer_load`` enqueued every layer's copy): the tokens of the
    step's loads not recorded yet (the layerwise and blending ones) are
    recorded on a side stream ordered after the current stream (the
    forward, and the blending connector's paged writes) and after the GPU
    connector's load stream (every layer's copy). Never earlier: a fence
    naming such a token is not met before the last layer is written.
    Never raises: a failure is counted in ``stock_fallbacks`` and logged
    once, and the tokens left unrecorded are met by no wait."""
    from blockpool.integrations.vllm import worker as vw
    from blockpool.integrations.vllm.lmcache_mp import _side_stream

    wh = vw.current()
    if wh is None or not loads:
        return
    pending = sorted((t for t in loads.values() if not wh.was_recorded(t.token)), key=lambda t: t.token.seq)
    if not pending:
        return
    try:
        current = wh.current_stream()
        side = _side_stream(conn, current)
        side.wait_stream(current)
        load = _load_stream(engine)
        if load is not None and load is not current:
            side.wait_stream(load)
        for t in pending:
            wh.record(t.token, side)
    except Exception as exc:  # noqa: BLE001  (never out of vLLM's worker)
        # A token not recorded here is one no wait can meet: whatever waits
        # on it keeps vLLM's own wait (WorkerHazards.wait_device_or_stock).
        wh.fell_back("recording an LMCache layerwise load", exc)


def wire_worker(patch: Patcher) -> None:
    """Install the worker half on vLLM's ``LMCacheConnectorV1``: the fence
    waits around LMCache's ``retrieve`` (load stream), before the step's
    layerwise and blending loads (load and current streams) and around
    ``store`` / ``store_layer`` (store stream), and the loads' and stores'
    tokens recorded after their copies (see the module docstring)."""
    import importlib

    cls = importlib.import_module(MODULE).LMCacheConnectorV1

    def wrap_start(orig: Any) -> Any:
        @functools.wraps(orig)
        def start_load_kv(self: Any, forward_context: Any, **kwargs: Any) -> None:
            loads = _transfers(self._connector_metadata, META_LOAD)
            if loads and _whole_chunks(self._lmcache_engine):
                # Layerwise and blending loads: their tokens are recorded by
                # wait_for_save, once the forward enqueued every layer.
                _wait_before_layerwise(_engine(self), loads)
                return orig(self, forward_context, **kwargs)
            with _fenced(
                _engine(self), ("retrieve",), loads, "load_stream", "an LMCache load", record_rest=True
            ):
                return orig(self, forward_context, **kwargs)

        return start_load_kv

    def wrap_save_layer(orig: Any) -> Any:
        @functools.wraps(orig)
        def save_kv_layer(self: Any, *args: Any, **kwargs: Any) -> None:
            stores = _transfers(self._connector_metadata, META_STORE)
            with _fenced(
                _engine(self), ("store_layer",), stores, "store_stream", "an LMCache store", record_rest=False
            ):
                return orig(self, *args, **kwargs)

        return save_kv_layer

    def wrap_wait_for_save(orig: Any) -> Any:
        @functools.wraps(orig)
        def wait_for_save(self: Any) -> None:
            meta = self._connector_metadata
            engine = _engine(self)
            loads, stores = _transfers(meta, META_LOAD), _transfers(meta, META_STORE)
            # The step's last call: its layerwise loads and stores ran to
            # their last layer; their tokens (and those of stores not run)
            # are recorded when it returns.
            with _fenced(engine, ("store",), stores, "store_stream", "an LMCache store", record_rest=True):
                try:
                    return orig(self)
                finally:
                    _record_layerwise(self, engine, loads)

        return wait_for_save

    patch(cls, "start_load_kv", wrap_start)
    patch(cls, "save_kv_layer", wrap_save_layer)
    patch(cls, "wait_for_save", wrap_wait_for_save)


register_connector(LMCACHE, ConnectorSpec(MODULE, STREAMS, patch_scheduler))
register_worker_half(LMCACHE, wire_worker)
