"""Model-based test: random allocate / free / touch / cache / CoW / load /
store / rewrite (a write recorded again by its token) / complete / fail
sequences against a deliberately simple reference
model; ``check()`` after every step; every fence judged by the independent
brute-force happens-before model in ``tests/hb_model.py`` (0 missed hazards,
0 redundant waits). A negative control proves the judge can fail.

Failures are on: any token may fail — a step's tagged write, a step that
writes the blocks it frees (``free_blocks(..., access=WRITE)``), a load, a
copy, a store, a plain step — including *late* (after it ended through
another token's completion or a later token of its stream); completions end
what their token waited on (transitive ends). ``pytest
--hypothesis-show-statistics`` lists how often each kind occurred.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blockpool import (
    EMPTY_FENCE,
    AccessKind,
    Fence,
    HazardAwareBlockPool,
    InvalidContentError,
    NoFreeBlocksError,
    RefCountError,
    SharedBlockError,
    StreamKind,
    Token,
)
from tests.hb_model import HBModel

READ, WRITE = AccessKind.READ, AccessKind.WRITE
STREAMS = {
    "compute": StreamKind.DEVICE,
    "h2d": StreamKind.DEVICE,
    "d2h": StreamKind.DEVICE,
    "rdma": StreamKind.HOST,
}
NUM_BLOCKS = 9  # 8 usable


class PoolMachine(RuleBasedStateMachine):
    pool_cls: type[HazardAwareBlockPool] = HazardAwareBlockPool

    @initialize()
    def setup(self) -> None:
        self.pool = self.pool_cls(NUM_BLOCKS, enable_caching=True, streams=STREAMS)
        self.hb = HBModel(STREAMS)
        self.ref = [0] * NUM_BLOCKS
        self.free = set(range(1, NUM_BLOCKS))
        self.held: set[int] = set()
        self.keys: dict[int, list[str]] = {}  # block id -> keys it holds
        self.invalid: set[int] = set()
        self.retired: dict[int, set[str]] = {}  # block id -> keys retired by a promotion
        # The fill a key announces: blocks allocated and neither written nor
        # published since (fresh), blocks published before any write since
        # their allocation (announced): a load into those is not refused.
        self.fresh: set[int] = set()
        self.announced: set[int] = set()
        self.loads: dict[Token, list[int]] = {}  # every write: tag, free WRITE, load, copy
        self.requests: list[list[int]] = []
        self.tokens: list[Token] = []
        self.transfers: set[Token] = set()  # tokens of begin_*
        self.kinds: dict[Token, str] = {}  # the writer kind of each token (for statistics)
        self.next_key = 0

    # -- helpers -------------------------------------------------------------

    def blocks(self, block_ids: list[int]) -> list:
        return [self.pool.blocks[i] for i in block_ids]

    def cached_keys(self) -> list[str]:
        return sorted({k for ks in self.keys.values() for k in ks})

    def written(self, block_ids: list[int]) -> None:
        """A write was recorded on the blocks: no longer a fill's target."""
        self.fresh -= set(block_ids)
        self.announced -= set(block_ids)

    def published(self, b: int) -> None:
        """``b`` is published: announced if nothing wrote it since its allocation."""
        if b in self.fresh:
            self.fresh.discard(b)
            self.announced.add(b)

    def judge_and_wait(self, fence: Fence, groups: list[tuple[list[int], AccessKind]], stream: str) -> None:
        self.hb.judge(fence, groups, stream)
        self.hb.stream_waits(stream, fence)

    def settle(self) -> None:
        """Release model-held blocks whose host accesses ended."""
        self.pool.poll()
        for b in sorted(self.held):
            if not self.hb.pending_host(b):
                self.held.discard(b)
                self.free.add(b)
        for b in sorted(self.free):
            # a failed write can restore a pending host access on a free block
            if self.hb.pending_host(b):
                self.free.discard(b)
                self.held.add(b)

    def refusal(self, kind: str, groups: list[tuple[list[int], AccessKind]]) -> type[Exception] | None:
        """The error the pool must refuse this transfer with
        (``tests/test_unsafe_transfers.py``), or None: a write (load, copy destination) into a cached
        block (it holds a key) more than one holder holds, unless it is a load into a block published
        before any write since its allocation (the fill its keys announce); a read that carries
        content a failed write left bad (store, copy source). Writes are checked first."""
        writes = [b for ids_, access in groups if access is WRITE for b in ids_]
        reads = [b for ids_, access in groups if access is READ for b in ids_]
        fill = self.announced if kind == "load" else set()
        if any(self.ref[b] > 1 and self.keys.get(b) and b not in fill for b in writes):
            return SharedBlockError
        if any(b in self.invalid for b in reads):
            return InvalidContentError
        return None

    def begin(self, kind: str, groups: list[tuple[list[int], AccessKind]], stream: str) -> Token | None:
        pool = self.pool
        refused = self.refusal(kind, groups)
        if refused is not None:
            event(f"{kind} refused: {refused.__name__}")
            pool.poll()
            before = pool.snapshot()
            with pytest.raises(refused):
                if kind == "load":
                    pool.begin_load(self.blocks(groups[0][0]), stream)
                elif kind == "store":
                    pool.begin_store(self.blocks(groups[0][0]), stream)
                else:
                    (src,), (dst,) = groups[0][0], groups[1][0]
                    pool.begin_copy([(pool.blocks[src], pool.blocks[dst])], stream)
            assert pool.snapshot() == before
            self.settle()
            return None
        if kind == "load":
            token, fence = pool.begin_load(self.blocks(groups[0][0]), stream)
        elif kind == "store":
            token, fence = pool.begin_store(self.blocks(groups[0][0]), stream)
        else:
            (src,), (dst,) = groups[0][0], groups[1][0]
            token, fence = pool.begin_copy([(pool.blocks[src], pool.blocks[dst])], stream)
        self.judge_and_wait(fence, groups, stream)
        self.hb.issue(token, fence if STREAMS[stream] is StreamKind.HOST else ())
        for ids_, access in groups:
            self.hb.tag(ids_, token, access)
            if access is WRITE:
                self.invalid -= set(ids_)
                if kind == "load":  # a load's new content withdraws the old keys
                    for b in ids_:  # (a copy's destination keeps keys published for it, a fill its own)
                        if b not in self.announced:
                            self.keys.pop(b, None)
                self.written(ids_)
                self.loads.setdefault(token, []).extend(ids_)
        self.tokens.append(token)
        self.transfers.add(token)
        self.kinds[token] = kind
        return token

    # -- rules ---------------------------------------------------------------

    @rule(
        n=st.integers(0, 5),
        stream=st.sampled_from(sorted(STREAMS)),
        nhits=st.integers(0, 3),
        data=st.data(),
    )
    def allocate(self, n: int, stream: str, nhits: int, data: st.DataObject) -> None:
        keys = self.cached_keys()
        chosen = data.draw(st.lists(st.sampled_from(keys), max_size=nhits)) if keys else []
        hits = [self.pool.get_cached_block(k) for k in chosen]
        hit_ids = [h.block_id for h in hits]
        free_hits = {h for h in hit_ids if self.ref[h] == 0 and h in self.free}
        if n > len(self.free) - len(free_hits):
            before = self.pool.snapshot()
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate_for(n, stream, hits=hits)
            assert self.pool.snapshot() == before
            return
        new, fence = self.pool.allocate_for(n, stream, hits=hits)
        new_ids = [b.block_id for b in new]
        assert set(new_ids) <= self.free and len(set(new_ids)) == n
        self.judge_and_wait(fence, [(hit_ids, READ), (new_ids, WRITE)], stream)
        for h in hit_ids:
            if self.ref[h] == 0:
                self.free.discard(h)
                self.held.discard(h)
            self.ref[h] += 1
        for b in new_ids:
            self.free.discard(b)
            self.ref[b] = 1
            self.keys.pop(b, None)
            self.invalid.discard(b)
            self.retired.pop(b, None)
            self.fresh.add(b)
            self.announced.discard(b)
        if hit_ids or new_ids:
            self.requests.append(hit_ids + new_ids)

    @precondition(lambda self: self.requests)
    @rule(
        data=st.data(),
        which_token=st.sampled_from(["none", "last", "any"]),
        dup=st.booleans(),
        write=st.booleans(),
    )
    def free_request(self, data: st.DataObject, which_token: str, dup: bool, write: bool) -> None:
        i = data.draw(st.integers(0, len(self.requests) - 1))
        req = self.requests[i]
        listed = list(reversed(req)) + ([req[0]] if dup else [])
        token = None
        if which_token == "last":
            token = self.pool.last_token("compute")
        elif which_token == "any" and self.tokens:
            token = data.draw(st.sampled_from(self.tokens))
        access = WRITE if write else READ
        counts = {b: listed.count(b) for b in listed}
        if any(c > self.ref[b] for b, c in counts.items()):
            before = self.pool.snapshot()
            with pytest.raises(RefCountError):
                self.pool.free_blocks(self.blocks(listed), token=token, access=access)
            assert self.pool.snapshot() == before
            return
        if access is WRITE:
            # A last step that writes the blocks it frees: it waited on
            # their fence, then was issued.
            fence = self.pool.fence_for(self.blocks(listed), "compute", WRITE)
            self.judge_and_wait(fence, [(listed, WRITE)], "compute")
            token = self.pool.issue("compute")
            self.hb.issue(token)
            self.tokens.append(token)
            self.kinds[token] = "free-write"
        self.pool.free_blocks(self.blocks(listed), token=token, access=access)
        if token is not None:
            self.hb.tag(listed, token, access)
            if access is WRITE:
                self.invalid -= set(listed)
                self.written(listed)
                self.loads.setdefault(token, []).extend(listed)
        for b, c in counts.items():
            self.ref[b] -= c
            if self.ref[b] == 0:
                (self.held if self.hb.pending_host(b) else self.free).add(b)
        if dup:
            # the request's extra reference was another holder's: drop it from any other request
            for other in self.requests:
                if other is not req and req[0] in other:
                    other.remove(req[0])
                    break
        del self.requests[i]
        self.requests = [r for r in self.requests if r and all(self.ref[b] > 0 for b in r)]

    @rule(write=st.booleans(), data=st.data())
    def step(self, write: bool, data: st.DataObject) -> None:
        if write and self.requests:
            req = data.draw(st.sampled_from(self.requests))
            target = [req[-1]]
            fence = self.pool.fence_for(self.blocks(target), "compute", WRITE)
            self.judge_and_wait(fence, [(target, WRITE)], "compute")
        token = self.pool.issue("compute")
        self.hb.issue(token)
        self.tokens.append(token)
        if write and self.requests:
            self.pool.tag(self.blocks(target), token, WRITE)
            self.hb.tag(target, token, WRITE)
            self.invalid -= set(target)
            self.written(target)
            self.loads.setdefault(token, []).extend(target)
            self.kinds[token] = "tag-write"

    @rule(data=st.data())
    def rewrite(self, data: st.DataObject) -> None:
        """A write recorded again by the token that is still the block's
        writer (a second KV cache group, a repeated tag), after accesses
        that waited on it may have read the block: those stay waited on."""
        pool = self.pool
        pairs = [
            (b.block_id, b.writer)
            for b in pool.blocks[1:]
            if b.writer is not None
            and self.ref[b.block_id] > 0
            and b.block_id not in self.invalid
            and not pool.tracker.is_ended(b.writer)
        ]
        if not pairs:
            return
        bid, token = data.draw(st.sampled_from(pairs))
        event("rewrite")
        pool.tag([pool.blocks[bid]], token, WRITE)
        self.hb.tag([bid], token, WRITE)
        self.written([bid])
        self.loads.setdefault(token, []).append(bid)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), stream=st.sampled_from(["h2d", "rdma"]))
    def load(self, data: st.DataObject, stream: str) -> None:
        req = data.draw(st.sampled_from(self.requests))
        self.begin("load", [(list(req), WRITE)], stream)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), stream=st.sampled_from(["d2h", "rdma"]))
    def store(self, data: st.DataObject, stream: str) -> None:
        req = data.draw(st.sampled_from(self.requests))
        self.begin("store", [(list(req), READ)], stream)

    @precondition(lambda self: len(self.requests) >= 2)
    @rule(data=st.data())
    def copy_on_write(self, data: st.DataObject) -> None:
        a, b = data.draw(st.lists(st.sampled_from(self.requests), min_size=2, max_size=2, unique_by=id))
        src, dst = a[0], b[-1]
        if src == dst:
            return
        self.begin("copy", [([src], READ), ([dst], WRITE)], "compute")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), failed=st.booleans())
    def complete(self, data: st.DataObject, failed: bool) -> None:
        token = data.draw(st.sampled_from(self.tokens))
        already = token in self.hb.known_ended()
        failed_before = token in self.hb.failed  # a repeated failure report changes nothing
        if failed:
            event(f"fail {self.kinds.get(token, 'step')}{' (late)' if already else ''}")
        elif not already:
            event("complete")
        # the content each block holds before the report (failed writes undone)
        in_effect = {b: self.hb.write_in_effect(b) for b in self.loads.get(token, ())}
        (self.pool.fail if failed else self.pool.complete)(token)
        self.hb.report(token, failed)
        if failed and not failed_before:
            # A failure withdraws the keys of every block whose write in
            # effect is the token's, also when reported late (after the
            # token ended through another token's completion).
            for b, t in in_effect.items():
                if t == token:
                    self.invalid.add(b)
                    self.keys.pop(b, None)
        self.settle()

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), reuse=st.booleans(), partial=st.booleans())
    def cache(self, data: st.DataObject, reuse: bool, partial: bool) -> None:
        req = data.draw(st.sampled_from(self.requests))
        b = data.draw(st.sampled_from(req))
        keys = self.cached_keys()
        if reuse and keys:
            key = data.draw(st.sampled_from(keys))
        else:
            key = f"k{self.next_key}"
            self.next_key += 1
        held_keys = self.keys.get(b, [])
        block = self.pool.blocks[b]
        if partial:
            self.pool.cache_partial_block(block, key, 8)
            if b not in self.invalid and key not in held_keys and key not in self.retired.get(b, ()):
                self.keys[b] = [*held_keys, key]
                self.published(b)
        elif not held_keys or (block.block_hash_num_tokens == 8 and key != block.block_hash):
            # publish, or promote a partial block to full (its other keys go)
            self.pool.cache_full_blocks([block], [key], 0, 1, block_size=16)
            if b not in self.invalid:
                if held_keys:  # promoted: the partial keys are retired for b
                    self.retired.setdefault(b, set()).update(held_keys)
                self.keys[b] = [key]
                self.published(b)

    @rule()
    def poll(self) -> None:
        self.settle()

    # -- invariants ------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check()
        assert [b.ref_cnt for b in pool.blocks] == self.ref
        assert {b.block_id for b in pool.free_block_queue} == self.free
        assert set(pool.held_block_ids()) == self.held
        assert pool.get_num_free_blocks() == len(self.free)
        for b in range(1, NUM_BLOCKS):
            assert sorted(pool.prefix_cache.keys_of(pool.blocks[b])) == sorted(self.keys.get(b, [])), b


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    # CI replays the same examples on every run; local runs explore anew.
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class _DroppingPool(HazardAwareBlockPool):
    """Negative control: hands out fences with their first token dropped."""

    def _fence(self, groups, st):  # type: ignore[no-untyped-def]
        fence = super()._fence(groups, st)
        return Fence(fence.tokens[1:], fence.needs_host_wait) if len(fence) else EMPTY_FENCE


class DroppingMachine(PoolMachine):
    pool_cls = _DroppingPool


def run_negative_control(
    machine: type[PoolMachine], match: str, exc: type[Exception] = AssertionError
) -> None:
    """Run ``machine`` until the judge (or the pool, with ``exc``) fails;
    the failure must match."""
    run = machine.TestCase("runTest")
    run.settings = settings(
        max_examples=200,
        stateful_step_count=50,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],  # the first failure is enough: no shrinking
    )
    with pytest.raises(exc, match=match):
        run.runTest()


def test_negative_control_dropped_fence_token_is_caught() -> None:
    run_negative_control(DroppingMachine, "missed hazard|needs_host_wait")


class _PaddingPool(HazardAwareBlockPool):
    """Negative control: pads every non-empty fence with the stream's first
    token (ended or covered more often than not): a redundant wait."""

    def _fence(self, groups, st):  # type: ignore[no-untyped-def]
        fence = super()._fence(groups, st)
        if not fence:
            return fence
        first = Token("compute", 1)
        if first in fence.tokens or self.tracker.streams["compute"].last_seq < 1:
            return fence
        return Fence((*fence.tokens, first), fence.needs_host_wait)


class PaddingMachine(PoolMachine):
    pool_cls = _PaddingPool


def test_negative_control_padded_fence_is_caught_as_redundant() -> None:
    run_negative_control(PaddingMachine, "redundant wait")


class _NoFillPool(HazardAwareBlockPool):
    """Negative control: the fill rule reverted (every load into a shared
    published block refused, as for a copy)."""

    def _check_exclusive(self, blocks, what, fill=False):  # type: ignore[no-untyped-def]
        super()._check_exclusive(blocks, what, False)


class NoFillMachine(PoolMachine):
    pool_cls = _NoFillPool


def test_negative_control_a_refused_fill_is_caught() -> None:
    run_negative_control(NoFillMachine, "is a cached block held by", SharedBlockError)
