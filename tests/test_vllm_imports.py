"""Import contracts of the vLLM integration (blockpool/integrations/vllm).

The modules sit in layers (``LAYERS``, top to bottom): a module imports
only from layers below its own, never from its own layer's other modules,
so the import graph has no circle and nothing imports back up. Every
import counts: at module level, inside a function (a lazy import), under
``TYPE_CHECKING``. The graph is read from the source with :mod:`ast`;
nothing is imported (no vLLM or torch needed).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = "blockpool.integrations.vllm"
_SPEC = importlib.util.find_spec(PACKAGE)
assert _SPEC is not None and _SPEC.submodule_search_locations, PACKAGE
ROOT = Path(next(iter(_SPEC.submodule_search_locations)))
"""The package's sources as imported (the checkout, or an installed wheel:
its modules ship as ``.py``; importing its parents imports no vLLM)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("pytest_plugin",),
    ("__init__", "parity"),
    ("lmcache",),
    ("lmcache_mp",),
    ("worker",),
    ("connectors", "pool"),
    ("events", "blocks"),
    ("surface",),
    ("wiring",),
    ("hazards", "audit"),
    ("served",),
)
"""The integration's modules by layer, top first (``__init__``: the
package's own module, the plugin's entry point)."""


def _short(module: str) -> str | None:
    """``"lmcache"`` for ``blockpool.integrations.vllm.lmcache``,
    ``"__init__"`` for the package itself, ``None`` outside it."""
    if module == PACKAGE:
        return "__init__"
    if module.startswith(PACKAGE + "."):
        return module[len(PACKAGE) + 1 :].split(".")[0]
    return None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package (short names, as in :data:`LAYERS`) and
    the modules of the package it imports anywhere in its source. ``from
    package import name`` is an import of the submodule ``name`` when there
    is one, else of the package's ``__init__``; a string that is a dotted
    path into the package (``importlib.import_module("...vllm.worker")``,
    ``sys.modules.get("...vllm.pool")``) is an import of that module.
    O(source size)."""
    modules = {p.stem for p in root.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        here = PACKAGE if name == "__init__" else f"{PACKAGE}.{name}"
        tree = ast.parse((root / f"{name}.py").read_text(), filename=f"{name}.py")
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = (PACKAGE if name == "__init__" else here).split(".")
                    base = base[: len(base) - node.level + (1 if name == "__init__" else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                found = []
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    submodule = sub == PACKAGE or (source == PACKAGE and _short(sub) in modules)
                    found.append(sub if submodule else source)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and (node.value == PACKAGE or node.value.startswith(PACKAGE + "."))
                and node.value.replace(".", "").replace("_", "").isalnum()
            ):
                # A module named by its dotted path (importlib.import_module,
                # __import__, a sys.modules lookup) is imported all the same.
                found = [node.value]
            else:
                continue
            for module in found:
                short = _short(module)
                if short is not None and short != name:
                    targets.add(short)
        graph[name] = targets
    return graph


def layer_violations(
    graph: Mapping[str, Iterable[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    """One line per import that does not go down a layer (``a -> b``: ``b``
    in ``a``'s layer or above it) and per module not placed in a layer
    (one imported included: a subpackage, whose source the graph does not
    read).
    Empty when the contract holds. O(edges)."""
    rank = {m: i for i, layer in enumerate(layers) for m in layer}
    named = set(graph).union(*map(set, graph.values()))
    out = [f"{m} is in no layer" for m in sorted(named) if m not in rank]
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if a in rank and b in rank and rank[b] <= rank[a]:
                where = "its own layer" if rank[a] == rank[b] else "a layer above"
                out.append(f"{a} -> {b}: imports from {where}")
    return out


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a
    circle of imports), sorted (Tarjan's algorithm). O(modules + edges)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_every_module_of_the_integration_is_in_a_layer_and_every_layer_names_a_module() -> None:
    graph = import_graph()
    placed = {m for layer in LAYERS for m in layer}
    assert set(graph) == placed


def test_the_integration_imports_only_down_its_layers() -> None:
    assert layer_violations(import_graph()) == []


def test_the_integration_has_no_import_circle() -> None:
    assert cycles(import_graph()) == []


def test_the_worker_and_the_surface_do_not_import_the_plugins_entry_module() -> None:
    graph = import_graph()
    assert "__init__" not in graph["worker"] and "__init__" not in graph["surface"]
    assert not any("__init__" in graph[m] for m in ("lmcache", "lmcache_mp", "connectors", "wiring"))


def test_the_engine_check_lives_outside_the_plugin_package_and_the_plugin_never_imports_it() -> None:
    assert "engine_check" not in import_graph()
    assert (ROOT.parent.parent / "checking" / "vllm_engine.py").is_file()
    for path in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.startswith("blockpool.checking.vllm_engine") for n in names), path.name


def test_the_connector_modules_register_themselves_and_the_registry_imports_none_of_them() -> None:
    graph = import_graph()
    assert graph["wiring"].isdisjoint({"connectors", "lmcache", "lmcache_mp", "worker", "__init__"})
    for module in ("connectors", "lmcache", "lmcache_mp"):
        assert "register_connector(" in (ROOT / f"{module}.py").read_text(), module


@pytest.mark.parametrize(
    ("edge", "expected"),
    [
        (("wiring", "__init__"), ["wiring -> __init__: imports from a layer above"]),
        (("worker", "lmcache"), ["worker -> lmcache: imports from a layer above"]),
        (("connectors", "pool"), ["connectors -> pool: imports from its own layer"]),
    ],
)
def test_a_back_import_breaks_the_contract(edge: tuple[str, str], expected: list[str]) -> None:
    graph = {m: set(t) for m, t in import_graph().items()}
    graph[edge[0]].add(edge[1])
    assert layer_violations(graph) == expected


def test_an_import_of_a_subpackage_is_of_a_module_in_no_layer() -> None:
    graph = {m: set(t) for m, t in import_graph().items()}
    graph["wiring"].add("lmcache_parts")
    assert layer_violations(graph) == ["lmcache_parts is in no layer"]


def test_a_circle_is_found_through_a_lazy_import(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("from blockpool.integrations.vllm import a\n")
    (tmp_path / "a.py").write_text("from blockpool.integrations.vllm.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from blockpool.integrations.vllm import a\n")
    (tmp_path / "c.py").write_text("from blockpool.integrations import vllm\n")
    (tmp_path / "d.py").write_text(
        "import importlib\n\n\ndef f():\n    return importlib.import_module('blockpool.integrations.vllm.c')\n"
    )
    graph = import_graph(tmp_path)
    assert graph == {"__init__": {"a"}, "a": {"b"}, "b": {"a"}, "c": {"__init__"}, "d": {"c"}}
    assert cycles(graph) == [["a", "b"]]
    assert layer_violations(graph, (("c",), ("__init__",), ("a",), ("b",), ("d",))) == [
        "b -> a: imports from a layer above",
        "d -> c: imports from a layer above",
    ]
