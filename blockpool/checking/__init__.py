"""Checking an allocation sequence for races.

- :mod:`~blockpool.checking.race_oracle`: :class:`RaceOracle`, an
  independent happens-before checker of block accesses (the model of
  torch's CUDA stream sanitizer: a table of accesses and a
  stream-synchronisation state, each changed through its own methods);
- :mod:`~blockpool.checking.harness`: :class:`RaceHarness`, which drives a
  pool and an oracle together from one allocation sequence;
- :mod:`~blockpool.checking.pytest_plugin`: the pytest fixtures (entry point
  ``pytest11: blockpool``).
"""

from __future__ import annotations

from blockpool._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RaceOracle": "race_oracle",
    "RaceViolation": "race_oracle",
    "RecordOrderError": "race_oracle",
    "UnrecordedTokenError": "race_oracle",
    "DEFAULT_STREAMS": "harness",
    "RaceHarness": "harness",
}
"""Public name -> the module of this sub-package that defines it (imported
on first use: importing the sub-package imports none of them)."""

__all__ = [
    "DEFAULT_STREAMS",
    "RaceHarness",
    "RaceOracle",
    "RaceViolation",
    "RecordOrderError",
    "UnrecordedTokenError",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
