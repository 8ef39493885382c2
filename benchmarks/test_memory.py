"""Memory per block and construction time at 10^6 blocks.

``bytes per block``: what ``tracemalloc`` sees allocated while a pool of
1,000,000 blocks is built, divided by 1,000,000 (block records, their id
ints, the block list, the free queue; for vLLM also the ``pool``
back-reference costs nothing extra, it is a slot). A second figure,
``bytes per block after use``, is taken after every block was allocated
and freed once (with a live ``compute`` token for our pools, so every
block's shadow is set): it shows that shadows add no per-block memory (the
token objects are shared). A third, ``bytes per block with generations``
(our pools only), adds what turning block generations on costs (the first
``generations()`` call) and another use of every block with them on.

The timed part is the construction itself (``pool construction`` rows).
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

from _pools import make_pool

BLOCKS = 1_000_000


def _traced(fn: Any) -> tuple[Any, int]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        out = fn()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return out, after - before


def test_memory_and_construction(benchmark: Any, kind: str) -> None:
    pool, built = _traced(lambda: make_pool(kind, BLOCKS))
    tok = pool.issue("compute") if kind != "vllm" else None

    def use() -> None:
        blocks = pool.get_new_blocks(BLOCKS - 1)
        if tok is None:
            pool.free_blocks(blocks)
        else:
            pool.free_blocks(blocks, tok)

    _, used = _traced(use)
    gens = None
    if kind != "vllm":
        # Block generations (stale block tables): off until the first
        # generations() call; then one word per block, stamped by each
        # allocation (a second use shows the stamping allocates nothing).
        _, gens = _traced(lambda: pool.generations([]))
        _, gens_used = _traced(use)
        gens += gens_used
    pool = tok = None
    gc.collect()
    scenario = "pool construction, 1,000,000 blocks"
    benchmark.group = scenario
    benchmark.extra_info.update(
        scenario=scenario,
        kind=kind,
        section="memory",
        blocks=BLOCKS,
        bytes_per_block=built / BLOCKS,
        bytes_per_block_after_use=(built + used) / BLOCKS,
        bytes_per_block_with_generations=None if gens is None else (built + used + gens) / BLOCKS,
    )
    benchmark.pedantic(make_pool, args=(kind, BLOCKS), rounds=3, iterations=1, warmup_rounds=0)
