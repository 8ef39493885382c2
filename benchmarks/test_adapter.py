"""The vLLM adapter's own-block check: ``free_blocks`` of 256 blocks, per block.

Each pool has 32,769 blocks; every round takes 256 blocks from the free
queue (``get_new_blocks``, not timed) and times one ``free_blocks`` of them
(``benchmark.pedantic``, one call per round). Variants, in one run:

- ``core`` (the baseline): :class:`~blockpool.HazardAwareBlockPool`, hazards
  on, its default blocks (the pool's own class: the check is a type test);
  the free is tagged with a live ``compute`` token.
- ``vLLM adapter``: :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`
  (hazards on, a live ``compute`` token, so frees are tagged as in
  ``core``): vLLM's block records, of the pool's own subclass.
- ``vLLM adapter, identity check``: the same, with the core told nothing
  about the blocks' class (``blocks[b.block_id] is b`` per block: the check
  every adapter free took before the per-pool class).
- ``vLLM``: the installed vLLM's own ``BlockPool`` (no hazards).

The adapter rows need a supported vLLM (``.venv-vllm034``, or another
line's venv); they are skipped otherwise.
"""

from __future__ import annotations

from typing import Any

import pytest
from _pools import BLOCK_SIZE, make_pool, vllm_missing

POOL_BLOCKS = 32769
N = 256
VARIANTS = ("core", "vLLM adapter", "vLLM adapter, identity check", "vLLM")


def _pool(variant: str) -> tuple[Any, tuple[Any, ...]]:
    """The pool and the extra arguments of its ``free_blocks``."""
    if variant == "core":
        pool = make_pool("on", POOL_BLOCKS)
        return pool, (pool.issue("compute"),)
    reason = vllm_missing()
    if reason is not None:
        pytest.skip(reason)
    if variant == "vLLM":
        return make_pool("vllm", POOL_BLOCKS), ()
    from blockpool.integrations.vllm.pool import VllmBlockPool

    pool = VllmBlockPool(POOL_BLOCKS, True, BLOCK_SIZE, track_hazards=True)
    if variant.endswith("identity check"):
        pool.core._block_cls = object  # no block is of this class: identity test per block
    pool.core.issue("compute")  # a live step: the adapter tags frees with it
    return pool, ()


@pytest.mark.parametrize("variant", VARIANTS)
def test_free_blocks_own_block_check(benchmark: Any, variant: str) -> None:
    pool, extra = _pool(variant)
    free = pool.get_num_free_blocks()
    pool.free_blocks(pool.get_new_blocks(N), *extra)
    assert pool.get_num_free_blocks() == free

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (pool.get_new_blocks(N), *extra), {}

    scenario = (
        f"vLLM adapter: free_blocks({N}) with the own-block check, {POOL_BLOCKS - 1:,} blocks, per block"
    )
    benchmark.group = scenario
    benchmark.extra_info.update(
        scenario=scenario, kind=variant, blocks_per_call=N, section="adapter", baseline="core"
    )
    benchmark.pedantic(pool.free_blocks, setup=setup, rounds=400, warmup_rounds=20)
    assert pool.get_num_free_blocks() == free
