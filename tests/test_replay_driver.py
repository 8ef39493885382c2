"""The replay driver: race counts per policy, accounting, figures, events."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from blockpool.checking.race_oracle import RaceOracle
from blockpool.core.errors import InvalidArgumentError
from blockpool.core.hazards import AccessKind, StreamKind, Token
from blockpool.replay.config import ReplayConfig
from blockpool.replay.driver import run_policy
from blockpool.replay.eventlog import EVENTS_SCHEMA, decode_runs
from blockpool.replay.policies import POLICIES, UnknownPolicyError, WaitPolicy
from blockpool.replay.report import ReplayReport
from blockpool.replay.run import replay
from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace
from blockpool.replay.traces import Trace, read_trace

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
CONVERSATION = TRACES / "conversation_trace.jsonl"

SMALL = ReplayConfig(num_blocks=1024, check_every=25)
"""Small enough to preempt, evict and load within 150 synthetic requests;
checks the pool's invariants every 25 steps."""


@pytest.fixture(scope="module")
def synthetic() -> Trace:
    return synthetic_trace(SyntheticSpec(num_requests=150), seed=0)


@pytest.fixture(scope="module")
def report(synthetic: Trace) -> ReplayReport:
    return replay(synthetic, POLICIES, SMALL)


@pytest.mark.parametrize("policy", ["exact", "step-event", "device-sync"])
def test_synthetic_replay_shows_no_race_under_a_hazard_aware_policy(
    report: ReplayReport, policy: str
) -> None:
    assert report.result(policy).races == 0, report.result(policy).race_examples


def test_synthetic_replay_shows_races_under_blind_policy(report: ReplayReport) -> None:
    blind = report.result("blind")
    assert blind.races > 0 and sum(blind.races_by_hazard.values()) == blind.races
    assert set(blind.races_by_hazard) == {"RAW", "WAR", "WAW"}
    assert report.result("exact").races_by_hazard == {}


def test_every_policy_serves_the_same_workload(report: ReplayReport) -> None:
    """Waits change when things happen, not what is served: the same
    requests finish and abort, with the same tokens, under every policy."""
    served = {
        p: (r.counts["finished"], r.counts["aborted"], r.tokens_served, r.output_tokens)
        for p in POLICIES
        for r in [report.result(p)]
    }
    assert len(set(served.values())) == 1, served
    finished, aborted, tokens, _ = served["exact"]
    assert (report.requests, finished + aborted) == (150, 150) and aborted > 0 and tokens > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_pool_is_empty_at_the_end(report: ReplayReport, policy: str) -> None:
    st = report.result(policy).pool_stats
    assert (st["held"], st["used"], st["free"]) == (0, 0, st["num_blocks"])


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_or_is_aborted(report: ReplayReport, policy: str) -> None:
    c = report.result(policy).counts
    assert report.requests == 150
    assert c.get("finished", 0) + c.get("aborted", 0) + c.get("rejected", 0) == 150


def test_small_pool_preempts_loads_evicts_and_copies_on_write(report: ReplayReport) -> None:
    r = report.result("exact")
    assert (
        r.counts["preemptions"] > 0,
        r.loads > 0,
        r.pool_stats["evictions"] > 0,
        r.counts["cow_copies"] > 0,
    ) == (
        True,
        True,
        True,
        True,
    )


def test_some_aborts_come_while_a_load_is_in_flight(report: ReplayReport) -> None:
    assert report.result("exact").counts["aborts_during_load"] > 0


def test_exact_loads_start_sooner_than_step_event_loads(report: ReplayReport) -> None:
    assert report.result("exact").load_delay_mean_ms < report.result("step-event").load_delay_mean_ms


def test_exact_loads_wait_on_nothing_more_often_than_step_event_loads(report: ReplayReport) -> None:
    assert report.result("exact").loads_empty_fence_pct > report.result("step-event").loads_empty_fence_pct


def test_blind_pool_holds_nothing_back(report: ReplayReport) -> None:
    assert report.result("blind").pool_stats["host_wait_fences"] == 0


def test_dropping_the_exact_fences_is_caught_by_the_oracle(
    synthetic: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(WaitPolicy, "waits", lambda self, fence, consumer, transfer=False: ())
    assert run_policy(synthetic.requests[:100], "exact", SMALL).races > 0


@pytest.mark.slow
@pytest.mark.skipif(
    not CONVERSATION.exists(), reason=f"Mooncake conversation trace not found at {CONVERSATION}"
)
def test_conversation_trace_prefix_races_per_policy() -> None:
    trace = read_trace(CONVERSATION, limit=150)
    rep = replay(trace, POLICIES, ReplayConfig(check_every=200), jobs=2)
    assert {p: rep.result(p).races > 0 for p in POLICIES} == {
        "exact": False,
        "step-event": False,
        "device-sync": False,
        "blind": True,
    }


# -- figures ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_report_json_carries_every_figure_per_policy(report: ReplayReport, policy: str) -> None:
    fig = report.to_json()["policies"][policy]  # type: ignore[index]
    r = report.result(policy)
    assert (fig["races"], fig["loads"], fig["counts"], fig["pool_stats"]) == (
        r.races,
        r.loads,
        r.counts,
        r.pool_stats,
    )
    assert fig["loads_empty_fence_pct"] == round(100 * r.loads_empty_fence / r.loads, 3)
    assert fig["throughput_tok_s"] == round(r.tokens_served / r.makespan_s, 3)
    assert {op: f["calls"] for op, f in fig["pool_ops"].items()} == {
        op: c for op, (c, _) in r.pool_ops.items()
    }
    assert {
        "races",
        "loads_empty_fence_pct",
        "load_start_delay_ms",
        "makespan_s",
        "throughput_tok_s",
        "pool_ops",
        "pool_ns_per_op",
    } <= set(fig)


def test_report_json_is_serialisable(report: ReplayReport) -> None:
    assert json.loads(json.dumps(report.to_json()))["schema"] == "blockpool.replay-report/1"


@pytest.mark.parametrize("policy", POLICIES)
def test_pool_operations_are_counted_as_the_workload_implies_and_timed(
    report: ReplayReport, policy: str
) -> None:
    r = report.result(policy)
    calls = {op: c for op, (c, _) in r.pool_ops.items()}
    assert all(ns > 0 for _, ns in r.pool_ops.values())
    c, st = r.counts, r.pool_stats
    assert (calls["issue"], calls["tag"]) == (c["steps"], c["steps"])  # one step token per step
    assert (calls["begin_load"], calls["begin_store"], calls["begin_copy"]) == (
        r.loads,
        c["stores"],
        c["cow_copies"],
    )
    assert (calls["get_cached_block"], calls["fail"]) == (st["lookups"], st["failed_tokens"])
    assert calls["allocate_for"] > 0


def test_parallel_policies_give_the_same_figures(synthetic: Trace) -> None:
    small = Trace("synthetic", "synthetic", synthetic.requests[:40])
    one = replay(small, "exact,blind", SMALL, jobs=1).to_json(timing=False)
    two = replay(small, "exact,blind", SMALL, jobs=2).to_json(timing=False)
    assert one == two


# -- events ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def events(synthetic: Trace, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], ReplayReport]:  # type: ignore[type-arg]
    path = tmp_path_factory.mktemp("ev") / "events.jsonl"
    rep = replay(Trace("synthetic", "synthetic", synthetic.requests[:80]), "exact,blind", SMALL, events=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[:-1], rep, lines[-1]  # header + events, report, trailer


def test_event_log_starts_with_a_versioned_header(events: tuple[list[dict], ReplayReport]) -> None:  # type: ignore[type-arg]
    head = events[0][0]
    assert (head["schema"], head["policies"], head["streams"]["rdma"]) == (
        EVENTS_SCHEMA,
        ["exact", "blind"],
        "host",
    )


def test_event_log_names_only_issued_tokens(events: tuple[list[dict], ReplayReport]) -> None:  # type: ignore[type-arg]
    issued: set[tuple[str, str]] = set()
    unknown = []
    for e in events[0][1:]:
        if e["ev"] == "fence":  # names tokens issued earlier (no token of its own)
            if any((e["policy"], t) not in issued for t in e["tokens"]):
                unknown.append(e)
            continue
        key = (e["policy"], e["token"])
        if e["ev"] == "issue":
            issued.add(key)
        elif key not in issued or any((e["policy"], t) not in issued for t in e.get("on", ())):
            unknown.append(e)
    assert unknown == []


def test_event_log_trailer_counts_the_lines_before_it(events) -> None:  # type: ignore[no-untyped-def]
    body, _, trailer = events
    assert trailer["trailer"] == EVENTS_SCHEMA and "ev" not in trailer
    assert trailer["lines"] == len(body)
    assert trailer["counts"] == dict(collections.Counter(e["ev"] for e in body[1:]))
    assert set(trailer["counts"]) == {"issue", "wait", "access", "fence", "table", "end"}


def test_event_log_has_the_block_table_reads_of_every_step(events) -> None:  # type: ignore[no-untyped-def]
    body, _, _ = events
    for policy in ("exact", "blind"):
        steps = {
            e["token"]
            for e in body[1:]
            if e["ev"] == "issue" and e["policy"] == policy and e["what"] == "forward"
        }
        tables = [e for e in body[1:] if e["ev"] == "table" and e["policy"] == policy]
        assert {e["token"] for e in tables} == steps  # every step reads a block
        assert all(
            e["blocks"] and decode_runs(e["blocks"]) == sorted(set(decode_runs(e["blocks"]))) for e in tables
        )
    # more reads than the oracle's once-per-block-at-free ones
    reads = sum(
        len(decode_runs(e["blocks"]))
        for e in body[1:]
        if e["ev"] == "access" and e["access"] == "read" and e["what"] == "forward"
    )
    assert sum(len(decode_runs(e["blocks"])) for e in body[1:] if e["ev"] == "table") > reads


def test_every_step_read_of_the_exact_replay_is_race_free(events) -> None:  # type: ignore[no-untyped-def]
    """A stricter checker: each ``table`` line judged as a read
    (``docfigures.table_read_check``, the one ``docs/guarantees.md``'s
    ``trace-events`` figures come from)."""
    from blockpool.replay.docfigures import table_read_check

    body, _, trailer = events
    check = table_read_check(json.dumps(e) for e in [*body, trailer])
    assert check["trailer_ok"]
    assert check["counts"]["table"] > 0
    assert check["races"]["exact"] == 0


def test_event_log_records_every_fence_with_its_call_blocks_and_tokens(events) -> None:  # type: ignore[no-untyped-def]
    body, _rep, _ = events
    kinds = body[0]["streams"]
    fences = [e for e in body[1:] if e["ev"] == "fence"]
    assert {e["call"] for e in fences} >= {"allocate_for", "fence_for", "begin_load"}
    for e in fences:
        assert isinstance(e["blocks"], list) and all(
            isinstance(b, int) and b > 0 for b in decode_runs(e["blocks"])
        )
        host = kinds[e["stream"]] == "host" or any(kinds[t.split(":")[0]] == "host" for t in e["tokens"])
        assert e["needs_host_wait"] == (bool(e["tokens"]) and host), e
    # blind runs with track_hazards=False: its fences are empty
    assert all(not e["tokens"] for e in fences if e["policy"] == "blind")
    assert any(e["tokens"] for e in fences if e["policy"] == "exact")


@pytest.mark.parametrize("policy", ["exact", "blind"])
def test_event_log_lets_an_independent_oracle_reach_the_same_verdict(
    events: tuple[list[dict], ReplayReport],  # type: ignore[type-arg]
    policy: str,
) -> None:
    log, rep, _ = events
    kinds = {n: StreamKind(k) for n, k in log[0]["streams"].items()}
    oracle = RaceOracle(kinds, retain=1 << 20)
    tok = {}
    evs = [e for e in log[1:] if e["policy"] == policy]
    for i, e in enumerate(evs):  # a wait line follows its issue line: record on the line after the issue
        if e["ev"] == "issue":
            tok[e["token"]] = Token(e["stream"], e["seq"], kinds[e["stream"]])
            nxt = evs[i + 1] if i + 1 < len(evs) else {}
            on = nxt.get("on", []) if nxt.get("ev") == "wait" and nxt.get("token") == e["token"] else []
            oracle.record(tok[e["token"]], [tok[t] for t in on])
        elif e["ev"] == "access":
            oracle.tag(tok[e["token"]], decode_runs(e["blocks"]), AccessKind(e["access"]), e["what"])
        elif e["ev"] == "end":
            oracle.complete(tok[e["token"]], failed=e["failed"])
    assert len(oracle.violations) == rep.result(policy).races


# -- policies and configuration ---------------------------------------------------------


KINDS = {
    "compute": StreamKind.DEVICE,
    "h2d": StreamKind.DEVICE,
    "d2h": StreamKind.DEVICE,
    "rdma": StreamKind.HOST,
}
NEWEST = {"compute": Token("compute", 9), "h2d": Token("h2d", 4), "d2h": Token("d2h", 2)}


def _waits(
    policy: str, fence: tuple[Token, ...], consumer: str, transfer: bool = False, ended: tuple = ()
) -> list[str]:  # type: ignore[type-arg]
    from blockpool.core.hazards import Fence

    p = WaitPolicy(policy, KINDS, NEWEST, lambda t: t in ended)
    return [str(t) for t in p.waits(Fence(fence), consumer, transfer=transfer)]


def test_exact_policy_waits_on_the_fence() -> None:
    assert _waits("exact", (Token("compute", 3),), "h2d", True) == ["compute:3"]


def test_step_event_waits_on_the_newest_token_of_each_named_stream() -> None:
    assert _waits("step-event", (Token("h2d", 1),), "compute") == ["h2d:4"]


def test_step_event_transfer_waits_on_all_compute_enqueued_before_it() -> None:
    assert _waits("step-event", (), "d2h", transfer=True) == ["compute:9"]


def test_device_sync_waits_on_every_other_device_stream() -> None:
    assert _waits("device-sync", (), "compute") == ["h2d:4", "d2h:2"]


def test_coarse_policies_keep_host_engine_tokens() -> None:
    host = Token("rdma", 3, StreamKind.HOST)
    assert _waits("step-event", (host,), "compute") == ["rdma:3"]


def test_coarse_policies_drop_ended_tokens() -> None:
    assert _waits("device-sync", (), "compute", ended=(Token("h2d", 4),)) == ["d2h:2"]


def test_blind_policy_waits_on_nothing() -> None:
    assert _waits("blind", (Token("compute", 3),), "h2d", True) == []


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(UnknownPolicyError):
        run_policy((), "optimistic")


def test_config_rejects_a_stream_set_without_the_named_streams() -> None:
    from blockpool.sim.simulator import StreamSpec

    with pytest.raises(InvalidArgumentError):
        ReplayConfig(streams={"compute": StreamSpec(StreamKind.DEVICE)})


def test_config_rejects_a_fraction_above_one() -> None:
    with pytest.raises(InvalidArgumentError):
        ReplayConfig(abort_fraction=1.5)


def test_request_too_long_for_the_pool_is_rejected_not_replayed(synthetic: Trace) -> None:
    r = run_policy(synthetic.requests[:20], "exact", ReplayConfig(num_blocks=64))
    assert (
        r.counts["rejected"] > 0
        and r.counts.get("finished", 0) + r.counts.get("aborted", 0) + r.counts["rejected"] == 20
    )


def test_requests_ready_after_loads_that_fill_the_pool_are_requeued_not_stalled() -> None:
    from blockpool.replay.traces import TraceRequest

    def req(i: int, t: float, segs: list[tuple[int, int]]) -> TraceRequest:
        return TraceRequest(i, t, sum(n for _, n in segs), 4, tuple(segs), -(i + 1))

    shared = [(1, 304)]  # stored by request 0, evicted from the pool by request 1
    reqs = (
        req(0, 0.0, shared),
        req(1, 1.0, [(2, 736)]),
        *(req(i, 3.0, [*shared, (10 + i, 300)]) for i in (2, 3, 4)),  # two load it, then neither fits
    )
    r = run_policy(reqs, "exact", ReplayConfig(num_blocks=48, remote_fraction=1.0, abort_fraction=0.0))
    assert (r.counts["finished"], r.counts["unstuck"]) == (5, 1)
