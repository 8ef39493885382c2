"""A load that spans KV cache groups is withdrawn as a whole: ``link_loads``
(``blockpool/core/load_groups.py``).

On a hybrid model (full attention + sliding window + Mamba) a request's
load is one transfer per KV cache group. When one group's part fails, the
prefix the other parts' keys name is not there: every group's keys of that
load go, not only the failed part's, and no other request's. Fences, holds
and the other parts' token status do not change (their transfers still
write). The model-based test at the end runs the stateful machine of
``tests/test_stateful.py`` (every fence judged by ``tests/hb_model.py``,
failures on, late ones included) with links between random loads.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from blockpool import HazardAwareBlockPool, StreamKind, Token, TokenStatus
from blockpool.core.errors import (
    BlockPoolError,
    ForeignTokenError,
    InvalidArgumentError,
    InvalidContentError,
    UnknownStreamError,
    UnknownTokenError,
)
from blockpool.core.hazards import AccessKind
from tests import test_stateful
from tests.conftest import make_pool, toks
from tests.test_stateful import PoolMachine

R, W = AccessKind.READ, AccessKind.WRITE
GROUPS = ("full", "window", "mamba")


def hybrid_request(
    pool: HazardAwareBlockPool, stream: str, name: str, n: int = 2
) -> tuple[dict[str, list], dict[str, Token]]:
    """One request's blocks in each KV cache group, loaded as one transfer
    per group (linked), each group's blocks published under its keys as
    vLLM does once the load is under way."""
    blocks = {g: pool.get_new_blocks(n) for g in GROUPS}
    loads = {g: pool.begin_load(blocks[g], stream)[0] for g in GROUPS}
    pool.link_loads(list(loads.values()))
    for g in GROUPS:
        pool.cache_full_blocks(blocks[g], [f"{name}-{g}-{i}" for i in range(n)], 0, n, 16)
    return blocks, loads


def published(pool: HazardAwareBlockPool, name: str, n: int = 2) -> dict[str, int]:
    """Keys of request ``name`` still published, per group."""
    return {g: sum(pool.get_cached_block(f"{name}-{g}-{i}") is not None for i in range(n)) for g in GROUPS}


# -- the field case ---------------------------------------------------------------


@pytest.mark.parametrize("stream", ["rdma", "h2d"])
def test_failed_load_on_a_hybrid_model_withdraws_every_groups_prefix(stream: str) -> None:
    pool = make_pool(16)
    blocks, loads = hybrid_request(pool, stream, "a")
    hybrid_request(pool, stream, "b", n=1)
    pool.take_events()
    pool.fail(loads["window"])  # the sliding-window group's part failed
    pool.poll()
    assert published(pool, "a") == dict.fromkeys(GROUPS, 0)
    assert published(pool, "b", n=1) == dict.fromkeys(GROUPS, 1)  # another request's load keeps its keys
    removed = pool.take_events()
    assert {e.block_hashes[0] for e in removed} == {f"a-{g}-{i}" for g in GROUPS for i in range(2)}
    assert {e.reason for e in removed} == {"load_failed"}
    every = sorted(b.block_id for g in GROUPS for b in blocks[g])
    assert pool.invalid_block_ids(loads["window"]) == every
    # not published again until rewritten, and not carried to another tier
    pool.cache_full_blocks(blocks["full"], ["a-full-0", "a-full-1"], 0, 2, 16)
    assert published(pool, "a")["full"] == 0
    with pytest.raises(InvalidContentError):
        pool.begin_store(blocks["mamba"], "d2h")
    pool.check()


def test_the_other_parts_keep_their_status_shadows_and_holds() -> None:
    pool = make_pool(16)
    blocks, loads = hybrid_request(pool, "rdma", "a")
    pool.fail(loads["mamba"])
    assert pool.token_status(loads["full"]) is TokenStatus.PENDING
    assert pool.token_status(loads["window"]) is TokenStatus.PENDING
    # the full-attention part is still writing: a reader waits on it, and its freed blocks stay held
    assert toks(pool.fence_for(blocks["full"], "compute", R)) == {str(loads["full"])}
    pool.free_blocks(blocks["full"])
    assert set(pool.held_block_ids()) >= {b.block_id for b in blocks["full"]}
    pool.complete(loads["full"])
    pool.poll()
    assert not set(pool.held_block_ids()) & {b.block_id for b in blocks["full"]}
    pool.check()


def test_a_rewritten_block_is_published_again() -> None:
    pool = make_pool(16)
    blocks, loads = hybrid_request(pool, "h2d", "a")
    pool.fail(loads["full"])
    step = pool.issue("compute")  # the recompute writes the window group's first block
    pool.tag(blocks["window"][:1], step, W)
    pool.cache_full_blocks(blocks["window"][:1], ["a-window-0"], 0, 1, 16)
    assert pool.get_cached_block("a-window-0") is blocks["window"][0]
    assert pool.get_cached_block("a-window-1") is None


# -- late failures, failures before the link, abandon --------------------------------


def test_a_late_failure_of_one_part_withdraws_every_parts_keys_but_not_blocks_rewritten_since() -> None:
    pool = make_pool(16)
    blocks, loads = hybrid_request(pool, "rdma", "a")
    for t in loads.values():
        pool.complete(t)
    step = pool.issue("compute")
    pool.tag(blocks["full"][1:], step, W)  # rewritten since: its key names the step's content
    pool.complete(step)
    pool.fail(loads["window"])  # the connector found the window part's data bad later
    pool.poll()
    assert pool.token_status(loads["window"]) is TokenStatus.FAILED
    assert pool.token_status(loads["full"]) is TokenStatus.COMPLETED
    assert published(pool, "a") == {"full": 1, "window": 0, "mamba": 0}
    assert pool.get_cached_block("a-full-1") is blocks["full"][1]
    pool.check()


def test_a_failure_applied_before_the_link_withdraws_the_parts_linked_after_it() -> None:
    pool = make_pool(16)
    full, window = pool.get_new_blocks(2), pool.get_new_blocks(2)
    t_full, _ = pool.begin_load(full, "rdma")
    t_window, _ = pool.begin_load(window, "rdma")
    pool.cache_full_blocks(full, ["f0", "f1"], 0, 2, 16)
    pool.fail(t_window)
    pool.poll()
    assert pool.get_cached_block("f0") is full[0]  # not linked yet
    pool.link_loads([t_full, t_window])
    assert pool.get_cached_block("f0") is None and pool.get_cached_block("f1") is None
    pool.check()


def test_abandoning_one_part_withdraws_the_others_keys() -> None:
    pool = make_pool(16)
    _, loads = hybrid_request(pool, "rdma", "a")
    pool.abandon(loads["full"])
    assert published(pool, "a") == dict.fromkeys(GROUPS, 0)
    assert pool.token_status(loads["mamba"]) is TokenStatus.PENDING


def test_unlinked_loads_of_one_request_are_withdrawn_one_by_one() -> None:
    pool = make_pool(16)
    full, window = pool.get_new_blocks(1), pool.get_new_blocks(1)
    t_full, _ = pool.begin_load(full, "rdma")
    t_window, _ = pool.begin_load(window, "rdma")
    pool.cache_full_blocks(full, ["f"], 0, 1, 16)
    pool.cache_full_blocks(window, ["w"], 0, 1, 16)
    pool.fail(t_window)
    pool.poll()
    assert pool.get_cached_block("w") is None
    assert pool.get_cached_block("f") is full[0]
    assert pool.linked_loads(t_full) == [t_full]


# -- the links -----------------------------------------------------------------------


def test_links_add_up_into_one_load() -> None:
    pool = make_pool(16)
    a, b, c, d = (pool.begin_load(pool.get_new_blocks(1), "rdma")[0] for _ in range(4))
    pool.link_loads([a, b])
    pool.link_loads([c, d])
    assert pool.linked_loads(d) == [c, d]
    pool.link_loads([d, b])
    assert pool.linked_loads(a) == pool.linked_loads(c)
    assert sorted(t.seq for t in pool.linked_loads(a)) == [1, 2, 3, 4]
    pool.link_loads([a, a])  # linking again changes nothing
    assert pool.linked_loads(b) == pool.linked_loads(c)
    assert len(pool.linked_loads(b)) == 4


def test_links_are_forgotten_once_nothing_is_left_to_withdraw() -> None:
    pool = make_pool(8)
    # the first load's block keeps it as its write in effect: its link is kept
    (kept,) = pool.get_new_blocks(1)
    first, _ = pool.begin_load([kept], "h2d")
    partner = pool.issue("h2d")
    pool.link_loads([first, partner])
    pool.complete(partner)
    for _ in range(200):  # links whose tokens ended and wrote nothing that is still theirs
        t = pool.issue("rdma")
        pool.complete(t)
        pool.link_loads([t, pool.issue("rdma")])
        pool.complete(pool.last_token("rdma"))
    assert len(pool.load_groups) <= 2 * pool.load_groups.MIN_PRUNE
    assert pool.linked_loads(first) == [first, partner]
    t = pool.issue("rdma")
    assert pool.linked_loads(t) == [t]


def test_check_catches_a_link_that_names_a_token_never_issued() -> None:
    from blockpool import InvariantError

    pool = make_pool(16)
    _, loads = hybrid_request(pool, "rdma", "a")
    pool.check()
    pool.load_groups.link([loads["full"], Token("rdma", 99, StreamKind.HOST)])  # behind the pool's back
    with pytest.raises(InvariantError, match="never issued"):
        pool.check()


# -- bad input -----------------------------------------------------------------------


def _bad_calls(pool: HazardAwareBlockPool, mine: Token) -> list[tuple[object, type[BlockPoolError]]]:
    other = make_pool()
    theirs = other.begin_load(other.get_new_blocks(1), "rdma")[0]
    return [
        ([], InvalidArgumentError),
        (None, InvalidArgumentError),
        ([mine, "rdma:1"], InvalidArgumentError),
        ([mine, Token("rdma", 1, StreamKind.DEVICE)], InvalidArgumentError),
        ([mine, Token("rdma", 99, StreamKind.HOST)], UnknownTokenError),
        ([mine, Token("nvme", 1)], UnknownStreamError),
        ([mine, Token("rdma", 1, StreamKind.HOST, theirs.pool)], ForeignTokenError),
    ]


def test_bad_tokens_are_refused_with_a_typed_error_and_change_nothing() -> None:
    pool = make_pool(16)
    _, loads = hybrid_request(pool, "rdma", "a")
    t_new, _ = pool.begin_load(pool.get_new_blocks(1), "rdma")
    pool.poll()
    before = pool.snapshot()
    for arg, error in _bad_calls(pool, t_new):
        with pytest.raises(error):
            pool.link_loads(arg)  # type: ignore[arg-type]
        assert issubclass(error, BlockPoolError)
        assert pool.snapshot() == before
        assert pool.linked_loads(t_new) == [t_new]
        assert pool.linked_loads(loads["full"]) == list(loads.values())
    with pytest.raises(ForeignTokenError):
        pool.linked_loads(Token("rdma", 1, StreamKind.HOST, make_pool().pool_id))
    # the refused call linked nothing: a failure of the new load withdraws nothing else
    pool.fail(t_new)
    pool.poll()
    assert published(pool, "a") == dict.fromkeys(GROUPS, 2)


# -- model-based: fences stay exact, keys follow the links ------------------------------


class LinkedLoadsMachine(PoolMachine):
    """:class:`PoolMachine` with links between random loads: a failure
    withdraws the keys of every block whose write in effect is a token
    linked with the failed one (the reference model below), and every
    fence is still judged exact by the happens-before model."""

    def model_links(self) -> dict[Token, list[Token]]:
        if not hasattr(self, "links"):
            self.links: dict[Token, list[Token]] = {}
        return self.links

    def withdraw_linked(self, failed: Token) -> None:
        for u in self.model_links().get(failed, ()):
            if u == failed:
                continue
            for b in self.loads.get(u, ()):
                if self.hb.write_in_effect(b) == u:
                    self.invalid.add(b)
                    self.keys.pop(b, None)

    @precondition(lambda self: any(k == "load" for k in self.kinds.values()))
    @rule(data=st.data())
    def link(self, data: st.DataObject) -> None:
        loads = [t for t, k in self.kinds.items() if k == "load"]
        chosen = data.draw(st.lists(st.sampled_from(loads), min_size=1, max_size=3, unique=True))
        self.pool.link_loads(chosen)
        links = self.model_links()
        group: list[Token] = []
        for t in chosen:
            for u in links.get(t, [t]):
                if u not in group:
                    group.append(u)
        for u in group:
            links[u] = group
        order = self.pool.linked_loads(chosen[0])
        assert sorted(map(str, order)) == sorted(map(str, group))
        failed = [u for u in order if self.pool.token_status(u) is TokenStatus.FAILED]
        if failed:
            event("link to a failed load")
            self.withdraw_linked(failed[0])
        self.settle()

    @precondition(lambda self: any(len(g) > 1 for g in self.model_links().values()))
    @rule(data=st.data())
    def fail_linked(self, data: st.DataObject) -> None:
        """A part of a linked load fails (on time, late or again)."""
        linked = sorted((t for t, g in self.model_links().items() if len(g) > 1), key=str)
        self.report(data.draw(st.sampled_from(linked)), True)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), failed=st.booleans())
    def complete(self, data: st.DataObject, failed: bool) -> None:
        self.report(data.draw(st.sampled_from(self.tokens)), failed)

    def report(self, token: Token, failed: bool) -> None:
        """The parent's ``complete`` rule for ``token``, then the links' withdrawal."""
        failed_before = token in self.hb.failed  # a repeated report of a failure on time
        late = token in self.hb.known_ended()
        in_effect = {b: self.hb.write_in_effect(b) for b in self.loads.get(token, ())}
        (self.pool.fail if failed else self.pool.complete)(token)
        self.hb.report(token, failed)
        if failed:
            if not failed_before:  # the parent's rule: the token's own blocks
                for b, t in in_effect.items():
                    if t == token:
                        self.invalid.add(b)
                        self.keys.pop(b, None)
            if len(self.model_links().get(token, ())) > 1:
                event(f"failure of a linked load{' (late)' if late else ''}")
            self.withdraw_linked(token)  # every failure report, late or repeated
        self.settle()


TestLinkedLoadsMachine = LinkedLoadsMachine.TestCase
TestLinkedLoadsMachine.settings = test_stateful.TestPoolMachine.settings


class _UnlinkedPool(HazardAwareBlockPool):
    """Negative control: forgets every link (a failure withdraws its own keys only)."""

    def _withdraw_linked(self, token: Token) -> None:
        pass


class UnlinkedMachine(LinkedLoadsMachine):
    pool_cls = _UnlinkedPool


def test_negative_control_a_pool_that_ignores_links_is_caught() -> None:
    run = UnlinkedMachine.TestCase("runTest")
    run.settings = settings(
        max_examples=200,
        stateful_step_count=50,
        deadline=None,
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        phases=[Phase.generate],  # the first failure is enough: no shrinking
        suppress_health_check=list(HealthCheck),
    )
    # a sibling's key the model withdrew is still published, or a store of
    # its content the model refuses is accepted
    with pytest.raises(
        (AssertionError, pytest.fail.Exception), match=r"assert \[|DID NOT RAISE InvalidContentError"
    ):
        run.runTest()
