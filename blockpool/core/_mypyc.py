"""The one seam between the core's source and its compiled build.

The core is plain, typed Python; ``BLOCKPOOL_MYPYC=1 pip wheel .`` compiles
every module of :mod:`blockpool.core` with mypyc (``docs/performance.md``,
"The compiled core"). ``mypyc_attr`` is mypy_extensions' class decorator:
mypyc reads it when it compiles (``native_class=False`` for the errors,
which have two builtin bases; ``allow_interpreted_subclasses=True`` for the
block record and the free queue, which the vLLM adapter subclasses, and for
the pool's line of classes, which the benchmarks' recorder and the tests'
negative controls subclass). At run time it changes
nothing, so the pure build does not need mypy_extensions: without it the
decorator is a no-op here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["mypyc_attr"]

_T = TypeVar("_T")

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # pragma: no cover - the pure build without mypy_extensions

    def mypyc_attr(*attrs: str, **kwattrs: Any) -> Callable[[_T], _T]:  # type: ignore[misc]
        """No-op stand-in for ``mypy_extensions.mypyc_attr`` (read only by mypyc)."""
        return lambda cls: cls
