"""Modules that moved into sub-packages keep their old import paths, with a
deprecation warning, as the very same module objects."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from blockpool._moved import MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_old_path_is_the_new_module_with_a_deprecation_warning(old: str, new: str) -> None:
    for dep, marker in (("torch", "worker"), ("vllm", "integrations.vllm.")):
        if marker in new and importlib.util.find_spec(dep) is None:
            pytest.skip(f"{dep} not installed")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    assert mod.__name__ == new


def test_from_import_of_a_name_through_the_old_path() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n"
        "    from blockpool.testing import RaceHarness\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "warned: blockpool.testing moved to blockpool.checking.harness; import it from there "
        "(the old path will be removed)"
    )


def test_unknown_submodule_is_still_a_module_not_found_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("blockpool.no_such_module")


@pytest.mark.parametrize("package", ["blockpool.checking", "blockpool.sim", "blockpool.worker"])
def test_subpackage_reexports_its_public_names_lazily(package: str) -> None:
    code = (
        f"import sys, {package} as p\n"
        "before = sorted(m for m in sys.modules if m.startswith(p.__name__ + '.'))\n"
        "import importlib\n"
        "same = all(getattr(p, n) is getattr(importlib.import_module(p.__name__ + '.' + p._EXPORTS[n]), n)"
        " for n in p.__all__)\n"
        "print(before, same)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        importlib.import_module(package).nope  # noqa: B018


def test_an_old_path_import_keeps_the_new_module_spec_and_reload_working() -> None:
    code = (
        "import warnings, importlib; warnings.simplefilter('ignore')\n"
        "import blockpool.core.pool as new\n"
        "import blockpool.pool\n"
        "print(new.__spec__.name, importlib.util.find_spec('blockpool.core.pool').origin.endswith('pool.py'))\n"
        "importlib.reload(new)\n"
        "print(new.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["blockpool.core.pool", "True", "blockpool.core.pool"]


def test_old_submodules_are_attributes_of_their_package() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import blockpool\n"
        "assert blockpool.HazardAwareBlockPool\n"
        "try:\n"
        "    blockpool.pool\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
        "warnings.simplefilter('ignore')\n"
        "print(blockpool.pool.HazardAwareBlockPool is blockpool.HazardAwareBlockPool)\n"
        "print(hasattr(blockpool, 'no_such_thing'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "warned: blockpool.pool moved to blockpool.core.pool; import it from there (the old path will be removed)",
        "True",
        "False",
    ]
