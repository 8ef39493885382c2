"""``fence_and_tag(blocks, stream, token)`` is ``fence_for(blocks, stream,
WRITE, token=token)`` then ``tag(blocks, token, WRITE)``: the same fence and
the same state afterwards (every later fence, stats, token statuses, what
the token's completion ends), on random pools and histories; on bad input
the error ``fence_for`` raises, with nothing changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockpool import AccessKind, HazardAwareBlockPool, KVCacheBlock, Token
from blockpool.core.errors import (
    BlockPoolError,
    ForeignBlockError,
    ForeignTokenError,
    InvalidArgumentError,
    UnknownStreamError,
    UnknownTokenError,
)
from tests.conftest import STREAMS, make_pool

READ, WRITE = AccessKind.READ, AccessKind.WRITE
NAMES = sorted(STREAMS)
N = 8  # blocks of each pool (block 0 is the null block)

OPS = (
    "alloc",
    "free",
    "issue",
    "tag_read",
    "tag_write",
    "fence",
    "fence_token",
    "fence_and_tag",
    "load",
    "store",
    "copy",
    "complete",
    "fail",
    "poll",
    "cache",
)
op = st.tuples(st.sampled_from(OPS), st.integers(0, 2**16), st.integers(0, 2**16))
busy_op = st.tuples(
    st.sampled_from(("alloc", "alloc", "load", "store", "issue", "tag_write", "free", "cache", "fail")),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
)
"""An op of a history without completions: transfers and steps in flight."""
history = st.one_of(st.lists(op, max_size=30), st.lists(busy_op, max_size=20))


def subset(pool: HazardAwareBlockPool, mask: int) -> list[KVCacheBlock]:
    """The pool's blocks whose bit is set in ``mask`` (the null block and
    free blocks included), one of them twice when bit ``N`` is set."""
    out = [pool.blocks[i] for i in range(N) if mask >> i & 1]
    if out and mask >> N & 1:
        out.append(out[0])
    return out


def build(ops: list[tuple[str, int, int]], **kw: Any) -> tuple[HazardAwareBlockPool, list[Token]]:
    """A pool after the history ``ops`` (each op's refusals included: a
    refused op changes nothing) and the tokens it issued, in order. The
    same ``ops`` give the same pool every time."""
    pool = make_pool(N, **kw)
    held: list[KVCacheBlock] = []
    tokens: list[Token] = []
    for name, x, y in ops:
        stream = NAMES[y % len(NAMES)]
        token = tokens[x % len(tokens)] if tokens else None
        blocks = subset(pool, x)
        try:
            if name == "alloc":
                held += pool.get_new_blocks(1 + y % 3)
            elif name == "free" and held:
                pool.free_blocks([held.pop(x % len(held))])
            elif name == "issue":
                tokens.append(pool.issue(stream))
            elif name in ("tag_read", "tag_write") and token is not None:
                pool.tag(blocks, token, READ if name == "tag_read" else WRITE)
            elif name == "fence":
                pool.fence_for(blocks, stream, READ if y & 8 else WRITE)
            elif name in ("fence_token", "fence_and_tag"):
                t = pool.last_token(stream) if y & 16 else token
                if t is not None and name == "fence_token":
                    pool.fence_for(blocks, stream, WRITE, token=t)
                elif t is not None:
                    pool.fence_and_tag(blocks, stream, t)
            elif name in ("load", "store"):
                begin = pool.begin_load if name == "load" else pool.begin_store
                mine = [b for i, b in enumerate(held) if x >> i & 1]  # allocated blocks
                tokens.append(begin(mine, ("h2d", "rdma", "d2h")[y % 3])[0])
            elif name == "copy" and len(held) >= 2:
                pair = (held[x % len(held)], held[y % len(held)])
                tokens.append(pool.begin_copy([pair], stream, refusals=bool(y & 32))[0])
            elif name == "complete" and token is not None:
                pool.complete(token)
            elif name == "fail" and token is not None:
                pool.fail(token)
            elif name == "poll":
                pool.poll()
            elif name == "cache" and held:
                mine = [b for i, b in enumerate(held) if x >> i & 1]
                pool.cache_full_blocks(mine, [f"k{y % 5}-{i}" for i in range(len(mine))], 0, len(mine), 16)
        except BlockPoolError:
            pass
    return pool, tokens


def token_clocks(pool: HazardAwareBlockPool) -> tuple[object, ...]:
    """Each token's issue-time clock (what ``order_after`` changes; not in
    ``snapshot()``)."""
    return tuple(
        (name, seq, tuple(sorted(c.dev.items())), tuple(sorted(map(str, c.host))))
        for name, s in sorted(pool.tracker.streams.items())
        for seq, c in sorted(s.token_clocks.items())
    )


def statuses(pool: HazardAwareBlockPool, tokens: list[Token]) -> list[object]:
    return [(str(t), pool.token_status(t)) for t in tokens]


def observe(pool: HazardAwareBlockPool, tokens: list[Token]) -> list[object]:
    """Everything a caller can see of the pool, before and after the next
    fences (one per stream and access over every block; they record their
    waits, so taken in the same order on every pool)."""
    seen: list[object] = [pool.snapshot(), token_clocks(pool), pool.stats(), statuses(pool, tokens)]
    seen += [sorted(b.block_id for b in blocks) for blocks in (pool._fresh, pool._announced)]  # fills
    every = list(pool.blocks)
    for name in NAMES:
        for access in (READ, WRITE):
            seen.append((name, access, sorted(map(str, pool.fence_for(every, name, access)))))
    seen += [pool.snapshot(), token_clocks(pool), pool.stats()]
    return seen


def unchanged(pool: HazardAwareBlockPool) -> tuple[object, ...]:
    return (pool.snapshot(), token_clocks(pool), pool.stats())


def two_calls(pool: HazardAwareBlockPool, blocks: list[KVCacheBlock], stream: Any, token: Any) -> Any:
    fence = pool.fence_for(blocks, stream, WRITE, token=token)
    pool.tag(blocks, token, WRITE)
    return fence


POOLS = st.sampled_from(
    [
        {},
        {"debug": True},
        {"track_hazards": False},
        {"enable_caching": False},
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kw=POOLS,
    ops=history,
    stream=st.sampled_from(["compute", *NAMES]),
    pick=st.integers(0, 2**16),
    mask=st.integers(0, 2 ** (N + 1) - 1),
    fresh=st.sampled_from([True, True, False]),
    done=st.booleans(),
)
def test_the_combined_call_returns_the_fence_and_leaves_the_state_of_the_two_calls(
    kw: dict[str, Any],
    ops: list[tuple[str, int, int]],
    stream: str,
    pick: int,
    mask: int,
    fresh: bool,
    done: bool,
) -> None:
    def setup() -> tuple[HazardAwareBlockPool, list[Token], Token]:
        pool, tokens = build(ops, **kw)
        if fresh or not tokens:
            tokens.append(pool.issue(stream))
        return pool, tokens, tokens[-1] if fresh else tokens[pick % len(tokens)]

    outcomes = []
    seen = []
    for call in (two_calls, HazardAwareBlockPool.fence_and_tag):
        pool, tokens, token = setup()
        try:
            fence = call(pool, subset(pool, mask), stream, token)
        except BlockPoolError as exc:
            outcomes.append(type(exc))
            if call is not two_calls:  # nothing changed but the queued completions applied
                reference = setup()[0]
                reference.poll()
                assert unchanged(pool) == unchanged(reference)
        else:
            outcomes.append(sorted(map(str, fence)))
        pool.check()
        view = observe(pool, tokens)
        if done:  # what the token's completion ends (order_after's effect)
            pool.complete(token)
            pool.poll()
            view += [pool.snapshot(), statuses(pool, tokens)]
        seen.append(view)
    assert outcomes[0] == outcomes[1]
    assert seen[0] == seen[1]


def test_the_step_token_is_ordered_after_the_fence_and_is_the_blocks_writer() -> None:
    pool = make_pool(N)
    a, b = pool.get_new_blocks(2)
    load, _ = pool.begin_load([a], "h2d")
    step = pool.issue("compute")
    fence = pool.fence_and_tag([a, b], "compute", step)
    assert list(fence) == [load]  # WAW on the load
    assert a.writer == step and b.writer == step
    assert [str(t) for t in pool.fence_for([a], "d2h", READ)] == ["compute:1"]  # RAW on the step
    pool.complete(step)  # its completion ends the load it was ordered after
    assert pool.is_ended(load)


def test_with_hazards_off_the_fence_is_empty_and_the_write_recorded_as_tag_records_it() -> None:
    pool = make_pool(N, track_hazards=False)
    (a,) = pool.get_new_blocks(1)
    step = pool.issue("compute")
    assert not pool.fence_and_tag([a], "compute", step)
    assert a.writer is None and a.readers is None


def _other_token() -> Token:
    return make_pool(N).issue("compute")


BAD: list[
    tuple[str, type[BlockPoolError], Callable[[HazardAwareBlockPool, list[Token]], tuple[Any, Any, Any]]]
] = [
    ("unknown stream", UnknownStreamError, lambda p, t: (p.blocks[1:3], "nope", t[-1])),
    ("stream not a str", InvalidArgumentError, lambda p, t: (p.blocks[1:3], ["compute"], t[-1])),
    ("not a token", InvalidArgumentError, lambda p, t: (p.blocks[1:3], "compute", "compute:2")),
    ("token of another pool", ForeignTokenError, lambda p, t: (p.blocks[1:3], "compute", _other_token())),
    ("token never issued", UnknownTokenError, lambda p, t: (p.blocks[1:3], "compute", Token("compute", 99))),
    ("token of another stream", InvalidArgumentError, lambda p, t: (p.blocks[1:3], "compute", t[0])),
    ("token not the newest", InvalidArgumentError, lambda p, t: (p.blocks[1:3], "compute", t[1])),
    ("host engine token", InvalidArgumentError, lambda p, t: (p.blocks[1:3], "rdma", t[3])),
    ("token already waited on", InvalidArgumentError, lambda p, t: (p.blocks[1:3], "d2h", t[4])),
    (
        "foreign block",
        ForeignBlockError,
        lambda p, t: ([p.blocks[1], make_pool(N).blocks[2]], "compute", t[-1]),
    ),
    ("not a block", InvalidArgumentError, lambda p, t: ([p.blocks[1], 2], "compute", t[-1])),
    ("blocks not iterable", InvalidArgumentError, lambda p, t: (7, "compute", t[-1])),
]


def _bad_pool() -> tuple[HazardAwareBlockPool, list[Token]]:
    """A pool with a load in flight, two compute steps (the second the
    newest), a host engine's load, and a d2h token that the compute
    stream waited on; the blocks hold writes and reads of them."""
    pool = make_pool(N)
    a, b, c = pool.get_new_blocks(3)
    load, _ = pool.begin_load([a], "h2d")
    e1 = pool.issue("compute")
    pool.tag([a, b], e1, WRITE)
    host, _ = pool.begin_load([c], "rdma")
    d2h = pool.issue("d2h")
    pool.fence_for([b], "compute", READ)
    pool.tag([b], d2h, READ)
    pool.fence_for([b], "compute", WRITE)  # compute waits on the d2h read
    e2 = pool.issue("compute")
    return pool, [load, e1, e2, host, d2h, e2]


@pytest.mark.parametrize("case", [c[0] for c in BAD])
def test_bad_input_raises_what_fence_for_raises_and_changes_nothing(case: str) -> None:
    _, error, args = next(c for c in BAD if c[0] == case)
    reference, ref_tokens = _bad_pool()
    blocks, stream, token = args(reference, ref_tokens)
    with pytest.raises(error) as first:
        reference.fence_for(blocks, stream, WRITE, token=token)
    assert type(first.value) is error  # the error of the first of the two calls
    pool, tokens = _bad_pool()
    before = unchanged(pool)
    with pytest.raises(error) as raised:
        pool.fence_and_tag(*args(pool, tokens))
    assert type(raised.value) is error
    assert unchanged(pool) == before
    pool.check()
