"""Lazy re-exports for the sub-packages (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) for a sub-package that re-exports
    the public names of its modules lazily: ``exports`` maps each name to
    the module of ``package`` that defines it, imported on first use
    (importing the sub-package imports none of them). O(1) per lookup after
    the first.

    The returned function raises AttributeError for a name not exported.
    """

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
