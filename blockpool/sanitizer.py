"""Deprecated: the race oracle moved to :mod:`blockpool.race_oracle`.

This alias re-exports the same objects so existing imports keep working;
importing it emits a :class:`DeprecationWarning`. It will be removed in a
future release: import from :mod:`blockpool.race_oracle` instead.
"""

from __future__ import annotations

import warnings

from blockpool.race_oracle import RaceOracle, RaceViolation, RecordOrderError, UnrecordedTokenError

__all__ = ["RaceOracle", "RaceViolation", "RecordOrderError", "UnrecordedTokenError"]

warnings.warn(
    "blockpool.sanitizer is deprecated; import blockpool.race_oracle instead",
    DeprecationWarning,
    stacklevel=2,
)
