"""Completion reports and the rank merge (``blockpool.core.completions``): one
behaviour per test. Torch-free: runs without torch installed."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from blockpool import BlockPoolError, InvalidArgumentError, StreamKind, Token
from blockpool.core.completions import CompletionReport, RankMerger
from tests.conftest import make_pool

HOST = StreamKind.HOST


def c(seq: int) -> Token:
    return Token("compute", seq)


def rdma(seq: int) -> Token:
    return Token("rdma", seq, HOST)


# -- CompletionReport ---------------------------------------------------------------


def test_report_holds_tokens_as_wire_tuples() -> None:
    report = CompletionReport.of(1, [c(3)], [rdma(2)])
    assert (report.completed, report.failed) == ((("compute", 3, "device"),), (("rdma", 2, "host"),))


def test_report_decodes_back_to_tokens_with_their_kind() -> None:
    report = CompletionReport.of(0, [rdma(2)])
    assert [t.kind for t in report.tokens()] == [HOST]


def test_report_round_trips_through_to_wire() -> None:
    report = CompletionReport.of(2, [c(3), rdma(4)], [rdma(5)])
    assert CompletionReport.from_wire(report.to_wire()) == report


def test_report_accepts_wire_lists_as_a_json_decoder_gives_them() -> None:
    report = CompletionReport.from_wire([0, [["compute", 3, "device"]], []])
    assert report.tokens() == [c(3)]


def test_report_is_picklable() -> None:
    report = CompletionReport.of(0, [c(3)], [rdma(1)])
    assert pickle.loads(pickle.dumps(report)) == report


def test_empty_report_is_falsy() -> None:
    assert not CompletionReport()


def test_report_from_malformed_wire_data_raises() -> None:
    with pytest.raises(InvalidArgumentError):
        CompletionReport.from_wire((0, [("compute", "x")], []))


def test_report_with_a_negative_rank_raises() -> None:
    with pytest.raises(InvalidArgumentError):
        CompletionReport(-1)


def test_apply_completes_and_fails_the_tokens_on_the_pool() -> None:
    pool = make_pool()
    e1, e2 = pool.issue("compute"), pool.issue("compute")
    r1 = pool.issue("rdma")
    CompletionReport.of(0, [e1], [r1]).apply(pool)
    assert (pool.is_ended(e1), pool.is_ended(e2), pool.is_ended(r1), pool.stats().failed_tokens) == (
        True,
        False,
        True,
        1,
    )


def test_apply_of_a_token_the_pool_never_issued_raises() -> None:
    with pytest.raises(BlockPoolError):
        CompletionReport.of(0, [c(5)]).apply(make_pool())


# -- RankMerger -------------------------------------------------------------------------


def test_device_token_ends_when_the_slowest_rank_reports_it() -> None:
    m = RankMerger(3)
    m.add(CompletionReport.of(0, [c(5)]))
    m.add(CompletionReport.of(1, [c(4)]))
    assert m.add(CompletionReport.of(2, [c(6)])).tokens() == [c(4)]


def test_device_mark_is_reported_once() -> None:
    m = RankMerger(2)
    m.add(CompletionReport.of(0, [c(2)]))
    m.add(CompletionReport.of(1, [c(2)]))
    assert not m.add(CompletionReport.of(1, [c(2)]))


def test_device_report_older_than_the_ranks_mark_changes_nothing() -> None:
    m = RankMerger(2)
    m.add(CompletionReport.of(0, [c(5)]))
    m.add(CompletionReport.of(0, [c(3)]))
    assert m.add(CompletionReport.of(1, [c(5)])).tokens() == [c(5)]


def test_host_token_ends_only_when_every_rank_reported_it() -> None:
    m = RankMerger(2)
    first = m.add(CompletionReport.of(1, [rdma(3)]))
    second = m.add(CompletionReport.of(0, [rdma(3)]))
    assert (first.tokens(), second.tokens()) == ([], [rdma(3)])


def test_host_token_completion_is_per_token() -> None:
    m = RankMerger(1)
    assert m.add(CompletionReport.of(0, [rdma(3)])).tokens() == [rdma(3)]


def test_host_token_failed_on_any_rank_is_failed() -> None:
    m = RankMerger(2)
    m.add(CompletionReport.of(0, [], [rdma(1)]))
    merged = m.add(CompletionReport.of(1, [rdma(1)]))
    assert (merged.tokens(), merged.failed_tokens()) == ([], [rdma(1)])


def test_merger_forgets_host_tokens_once_merged() -> None:
    m = RankMerger(2)
    m.add(CompletionReport.of(0, [rdma(1)]))
    before = m.pending()
    m.add(CompletionReport.of(1, [rdma(1)]))
    assert (before, m.pending()) == (1, 0)


def test_merger_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(InvalidArgumentError):
        RankMerger(2).add(CompletionReport.of(2, [c(1)]))


def test_merger_rejects_a_failed_device_token() -> None:
    with pytest.raises(InvalidArgumentError):
        RankMerger(1).add(CompletionReport.of(0, [], [c(1)]))


def test_merger_rejects_a_world_size_below_one() -> None:
    with pytest.raises(InvalidArgumentError):
        RankMerger(0)


def test_completions_and_stand_ins_import_without_torch() -> None:
    code = (
        "import sys, blockpool, blockpool.core.completions, blockpool.worker.standins; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, capture_output=True).returncode == 0
