"""Configuration of a replay (:class:`ReplayConfig`) and its errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockpool.core.errors import BlockPoolError, InvalidArgumentError
from blockpool.core.hazards import StreamKind
from blockpool.sim.simulator import DEFAULT_STREAM_SPECS, CostModel, StreamSpec

__all__ = [
    "DEFAULT_NUM_BLOCKS",
    "SYNTHETIC_NUM_BLOCKS",
    "ReplayConfig",
    "ReplayError",
    "check_fits",
    "request_blocks",
]

DEFAULT_NUM_BLOCKS = 16384
"""Default pool size for a trace: 16,384 blocks of 16 tokens (262,144 tokens,
32 GiB of Llama-3.1-8B KV): about what an 80 GB H100 holds beside the
weights, and small enough that the Mooncake conversation trace evicts,
preempts and loads."""

SYNTHETIC_NUM_BLOCKS = 2048
"""Default pool size for the built-in synthetic workload (under pressure at
its smaller scale)."""


class ReplayError(BlockPoolError, RuntimeError):
    """A replay could not go on (no event left while requests still wait),
    or ended with blocks that were never returned to the pool."""


def request_blocks(prompt_tokens: int, output_tokens: int, block_size: int) -> int:
    """Blocks a request needs at its longest: ``ceil((prompt_tokens +
    output_tokens) / block_size)``. A request needing more than the pool's
    ``num_blocks - 1`` (the null block is never handed out) is rejected on
    arrival by the replay. O(1)."""
    return -(-(prompt_tokens + output_tokens) // block_size)


def check_fits(requests: Sequence[Any], config: ReplayConfig, *, name: str = "num_blocks") -> None:
    """Refuse a pool too small for every request: a replay of it would
    reject them all and report nothing but zeros. ``requests`` are
    :class:`~blockpool.replay.traces.TraceRequest` (``prompt_tokens``,
    ``output_tokens``); an empty sequence passes. ``name`` is what the
    message calls the pool size (the command line passes its option,
    ``--num-blocks``). O(len(requests)).

    Raises:
        InvalidArgumentError: not one request fits in ``config.num_blocks
            - 1`` blocks of ``config.block_size`` tokens; names the
            smallest request's need.
    """
    if not requests:
        return
    need = min(request_blocks(r.prompt_tokens, r.output_tokens, config.block_size) for r in requests)
    cap = config.num_blocks - 1
    if need > cap:
        n = len(requests)
        raise InvalidArgumentError(
            f"{name} {config.num_blocks} is too small for any of the {n} request{'s' if n != 1 else ''}: "
            f"the pool hands out {cap} block{'s' if cap != 1 else ''} (the null block is never handed out) and "
            f"the smallest request needs {need} blocks of {config.block_size} tokens"
        )


def _int_at_least(lo: int):  # type: ignore[no-untyped-def]
    def check(_: object, a: attrs.Attribute, v: object) -> None:  # type: ignore[type-arg]
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise InvalidArgumentError(f"{a.name} must be an int >= {lo}, got {v!r}")

    return check


def _fraction(_: object, a: attrs.Attribute, v: object) -> None:  # type: ignore[type-arg]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise InvalidArgumentError(f"{a.name} must be in [0, 1], got {v!r}")


def _known_eviction(v: object) -> None:
    from blockpool.core.eviction import EVICTION_POLICIES, UnknownEvictionPolicyError

    if v not in EVICTION_POLICIES:
        raise UnknownEvictionPolicyError(
            f"unknown eviction policy {v!r}; choose from {', '.join(EVICTION_POLICIES)}"
        )


def _known_placement(v: object) -> None:
    from blockpool.core.eviction import UnknownEvictionPolicyError
    from blockpool.core.pool import PLACEMENTS

    if v not in PLACEMENTS:
        raise UnknownEvictionPolicyError(f"unknown placement {v!r}; choose from {', '.join(PLACEMENTS)}")


@attrs.frozen(slots=True)
class ReplayConfig:
    """Everything a replay depends on besides the trace and the policy.

    Attributes:
        block_size: Tokens per block.
        num_blocks: Blocks in the pool, null block included.
        seed: Seed of the request plans (tier, aborts) and of the simulator.
        max_batched_tokens: Token budget per step (vLLM's
            ``max_num_batched_tokens``; 8192 as vLLM V1's default for online
            serving on large GPUs).
        max_num_seqs: Requests per step (vLLM's default 256).
        async_scheduling: Enqueue step N+1 before step N's output is seen.
        watermark: Fraction of blocks a new request must leave free
            (vLLM's ``watermark``, 0.01).
        abort_fraction: Fraction of requests aborted by their client; each
            abort comes while queued, while its load is in flight, or during
            its answer (a third each, seeded).
        remote_fraction: Fraction of requests whose external tier is the
            remote store (``rdma`` loads, ``xfer`` stores) instead of CPU
            offload (``h2d`` loads, ``d2h`` stores).
        store_capacity_blocks: Blocks the external store keeps (LRU);
            262,144 = 512 GiB of 2 MiB blocks (assumption: a host's DRAM tier).
        sched_overhead_s: Host time to build a step (0.5 ms; assumption).
        cost: The :class:`~blockpool.sim.simulator.CostModel`.
        streams: The machine (must define ``compute`` and the streams below).
        load_streams, store_streams: ``(cpu offload, remote)`` stream names.
        check_every: Call ``pool.check()`` every this many steps (0: never).
        timeline: Works kept per stream for the timeline plot.
        eviction: The pool's eviction policy (``"lru"``, ``"s3fifo"``,
            ``"2q"``; :mod:`blockpool.core.eviction`).
        placement: The pool's placement (one of
            :data:`blockpool.core.pool.PLACEMENTS`: ``"lru"``, ``"ready_first"``,
            ``"ready_first_cached"``, ``"runs"``, ``"runs_cached"``,
            ``"ready_first_runs"``; see
            :class:`~blockpool.core.pool.HazardAwareBlockPool`); with any mode
            but ``"lru"`` the scheduler also allocates a load's blocks
            with ``allocate_for(n, load stream)`` (placed for the load)
            instead of ``get_new_blocks``.

    Raises:
        InvalidArgumentError: a bad figure, or streams that lack one named here.
    """

    block_size: int = attrs.field(default=16, validator=_int_at_least(1))
    num_blocks: int = attrs.field(default=DEFAULT_NUM_BLOCKS, validator=_int_at_least(2))
    seed: int = attrs.field(default=0, validator=_int_at_least(-(2**63)))
    max_batched_tokens: int = attrs.field(default=8192, validator=_int_at_least(1))
    max_num_seqs: int = attrs.field(default=256, validator=_int_at_least(1))
    async_scheduling: bool = True
    watermark: float = attrs.field(default=0.01, validator=_fraction)
    abort_fraction: float = attrs.field(default=0.05, validator=_fraction)
    remote_fraction: float = attrs.field(default=0.5, validator=_fraction)
    store_capacity_blocks: int | None = 262_144
    sched_overhead_s: float = 0.5e-3
    cost: CostModel = attrs.field(factory=CostModel)
    streams: Mapping[str, StreamSpec] = attrs.field(
        factory=lambda: dict(DEFAULT_STREAM_SPECS), eq=False, hash=False
    )
    load_streams: tuple[str, str] = ("h2d", "rdma")
    store_streams: tuple[str, str] = ("d2h", "xfer")
    check_every: int = attrs.field(default=0, validator=_int_at_least(0))
    timeline: int = attrs.field(default=300, validator=_int_at_least(0))
    eviction: str = attrs.field(default="lru", validator=lambda _, __, v: _known_eviction(v))
    placement: str = attrs.field(default="lru", validator=lambda _, __, v: _known_placement(v))

    def __attrs_post_init__(self) -> None:
        names = {"compute", *self.load_streams, *self.store_streams}
        missing = sorted(n for n in names if n not in self.streams)
        if missing:
            raise InvalidArgumentError(f"streams lack {missing}")
        if self.streams["compute"].kind is not StreamKind.DEVICE:
            raise InvalidArgumentError("'compute' must be a DEVICE stream")
        for n in (*self.load_streams, *self.store_streams):
            if self.streams[n].bandwidth is None:
                raise InvalidArgumentError(f"transfer stream {n!r} needs a bandwidth")
        if self.sched_overhead_s < 0:
            raise InvalidArgumentError("sched_overhead_s must be >= 0")
        if self.store_capacity_blocks is not None and self.store_capacity_blocks < 1:
            raise InvalidArgumentError("store_capacity_blocks must be >= 1 or None")

    def to_json(self) -> dict[str, object]:
        """The configuration as JSON-ready data. O(#streams)."""
        out = attrs.asdict(self, filter=lambda a, _: a.name not in ("streams", "cost"))
        out["cost"] = attrs.asdict(self.cost)
        out["streams"] = {
            n: {**attrs.asdict(s, filter=lambda a, _: a.name != "kind"), "kind": s.kind.value}
            for n, s in self.streams.items()
        }
        out["load_streams"] = list(self.load_streams)
        out["store_streams"] = list(self.store_streams)
        return out
