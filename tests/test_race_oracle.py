"""The race oracle (``blockpool.checking.race_oracle``): hand-written sequences.

Streams: ``compute``, ``h2d``, ``d2h`` are in-order device streams; ``rdma``
is a host-driven engine whose postings complete out of order. Tokens are
written ``stream:seq``; each test records them in issue order.
"""

from __future__ import annotations

import attrs
import pytest

from blockpool.checking.race_oracle import (
    RaceOracle,
    RaceViolation,
    RecordOrderError,
    UnrecordedTokenError,
    block_ranges,
    describe_group,
    group_by_access_pair,
)
from blockpool.core.errors import BlockPoolError, InvalidArgumentError, UnknownStreamError, UnknownTokenError
from blockpool.core.hazards import AccessKind, StreamKind, Token

D, H = StreamKind.DEVICE, StreamKind.HOST
R, W = AccessKind.READ, AccessKind.WRITE
STREAMS = {"compute": D, "h2d": D, "d2h": D, "rdma": H}
WHAT = {R: "store", W: "load"}


def tok(name: str) -> Token:
    stream, seq = name.split(":")
    return Token(stream, int(seq), STREAMS[stream])


@pytest.fixture
def oracle() -> RaceOracle:
    return RaceOracle(STREAMS)


def run(
    o: RaceOracle, name: str, blocks: list[int], kind: AccessKind, what: str = "", after: tuple[str, ...] = ()
) -> list[RaceViolation]:
    """Record ``name`` after ``after`` and let it access ``blocks``."""
    t = tok(name)
    o.record(t, [tok(a) for a in after])
    return o.tag(t, blocks, kind, what or WHAT[kind])


# -- every hazard, every pair of stream kinds -------------------------------

HAZARDS = {"RAW": (W, R), "WAR": (R, W), "WAW": (W, W)}
PAIRS = {
    "device-device": ("h2d:1", "compute:1"),
    "device-host": ("compute:1", "rdma:1"),
    "host-device": ("rdma:1", "compute:1"),
    "host-host-same-engine": ("rdma:1", "rdma:2"),
}
CASES = [(h, p) for h in HAZARDS for p in PAIRS]


@pytest.mark.parametrize(("hazard", "pair"), CASES, ids=[f"{h}-{p}" for h, p in CASES])
def test_unordered_conflicting_accesses_are_flagged_exactly(
    oracle: RaceOracle, hazard: str, pair: str
) -> None:
    (pk, ck), (prior, cur) = HAZARDS[hazard], PAIRS[pair]
    run(oracle, prior, [7], pk)
    found = run(oracle, cur, [7], ck)
    assert found == [RaceViolation(7, hazard, tok(prior), pk, WHAT[pk], tok(cur), ck, WHAT[ck])]


FENCES = {
    # how the consumer is ordered after the prior access
    "stream_wait": lambda o, prior: o.stream_wait("compute", tok(prior)),
    "record_after": None,  # record(consumer, after=[prior]): stream wait or host wait
    "complete": lambda o, prior: o.complete(tok(prior)),
}
FENCED = [
    (h, p, f)
    for h in HAZARDS
    for p in PAIRS
    for f in FENCES
    if not (f == "stream_wait" and PAIRS[p][1].startswith("rdma"))  # engines have no stream waits
]


@pytest.mark.parametrize(("hazard", "pair", "fence"), FENCED, ids=["-".join(c) for c in FENCED])
def test_fenced_conflicting_accesses_pass(oracle: RaceOracle, hazard: str, pair: str, fence: str) -> None:
    (pk, ck), (prior, cur) = HAZARDS[hazard], PAIRS[pair]
    run(oracle, prior, [7], pk)
    sync = FENCES[fence]
    if sync is not None:
        sync(oracle, prior)
    assert run(oracle, cur, [7], ck, after=(prior,) if sync is None else ()) == []
    assert oracle.violations == []


# -- what orders and what does not -----------------------------------------


def test_accesses_on_the_same_device_stream_never_race(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [1], W)
    run(oracle, "compute:2", [1], R)
    run(oracle, "compute:3", [1], W)
    assert oracle.violations == []


def test_reads_never_race_with_reads(oracle: RaceOracle) -> None:
    for name in ("h2d:1", "rdma:1", "rdma:2", "compute:1"):
        run(oracle, name, [1, 2], R)
    assert oracle.violations == []


def test_completing_a_device_token_orders_its_earlier_tokens(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1], W)
    run(oracle, "h2d:2", [2], W)
    oracle.complete(tok("h2d:2"))
    assert run(oracle, "compute:1", [1], R) == []


def test_completing_a_host_token_does_not_order_other_tokens_of_its_engine(oracle: RaceOracle) -> None:
    run(oracle, "rdma:1", [1], W)
    run(oracle, "rdma:2", [2], W)
    oracle.complete(tok("rdma:2"))
    assert run(oracle, "compute:1", [1], R) == [
        RaceViolation(1, "RAW", tok("rdma:1"), W, "load", tok("compute:1"), R, "store")
    ]


def test_completion_does_not_order_work_recorded_before_it(oracle: RaceOracle) -> None:
    oracle.record(tok("h2d:1"))
    oracle.record(tok("compute:1"))
    oracle.tag(tok("h2d:1"), [1], W, "load")
    oracle.complete(tok("h2d:1"))
    assert [v.hazard for v in oracle.tag(tok("compute:1"), [1], R, "forward")] == ["RAW"]


def test_completion_orders_what_the_token_waited_on(oracle: RaceOracle) -> None:
    run(oracle, "rdma:1", [1], W)
    run(oracle, "compute:1", [2], R, after=("rdma:1",))  # host wait, then enqueue
    oracle.complete(tok("compute:1"))
    assert run(oracle, "h2d:1", [1], W) == []


def test_stream_wait_persists_for_later_work_on_the_stream(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1], W)
    oracle.stream_wait("compute", tok("h2d:1"))
    run(oracle, "compute:1", [2], W)
    assert run(oracle, "compute:2", [1], R) == []


def test_host_wait_orders_only_that_posting(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1], W)
    run(oracle, "rdma:1", [1], R, after=("h2d:1",))
    assert [str(v.token) for v in run(oracle, "rdma:2", [1], R)] == ["rdma:2"]


def test_waits_are_transitive(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1], W)
    run(oracle, "compute:1", [2], R, after=("h2d:1",))
    assert run(oracle, "rdma:1", [1], R, after=("compute:1",)) == []


def test_write_is_checked_against_the_last_write_even_after_reads(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1], W)
    run(oracle, "compute:1", [1], R)  # races (RAW), and does not order h2d:1
    found = run(oracle, "d2h:1", [1], W, after=("compute:1",))
    assert found == [RaceViolation(1, "WAW", tok("h2d:1"), W, "load", tok("d2h:1"), W, "load")]


def test_newer_read_on_a_device_stream_stands_for_older_ones(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [1], R)
    run(oracle, "compute:2", [1], R)
    assert run(oracle, "h2d:1", [1], W, after=("compute:2",)) == []


def test_late_read_ordered_before_a_write_is_not_a_race(oracle: RaceOracle) -> None:
    oracle.record(tok("compute:1"))  # step 1; its block-table read is reported at free time
    run(oracle, "h2d:1", [1], W, after=("compute:1",))
    assert oracle.tag(tok("compute:1"), [1], R, "forward") == []


def test_late_read_unordered_with_a_write_is_a_race(oracle: RaceOracle) -> None:
    oracle.record(tok("compute:1"))
    run(oracle, "h2d:1", [1], W)
    found = oracle.tag(tok("compute:1"), [1], R, "forward")
    assert found == [RaceViolation(1, "RAW", tok("h2d:1"), W, "load", tok("compute:1"), R, "forward")]


def test_late_read_of_a_completed_token_is_judged_by_its_clock(oracle: RaceOracle) -> None:
    oracle.record(tok("compute:1"))
    oracle.complete(tok("compute:1"))
    run(oracle, "h2d:1", [1], W)  # recorded after the host saw compute:1 end
    assert oracle.tag(tok("compute:1"), [1], R, "forward") == []


# -- reports ------------------------------------------------------------------


def test_violation_text_names_block_accesses_streams_and_tokens() -> None:
    v = RaceViolation(7, "WAR", tok("compute:12"), R, "forward", tok("h2d:3"), W, "load")
    assert (
        str(v)
        == "WAR race on block 7: load (write) by h2d:3 is not ordered after forward (read) by compute:12"
    )


def test_violation_is_a_frozen_value() -> None:
    v = RaceViolation(7, "RAW", tok("h2d:1"), W, "load", tok("compute:1"), R, "forward")
    assert v == RaceViolation(7, "RAW", tok("h2d:1"), W, "load", tok("compute:1"), R, "forward")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        v.block_id = 8  # type: ignore[misc]


def test_violation_with_unknown_hazard_raises_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError):
        RaceViolation(7, "RAR", tok("h2d:1"), R, "x", tok("compute:1"), R, "y")


def test_access_returns_only_new_violations_and_keeps_all(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1, 2], W)
    first = run(oracle, "compute:1", [1], R)
    second = run(oracle, "compute:2", [2], R)
    assert [v.block_id for v in first] == [1]
    assert [v.block_id for v in second] == [2]
    assert oracle.violations == first + second


def test_num_accesses_counts_block_accesses(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1, 2, 3], W)
    run(oracle, "compute:1", [1], R)
    assert oracle.num_accesses == 4


def test_report_lists_one_violation_per_line(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1, 2], W)
    run(oracle, "compute:1", [1, 2], R)
    assert oracle.report().splitlines() == [str(v) for v in oracle.violations]


def test_check_access_records_nothing(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1], W)
    dry = oracle.check_access("compute", [1], R, "forward")
    assert [str(v.token) for v in dry] == ["compute:1"]
    assert oracle.violations == [] and oracle.num_accesses == 1
    assert run(oracle, "compute:1", [1], R, what="forward") == dry


def test_check_access_judges_a_fence(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [1], R)
    run(oracle, "rdma:1", [2], R)
    fence = [tok("compute:1"), tok("rdma:1")]
    assert oracle.check_access("h2d", [1, 2], W, after=fence) == []
    for dropped in fence:
        kept = [t for t in fence if t != dropped]
        assert [v.prior_token for v in oracle.check_access("h2d", [1, 2], W, after=kept)] == [dropped]


# -- bad input ------------------------------------------------------------------


def test_record_on_unknown_stream_raises_unknown_stream_error(oracle: RaceOracle) -> None:
    with pytest.raises(UnknownStreamError) as info:
        oracle.record(Token("nvme", 1))
    assert isinstance(info.value, LookupError) and isinstance(info.value, BlockPoolError)


def test_access_by_unrecorded_token_raises(oracle: RaceOracle) -> None:
    with pytest.raises(UnrecordedTokenError) as info:
        oracle.tag(tok("compute:1"), [1], R, "forward")
    assert isinstance(info.value, UnknownTokenError) and isinstance(info.value, LookupError)


def test_record_after_unrecorded_token_raises_and_records_nothing(oracle: RaceOracle) -> None:
    with pytest.raises(UnrecordedTokenError):
        oracle.record(tok("compute:1"), [tok("h2d:1")])
    oracle.record(tok("compute:1"))  # not recorded by the failed call
    assert oracle.tag(tok("compute:1"), [1], R, "forward") == []


def test_recording_a_token_twice_raises_record_order_error(oracle: RaceOracle) -> None:
    oracle.record(tok("compute:1"))
    with pytest.raises(RecordOrderError) as info:
        oracle.record(tok("compute:1"))
    assert isinstance(info.value, ValueError) and isinstance(info.value, BlockPoolError)


def test_recording_out_of_issue_order_raises_record_order_error(oracle: RaceOracle) -> None:
    oracle.record(tok("rdma:2"))
    with pytest.raises(RecordOrderError):
        oracle.record(tok("rdma:1"))


def test_complete_of_unrecorded_token_raises(oracle: RaceOracle) -> None:
    with pytest.raises(UnrecordedTokenError):
        oracle.complete(tok("rdma:1"))


def test_complete_is_idempotent(oracle: RaceOracle) -> None:
    run(oracle, "rdma:1", [1], W)
    oracle.complete(tok("rdma:1"))
    oracle.complete(tok("rdma:1"))
    assert run(oracle, "compute:1", [1], R) == []


def test_stream_wait_of_a_host_engine_raises_invalid_argument(oracle: RaceOracle) -> None:
    oracle.record(tok("compute:1"))
    with pytest.raises(InvalidArgumentError):
        oracle.stream_wait("rdma", tok("compute:1"))


def test_stream_wait_on_unrecorded_token_raises(oracle: RaceOracle) -> None:
    with pytest.raises(UnrecordedTokenError):
        oracle.stream_wait("compute", tok("h2d:1"))


def test_access_with_a_bad_block_id_raises_and_changes_nothing(oracle: RaceOracle) -> None:
    run(oracle, "h2d:1", [1], W)
    oracle.record(tok("compute:1"))
    with pytest.raises(InvalidArgumentError):
        oracle.tag(tok("compute:1"), [1, -1], R, "forward")
    assert oracle.violations == [] and oracle.num_accesses == 1


def test_access_with_a_bad_kind_raises_invalid_argument(oracle: RaceOracle) -> None:
    oracle.record(tok("compute:1"))
    with pytest.raises(InvalidArgumentError):
        oracle.tag(tok("compute:1"), [1], "read", "forward")  # type: ignore[arg-type]


def test_access_by_a_non_token_raises_invalid_argument(oracle: RaceOracle) -> None:
    with pytest.raises(InvalidArgumentError):
        oracle.tag(("compute", 1), [1], R, "forward")  # type: ignore[arg-type]


def test_add_stream_with_the_other_kind_raises_invalid_argument(oracle: RaceOracle) -> None:
    with pytest.raises(InvalidArgumentError):
        oracle.add_stream("rdma", D)
    assert oracle.streams == STREAMS


def test_negative_retain_raises_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError):
        RaceOracle(STREAMS, retain=-1)


def test_access_by_a_token_whose_clock_was_dropped_raises() -> None:
    o = RaceOracle(STREAMS, retain=1)
    o.record(tok("compute:1"))
    o.complete(tok("compute:1"))
    o.record(tok("compute:2"))  # compute:1 ended and is beyond retain
    with pytest.raises(UnrecordedTokenError):
        o.tag(tok("compute:1"), [1], R, "forward")


def test_waiting_on_an_ended_token_whose_clock_was_dropped_is_allowed() -> None:
    o = RaceOracle(STREAMS, retain=0)
    run(o, "rdma:1", [1], W)
    o.complete(tok("rdma:1"))
    o.record(tok("rdma:2"))  # drops rdma:1's clock
    assert run(o, "compute:1", [1], R, after=("rdma:1",)) == []


def test_failed_token_does_not_order_later_work_after_its_waits() -> None:
    from blockpool.checking.race_oracle import RaceOracle
    from blockpool.core.hazards import AccessKind, StreamKind, Token

    oracle = RaceOracle({"compute": StreamKind.DEVICE, "h2d": StreamKind.DEVICE, "rdma": StreamKind.HOST})
    e1, load, dma = Token("compute", 1), Token("rdma", 1, StreamKind.HOST), Token("h2d", 1)
    oracle.record(e1)
    oracle.tag(e1, [3], AccessKind.READ, "forward")
    oracle.record(load, after=[e1])
    oracle.complete(load, failed=True)  # may have failed before waiting on e1
    oracle.record(dma)
    (v,) = oracle.tag(dma, [3], AccessKind.WRITE, "load")
    assert (v.hazard, v.prior_token, v.token) == ("WAR", e1, dma)


def test_second_racy_write_after_a_racy_write_is_reported_too(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [1], R)
    first = run(oracle, "h2d:1", [1], W)  # forgot to wait on compute:1
    assert [v.hazard for v in first] == ["WAR"]
    second = run(oracle, "h2d:2", [1], W)  # ordered after h2d:1, still not after compute:1
    assert second == [RaceViolation(1, "WAR", tok("compute:1"), R, "store", tok("h2d:2"), W, "load")]


def test_access_after_a_racy_write_is_checked_against_the_write_it_raced(oracle: RaceOracle) -> None:
    run(oracle, "rdma:1", [1], W)
    run(oracle, "h2d:1", [1], W)  # WAW with rdma:1
    found = run(oracle, "h2d:2", [1], R)  # reads after h2d:1, rdma:1 may still write
    assert found == [RaceViolation(1, "RAW", tok("rdma:1"), W, "load", tok("h2d:2"), R, "store")]


def test_ordered_write_clears_what_the_racy_write_raced_with(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [1], R)
    run(oracle, "h2d:1", [1], W)  # races
    assert run(oracle, "d2h:1", [1], W, after=("h2d:1", "compute:1")) == []
    assert run(oracle, "d2h:2", [1], W) == []


# -- one race on several blocks: grouped by access pair ------------------------------------


def test_races_of_one_access_pair_on_several_blocks_form_one_group(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [3, 1, 2, 4], R, "forward")
    found = run(oracle, "h2d:1", [3, 1, 2, 4], W)
    ((v, ids),) = group_by_access_pair(found)
    assert ids == [3, 1, 2, 4] and v == found[0]
    assert describe_group(v, ids) == (
        "WAR race on blocks 1-4: load (write) by h2d:1 is not ordered after forward (read) by compute:1"
    )


def test_races_of_different_access_pairs_stay_apart_in_the_order_found(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [1, 2], W, "forward")
    run(oracle, "compute:2", [1, 2], R, "forward")
    found = run(oracle, "h2d:1", [1, 2], W)
    groups = group_by_access_pair(found)
    assert [(v.hazard, v.prior_token, ids) for v, ids in groups] == [
        ("WAW", tok("compute:1"), [1, 2]),
        ("WAR", tok("compute:2"), [1, 2]),
    ]


def test_a_key_splits_a_group(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [1, 2, 3], R, "forward")
    found = run(oracle, "h2d:1", [1, 2, 3], W)
    assert [ids for _, ids in group_by_access_pair(found, key=lambda v: v.block_id == 2)] == [[1, 3], [2]]


def test_a_violation_on_one_block_reads_as_one_block(oracle: RaceOracle) -> None:
    run(oracle, "compute:1", [7], R, "forward")
    (v,) = run(oracle, "h2d:1", [7], W)
    assert (
        str(v)
        == describe_group(v, [7])
        == ("WAR race on block 7: load (write) by h2d:1 is not ordered after forward (read) by compute:1")
    )


@pytest.mark.parametrize(
    ("ids", "text"), [([5], "5"), ([2, 1], "1-2"), ([1, 2, 3, 5, 7, 8], "1-3, 5, 7-8"), ([4, 4, 3], "3-4")]
)
def test_block_ranges_writes_sorted_runs(ids: list[int], text: str) -> None:
    assert block_ranges(ids) == text
