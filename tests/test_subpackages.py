"""The package layout: sub-packages re-export their public names lazily; the
old pre-release module paths and deprecated aliases are gone."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

OLD_PATHS = [
    "blockpool.block", "blockpool.completions", "blockpool.errors", "blockpool.events", "blockpool.eviction",
    "blockpool.hazards", "blockpool.pool", "blockpool.prefix_cache", "blockpool.stats", "blockpool.tracker",
    "blockpool.integrations.vllm_pool", "blockpool.integrations.vllm_hazards",
    "blockpool.integrations.vllm_connectors", "blockpool.integrations.vllm_worker",
    "blockpool.integrations.vllm_pytest", "blockpool.sanitizer", "blockpool.race_oracle", "blockpool.testing",
    "blockpool.pytest_plugin", "blockpool.simulator", "blockpool.costmodel", "blockpool.torch_events",
    "blockpool.testing_streams", "blockpool._moved",
]  # fmt: skip
"""Module paths of the sub-packages' modules before they moved (never released)."""


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_module_path_no_longer_imports(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_old_submodules_are_not_attributes_of_their_package() -> None:
    code = (
        "import blockpool, blockpool.integrations\n"
        "print(hasattr(blockpool, 'pool'), hasattr(blockpool, 'sanitizer'),"
        " hasattr(blockpool.integrations, 'vllm_pool'))\n"
        "print(any(type(f).__module__.startswith('blockpool') for f in sys.meta_path))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False", "False", "False"]  # and no import hook of ours


def test_the_deprecated_aliases_are_gone() -> None:
    from blockpool.checking.race_oracle import RaceOracle
    from blockpool.sim import costmodel, simulator

    assert not hasattr(RaceOracle, "access")  # RaceOracle.tag
    for module in (costmodel, simulator):
        with pytest.raises(AttributeError, match="DEFAULT_STREAMS"):
            module.DEFAULT_STREAMS  # noqa: B018  (DEFAULT_STREAM_SPECS)


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


def test_unknown_submodule_is_a_module_not_found_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("blockpool.no_such_module")
