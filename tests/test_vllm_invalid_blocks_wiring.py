"""``StepHazards`` alone (no vLLM: fakes stand for its outputs): the pool's
bad blocks join a connector's ``invalid_block_ids``, the zeroing of a
step's new blocks is a write by the step's copy token, and the blocks held
back for transfers in flight are counted for the scheduler."""

from __future__ import annotations

from types import SimpleNamespace as NS

from blockpool import HazardAwareBlockPool, StreamKind
from blockpool.integrations.vllm.hazards import StepHazards


def wired(num_blocks: int = 16) -> tuple[HazardAwareBlockPool, StepHazards]:
    pool = HazardAwareBlockPool(num_blocks, streams={"compute": StreamKind.DEVICE})
    hz = StepHazards(pool)
    hz.add_stream("nic", StreamKind.HOST)
    return pool, hz


def test_a_report_whose_invalid_blocks_are_not_a_set_gets_a_new_set_with_the_pools() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(3)
    hz.begin_load("r", blocks, "nic")
    report = NS(invalid_block_ids=frozenset({blocks[2].block_id}))
    assert hz.on_connector_output(report) == 1
    assert report.invalid_block_ids == {b.block_id for b in blocks}
    assert hz.invalid_blocks_added == 2


def test_invalid_blocks_no_load_of_the_pool_wrote_are_left_as_reported() -> None:
    pool, hz = wired()
    blocks = pool.get_new_blocks(2)
    hz.begin_load("r", blocks[:1], "nic")
    reported = {blocks[1].block_id}
    assert hz.on_connector_output(NS(invalid_block_ids=reported)) == 0
    assert reported == {blocks[1].block_id}
    assert (hz.invalid_blocks_added, hz.invalid_reports_disagreeing) == (0, 0)
    assert pool.invalid_block_ids() == []


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
