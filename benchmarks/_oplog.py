"""The trace op log: every pool call a replay makes, recorded once and
replayed against each pool.

Recording. :func:`record` runs the replay driver
(:func:`blockpool.replay.driver.run_policy`, policy ``exact``, default
:class:`~blockpool.replay.config.ReplayConfig`: 16,384 blocks of 16 tokens)
over the first ``limit`` requests of a trace. For that run only, the pool
class the driver constructs (``blockpool.replay.machine.HazardAwareBlockPool``)
is replaced by :class:`_RecordingPool`, a subclass whose public operations
(the driver's :data:`~blockpool.replay.state.POOL_OPS`) append one entry per
outermost call to the log: the arguments as block ids, token
``(stream, seq)`` pairs and key indices, and the result (block ids, seq
numbers, counts) for later checking. Nothing else in the driver changes.

What a hazard-blind pool must do to keep the same block ids. The recorded
pool tracks hazards, so it *holds back* freed blocks that a host engine may
still be reading (a pending ``xfer`` store) and releases them when the
store ends; it also drops the keys of blocks whose load failed. A pool
without hazard tracking (ours with ``track_hazards=False``, or vLLM's) would
put those blocks straight back in the free queue and hand out different
block ids from then on. The log therefore also records, at the call where
they happen, three pseudo-operations, and the blind pools replay them as
the calls a vLLM connector makes for the same effect (a reference kept
while a transfer reads the block):

- a block held by ``free_blocks`` keeps its reference(s) in the blind pool
  (it is left out of that ``free_blocks`` call);
- ``release``: the held blocks the pool released at the start of a call
  (one batch per ended token, in the pool's order) are freed then, with
  one ``free_blocks`` call per batch;
- ``unhold``: a held block that a call touched (a prefix hit on it) drops
  the kept reference(s) after that call;
- ``unpublish``: keys dropped for a failed load become ``evict_blocks``.

With these, every pool's free queue is the same after every call, which
:func:`validate` checks: every allocation returns the recorded block ids in
every pool, every lookup the recorded block, every free count the recorded
count.

The call level (see ``docs/performance.md``): each recorded call becomes
the call(s) that pool offers for the same work.

=================== ============================= =====================================
recorded call        blockpool (hazards on / off)  vLLM's ``BlockPool`` (0.32-0.34)
=================== ============================= =====================================
get_cached_block(k)  ``get_cached_block(key36)``   ``get_cached_block(hash32, [0])``
allocate_for(n, s,   ``allocate_for`` (one call)   ``touch(hits)`` if hits, then
hits)                                              ``get_new_blocks(n)`` if n > 0; a
                                                   failed one: ``get_num_free_blocks()``
                                                   (vLLM checks before it allocates)
get_new_blocks(n),   the same                      the same
touch, get_num_free
free_blocks(bs, tok) ``free_blocks(bs, token=tok)`` ``free_blocks(bs)``
cache_full_blocks    ``cache_full_blocks(blocks,    ``cache_full_blocks(req, blocks, lo,
                     keys36, lo, hi, 16)``          hi, 16, 0)``, ``req.block_hashes``
                                                   the 32-byte hashes
cache_partial_block  ``cache_partial_block(b,       ``cache_partial_block(req, b,
(b, k, ntok)         key36, ntok)``                 16 * (ntok // 16 + 1), 0, 16)`` with
                                                   ``req.block_hashes[ntok // 16]`` the
                                                   partial key's hash (vLLM keys partial
                                                   entries at hash-block granularity)
issue, complete,     the same                      nothing (vLLM has no hazard work)
fail, fence_for,
tag, begin_*
=================== ============================= =====================================

Keys: each distinct replay key (a tuple of ints) becomes a 32-byte
``BlockHash`` (SHA-256 of its ``repr``) and, with group id 0 appended as 4
big-endian bytes, the 36-byte ``BlockHashWithGroupId`` vLLM's map uses;
our pool gets that same 36-byte value as its opaque key. Stand-in requests
and key lists are built before the timed part.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _pools import Request

from blockpool import HazardAwareBlockPool
from blockpool.core.errors import NoFreeBlocksError
from blockpool.core.hazards import AccessKind, StreamKind, Token

__all__ = ["TRACE", "OpLog", "build_replay", "compile_calls", "load", "record", "run_calls", "validate"]

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"
"""``../shared/traces/conversation_trace.jsonl`` relative to the repo root,
read in place."""

GROUP0 = (0).to_bytes(4, "big")
FAIL = "NoFreeBlocksError"


# ---------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------


class _Log:
    """What the recording pool appends to (module-level, one recording at a time)."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []
        self.keys: dict[object, int] = {}
        self.tables: dict[int, int] = {}  # id(list) -> index
        self.table_objs: list[list[Any]] = []
        self.table_checks: list[tuple[int, int, int, tuple[int, ...]]] = []
        self.keylists: dict[int, int] = {}
        self.keylist_objs: list[list[Any]] = []
        self.depth = 0
        self.in_apply_completions = False
        self.pre: list[tuple[Any, ...]] = []

    def key(self, k: object) -> int:
        i = self.keys.get(k)
        if i is None:
            i = self.keys[k] = len(self.keys)
        return i


_LOG: _Log | None = None


def _ids(blocks: Any) -> list[int]:
    return [b.block_id for b in blocks]


def _tok(t: Token | None) -> tuple[str, int] | None:
    return None if t is None else (t.stream, t.seq)


class _RecordingPool(HazardAwareBlockPool):
    """The pool the driver builds during :func:`record`; see the module docstring."""

    def _call(self, name: str, enc: tuple[Any, ...], fn: Callable[[], Any], res: Callable[[Any], Any]) -> Any:
        log = _LOG
        assert log is not None
        if log.depth:
            return fn()
        log.depth = 1
        log.pre = []
        held_before = set(self.holdback.held_ids())
        try:
            out = fn()
        except NoFreeBlocksError:
            log.ops.extend(log.pre)
            log.ops.append((name, *enc, FAIL))
            raise
        finally:
            log.depth = 0
        log.ops.extend(log.pre)
        released = {bid for op in log.pre if op[0] == "release" for bid in op[1]}
        if name == "free_blocks":
            ids = enc[0]
            held = sorted(
                {bid for bid in ids if self.blocks[bid] in self.holdback and bid not in held_before}
            )
            log.ops.append((name, *enc, held))
        else:
            log.ops.append((name, *enc, res(out)))
        unheld = sorted(held_before - set(self.holdback.held_ids()) - released)
        if unheld:
            assert all(self.blocks[b].ref_cnt > 0 for b in unheld)
            log.ops.append(("unhold", unheld))
        return out

    # -- private hooks: where a hazard-aware pool departs from a blind one --

    def _apply_completions(self) -> None:
        log = _LOG
        assert log is not None
        log.in_apply_completions = True
        try:
            super()._apply_completions()
        finally:
            log.in_apply_completions = False

    def _enqueue_free(self, blocks: list[Any], to_tail: bool = False, evict_first: bool = False) -> None:
        log = _LOG
        assert log is not None
        super()._enqueue_free(blocks, to_tail, evict_first)
        if log.in_apply_completions and log.depth:
            assert not any(b in self.holdback for b in blocks)
            log.pre.append(("release", _ids(blocks)))

    def _drop_keys(self, b: Any, reason: str | None = None) -> list[Any]:
        log = _LOG
        assert log is not None
        had = bool(self.prefix_cache.keys_of(b))
        keys = super()._drop_keys(b, reason)
        if log.in_apply_completions and log.depth and had:
            log.pre.append(("unpublish", b.block_id))
        return keys

    # -- the driver's operations --

    def issue(self, stream: str) -> Token:
        return self._call(
            "issue", (stream,), lambda: super(_RecordingPool, self).issue(stream), lambda t: t.seq
        )

    def complete(self, token: Token) -> None:
        return self._call(
            "complete", (_tok(token),), lambda: super(_RecordingPool, self).complete(token), _none
        )

    def fail(self, token: Token) -> None:
        return self._call("fail", (_tok(token),), lambda: super(_RecordingPool, self).fail(token), _none)

    def get_cached_block(self, block_hash: Any) -> Any:
        assert _LOG is not None
        return self._call(
            "get_cached_block",
            (_LOG.key(block_hash),),
            lambda: super(_RecordingPool, self).get_cached_block(block_hash),
            lambda b: -1 if b is None else b.block_id,
        )

    def get_num_free_blocks(self) -> int:
        return self._call(
            "get_num_free_blocks", (), lambda: super(_RecordingPool, self).get_num_free_blocks(), lambda n: n
        )

    def allocate_for(
        self, num_blocks: int, stream: str, *, hits: Any = (), access: AccessKind = AccessKind.WRITE
    ) -> Any:
        hits = list(hits)
        return self._call(
            "allocate_for",
            (num_blocks, stream, _ids(hits), access.value),
            lambda: super(_RecordingPool, self).allocate_for(num_blocks, stream, hits=hits, access=access),
            lambda r: _ids(r[0]),
        )

    def get_new_blocks(self, num_blocks: int) -> Any:
        return self._call(
            "get_new_blocks",
            (num_blocks,),
            lambda: super(_RecordingPool, self).get_new_blocks(num_blocks),
            _ids,
        )

    def touch(self, blocks: Any) -> None:
        blocks = list(blocks)
        return self._call("touch", (_ids(blocks),), lambda: super(_RecordingPool, self).touch(blocks), _none)

    def free_blocks(
        self, ordered_blocks: Any, token: Token | None = None, access: AccessKind = AccessKind.READ
    ) -> None:
        blocks = list(ordered_blocks)
        return self._call(
            "free_blocks",
            (_ids(blocks), _tok(token), access.value),
            lambda: super(_RecordingPool, self).free_blocks(blocks, token, access),
            _none,
        )

    def fence_for(self, blocks: Any, stream: str, access: AccessKind = AccessKind.WRITE) -> Any:
        blocks = list(blocks)
        return self._call(
            "fence_for",
            (_ids(blocks), stream, access.value),
            lambda: super(_RecordingPool, self).fence_for(blocks, stream, access),
            lambda f: [_tok(t) for t in f],
        )

    def tag(self, blocks: Any, token: Token, access: AccessKind) -> None:
        blocks = list(blocks)
        return self._call(
            "tag",
            (_ids(blocks), _tok(token), access.value),
            lambda: super(_RecordingPool, self).tag(blocks, token, access),
            _none,
        )

    def begin_copy(self, pairs: Any, stream: str = "compute") -> Any:
        pairs = list(pairs)
        return self._call(
            "begin_copy",
            ([(s.block_id, d.block_id) for s, d in pairs], stream),
            lambda: super(_RecordingPool, self).begin_copy(pairs, stream),
            lambda r: r[0].seq,
        )

    def begin_load(self, blocks: Any, stream: str) -> Any:
        blocks = list(blocks)
        return self._call(
            "begin_load",
            (_ids(blocks), stream),
            lambda: super(_RecordingPool, self).begin_load(blocks, stream),
            lambda r: r[0].seq,
        )

    def begin_store(self, blocks: Any, stream: str) -> Any:
        blocks = list(blocks)
        return self._call(
            "begin_store",
            (_ids(blocks), stream),
            lambda: super(_RecordingPool, self).begin_store(blocks, stream),
            lambda r: r[0].seq,
        )

    def cache_full_blocks(
        self,
        blocks: Any,
        block_hashes: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int | None = None,
        block_mask: Any = None,
    ) -> None:
        log = _LOG
        assert log is not None and block_mask is None
        # The driver passes the request's live block table and key list; a
        # block table only grows (a new list after a preemption), so its
        # final content agrees with every call's [lo:hi] (checked at the end).
        ti = log.tables.get(id(blocks))
        if ti is None:
            ti = log.tables[id(blocks)] = len(log.table_objs)
            log.table_objs.append(blocks)
        log.table_checks.append(
            (ti, num_cached_blocks, num_full_blocks, tuple(_ids(blocks[num_cached_blocks:num_full_blocks])))
        )
        ki = log.keylists.get(id(block_hashes))
        if ki is None:
            ki = log.keylists[id(block_hashes)] = len(log.keylist_objs)
            log.keylist_objs.append(block_hashes)
        return self._call(
            "cache_full_blocks",
            (ti, ki, num_cached_blocks, num_full_blocks, block_size),
            lambda: super(_RecordingPool, self).cache_full_blocks(
                blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size
            ),
            _none,
        )

    def cache_partial_block(
        self, block: Any, block_hash: Any, num_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        assert _LOG is not None and not args and not kwargs
        return self._call(
            "cache_partial_block",
            (block.block_id, _LOG.key(block_hash), num_tokens),
            lambda: super(_RecordingPool, self).cache_partial_block(block, block_hash, num_tokens),
            lambda k: k is not None,
        )


def _none(_: object) -> None:
    return None


class OpLog:
    """A recorded op log (see the module docstring), as loaded from its file.

    Attributes:
        ops: The entries, in call order.
        digests: Key index -> 32-byte hash.
        tables: Block tables (block ids) that ``cache_full_blocks`` entries name.
        keylists: Key lists (key indices) that ``cache_full_blocks`` entries name.
        streams: ``{name: "device" | "host"}``.
        num_blocks, block_size: The recorded pool.
        meta: Trace, requests, record wall time, per-op counts.
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.ops: list[tuple[Any, ...]] = data["ops"]
        self.digests: list[bytes] = data["digests"]
        self.tables: list[list[int]] = data["tables"]
        self.keylists: list[list[int]] = data["keylists"]
        self.streams: dict[str, str] = data["streams"]
        self.num_blocks: int = data["num_blocks"]
        self.block_size: int = data["block_size"]
        self.meta: dict[str, Any] = data["meta"]


def record(path: Path, trace: Path = TRACE, limit: int = 2000, policy: str = "exact") -> dict[str, Any]:
    """Replay the first ``limit`` requests of ``trace`` with the recording
    pool and write the op log to ``path`` (pickle). Returns the log's meta."""
    global _LOG
    from blockpool.replay import machine
    from blockpool.replay.config import ReplayConfig
    from blockpool.replay.driver import run_policy
    from blockpool.replay.traces import read_trace

    cfg = ReplayConfig()
    tr = read_trace(trace, limit=limit)
    log = _LOG = _Log()
    orig = machine.HazardAwareBlockPool
    machine.HazardAwareBlockPool = _RecordingPool  # type: ignore[misc]
    t0 = time.perf_counter()
    try:
        result = run_policy(tr.requests, policy, cfg)
    finally:
        machine.HazardAwareBlockPool = orig  # type: ignore[misc]
        _LOG = None
    wall = time.perf_counter() - t0
    if not log.ops:
        raise RuntimeError(
            "the replay driver made no call on the recording pool (did it stop using machine.HazardAwareBlockPool?)"
        )
    tables = [_ids(t) for t in log.table_objs]
    for ti, lo, hi, ids in log.table_checks:
        if tuple(tables[ti][lo:hi]) != ids:
            raise RuntimeError(f"block table {ti} changed in [{lo}:{hi}] after it was cached")
    keylists = [[log.key(k) for k in kl] for kl in log.keylist_objs]
    digests: list[bytes] = [b""] * len(log.keys)
    for k, i in log.keys.items():
        digests[i] = hashlib.sha256(repr(k).encode()).digest()
    counts: dict[str, int] = {}
    for op in log.ops:
        counts[op[0]] = counts.get(op[0], 0) + 1
    meta = {
        "trace": str(trace),
        "requests": len(tr.requests),
        "policy": policy,
        "record_wall_s": wall,
        "counts": counts,
        "driver_pool_ops": {k: v[0] for k, v in result.pool_ops.items()},
    }
    data = {
        "ops": log.ops,
        "digests": digests,
        "tables": tables,
        "keylists": keylists,
        "streams": {n: s.kind.value for n, s in cfg.streams.items()},
        "num_blocks": cfg.num_blocks,
        "block_size": cfg.block_size,
        "meta": meta,
    }
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
    return meta


def load(path: Path) -> OpLog:
    with open(path, "rb") as f:
        return OpLog(pickle.load(f))


# ---------------------------------------------------------------------------
# compiling a log into calls on one pool
# ---------------------------------------------------------------------------

_ACCESS = {"read": AccessKind.READ, "write": AccessKind.WRITE}


def _expect_no_space(fn: Callable[..., Any], n: int, stream: str, hits: list[Any]) -> str:
    try:
        fn(n, stream, hits=hits)
    except NoFreeBlocksError:
        return FAIL
    raise AssertionError("the recorded call failed for lack of space but succeeded here")


Calls = list[tuple[Callable[..., Any], tuple[Any, ...]]]
Checks = list[tuple[int, str, Any]]  # (call index, how to read the result, expected)


def compile_calls(log: OpLog, kind: str, pool: Any) -> tuple[Calls, Checks]:
    """The calls ``pool`` makes for ``log`` (``kind``: ``"on"``/``"off"`` for
    ours, ``"vllm"``), as ``(fn, args)`` (keyword arguments bound with
    ``functools.partial``), with the results to check.
    O(len(log.ops) + blocks named)."""
    enabled = gc.isenabled()
    gc.disable()  # millions of small containers: the collector would rescan them
    try:
        return _compile(log, kind, pool)
    finally:
        if enabled:
            gc.enable()


def _compile(log: OpLog, kind: str, pool: Any) -> tuple[Calls, Checks]:
    blocks = pool.blocks
    kinds = {n: StreamKind(v) for n, v in log.streams.items()}
    toks: dict[tuple[str, int], Token] = {}

    def tok(t: tuple[str, int] | None) -> Token | None:
        if t is None:
            return None
        x = toks.get(t)
        if x is None:
            x = toks[t] = Token(t[0], t[1], kinds[t[0]])
        return x

    def bl(ids: list[int]) -> list[Any]:
        return [blocks[i] for i in ids]

    calls: Calls = []
    checks: Checks = []
    add = calls.append
    vllm = kind == "vllm"
    emulate = kind != "on"
    phantom: dict[int, int] = {}
    bs = log.block_size
    if vllm:
        key_arg = log.digests
        tables: list[Any] = [None] * len(log.tables)
        reqs: list[Any] = [None] * len(log.keylists)
    else:
        key_arg = [d + GROUP0 for d in log.digests]
        tables = [None] * len(log.tables)
        reqs = [None] * len(log.keylists)
    filler = b"\0" * 32
    for op in log.ops:
        name = op[0]
        if name == "get_cached_block":
            k = key_arg[op[1]]
            checks.append((len(calls), "vblock" if vllm else "block", op[2]))
            add((pool.get_cached_block, (k, [0]) if vllm else (k,)))
        elif name == "get_num_free_blocks":
            checks.append((len(calls), "value", op[1]))
            add((pool.get_num_free_blocks, ()))
        elif name == "allocate_for":
            n, stream, hits, access, res = op[1:]
            if vllm:
                if res == FAIL:
                    add((pool.get_num_free_blocks, ()))
                    continue
                if hits:
                    add((pool.touch, (bl(hits),)))
                if n:
                    checks.append((len(calls), "ids", res))
                    add((pool.get_new_blocks, (n,)))
            elif res == FAIL:
                checks.append((len(calls), "value", FAIL))
                add((_expect_no_space, (pool.allocate_for, n, stream, bl(hits))))
            else:
                checks.append((len(calls), "ids0", res))
                add(
                    (functools.partial(pool.allocate_for, hits=bl(hits), access=_ACCESS[access]), (n, stream))
                )
        elif name == "get_new_blocks":
            checks.append((len(calls), "ids", op[2]))
            add((pool.get_new_blocks, (op[1],)))
        elif name == "touch":
            add((pool.touch, (bl(op[1]),)))
        elif name == "free_blocks":
            ids, t, access, held = op[1:]
            if emulate and held:
                hs = set(held)
                for i in ids:
                    if i in hs:
                        phantom[i] = phantom.get(i, 0) + 1
                ids = [i for i in ids if i not in hs]
            if vllm:
                add((pool.free_blocks, (bl(ids),)))
            else:
                add((pool.free_blocks, (bl(ids), tok(t), _ACCESS[access])))
        elif name in ("release", "unhold"):
            if emulate:
                ids = [i for i in op[1] for _ in range(phantom.pop(i))]
                add((pool.free_blocks, (bl(ids),)))
        elif name == "unpublish":
            if emulate:
                add((pool.evict_blocks, ([op[1]],)))
        elif name == "cache_full_blocks":
            ti, ki, lo, hi, bsz = op[1:6]
            if tables[ti] is None:
                tables[ti] = bl(log.tables[ti])
            if reqs[ki] is None:
                kl = log.keylists[ki]
                reqs[ki] = Request([key_arg[k] for k in kl]) if vllm else [key_arg[k] for k in kl]
            if vllm:
                add((pool.cache_full_blocks, (reqs[ki], tables[ti], lo, hi, bsz, 0)))
            else:
                add((pool.cache_full_blocks, (tables[ti], reqs[ki], lo, hi, bsz)))
        elif name == "cache_partial_block":
            bid, ki, ntok = op[1:4]
            if vllm:
                j = ntok // bs
                req = Request([filler] * j + [key_arg[ki]])
                add((pool.cache_partial_block, (req, blocks[bid], bs * (j + 1), 0, bs)))
            else:
                add((pool.cache_partial_block, (blocks[bid], key_arg[ki], ntok)))
        elif vllm:
            continue  # hazard calls: nothing in vLLM
        elif name == "issue":
            checks.append((len(calls), "seq", op[2]))
            add((pool.issue, (op[1],)))
        elif name == "complete":
            add((pool.complete, (tok(op[1]),)))
        elif name == "fail":
            add((pool.fail, (tok(op[1]),)))
        elif name == "fence_for":
            add((pool.fence_for, (bl(op[1]), op[2], _ACCESS[op[3]])))
        elif name == "tag":
            add((pool.tag, (bl(op[1]), tok(op[2]), _ACCESS[op[3]])))
        elif name == "begin_copy":
            pairs = [(blocks[s], blocks[d]) for s, d in op[1]]
            add((pool.begin_copy, (pairs, op[2])))
        elif name == "begin_load":
            add((pool.begin_load, (bl(op[1]), op[2])))
        elif name == "begin_store":
            add((pool.begin_store, (bl(op[1]), op[2])))
        else:
            raise AssertionError(f"unknown op {name!r}")
    return calls, checks


def run_calls(calls: Calls) -> None:
    """The timed loop: one Python call per entry. O(len(calls))."""
    for fn, a in calls:
        fn(*a)


def validate(calls: Calls, checks: Checks) -> int:
    """Run ``calls`` and compare every checked result with the recording.
    Returns the number of results checked; raises AssertionError on the first
    mismatch."""
    want = {i: (how, exp) for i, how, exp in checks}
    for i, (fn, a) in enumerate(calls):
        r = fn(*a)
        c = want.get(i)
        if c is None:
            continue
        how, exp = c
        if how == "block":
            got: Any = -1 if r is None else r.block_id
        elif how == "vblock":
            got = -1 if r is None else r[0].block_id
        elif how == "ids":
            got = [b.block_id for b in r]
        elif how == "seq":
            got = r.seq
        elif how == "ids0":
            got = [b.block_id for b in r[0]]
        else:
            got = r
        if got != exp:
            raise AssertionError(f"call {i} ({getattr(fn, '__name__', fn)}): recorded {exp!r}, got {got!r}")
    return len(checks)


def build_replay(log: OpLog, kind: str, make_pool: Callable[[], Any]) -> tuple[Calls, Any]:
    """A fresh pool and its compiled calls, with the heap frozen (``gc.freeze``)
    so that the op log's own objects are not scanned by the collector during
    the timed part (vLLM freezes its startup heap the same way)."""
    gc.unfreeze()
    pool = make_pool()
    calls, _ = compile_calls(log, kind, pool)
    gc.collect()
    gc.freeze()
    return calls, pool
