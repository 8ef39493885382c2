"""``StepHazards`` alone (no vLLM: fakes stand for its outputs): a
connector's ``invalid_block_ids`` end a load with exactly those blocks bad
and reach vLLM as reported, an engine's rewrites of the blocks it received
are writes by the next step, the zeroing of a step's new blocks is a write
by the step's copy token, and the blocks held back for transfers in flight
are counted for the scheduler."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

from blockpool import HazardAwareBlockPool, StreamKind
from blockpool.core.errors import UnknownStreamError
from blockpool.integrations.vllm.hazards import StepHazards, StepRecord


def wired(num_blocks: int = 16) -> tuple[HazardAwareBlockPool, StepHazards]:
    pool = HazardAwareBlockPool(num_blocks, streams={"compute": StreamKind.DEVICE})
    hz = StepHazards(pool)
    hz.add_stream("nic", StreamKind.HOST)
    return pool, hz


def test_a_load_reported_invalid_in_some_blocks_ends_with_exactly_those_bad() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(4)
    load = hz.begin_load("r", blocks, "nic")
    pool.cache_full_blocks(blocks, ["k0", "k1", "k2", "k3"], 0, 4, 16)
    report = NS(invalid_block_ids=frozenset({blocks[2].block_id}), finished_recving={"r"})
    assert hz.on_connector_output(report) == 1
    assert report.invalid_block_ids == frozenset({blocks[2].block_id})  # left as the connector made it
    assert pool.invalid_block_ids(load.token) == [blocks[2].block_id]
    assert pool.token_status(load.token).value == "completed"
    assert [pool.get_cached_block(k) for k in ("k0", "k1", "k2", "k3")] == [
        blocks[0],
        blocks[1],
        None,
        blocks[3],
    ]
    assert (hz.loads_failed_in_part, hz.pending_transfers()) == (1, [])


def test_a_load_reported_invalid_in_every_block_fails_whole() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(2)
    load = hz.begin_load("r", blocks, "nic")
    assert hz.end_transfers(invalid_block_ids=[b.block_id for b in blocks]) == 1
    assert pool.token_status(load.token).value == "failed"
    assert pool.invalid_block_ids(load.token) == [b.block_id for b in blocks]
    assert hz.loads_failed_in_part == 0


def test_a_failed_request_fails_its_load_whole_before_its_invalid_blocks_are_read() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(3)
    load = hz.begin_load("r", blocks, "nic")
    ended = hz.end_transfers(
        failed_recving={"r"}, finished_recving={"r"}, invalid_block_ids=[blocks[0].block_id]
    )
    assert ended == 1
    assert pool.token_status(load.token).value == "failed"
    assert pool.invalid_block_ids() == [b.block_id for b in blocks]


def test_only_the_part_of_a_load_that_wrote_an_invalid_block_ends() -> None:
    pool, hz = wired()
    first, second = pool.get_new_blocks(2), pool.get_new_blocks(2)
    a = hz.begin_load("r", first, "nic")
    b = hz.begin_load("r", second, "nic")
    assert hz.end_transfers(invalid_block_ids=[first[1].block_id]) == 1
    assert pool.invalid_block_ids() == [first[1].block_id]
    assert (pool.is_ended(a.token), pool.is_ended(b.token)) == (True, False)
    assert hz.pending_transfers() == [b]
    assert hz.end_transfers(finished_recving={"r"}) == 1
    assert pool.token_status(b.token).value == "completed"


def test_invalid_blocks_no_load_of_the_pool_wrote_are_left_as_reported() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(2)
    load = hz.begin_load("r", blocks[:1], "nic")
    reported = {blocks[1].block_id}
    assert hz.on_connector_output(NS(invalid_block_ids=reported)) == 0
    assert reported == {blocks[1].block_id}
    assert pool.invalid_block_ids() == []
    assert hz.pending_transfers() == [load]


def received(rewrites: bool = True) -> tuple[HazardAwareBlockPool, StepHazards, list[Any], StepRecord | None]:
    """Two blocks read by the engine ``nic`` (one that rewrites what it
    receives when ``rewrites``), reported finished after a step was issued.
    Returns the pool, the wiring, the blocks and that step's record."""
    pool, hz = wired()
    if rewrites:
        hz.rewrites_on_receive("nic")
    blocks = pool.get_new_blocks(2)
    hz.begin_load("r", blocks, "nic")
    issued = hz.step_record(NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=None))
    assert hz.on_connector_output(NS(finished_recving={"r"})) == 1
    return pool, hz, blocks, issued


def test_blocks_an_engine_rewrites_on_receive_are_written_by_the_next_steps_forward() -> None:
    _, hz, blocks, issued = received()
    after = hz.step_record(NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=None))
    assert issued is not None and after is not None and after.forward.seq == issued.forward.seq + 1
    assert hz.begin_store("r", blocks, "nic").fence.tokens == (after.forward,)
    assert hz.blocks_rewritten_on_receive == 2


def test_an_empty_step_after_a_receive_gets_a_record_whose_forward_token_writes_the_blocks() -> None:
    _, hz, blocks, _ = received()
    empty = hz.step_record(NS(total_num_scheduled_tokens=0, new_block_ids_to_zero=None))
    assert empty is not None and empty.copies is None
    assert hz.begin_store("r", blocks, "nic").fence.tokens == (empty.forward,)
    assert (
        hz.step_record(NS(total_num_scheduled_tokens=0, new_block_ids_to_zero=None)) is None
    )  # nothing left to write


def test_blocks_received_by_an_engine_that_does_not_rewrite_them_are_not_written_again() -> None:
    _, hz, blocks, _ = received(rewrites=False)
    hz.step_record(NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=None))
    assert hz.begin_store("r", blocks, "nic").fence.tokens == ()
    assert hz.blocks_rewritten_on_receive == 0


def test_a_failed_read_is_not_rewritten() -> None:
    pool, hz = wired()
    hz.rewrites_on_receive("nic")
    blocks = pool.get_new_blocks(2)
    hz.begin_load("r", blocks, "nic")
    hz.on_connector_output(NS(finished_recving={"r"}, failed_recving={"r"}))
    assert hz.step_record(NS(total_num_scheduled_tokens=0, new_block_ids_to_zero=None)) is None
    assert hz.blocks_rewritten_on_receive == 0


def test_a_received_block_freed_before_the_next_step_keeps_the_write_for_its_next_user() -> None:
    pool, hz, blocks, _ = received()
    pool.free_blocks(blocks)
    after = hz.step_record(NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=None))
    assert after is not None
    again = pool.get_new_blocks(2)
    assert {b.block_id for b in again} == {b.block_id for b in blocks}
    assert hz.begin_load("s", again, "nic").fence.tokens == (after.forward,)


def test_a_received_block_loaded_again_before_the_next_step_keeps_that_load_as_its_writer() -> None:
    # The block is freed and handed out again, and a new read into it begins
    # in the schedule() that learnt of the first read, before the step
    # that would carry the rewrite is issued: the rewrite must not replace
    # the new read in the block's shadow, or a free of it while that read
    # is in flight would not be held back.
    pool, hz, blocks, _ = received()
    pool.free_blocks(blocks)
    again = pool.get_new_blocks(2)
    assert {b.block_id for b in again} == {b.block_id for b in blocks}
    second = hz.begin_load("s", again, "nic")
    assert hz.step_record(NS(total_num_scheduled_tokens=0, new_block_ids_to_zero=None)) is not None
    assert [b.writer for b in again] == [second.token, second.token]
    assert hz.blocks_rewritten_on_receive == 0
    pool.free_blocks(again)
    assert pool.held_block_ids() == sorted(b.block_id for b in again)


def test_rewrites_on_receive_refuses_an_engine_never_added() -> None:
    _, hz = wired()
    with pytest.raises(UnknownStreamError):
        hz.rewrites_on_receive("rdma")
    hz.rewrites_on_receive("nic")
    hz.rewrites_on_receive("nic")  # idempotent


def test_a_steps_zeroing_without_copies_gets_a_token_that_a_later_load_waits_on() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(2)
    ids = [b.block_id for b in blocks]
    record = hz.step_record(NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=ids))
    assert record is not None and record.copies is not None
    assert (record.copies.stream, record.copies.seq, record.forward.seq) == ("compute", 1, 2)
    assert hz.blocks_zeroed == 2
    load = hz.begin_load("r", blocks, "nic")
    assert load.fence.tokens == (record.copies,) and load.fence.needs_host_wait


def test_a_steps_zeroing_with_copies_is_written_by_the_copy_token() -> None:
    pool, hz = wired()
    src, dst, new = pool.get_new_blocks(3)
    copy, _ = hz.begin_copies([(src, dst)])
    record = hz.step_record(
        NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=[dst.block_id, new.block_id])
    )
    assert record is not None and record.copies == copy
    assert hz.begin_load("r", [new], "nic").fence.tokens == (copy,)


def test_a_zeroing_that_cannot_be_ordered_before_the_copies_is_not_tagged() -> None:
    pool, hz = wired()
    src, dst, new = pool.get_new_blocks(3)
    copy, _ = hz.begin_copies([(src, dst)])
    pool.issue("compute")  # ordered after the copy token already
    record = hz.step_record(NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=[new.block_id]))
    assert record is not None and record.copies == copy
    assert (hz.zeroings_untagged, hz.blocks_zeroed) == (1, 0)
    assert hz.begin_load("r", [new], "nic").fence.tokens == ()


def test_zeroing_a_block_a_failed_load_left_bad_rewrites_it() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(2)
    load = hz.begin_load("r", blocks, "nic")
    pool.fail(load.token)
    assert pool.invalid_block_ids() == [b.block_id for b in blocks]
    hz.step_record(NS(total_num_scheduled_tokens=8, new_block_ids_to_zero=[blocks[0].block_id]))
    assert pool.invalid_block_ids() == [blocks[1].block_id]


def test_blocks_on_their_way_counts_the_blocks_held_for_transfers_in_flight() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(3)
    store = hz.begin_store("r", blocks[:2], "nic")
    pool.free_blocks(blocks)
    assert hz.blocks_on_their_way() == 2 and pool.get_num_free_blocks() == 13
    pool.complete(store.token)
    assert hz.blocks_on_their_way() == 0 and pool.get_num_free_blocks() == 15
