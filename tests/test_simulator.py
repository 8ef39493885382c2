"""The stream simulator and its cost model."""

from __future__ import annotations

import pytest

from blockpool.core.errors import InvalidArgumentError, UnknownStreamError, UnknownTokenError
from blockpool.core.hazards import StreamKind, Token
from blockpool.sim.simulator import (
    DEFAULT_STREAM_SPECS,
    CostModel,
    SimulationError,
    StreamSimulator,
    StreamSpec,
)

DEV, HOST = StreamKind.DEVICE, StreamKind.HOST


def c(seq: int) -> Token:
    return Token("compute", seq)


def h(seq: int) -> Token:
    return Token("h2d", seq)


def r(seq: int) -> Token:
    return Token("rdma", seq, HOST)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def complete(self, token: Token) -> None:
        self.calls.append(("complete", str(token)))

    def fail(self, token: Token) -> None:
        self.calls.append(("fail", str(token)))


def sim(pool: Recorder | None = None, seed: int = 0, **host: object) -> StreamSimulator:
    return StreamSimulator(
        {
            "compute": StreamSpec(DEV),
            "h2d": StreamSpec(DEV, bandwidth=1e9),
            "rdma": StreamSpec(HOST, bandwidth=2e9, lanes=2, **host),  # type: ignore[arg-type]
        },
        seed=seed,
        pool=pool,
    )


def test_device_stream_runs_in_order() -> None:
    s = sim()
    s.submit(c(1), ready=0.0, duration=1.0)
    assert s.submit(c(2), ready=0.5, duration=1.0).start == 1.0


def test_device_work_waits_for_the_waited_token() -> None:
    s = sim()
    s.submit(c(1), ready=0.0, duration=2.0)
    assert s.submit(h(1), ready=0.1, num_bytes=10**9, waits=[c(1)]).start == 2.0


def test_work_without_waits_starts_when_ready() -> None:
    s = sim()
    s.submit(c(1), ready=0.0, duration=2.0)
    assert s.submit(h(1), ready=0.1, num_bytes=10**9).start == 0.1


def test_transfer_time_is_bytes_over_bandwidth_plus_latency() -> None:
    s = StreamSimulator({"h2d": StreamSpec(DEV, bandwidth=1e9, latency=0.5)})
    w = s.submit(h(1), ready=0.0, num_bytes=2 * 10**9)
    assert w.end == 2.5


def test_host_engine_lanes_share_its_bandwidth() -> None:
    s = sim()
    assert s.submit(r(1), ready=0.0, num_bytes=10**9).end == 1.0  # 2 GB/s over 2 lanes


def test_host_engine_runs_postings_side_by_side_up_to_its_lanes() -> None:
    s = sim()
    starts = [s.submit(r(i), ready=0.0, num_bytes=10**9).start for i in (1, 2, 3)]
    assert starts == [0.0, 0.0, 1.0]


def test_host_engine_completes_out_of_order() -> None:
    s = sim()
    s.submit(r(1), ready=0.0, num_bytes=4 * 10**9)
    s.submit(r(2), ready=0.0, num_bytes=10**9)
    assert [str(w.token) for w in s.advance(10.0)] == ["rdma:2", "rdma:1"]


def test_host_posting_waits_on_the_host_for_a_device_token() -> None:
    s = sim()
    s.submit(c(1), ready=0.0, duration=3.0)
    assert s.submit(r(1), ready=0.0, num_bytes=10, waits=[c(1)]).start == 3.0


def test_advance_reports_completions_to_the_pool_in_end_order() -> None:
    rec = Recorder()
    s = sim(rec)
    s.submit(c(1), ready=0.0, duration=2.0)
    s.submit(h(1), ready=0.0, num_bytes=10**9)
    s.advance(5.0)
    assert rec.calls == [("complete", "h2d:1"), ("complete", "compute:1")]


def test_advance_reports_nothing_before_its_time() -> None:
    rec = Recorder()
    s = sim(rec)
    s.submit(c(1), ready=0.0, duration=2.0)
    assert s.advance(1.9) == [] and rec.calls == [] and not s.is_ended(c(1))


def test_failed_posting_is_reported_with_fail() -> None:
    rec = Recorder()
    s = sim(rec, failure_rate=1.0)
    s.submit(r(1), ready=0.0, num_bytes=10)
    s.advance(1.0)
    assert rec.calls == [("fail", "rdma:1")]


def test_cancel_drops_a_host_posting_that_has_not_started() -> None:
    rec = Recorder()
    s = sim(rec)
    s.submit(c(1), ready=0.0, duration=5.0)
    s.submit(r(1), ready=0.0, num_bytes=10, waits=[c(1)])
    assert s.cancel(r(1), now=1.0)
    s.advance(1.0)
    assert rec.calls == [("fail", "rdma:1")]


def test_cancel_leaves_a_started_posting_to_run_to_its_end() -> None:
    s = sim()
    w = s.submit(r(1), ready=0.0, num_bytes=10**9)
    assert not s.cancel(r(1), now=0.5)
    assert [x.end for x in s.advance(5.0)] == [w.end]


def test_cancel_never_drops_device_work() -> None:
    s = sim()
    s.submit(c(1), ready=0.0, duration=5.0)
    s.submit(h(1), ready=0.0, num_bytes=10, waits=[c(1)])
    assert not s.cancel(h(1), now=1.0)


def test_next_time_is_the_earliest_pending_end() -> None:
    s = sim()
    s.submit(c(1), ready=0.0, duration=2.0)
    s.submit(h(1), ready=0.0, num_bytes=10**9)
    assert s.next_time() == 1.0


def test_same_seed_gives_the_same_jitter_and_failures() -> None:
    def ends(seed: int) -> list[tuple[float, bool]]:
        s = sim(seed=seed, jitter=0.5, failure_rate=0.5)
        return [(w.end, w.failed) for w in (s.submit(r(i), ready=0.0, num_bytes=10**6) for i in range(1, 30))]

    assert ends(7) == ends(7) and ends(7) != ends(8)


def test_submitting_a_token_out_of_order_is_an_error() -> None:
    s = sim()
    with pytest.raises(SimulationError):
        s.submit(c(2), ready=0.0, duration=1.0)


def test_waiting_on_a_token_never_submitted_is_an_error() -> None:
    s = sim()
    with pytest.raises(UnknownTokenError):
        s.submit(c(1), ready=0.0, duration=1.0, waits=[h(1)])


def test_unknown_stream_is_an_error() -> None:
    with pytest.raises(UnknownStreamError):
        sim().submit(Token("d2h", 1), ready=0.0, duration=1.0)


def test_duration_and_bytes_are_exclusive() -> None:
    with pytest.raises(InvalidArgumentError):
        sim().submit(h(1), ready=0.0, duration=1.0, num_bytes=5)


def test_bytes_on_a_stream_without_bandwidth_is_an_error() -> None:
    with pytest.raises(InvalidArgumentError):
        sim().submit(c(1), ready=0.0, num_bytes=5)


def test_device_stream_spec_rejects_failures() -> None:
    with pytest.raises(InvalidArgumentError):
        StreamSpec(DEV, bandwidth=1e9, failure_rate=0.1)


def test_stream_spec_rejects_zero_lanes() -> None:
    with pytest.raises(InvalidArgumentError):
        StreamSpec(HOST, bandwidth=1e9, lanes=0)


def test_timeline_keeps_works_around_the_mark() -> None:
    s = StreamSimulator({"compute": StreamSpec(DEV)}, timeline=2)
    for i in range(1, 5):
        s.submit(c(i), ready=0.0, duration=1.0)
    s.mark_timeline(4.0)
    for i in range(5, 9):
        s.submit(c(i), ready=0.0, duration=1.0)
    assert [w.token.seq for w in s.timeline] == [3, 4, 5, 6]


def test_default_block_of_16_tokens_is_2_mib_of_kv() -> None:
    assert CostModel().block_bytes(16) == 2 * 1024**2


def test_decode_step_is_bound_by_reading_the_weights() -> None:
    cm = CostModel()
    assert cm.step_seconds(1, 0) == pytest.approx(cm.step_overhead_s + 16.06e9 / 3.35e12)


def test_prefill_step_is_bound_by_flops() -> None:
    cm = CostModel()
    assert cm.step_seconds(8192, 8192) == pytest.approx(
        cm.step_overhead_s + 2 * 8.03e9 * 8192 / (989e12 * 0.5)
    )


def test_cost_model_rejects_a_non_positive_bandwidth() -> None:
    with pytest.raises(InvalidArgumentError):
        CostModel(hbm_bandwidth=0)


def test_default_machine_has_device_dma_and_host_engines() -> None:
    kinds = {n: s.kind for n, s in DEFAULT_STREAM_SPECS.items()}
    assert kinds == {"compute": DEV, "h2d": DEV, "d2h": DEV, "rdma": HOST, "xfer": HOST}


def _replay_figures(seed: int) -> dict[str, object]:
    from blockpool.replay.config import ReplayConfig
    from blockpool.replay.run import replay
    from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace

    trace = synthetic_trace(SyntheticSpec(num_requests=40), seed=0)
    return replay(trace, "exact,blind", ReplayConfig(num_blocks=1024, seed=seed)).to_json(timing=False)


def test_same_seed_gives_the_same_replay_report() -> None:
    assert _replay_figures(5) == _replay_figures(5)


def test_different_seeds_give_different_replay_reports() -> None:
    assert _replay_figures(5) != _replay_figures(6)


def test_default_streams_has_one_meaning_and_the_specs_agree_with_it() -> None:
    from blockpool.checking.harness import DEFAULT_STREAMS
    from blockpool.sim import costmodel, simulator

    assert all(isinstance(k, StreamKind) for k in DEFAULT_STREAMS.values())
    assert {n: DEFAULT_STREAM_SPECS[n].kind for n in DEFAULT_STREAMS} == dict(DEFAULT_STREAMS)
    assert set(DEFAULT_STREAM_SPECS) - set(DEFAULT_STREAMS) == {"xfer"}
    assert costmodel.DEFAULT_STREAM_SPECS is simulator.DEFAULT_STREAM_SPECS is DEFAULT_STREAM_SPECS
