"""Old import paths of modules that moved into sub-packages.

``import blockpool.simulator`` (say) still works: it emits a
:class:`DeprecationWarning` naming the new path and binds the very module
object at that path (``sys.modules`` holds it under both names, so
``isinstance`` checks and monkeypatches agree). The old paths will be
removed in a future release. Installed by :mod:`blockpool` on import; costs
one dict lookup per import of a name no other finder found (the finder is
appended to :data:`sys.meta_path`, after the normal finders).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

__all__ = ["MOVED", "install", "lazy_exports", "old_submodule"]

MOVED: dict[str, str] = {
    "blockpool.block": "blockpool.core.block",
    "blockpool.completions": "blockpool.core.completions",
    "blockpool.errors": "blockpool.core.errors",
    "blockpool.events": "blockpool.core.events",
    "blockpool.eviction": "blockpool.core.eviction",
    "blockpool.hazards": "blockpool.core.hazards",
    "blockpool.pool": "blockpool.core.pool",
    "blockpool.prefix_cache": "blockpool.core.prefix_cache",
    "blockpool.stats": "blockpool.core.stats",
    "blockpool.tracker": "blockpool.core.tracker",
    "blockpool.integrations.vllm_pool": "blockpool.integrations.vllm.pool",
    "blockpool.integrations.vllm_hazards": "blockpool.integrations.vllm.hazards",
    "blockpool.integrations.vllm_connectors": "blockpool.integrations.vllm.connectors",
    "blockpool.integrations.vllm_worker": "blockpool.integrations.vllm.worker",
    "blockpool.integrations.vllm_pytest": "blockpool.integrations.vllm.pytest_plugin",
    "blockpool.sanitizer": "blockpool.checking.race_oracle",
    "blockpool.race_oracle": "blockpool.checking.race_oracle",
    "blockpool.testing": "blockpool.checking.harness",
    "blockpool.pytest_plugin": "blockpool.checking.pytest_plugin",
    "blockpool.simulator": "blockpool.sim.simulator",
    "blockpool.costmodel": "blockpool.sim.costmodel",
    "blockpool.torch_events": "blockpool.worker.torch_events",
    "blockpool.testing_streams": "blockpool.worker.standins",
}
"""Old dotted module path -> the path it moved to."""


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED`; loading one imports the new
    module and hands that object back, its own ``__spec__`` kept (importlib
    sets the alias's spec on whatever ``create_module`` returns; put back,
    ``importlib.reload`` and ``find_spec`` of the new path keep working)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module is the moved one, already executed):
        put its own spec back."""
        for old, new in MOVED.items():
            if new == module.__name__ and old in self._specs:
                module.__spec__ = self._specs[old]
                return


def old_submodule(package: str, name: str) -> ModuleType:
    """``package.name`` when it is an old path of :data:`MOVED` (imported
    through the alias, so it warns), for a package's ``__getattr__``: after
    ``import blockpool``, ``blockpool.pool`` works as it did when the
    package imported its submodules itself.

    Raises:
        AttributeError: ``package.name`` is not an old path.
    """
    old = f"{package}.{name}"
    if old not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(old)


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) for a sub-package that re-exports
    the public names of its modules lazily: ``exports`` maps each name to
    the module of ``package`` that defines it, imported on first use.
    O(1) per lookup after the first.

    The returned function raises AttributeError for a name not exported.
    """

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__


def install() -> None:
    """Append the finder to :data:`sys.meta_path` once. O(len(meta_path))."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
