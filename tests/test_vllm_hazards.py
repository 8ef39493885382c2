"""Scheduler-side hazard wiring (blockpool.integrations.vllm.hazards), with
fakes for vLLM's SchedulerOutput and KVConnectorOutput: no vLLM needed."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from blockpool import HazardAwareBlockPool, StreamKind, Token
from blockpool.core.errors import UnknownStreamError
from blockpool.integrations.vllm import hazards as vh
from blockpool.integrations.vllm.hazards import StepHazards, StepRecord, Transfer
from tests.conftest import ids, toks


class Out:
    """Stands for vLLM's SchedulerOutput (only the fields the wiring reads)."""

    def __init__(self, tokens: int = 16) -> None:
        self.total_num_scheduled_tokens = tokens
        self.new_block_ids_to_zero: list[int] | None = None
        self.kv_connector_block_state: BlockState | None = None  # no connector: no step writes to tag
        self.num_scheduled_tokens: dict[str, int] = {}


class ConnOut:
    """Stands for vLLM's KVConnectorOutput."""

    def __init__(self, **kw: object) -> None:
        self.finished_sending = kw.get("finished_sending")
        self.finished_recving = kw.get("finished_recving")
        self.failed_recving = kw.get("failed_recving", set())
        self.invalid_block_ids = kw.get("invalid_block_ids", set())


def make() -> tuple[HazardAwareBlockPool, StepHazards]:
    pool = HazardAwareBlockPool(16, enable_kv_cache_events=True)
    hz = StepHazards(pool)
    hz.add_stream("h2d", StreamKind.DEVICE)
    hz.add_stream("nixl", StreamKind.HOST)
    hz.add_stream("d2h", StreamKind.DEVICE)
    return pool, hz


def test_each_non_empty_step_issues_one_forward_token() -> None:
    _, hz = make()
    r1, r2 = hz.step_record(Out()), hz.step_record(Out())
    assert (str(r1.forward), str(r2.forward)) == ("compute:1", "compute:2")
    assert (r1.index, r2.index) == (1, 2)


def test_empty_step_issues_nothing() -> None:
    _, hz = make()
    assert hz.step_record(Out(tokens=0)) is None
    assert hz.free_token() is None


def test_step_record_is_idempotent_per_output() -> None:
    _, hz = make()
    out = Out()
    assert hz.step_record(out) is hz.step_record(out)
    assert hz.steps_issued == 1


def test_free_is_tagged_with_last_enqueued_step_under_async_scheduling() -> None:
    pool, hz = make()
    blocks = pool.get_new_blocks(2)
    s1 = Out()
    hz.step_record(s1)
    hz.step_record(Out())  # step 2 enqueued before step 1's output arrives
    hz.end_step(s1)
    pool.free_blocks(blocks, token=hz.free_token())
    assert toks(pool.fence_for(blocks, "h2d")) == {"compute:2"}


def test_step_output_ends_its_forward_token_and_earlier_ones() -> None:
    pool, hz = make()
    s1, s2 = Out(), Out()
    r1, r2 = hz.step_record(s1), hz.step_record(s2)
    assert hz.end_step(s2) is r2
    assert pool.is_ended(r1.forward) and pool.is_ended(r2.forward)
    assert hz.outstanding_steps() == []


def test_output_never_scheduled_ends_nothing() -> None:
    pool, hz = make()
    r = hz.step_record(Out())
    assert hz.end_step(Out()) is None
    assert not pool.is_ended(r.forward)


def test_outstanding_records_are_bounded() -> None:
    pool = HazardAwareBlockPool(4)
    hz = StepHazards(pool, max_outstanding=3)
    outs = [Out() for _ in range(5)]
    for o in outs:
        hz.step_record(o)
    assert [r.index for r in hz.outstanding_steps()] == [3, 4, 5]


def test_block_copies_are_a_read_of_src_and_write_of_dst_before_the_step() -> None:
    pool, hz = make()
    src, dst = pool.get_new_blocks(2)
    load = hz.begin_load("r", [src], "h2d")
    token, fence = hz.begin_copies([(src, dst)])
    assert toks(fence) == {str(load.token)}  # RAW on the source
    record = hz.step_record(Out())
    assert record.copies == token and record.copy_fence == fence
    assert token.seq < record.forward.seq


def test_copies_of_foreign_null_or_free_blocks_are_skipped() -> None:
    pool, hz = make()
    other = HazardAwareBlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    assert hz.begin_copies([(a, other.get_new_blocks(1)[0]), (pool.null_block, a), (a, b)]) is None
    assert hz.copy_pairs_skipped == 3


def test_load_into_blocks_freed_by_a_running_step_waits_for_it() -> None:
    pool, hz = make()
    blocks = pool.get_new_blocks(3)
    hz.step_record(Out())
    pool.free_blocks(blocks, token=hz.free_token())
    again = pool.get_new_blocks(3)
    assert ids(again) == ids(blocks)
    t = hz.begin_load("req", again, "nixl")
    assert toks(t.fence) == {"compute:1"} and t.fence.needs_host_wait


def test_finished_recving_ends_the_requests_loads() -> None:
    pool, hz = make()
    t = hz.begin_load("req", pool.get_new_blocks(1), "nixl")
    assert hz.on_connector_output(ConnOut(finished_recving={"req"})) == 1
    assert pool.is_ended(t.token) and hz.pending_transfers() == []


def test_finished_sending_ends_the_requests_stores() -> None:
    pool, hz = make()
    t = hz.begin_store("req", pool.get_new_blocks(1), "d2h")
    hz.on_connector_output(ConnOut(finished_sending={"other"}))
    assert not pool.is_ended(t.token)
    hz.on_connector_output(ConnOut(finished_sending={"req"}))
    assert pool.is_ended(t.token)


def test_failed_recving_fails_the_load_and_unpublishes_its_blocks() -> None:
    pool, hz = make()
    (b,) = pool.get_new_blocks(1)
    hz.begin_load("req", [b], "nixl")
    pool.cache_full_blocks([b], ["k"], 0, 1, block_size=16)
    hz.on_connector_output(ConnOut(failed_recving={"req"}, finished_recving={"req"}))
    pool.poll()
    assert pool.get_cached_block("k") is None
    assert pool.stats().failed_tokens == 1


def test_invalid_block_ids_fail_the_loads_that_wrote_them() -> None:
    pool, hz = make()
    a, b = pool.get_new_blocks(2)
    bad = hz.begin_load("r1", [a], "nixl")
    good = hz.begin_load("r2", [b], "nixl")
    hz.end_transfers(invalid_block_ids={a.block_id})
    pool.poll()
    assert pool.is_ended(bad.token) and not pool.is_ended(good.token)
    assert pool.stats().failed_tokens == 1


def test_none_connector_output_ends_nothing() -> None:
    _, hz = make()
    assert hz.on_connector_output(None) == 0


def test_load_on_unknown_stream_raises() -> None:
    pool, hz = make()
    with pytest.raises(UnknownStreamError):
        hz.begin_load("r", pool.get_new_blocks(1), "mooncake")


def test_transfer_round_trips_through_pickle_and_json_wire_form() -> None:
    pool, hz = make()
    hz.step_record(Out())
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks, token=hz.free_token())
    t = hz.begin_load("r", pool.get_new_blocks(2), "nixl")
    assert pickle.loads(pickle.dumps(t)) == t
    assert Transfer.from_wire(json.loads(json.dumps(t.to_wire()))) == t


def test_step_record_round_trips_through_wire_form() -> None:
    pool, hz = make()
    a, b = pool.get_new_blocks(2)
    hz.begin_load("r", [a], "h2d")
    hz.begin_copies([(a, b)])
    r = hz.step_record(Out())
    assert StepRecord.from_wire(json.loads(json.dumps(r.to_wire()))) == r
    assert pickle.loads(pickle.dumps(r)) == r


def test_wire_form_is_msgspec_encodable() -> None:
    msgspec = pytest.importorskip("msgspec")
    pool, hz = make()
    t = hz.begin_store("r", pool.get_new_blocks(1), "d2h")
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(t.to_wire()))
    assert Transfer.from_wire(data) == t
    assert Token.from_wire(msgspec.json.decode(msgspec.json.encode(t.token.to_wire()))) == t.token


class BlockState:
    """Stands for vLLM's KVConnectorBlockState (current block tables)."""

    def __init__(self, tables: dict[str, tuple[list[int], ...]]) -> None:
        self.tables = tables
        self.req_ids = set(tables)
        self.resolve_block_ids = tables.get  # not vLLM's KVCacheManager.get_block_ids: the ids are read

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return self.tables.get(req_id)


class StepOut(Out):
    """A SchedulerOutput with the fields step-write tagging reads."""

    def __init__(
        self, scheduled: dict[str, int], computed: dict[str, int], tables: dict[str, tuple[list[int], ...]]
    ) -> None:
        super().__init__(sum(scheduled.values()))
        self.num_scheduled_tokens = scheduled
        self.scheduled_new_reqs = []
        self.scheduled_cached_reqs = type(
            "Cached", (), {"req_ids": list(computed), "num_computed_tokens": list(computed.values())}
        )()
        self.kv_connector_block_state = BlockState(tables)


def test_step_writes_make_a_store_of_those_blocks_wait_on_that_step() -> None:
    pool, hz = make()
    blocks = pool.get_new_blocks(4)
    table = ([b.block_id for b in blocks],)
    out = StepOut({"r": 20}, {"r": 40}, {"r": table})  # tokens 40..59: blocks 2 and 3 (16-token blocks)
    assert hz.tag_step_writes(out, 16).tokens == ()
    e1 = hz.step_record(out).forward
    assert toks(hz.begin_store("r", blocks[2:], "d2h").fence) == {str(e1)}
    assert hz.begin_store("r", blocks[:2], "d2h").fence.tokens == ()  # written before this step


def test_step_writes_are_tagged_once_per_step_and_return_the_same_fence() -> None:
    pool, hz = make()
    blocks = pool.get_new_blocks(2)
    store = hz.begin_store("r", blocks, "nixl")  # a host engine still reads both blocks
    out = StepOut({"r": 8}, {"r": 20}, {"r": ([b.block_id for b in blocks],)})
    first = hz.tag_step_writes(out, 16)
    assert first.tokens == (store.token,) and first.needs_host_wait
    assert hz.tag_step_writes(out, 16) == first  # a second connector of the same step
    # A later write waits on the forward, which the worker ordered after the store.
    assert toks(pool.fence_for(blocks[1:], "h2d")) == {str(hz.step_record(out).forward)}


def test_step_without_a_block_state_tags_nothing() -> None:
    pool, hz = make()
    blocks = pool.get_new_blocks(1)
    assert hz.tag_step_writes(Out(), 16).tokens == ()
    assert hz.begin_store("r", blocks, "d2h").fence.tokens == ()


def test_blocks_of_leaves_out_null_foreign_and_free_ids() -> None:
    pool, hz = make()
    used = pool.get_new_blocks(2)
    free_id = next(i for i in range(1, 16) if i not in ids(used))
    assert ids(hz.blocks_of([0, used[0].block_id, free_id, 99, used[1].block_id, "x"])) == ids(used)  # type: ignore[list-item]
    assert hz.transfer_blocks_skipped == 4


def test_finish_ends_every_transfer_under_a_job_key() -> None:
    pool, hz = make()
    (a, b) = pool.get_new_blocks(2)
    load = hz.begin_load("req", [a], "h2d", key=("job", 1))
    store = hz.begin_store("req", [b], "d2h", key=("job", 1))
    other = hz.begin_store("req", [a], "d2h", key=("job", 2))
    assert hz.finish(("job", 1)) == 2
    assert pool.is_ended(load.token) and pool.is_ended(store.token) and not pool.is_ended(other.token)
    assert hz.finish(("job", 1)) == 0
    assert (hz.transfers_begun, hz.fences_nonempty) == (3, 1)


def test_finish_failed_fails_the_load_and_drops_its_keys() -> None:
    pool, hz = make()
    (b,) = pool.get_new_blocks(1)
    hz.begin_load("req", [b], "h2d", key=("job", 7))
    pool.cache_full_blocks([b], ["k"], 0, 1, block_size=16)
    hz.finish(("job", 7), failed=True)
    pool.poll()
    assert pool.get_cached_block("k") is None


def test_step_writes_use_each_groups_block_size() -> None:
    pool, hz = make()
    small = pool.get_new_blocks(4)  # 16-token blocks
    large = pool.get_new_blocks(2)  # 64-token blocks: 40 computed tokens end inside the first
    out = StepOut({"r": 8}, {"r": 40}, {"r": ([b.block_id for b in small], [b.block_id for b in large])})
    hz.tag_step_writes(out, (16, 64))
    e1 = hz.step_record(out).forward
    # Each on its own stream: a stream that waited on e1 once is ordered after it.
    assert toks(hz.begin_store("r", large[:1], "d2h").fence) == {str(e1)}
    assert toks(hz.begin_store("r", small[2:3], "h2d").fence) == {str(e1)}
    assert hz.begin_store("r", small[1:2], "nixl").fence.tokens == ()


def test_live_table_tails_match_the_ids_read_per_group_and_skip_what_blocks_of_skips() -> None:
    pool, hz = make()
    small = pool.get_new_blocks(4)  # group 0: 16-token blocks
    large = pool.get_new_blocks(2)  # group 1: 64-token blocks
    other = HazardAwareBlockPool(16).get_new_blocks(1)[0]  # another pool's block, same id range
    (freed,) = pool.get_new_blocks(1)
    pool.free_blocks([freed])  # ref count 0
    tables = (
        {"r": [pool.null_block, *small, other, freed], "gone": small[:1], "idle": small[1:2]},
        {"r": large},
    )
    computed = iter([("r", 40), ("gone", 0), ("idle", 0), ("new", 0)])  # read once
    got = hz._tail_blocks(computed, {"r": 8, "gone": 1, "new": 4}, {"r", "idle", "new"}, tables, (16, 64))
    # r: group 0 from index 40 // 16 = 2 (small[1:], then other and freed skipped), group 1 from 0;
    # "gone" is not in the block state, "idle" not scheduled, "new" has no table yet.
    assert [b.block_id for b in got] == [b.block_id for b in (*small[1:], *large)]
    assert all(b is pool.blocks[b.block_id] for b in got)
    assert hz.transfer_blocks_skipped == 2
    # one int: every group's block size; the null block at index 0 is skipped
    got = hz._tail_blocks([("r", 0)], {"r": 8}, {"r"}, tables[:1], 16)
    assert [b.block_id for b in got] == [b.block_id for b in small]
    assert hz.transfer_blocks_skipped == 5


def _as_vllm(fn: Any, qualname: str, module: str) -> Any:
    """``fn`` under vLLM's own name, as ``_live_tables`` recognises it."""
    fn.__qualname__, fn.__module__ = qualname, module
    return fn


class _Coordinator:
    """Stands for vLLM's KVCacheCoordinator: one manager per group."""

    def __init__(self, tables: list[dict[str, list[Any]]]) -> None:
        self.single_type_managers = [SimpleNamespace(req_to_blocks=t) for t in tables]

    get_blocks = _as_vllm(
        lambda self, request_id: tuple(
            m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers
        ),
        "KVCacheCoordinator.get_blocks",
        "vllm.v1.core.kv_cache_coordinator",
    )


class _Manager:
    """Stands for vLLM's KVCacheManager: its get_block_ids resolves a block state."""

    def __init__(self, coordinator: _Coordinator) -> None:
        self.coordinator = coordinator

    get_block_ids = _as_vllm(
        lambda self, request_id: tuple(
            [b.block_id for b in g] for g in self.coordinator.get_blocks(request_id)
        ),
        "KVCacheManager.get_block_ids",
        "vllm.v1.core.kv_cache_manager",
    )


def test_a_request_listed_twice_in_a_step_is_tagged_once_from_its_cached_entry_as_by_ids() -> None:
    pool, hz = make()
    blocks = pool.get_new_blocks(4)  # 16-token blocks; the cached entry says 40 tokens computed
    manager = _Manager(_Coordinator([{"r": blocks}]))
    out = StepOut({"r": 8}, {"r": 40}, {})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="r", num_computed_tokens=0)]  # listed twice
    out.kv_connector_block_state = SimpleNamespace(
        req_ids={"r"}, resolve_block_ids=manager.get_block_ids, get_block_ids=manager.get_block_ids
    )
    assert vh._live_tables(out.kv_connector_block_state) is not None  # the live tables are read
    hz.tag_step_writes(out, 16)
    e1 = hz.step_record(out).forward
    assert toks(hz.begin_store("r", blocks[2:], "d2h").fence) == {str(e1)}  # written from index 40 // 16
    assert hz.begin_store("r", blocks[:2], "h2d").fence.tokens == ()  # not written by this step
    assert hz.transfer_blocks_skipped == 0


def test_frees_after_their_steps_are_tagged_with_nothing() -> None:
    pool, hz = make()
    pool.get_new_blocks(2)
    hz.step_record(Out())  # a later step runs, but never touched these blocks
    with hz.frees_after_their_steps():
        assert hz.free_token() is None
    assert hz.free_token() == Token("compute", 1)


def test_transfers_that_end_with_their_step_end_when_its_output_comes_back_not_before() -> None:
    pool, hz = make()
    s1, s2 = Out(), Out()
    hz.step_record(s1)
    load = hz.begin_load("r1", pool.get_new_blocks(1), "h2d", key=("lmcache", 1))
    store = hz.begin_store("r1", pool.get_new_blocks(1), "d2h", key=("lmcache", 1))
    hz.end_with_step(("lmcache", 1))
    hz.step_record(s2)
    later = hz.begin_store("r2", pool.get_new_blocks(1), "d2h", key=("lmcache", 2))
    hz.end_with_step(("lmcache", 2))
    assert [pool.token_status(t.token).value for t in (load, store, later)] == ["pending"] * 3
    hz.end_step(s1)
    assert [pool.token_status(t.token).value for t in (load, store, later)] == [
        "completed",
        "completed",
        "pending",
    ]
    assert hz.pending_transfers() == [later]


def test_a_load_its_steps_output_reports_failed_fails_before_the_step_ends_the_rest() -> None:
    pool, hz = make()
    s1 = Out()
    hz.step_record(s1)
    bad, good = pool.get_new_blocks(1), pool.get_new_blocks(1)
    failed = hz.begin_load("r1", bad, "h2d", key=("lmcache", 1, "r1"))
    ok = hz.begin_load("r2", good, "h2d", key=("lmcache", 1, "r2"))
    hz.end_with_step(("lmcache", 1, "r1"))
    hz.end_with_step(("lmcache", 1, "r2"))
    hz.on_connector_output(ConnOut(invalid_block_ids={bad[0].block_id}))
    hz.end_step(s1)
    assert [pool.token_status(t.token).value for t in (failed, ok)] == ["failed", "completed"]
