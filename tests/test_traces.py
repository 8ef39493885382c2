"""Trace readers, block-key derivation and the synthetic workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockpool.core.errors import BlockPoolError, InvalidArgumentError
from blockpool.replay.keys import ROOT_DIGEST, BlockKeys
from blockpool.replay.synthetic import SyntheticSpec, synthetic_trace
from blockpool.replay.traces import (
    TraceFormatError,
    TraceNotFoundError,
    read_azure,
    read_mooncake,
    read_trace,
)

GOOD = {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [3, 9]}


def _jsonl(tmp_path: Path, *lines: object, name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def _csv(tmp_path: Path, *rows: str, header: str = "TIMESTAMP,ContextTokens,GeneratedTokens") -> Path:
    p = tmp_path / "t.csv"
    p.write_text("\n".join((header, *rows)) + "\n")
    return p


# -- Mooncake ---------------------------------------------------------------------


def test_mooncake_line_becomes_request_with_512_token_segments(tmp_path: Path) -> None:
    r = read_mooncake(_jsonl(tmp_path, GOOD)).requests[0]
    assert (r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens) == (0, 1.5, 600, 7)
    assert r.segments == ((3, 512), (9, 88))


def test_mooncake_output_ids_are_negative_and_distinct_per_request(tmp_path: Path) -> None:
    reqs = read_mooncake(_jsonl(tmp_path, GOOD, GOOD)).requests
    assert [r.output_id for r in reqs] == [-1, -2]


def test_mooncake_blank_lines_are_ignored(tmp_path: Path) -> None:
    tr = read_mooncake(_jsonl(tmp_path, GOOD, "", "   ", GOOD))
    assert [r.line for r in tr.requests] == [1, 4]
    assert tr.skipped == ()


def test_mooncake_limit_counts_good_requests(tmp_path: Path) -> None:
    tr = read_mooncake(_jsonl(tmp_path, GOOD, GOOD, GOOD), limit=2)
    assert len(tr.requests) == 2


BAD_LINES = [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({**GOOD, "timestamp": -1}, "timestamp is negative"),
    ({**GOOD, "input_length": -5}, "input_length is negative"),
    ({**GOOD, "output_length": -1}, "output_length is negative"),
    ({**GOOD, "output_length": 0}, "output_length must be >= 1"),
    ({**GOOD, "input_length": "600"}, "input_length must be an integer"),
    ({**GOOD, "input_length": True}, "input_length must be an integer"),
    ({**GOOD, "hash_ids": [3]}, "1 hash_ids for input_length 600"),
    ({**GOOD, "hash_ids": [3, -9]}, "negative id"),
    ({**GOOD, "hash_ids": "3,9"}, "hash_ids must be a list of integers"),
    ({k: v for k, v in GOOD.items() if k != "timestamp"}, "missing field 'timestamp'"),
    ({k: v for k, v in GOOD.items() if k != "input_length"}, "missing field 'input_length'"),
    ({k: v for k, v in GOOD.items() if k != "output_length"}, "missing field 'output_length'"),
    ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "missing field 'hash_ids'"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_mooncake_bad_line_raises_error_naming_file_and_line(
    tmp_path: Path, line: object, reason: str
) -> None:
    p = _jsonl(tmp_path, GOOD, line)
    with pytest.raises(TraceFormatError) as ei:
        read_mooncake(p)
    assert (ei.value.path, ei.value.line) == (str(p), 2)
    assert reason in ei.value.reason
    assert str(ei.value).startswith(f"{p}:2: ")


@pytest.mark.parametrize(("line", "reason"), BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_mooncake_bad_line_is_skipped_and_counted_with_skip_flag(
    tmp_path: Path, line: object, reason: str
) -> None:
    tr = read_mooncake(_jsonl(tmp_path, GOOD, line, GOOD), skip_bad_lines=True)
    assert [r.line for r in tr.requests] == [1, 3]
    assert [(s.line, reason in s.reason) for s in tr.skipped] == [(2, True)]


def test_skipped_requests_do_not_take_a_request_id(tmp_path: Path) -> None:
    tr = read_mooncake(_jsonl(tmp_path, "oops", GOOD), skip_bad_lines=True)
    assert [r.request_id for r in tr.requests] == [0]


def test_trace_format_error_is_a_blockpool_error_and_a_value_error() -> None:
    e = TraceFormatError("f", 3, "bad")
    assert isinstance(e, BlockPoolError) and isinstance(e, ValueError)


def test_missing_file_raises_trace_not_found(tmp_path: Path) -> None:
    with pytest.raises(TraceNotFoundError) as ei:
        read_trace(tmp_path / "nope.jsonl")
    assert isinstance(ei.value, FileNotFoundError) and "nope.jsonl" in str(ei.value)


def test_non_utf8_file_raises_format_error_without_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p)
    assert ei.value.line is None


def test_negative_limit_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        read_trace(_jsonl(tmp_path, GOOD), limit=-1)


# -- Azure --------------------------------------------------------------------------


def test_azure_rows_become_requests_with_relative_arrivals(tmp_path: Path) -> None:
    tr = read_azure(
        _csv(tmp_path, "2023-11-16 18:17:03.9799600,4808,10", "2023-11-16 18:17:04.0319600,3180,8")
    )
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.line) for r in tr.requests] == [
        (0.0, 4808, 10, 2),
        (0.052, 3180, 8, 3),
    ]


def test_azure_requests_share_no_content(tmp_path: Path) -> None:
    tr = read_azure(_csv(tmp_path, "10.0,100,5", "11.0,100,5"))
    ids = [cid for r in tr.requests for cid, _ in r.segments] + [r.output_id for r in tr.requests]
    assert len(set(ids)) == 4 and all(i < 0 for i in ids)


def test_azure_header_without_a_column_raises_even_with_skip_flag(tmp_path: Path) -> None:
    p = _csv(tmp_path, "1.0,10", header="TIMESTAMP,ContextTokens")
    with pytest.raises(TraceFormatError) as ei:
        read_azure(p, skip_bad_lines=True)
    assert ei.value.line == 1 and "GeneratedTokens" in ei.value.reason


AZURE_BAD = [
    ("2023-11-16 18:17:04,abc,8", "ContextTokens must be an integer"),
    ("2023-11-16 18:17:04,-3,8", "ContextTokens is negative"),
    ("2023-11-16 18:17:04,30,0", "GeneratedTokens must be >= 1"),
    ("2023-11-16 18:17:04,,8", "missing field 'ContextTokens'"),
    ("yesterday,30,8", "TIMESTAMP 'yesterday'"),
    ("2023-11-16 18:17:04,30", "missing field 'GeneratedTokens'"),
    ("2023-11-16 18:17:04,30,8,9", "4 fields, expected 3"),
]


@pytest.mark.parametrize(("row", "reason"), AZURE_BAD, ids=[r for _, r in AZURE_BAD])
def test_azure_bad_row_raises_error_naming_file_and_line(tmp_path: Path, row: str, reason: str) -> None:
    p = _csv(tmp_path, "2023-11-16 18:17:03,10,1", row)
    with pytest.raises(TraceFormatError) as ei:
        read_azure(p)
    assert (ei.value.path, ei.value.line) == (str(p), 3)
    assert reason in ei.value.reason


@pytest.mark.parametrize(("row", "reason"), AZURE_BAD, ids=[r for _, r in AZURE_BAD])
def test_azure_bad_row_is_skipped_and_counted_with_skip_flag(tmp_path: Path, row: str, reason: str) -> None:
    tr = read_azure(
        _csv(tmp_path, "2023-11-16 18:17:03,10,1", row, "2023-11-16 18:17:05,10,1"), skip_bad_lines=True
    )
    assert [r.line for r in tr.requests] == [2, 4]
    assert [(s.line, reason in s.reason) for s in tr.skipped] == [(3, True)]


# -- format detection -------------------------------------------------------------


def test_read_trace_tells_mooncake_by_suffix(tmp_path: Path) -> None:
    assert read_trace(_jsonl(tmp_path, GOOD)).format == "mooncake"


def test_read_trace_tells_azure_by_suffix(tmp_path: Path) -> None:
    assert read_trace(_csv(tmp_path, "1.0,10,2")).format == "azure"


def test_read_trace_sniffs_json_objects_without_suffix(tmp_path: Path) -> None:
    assert read_trace(_jsonl(tmp_path, GOOD, name="trace.txt")).format == "mooncake"


# -- block keys --------------------------------------------------------------------


def test_each_512_token_hash_id_gives_32_sub_block_keys_of_16_tokens() -> None:
    keys = BlockKeys([(3, 512), (9, 512)], 16)
    assert len(keys) == 64
    assert [k[1:] for k in keys.full[:2]] + [k[1:] for k in keys.full[31:33]] == [
        (3, 0),
        (3, 1),
        (3, 31),
        (9, 0),
    ]


def test_sub_block_key_is_parent_digest_hash_id_and_index() -> None:
    keys = BlockKeys([(3, 512)], 16)
    assert keys.full[0] == (ROOT_DIGEST, 3, 0)
    assert keys.full[5] == (hash(keys.full[4]), 3, 5)


def test_requests_sharing_a_prefix_share_its_keys_and_no_more() -> None:
    a = BlockKeys([(0, 512), (1, 512)], 16).full
    b = BlockKeys([(0, 512), (2, 512)], 16).full
    assert a[:32] == b[:32]
    assert all(x != y for x, y in zip(a[32:], b[32:]))


def test_same_hash_id_after_different_prefix_gives_different_keys() -> None:
    a = BlockKeys([(0, 512), (5, 512)], 16).full
    b = BlockKeys([(1, 512), (5, 512)], 16).full
    assert a[32][1:] == b[32][1:] and a[32] != b[32]


def test_partial_last_block_has_no_full_key() -> None:
    keys = BlockKeys([(3, 512), (9, 100)], 16)
    assert len(keys) == 32 + 6 and keys.num_tokens == 612


def test_partial_key_names_the_prefix_and_differs_from_full_keys() -> None:
    keys = BlockKeys([(3, 512), (9, 100)], 16)
    assert keys.partial(38, 4) == (hash(keys.full[37]), 9, 96, 4)
    assert keys.partial(0, 15) not in set(keys.full)


def test_partial_key_beyond_the_sequence_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockKeys([(3, 20)], 16).partial(1, 5)


def test_block_spanning_two_segments_gets_piece_key() -> None:
    keys = BlockKeys([(1, 10), (2, 30)], 16)
    assert keys.full[0] == (ROOT_DIGEST, 1, 0, 10, 2, 0, 6)
    assert keys.full[1] == (hash(keys.full[0]), 2, 6, 16)


def test_block_keys_reject_a_bad_block_size() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockKeys([(1, 10)], 0)


def test_block_keys_do_not_depend_on_the_hash_seed() -> None:
    code = "from blockpool.replay.keys import BlockKeys; print(hash(BlockKeys([(3, 512), (-1, 40)], 16).full[-1]))"
    root = str(Path(__file__).resolve().parents[1])
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


# -- synthetic workload --------------------------------------------------------------


def test_synthetic_trace_is_deterministic_in_its_seed() -> None:
    spec = SyntheticSpec(num_requests=40)
    assert synthetic_trace(spec, seed=3).requests == synthetic_trace(spec, seed=3).requests


def test_synthetic_trace_differs_between_seeds() -> None:
    spec = SyntheticSpec(num_requests=40)
    assert synthetic_trace(spec, seed=3).requests != synthetic_trace(spec, seed=4).requests


def test_synthetic_next_turn_prompt_extends_previous_prompt_and_answer() -> None:
    reqs = synthetic_trace(SyntheticSpec(num_requests=60), seed=0).requests
    by_output = {r.output_id: r for r in reqs}
    follow = [r for r in reqs if len(r.segments) > 2]
    assert follow
    r = follow[0]
    prev = by_output[r.segments[-2][0]]
    assert r.segments[:-1] == (*prev.segments, (prev.output_id, prev.output_tokens))


def test_synthetic_requests_are_in_arrival_order_with_positional_ids() -> None:
    reqs = synthetic_trace(SyntheticSpec(num_requests=50), seed=0).requests
    assert [r.request_id for r in reqs] == list(range(50))
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_synthetic_spec_rejects_a_non_positive_count() -> None:
    with pytest.raises(InvalidArgumentError):
        SyntheticSpec(num_requests=0)
