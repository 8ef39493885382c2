"""One count per connector transfer: a load or store a connector wiring
begins is counted once, by the core pool where it begins
(``loads_begun``, ``stores_begun``, ``transfer_fences_nonempty`` in its
stats), and the scheduler wiring's counters (``StepHazards.transfers_begun``,
``fences_nonempty``) read that count; the process's ``SERVED``
(``transfers_fenced``, ``fences_nonempty``) shows the same. The core's
``fences`` also count the fences of a step's block copies and writes, which
are no transfer. A transfer the pool refuses shows in none of them. Needs
neither vLLM nor torch."""

from __future__ import annotations

import pytest

from blockpool import AccessKind, HazardAwareBlockPool, StreamKind
from blockpool.integrations.vllm.connectors import MOONCAKE, OFFLOAD_D2H, ConnectorWiring
from blockpool.integrations.vllm.hazards import StepHazards
from blockpool.integrations.vllm.served import SERVED


@pytest.fixture
def wired() -> tuple[HazardAwareBlockPool, ConnectorWiring]:
    pool = HazardAwareBlockPool(16, streams={"compute": StreamKind.DEVICE})
    hz = StepHazards(pool)
    hz.add_stream(MOONCAKE, StreamKind.HOST)
    hz.add_stream(OFFLOAD_D2H, StreamKind.DEVICE)
    return pool, ConnectorWiring("mooncake_store", hz, (16,))


def _counts(pool: HazardAwareBlockPool, w: ConnectorWiring) -> tuple[tuple[int, int], ...]:
    """(begun, non-empty fences) as the hazard wiring, SERVED, the core's
    transfer counts and the core's fence counts show them."""
    stats = pool.stats()
    return (
        (w.hazards.transfers_begun, w.hazards.fences_nonempty),
        (SERVED.transfers_fenced, SERVED.fences_nonempty),
        (stats.loads_begun + stats.stores_begun, stats.transfer_fences_nonempty),
        (stats.fences, stats.fences - stats.empty_fences),
    )


def _delta(after: tuple[tuple[int, int], ...], before: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]


def test_each_transfer_begun_is_one_count_read_alike_by_the_wiring_served_and_the_pool(
    wired: tuple[HazardAwareBlockPool, ConnectorWiring],
) -> None:
    pool, w = wired
    blocks = pool.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    before = _counts(pool, w)
    assert w.load("req-1", ids[:2], MOONCAKE, key=("job", 1)) is not None  # empty fence: fresh blocks
    pool.tag(blocks[2:], pool.issue("compute"), AccessKind.WRITE)  # a step writes the third block
    assert w.store("req-2", ids[2:], OFFLOAD_D2H, key=("job", 2)) is not None  # waits on that step
    assert _delta(_counts(pool, w), before) == [(2, 1), (2, 1), (2, 1), (2, 1)]
    assert (pool.stats().loads_begun, pool.stats().stores_begun) == (1, 1)


def test_a_block_copy_is_no_transfer_and_only_the_cores_fence_count_shows_it(
    wired: tuple[HazardAwareBlockPool, ConnectorWiring],
) -> None:
    pool, w = wired
    blocks = pool.get_new_blocks(4)
    before = _counts(pool, w)
    w.load("req-1", [blocks[0].block_id], MOONCAKE, key=("job", 1))
    assert w.hazards.begin_copies([(blocks[1], blocks[2])]) is not None  # a step's block copy
    w.store("req-1", [blocks[3].block_id], MOONCAKE, key=("job", 2))
    assert _delta(_counts(pool, w), before) == [(2, 0), (2, 0), (2, 0), (3, 0)]


def test_a_refused_or_empty_transfer_is_counted_nowhere(
    wired: tuple[HazardAwareBlockPool, ConnectorWiring],
) -> None:
    pool, w = wired
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, ["p0", "p1"], 0, 2, 16)
    pool.tag(a, pool.issue("compute"), AccessKind.WRITE)  # the first request's step wrote them
    pool.touch(a)  # a second request's prefix hit: a load into them is refused
    before = _counts(pool, w)
    assert w.load("req-2", [b.block_id for b in a], MOONCAKE, key=("job", 3)) is None
    assert w.store("req-3", [0, 999], OFFLOAD_D2H) is None  # the null block and an id outside the pool
    assert _counts(pool, w) == before
    assert w.pending == set()


@pytest.mark.parametrize("failed", [False, True])
def test_finish_ends_every_transfer_under_its_key_completed_or_failed(
    wired: tuple[HazardAwareBlockPool, ConnectorWiring], failed: bool
) -> None:
    pool, w = wired
    blocks = pool.get_new_blocks(2)
    ids = [b.block_id for b in blocks]
    w.load("req-1", ids[:1], MOONCAKE, key=("job", 5))
    w.store("req-1", ids[1:], MOONCAKE, key=("job", 5))
    tokens = [t.token for t in w.hazards.pending_transfers()]
    assert w.finish(("job", 5), failed=failed) == 2
    assert w.hazards.pending_transfers() == [] and all(pool.is_ended(t) for t in tokens)
    assert (blocks[0].block_hash, pool.stats().failed_tokens) == (None, 2 if failed else 0)
