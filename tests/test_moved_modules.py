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
