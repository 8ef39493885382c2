"""Simulated streams for replays and tests.

- :mod:`~blockpool.sim.simulator`: :class:`StreamSimulator`, in-order device
  streams and out-of-order host engines on a simulated clock, honouring the
  waits each work item names;
- :mod:`~blockpool.sim.costmodel`: :class:`CostModel` and
  :class:`StreamSpec`, the durations it gives compute steps and transfers.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
