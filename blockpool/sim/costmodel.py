"""The cost model of the stream simulator: durations of forward steps, block
copies and transfers, and the streams of the simulated machine.

Every default is either sourced (a datasheet, a model card) or labelled as an
assumption in the docstrings below and in ``docs/replay.md``.

>>> CostModel().block_bytes(16)
2097152
>>> round(DEFAULT_STREAM_SPECS["h2d"].transfer_seconds(50 * 10**9), 6)
1.00001
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from blockpool.core.errors import InvalidArgumentError
from blockpool.core.hazards import StreamKind

__all__ = ["DEFAULT_STREAM_SPECS", "CostModel", "StreamSpec"]


def _nonneg(_: object, a: attrs.Attribute, v: float) -> None:  # type: ignore[type-arg]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise InvalidArgumentError(f"{a.name} must be a number >= 0, got {v!r}")


def _pos(_: object, a: attrs.Attribute, v: float) -> None:  # type: ignore[type-arg]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise InvalidArgumentError(f"{a.name} must be a number > 0, got {v!r}")


@attrs.frozen(slots=True)
class CostModel:
    """Durations of forward steps and block copies, in seconds.

    A step is the roofline maximum of its memory time (weights plus the KV
    of every context token it reads, over HBM bandwidth) and its compute
    time (``2 * params`` FLOPs per token over ``peak_flops * mfu``), plus a
    fixed launch overhead. A copy reads and writes each block once over HBM.

    Defaults: Llama-3.1-8B in bf16 on one H100 SXM.

    Attributes:
        kv_bytes_per_token: KV bytes per token: 2 (K, V) x 32 layers x 8 KV
            heads x 128 dims x 2 bytes = 131,072 (Llama-3.1-8B
            ``config.json``: ``num_hidden_layers=32``,
            ``num_key_value_heads=8``, head dim 4096/32). A 16-token block
            is 2 MiB.
        kv_bytes_per_block: Override of ``kv_bytes_per_token * block_size``
            (``None``: derived).
        params: Model parameters, 8.03e9 (Llama-3.1-8B model card).
        weight_bytes: Bytes of weights read per step, ``2 * params`` (bf16).
        hbm_bandwidth: 3.35e12 B/s (NVIDIA H100 SXM datasheet).
        peak_flops: 989e12 dense bf16 FLOP/s (NVIDIA H100 SXM datasheet).
        mfu: Fraction of peak reached by prefill, 0.5 (assumption).
        step_overhead_s: Launch and sampling overhead per step, 0.5 ms
            (assumption).
        copy_overhead_s: Launch overhead per copy kernel, 5 us (assumption).

    Raises:
        InvalidArgumentError: a figure that is not a positive number.
    """

    kv_bytes_per_token: int = attrs.field(default=131_072, validator=_pos)
    kv_bytes_per_block: int | None = attrs.field(default=None)
    params: float = attrs.field(default=8.03e9, validator=_pos)
    weight_bytes: float = attrs.field(default=16.06e9, validator=_nonneg)
    hbm_bandwidth: float = attrs.field(default=3.35e12, validator=_pos)
    peak_flops: float = attrs.field(default=989e12, validator=_pos)
    mfu: float = attrs.field(default=0.5, validator=_pos)
    step_overhead_s: float = attrs.field(default=0.5e-3, validator=_nonneg)
    copy_overhead_s: float = attrs.field(default=5e-6, validator=_nonneg)

    @kv_bytes_per_block.validator
    def _check_block_bytes(self, a: attrs.Attribute, v: int | None) -> None:  # type: ignore[type-arg]
        if v is not None:
            _pos(self, a, v)

    def block_bytes(self, block_size: int) -> int:
        """KV bytes of one block of ``block_size`` tokens. O(1)."""
        if self.kv_bytes_per_block is not None:
            return int(self.kv_bytes_per_block)
        return int(self.kv_bytes_per_token) * block_size

    def step_seconds(self, num_tokens: int, context_tokens: int) -> float:
        """Duration of a forward step computing ``num_tokens`` new tokens
        whose attention reads ``context_tokens`` tokens of KV in all. O(1)."""
        mem = (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / self.hbm_bandwidth
        flops = 2.0 * self.params * num_tokens / (self.peak_flops * self.mfu)
        return self.step_overhead_s + max(mem, flops)

    def copy_seconds(self, num_blocks: int, block_size: int) -> float:
        """Duration of a block copy of ``num_blocks`` blocks (read + write). O(1)."""
        return self.copy_overhead_s + 2.0 * num_blocks * self.block_bytes(block_size) / self.hbm_bandwidth


@attrs.frozen(slots=True)
class StreamSpec:
    """One stream or engine of the simulated machine.

    Attributes:
        kind: ``DEVICE`` (in-order queue) or ``HOST`` (out-of-order engine).
        bandwidth: Bytes/s of a transfer stream (``None``: not a transfer
            stream; submissions give their duration). A ``HOST`` engine's
            bandwidth is shared evenly by its lanes.
        latency: Seconds added to each transfer (setup, doorbell, RTT).
        lanes: Postings in flight at once (``HOST`` only; ``>= 1``).
        jitter: A transfer lasts ``x (1 + U(-jitter, +jitter))``.
        failure_rate: Probability that a posting fails (``HOST`` only).

    Raises:
        InvalidArgumentError: a bad kind, a negative figure, ``lanes < 1``,
            ``jitter >= 1``, a rate outside ``[0, 1]``, or jitter, failures
            or several lanes on a ``DEVICE`` stream (DMA is deterministic
            and in order here).
    """

    kind: StreamKind = attrs.field(validator=attrs.validators.instance_of(StreamKind))
    bandwidth: float | None = None
    latency: float = attrs.field(default=0.0, validator=_nonneg)
    lanes: int = 1
    jitter: float = attrs.field(default=0.0, validator=_nonneg)
    failure_rate: float = attrs.field(default=0.0, validator=_nonneg)

    def __attrs_post_init__(self) -> None:
        if self.bandwidth is not None:
            _pos(self, attrs.fields(StreamSpec).bandwidth, self.bandwidth)
        if not isinstance(self.lanes, int) or self.lanes < 1:
            raise InvalidArgumentError(f"lanes must be an int >= 1, got {self.lanes!r}")
        if self.jitter >= 1 or self.failure_rate > 1:
            raise InvalidArgumentError("jitter must be < 1 and failure_rate <= 1")
        if self.kind is StreamKind.DEVICE and (self.jitter or self.failure_rate or self.lanes != 1):
            raise InvalidArgumentError("jitter, failure_rate and lanes > 1 apply to HOST engines only")

    def transfer_seconds(self, num_bytes: int) -> float:
        """Un-jittered duration of a transfer of ``num_bytes`` bytes. O(1).

        Raises:
            InvalidArgumentError: the stream has no bandwidth.
        """
        if self.bandwidth is None:
            raise InvalidArgumentError("not a transfer stream (no bandwidth)")
        lane_bw = self.bandwidth / (self.lanes if self.kind is StreamKind.HOST else 1)
        return self.latency + num_bytes / lane_bw


DEFAULT_STREAM_SPECS: Mapping[str, StreamSpec] = {
    "compute": StreamSpec(StreamKind.DEVICE),
    # PCIe Gen5 x16: 64 GB/s per direction (PCI-SIG); 50 GB/s achieved and
    # 10 us per DMA are assumptions.
    "h2d": StreamSpec(StreamKind.DEVICE, bandwidth=50e9, latency=10e-6),
    "d2h": StreamSpec(StreamKind.DEVICE, bandwidth=50e9, latency=10e-6),
    # One 400 Gb/s NIC (NVIDIA ConnectX-7 datasheet: 50 GB/s line rate);
    # 40 GB/s achieved, 4 queue pairs, 50 us per posting, +-20% jitter and
    # 1% failed GETs are assumptions.
    "rdma": StreamSpec(
        StreamKind.HOST, bandwidth=40e9, latency=50e-6, lanes=4, jitter=0.2, failure_rate=0.01
    ),
    # A background transfer thread pool doing remote-store PUTs: 2 threads,
    # 20 GB/s, 100 us per posting, +-20% jitter, 1% failures (assumptions).
    "xfer": StreamSpec(
        StreamKind.HOST, bandwidth=20e9, latency=100e-6, lanes=2, jitter=0.2, failure_rate=0.01
    ),
}
"""The default machine: ``compute`` (forward steps and copy-on-write),
``h2d``/``d2h`` (CPU offload DMA), ``rdma`` (remote-store GETs, out of
order) and ``xfer`` (remote-store PUTs from a transfer thread). Their
kinds agree with :data:`blockpool.checking.harness.DEFAULT_STREAMS` (``{name:
StreamKind}``, the streams a pool and the race oracle take), which lacks
``xfer``."""
