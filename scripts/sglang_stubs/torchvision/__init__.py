"""A stand-in for torchvision in the SGLang test venv (scripts/sglang_setup.sh).

SGLang's import chain reaches ``torchvision.transforms`` through its multimodal
configs; the KV-cache classes the blockpool plugin wraps never call it. PyPI's
torchvision wheels are built against a CUDA torch and fail to import beside the
CPU torch the venv pins, so this package satisfies every ``torchvision.*``
import with a module whose attributes are placeholders that raise
``RuntimeError`` when called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+stand-in"


class _Placeholder:
    """Any torchvision name: usable in annotations and defaults, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"torchvision stand-in: {self._name} is not available in this venv")

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def _module_getattr(module_name: str) -> Any:
    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{module_name}.{attr}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Finder())
__getattr__ = _module_getattr("torchvision")
