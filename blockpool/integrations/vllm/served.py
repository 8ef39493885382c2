"""What our pool served vLLM in this process: :data:`SERVED`.

Written by three parts of the integration, none of which owns it: the pool
adapter (:class:`~blockpool.integrations.vllm.pool.VllmBlockPool`:
allocations, frees, hits, blocks cached), the scheduler wiring
(:mod:`blockpool.integrations.vllm`: steps issued and ended, copy batches)
and the hazard wiring (:class:`~blockpool.integrations.vllm.hazards.StepHazards`:
each connector transfer begun is counted once, where it begins on the pool,
in that pool's ``transfers_begun`` and ``fences_nonempty`` and here). Read by the parity harness's pytest plugin
(:mod:`~blockpool.integrations.vllm.pytest_plugin`) as the proof that the
core, not vLLM's pool, did the work. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import attrs

__all__ = ["SERVED", "Served"]


@attrs.define
class Served:
    """Work done by every :class:`~blockpool.integrations.vllm.pool.VllmBlockPool`
    core in this process (the proof that the core, not vLLM's pool, served
    vLLM's calls), and by the scheduler wiring (steps issued and ended, steps
    seen without a token because nothing could wait on one, copy batches
    begun, preemptions the scheduler did not make because blocks held back
    for transfers in flight were coming back, runs of such deferrals that
    reached their bound in steps so that vLLM preempted as stock, host
    transfers given up when their lease ended, faults of the wiring that
    answered vLLM as stock) and by the connector wiring (transfers begun
    with a fence, and how many of those fences were non-empty)."""

    pools: int = 0
    allocations: int = 0
    blocks_allocated: int = 0
    frees: int = 0
    blocks_freed: int = 0
    cache_hits: int = 0
    blocks_cached: int = 0
    steps_issued: int = 0
    steps_untokened: int = 0
    steps_ended: int = 0
    copy_batches: int = 0
    preemptions_deferred: int = 0
    deferrals_given_up: int = 0
    transfers_given_up: int = 0
    wiring_faults: int = 0
    transfers_fenced: int = 0
    fences_nonempty: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name. O(fields)."""
        return attrs.asdict(self)


SERVED = Served()
"""Process-wide counters, updated on the scheduler's thread (no lock: they
are a report, not state)."""
