"""``docs/api.md`` and the docstrings agree: every public method of
:class:`~blockpool.HazardAwareBlockPool` has a row, a docstring stating its
complexity, and the same error names in its row as in its ``Raises:``
section; every public name of :mod:`blockpool` is documented."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import blockpool
from blockpool import HazardAwareBlockPool
from tests import _docsource

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
ERROR = re.compile(r"\b([A-Z]\w*(?:Error|Warning))\b")


def api_rows() -> dict[str, set[str]]:
    """``{method: error names in its row}`` for each ``| `call(...)` |`` row."""
    rows: dict[str, set[str]] = {}
    for line in API_MD.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first, *rest = (c.strip() for c in line.strip().strip("|").split(" | "))
        for name in re.findall(r"`([a-z_]+)\(", first):
            rows.setdefault(name, set()).update(ERROR.findall(" ".join(rest)))
    return rows


def raises(doc: str) -> set[str]:
    """Error names in a Google-style ``Raises:`` section (to the docstring's end)."""
    return set(ERROR.findall(doc.split("Raises:", 1)[1])) if "Raises:" in doc else set()


PUBLIC_METHODS = sorted(
    n for n, v in inspect.getmembers(HazardAwareBlockPool) if not n.startswith("_") and callable(v)
)
ROWS = api_rows()


def doc_of(name: str) -> str:
    return _docsource.doc(HazardAwareBlockPool, name)


def test_the_parser_sees_the_tables() -> None:
    assert len(PUBLIC_METHODS) > 30 and {"get_new_blocks", "fence_for", "check"} <= set(ROWS)
    assert ROWS["tag"] and raises(doc_of("free_blocks")) >= {"RefCountError", "ForeignBlockError"}


@pytest.mark.parametrize("name", PUBLIC_METHODS)
def test_public_method_states_its_complexity(name: str) -> None:
    assert "O(" in doc_of(name), f"{name}: docstring does not state its complexity"


@pytest.mark.parametrize("name", PUBLIC_METHODS)
def test_public_method_has_a_row_listing_the_errors_its_docstring_raises(name: str) -> None:
    assert name in ROWS, f"{name}: no row in docs/api.md"
    assert ROWS[name] == raises(doc_of(name)), (
        f"{name}: api.md lists {sorted(ROWS[name])}, the docstring's Raises: {sorted(raises(doc_of(name)))}"
    )


def test_every_row_names_a_public_method() -> None:
    assert set(ROWS) - set(PUBLIC_METHODS) == set()


@pytest.mark.parametrize("name", [n for n in blockpool.__all__ if n not in ("__version__", "__compiled__")])
def test_public_name_is_documented_and_its_methods_state_their_complexity(name: str) -> None:
    obj = getattr(blockpool, name)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return  # a value (EMPTY_FENCE, LAST_STEP, the KVCacheEvent union): documented in api.md
    assert _docsource.doc(obj) if inspect.isclass(obj) else inspect.getdoc(obj), f"{name}: no docstring"
    if inspect.isclass(obj):
        missing = [m for m in _docsource.public_methods(obj) if "O(" not in _docsource.doc(obj, m)]
        assert missing == [], f"{name}: methods without complexity: {missing}"


@pytest.mark.parametrize("name", ["EMPTY_FENCE", "LAST_STEP", "KVCacheEvent", "__compiled__"])
def test_public_values_are_in_api_md(name: str) -> None:
    assert f"`{name}`" in API_MD.read_text()


def _namespace_table() -> set[str]:
    """The names in the rows of api.md's "The top-level namespace" table."""
    section = API_MD.read_text().split("## The top-level namespace", 1)[1].split("\n## ", 1)[0]
    rows = [x for x in section.splitlines() if x.startswith("| `")]
    return {n for row in rows for n in re.findall(r"`(\w+)`", row.split(" | ")[0])}


def test_api_md_lists_exactly_the_top_level_names() -> None:
    assert _namespace_table() == set(blockpool.__all__)


def test_every_top_level_error_is_importable_from_core_errors_too() -> None:
    from blockpool.core import errors

    for name in blockpool.__all__:
        if name.endswith(("Error", "Warning")):
            assert getattr(errors, name) is getattr(blockpool, name)


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("ClusterUnavailableError", "blockpool.core.errors"),
        ("MissingDependencyError", "blockpool.core.errors"),
        ("FreeBlockQueue", "blockpool.core.block"),
    ],
)
def test_tooling_errors_and_adapter_seams_live_in_their_modules_only(name: str, module: str) -> None:
    import importlib

    assert name not in blockpool.__all__ and not hasattr(blockpool, name)
    assert inspect.isclass(getattr(importlib.import_module(module), name))
