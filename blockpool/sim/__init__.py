"""Simulated streams for replays and tests.

- :mod:`~blockpool.sim.simulator`: :class:`StreamSimulator`, in-order device
  streams and out-of-order host engines on a simulated clock, honouring the
  waits each work item names;
- :mod:`~blockpool.sim.costmodel`: :class:`CostModel` and
  :class:`StreamSpec`, the durations it gives compute steps and transfers.
"""

from __future__ import annotations

from blockpool._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DEFAULT_STREAM_SPECS": "costmodel",
    "CostModel": "costmodel",
    "SimulationError": "simulator",
    "StreamSimulator": "simulator",
    "StreamSpec": "costmodel",
    "Work": "simulator",
}
"""Public name -> the module of this sub-package that defines it (imported
on first use: importing the sub-package imports none of them)."""

__all__ = [
    "DEFAULT_STREAM_SPECS",
    "CostModel",
    "SimulationError",
    "StreamSimulator",
    "StreamSpec",
    "Work",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
