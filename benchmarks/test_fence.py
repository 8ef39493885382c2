"""Allocation for a load whose fence is not empty (blockpool only).

The cycle a CPU-offload load makes while the previous step still runs:
``allocate_for(n, "h2d")`` takes n blocks that the last step (a live
``compute`` token) read, so the load's fence names that token (WAR); the
step then completes, the next step is issued, and the blocks are freed
with its token. ``on`` computes and records the fence; ``off`` makes the
same calls with hazard tracking off (empty fences). 4,097-block pools.
"""

from __future__ import annotations

from typing import Any

import pytest
from _pools import make_pool

POOL_BLOCKS = 4097


@pytest.mark.parametrize("n", [16, 256])
def test_allocate_for_load_with_fence(benchmark: Any, ours: str, n: int) -> None:
    pool = make_pool(ours, POOL_BLOCKS)
    step = [pool.issue("compute")]
    pool.free_blocks(pool.get_new_blocks(n), step[0])

    def cycle() -> Any:
        blocks, fence = pool.allocate_for(n, "h2d")
        pool.complete(step[0])
        step[0] = pool.issue("compute")
        pool.free_blocks(blocks, step[0])
        return fence

    for _ in range(3):
        fence = cycle()
        assert bool(fence) == (ours == "on"), fence
    scenario = f"allocate_for({n}, 'h2d') with a non-empty fence + free"
    benchmark.group = scenario
    benchmark.extra_info.update(scenario=scenario, kind=ours, blocks_per_call=n, section="fence")
    benchmark(cycle)
    assert bool(cycle()) == (ours == "on")
