"""Every version-dependent read of a vLLM name goes through the line's
declared surface: a static scan of the plugin's modules (no vLLM needed).

- A read with a default (``getattr(obj, "name", default)``, ``hasattr``) is
  of one of the plugin's own or Python's attributes, or of a name the
  surface lists in ``OPTIONAL_READS`` (a third-party object's per-instance
  optional attribute); never of a name a line declares as a field (that is
  read plainly, the line's declaration or switch standing for it).
- Every instance attribute the surface declares on some line but not on
  all (``field`` rows) is read only where each line either declares it or
  has the switch that guards it (``SWITCHED``) off.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

from blockpool.integrations.vllm import surface as vs
from blockpool.integrations.vllm import wiring

PACKAGE = pathlib.Path(vs.__file__).parent
MODULES = sorted(p for p in PACKAGE.glob("*.py") if p.name != "surface.py")

# Attributes of the plugin's own objects (its pool and its module, the
# wiring and hazards it hangs on vLLM's objects, the tags it puts on
# connector metadata, its wrappers' marks) and of Python's, which a read may
# default.
OWN = frozenset(
    {
        "VllmBlockPool",
        wiring.META_STEP,
        wiring.META_LOAD,
        wiring.META_STORE,
        wiring.META_STOCK,
        "_blockpool_vllm_BlockPool",
        "_blockpool_step_hazards",
        "_blockpool_wiring",
        "hazards",
        "__blockpool_wrapped__",
        "__func__",
        "__module__",
        "__qualname__",
        "__version__",
    }
)

# Reads whose attribute name is a parameter, by (module, function): the
# names each can take.
DYNAMIC = {
    ("lmcache.py", "_transfers"): "the plugin's own metadata tags",
    ("lmcache_mp.py", "_transfers"): "the plugin's own metadata tags",
    ("worker.py", "record_points"): "the plugin's own metadata tags",
    ("worker.py", "add_jobs"): "the plugin's own metadata tags",
    ("lmcache.py", "_fenced"): "LMCache's GPU connector streams and LMCacheEngine's declared methods",
    ("wiring.py", "bind_gpu_block_pool"): "a connector's scheduler half and its KV cache config",
    ("wiring.py", "update_connector_output"): "a connector's worker metadata's completion counts",
}


def _constants() -> dict[str, str]:
    """Every module's ``NAME = "text"`` constants (a read may name its
    attribute through one, imported from another module)."""
    out = {}
    for path in MODULES:
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _reads(path: pathlib.Path, consts: dict[str, str]) -> Iterator[tuple[str, int, str, str | None, bool]]:
    """``(module, line, enclosing function, attribute name or None when it
    is a parameter, read with a default)`` for every attribute read in
    ``path``."""

    def walk(node: ast.AST, func: str) -> Iterator[tuple[str, int, str, str | None, bool]]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            yield path.name, node.lineno, func, node.attr, False
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and (
                (node.func.id == "getattr" and len(node.args) == 3)
                or (node.func.id == "hasattr" and len(node.args) == 2)
            )
        ):
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name: str | None = arg.value
            elif isinstance(arg, ast.Name):
                name = consts.get(arg.id)
            else:
                name = None
            yield path.name, node.lineno, func, name, True
        for child in ast.iter_child_nodes(node):
            yield from walk(child, func)

    yield from walk(ast.parse(path.read_text()), "")


def _all_reads() -> list[tuple[str, int, str, str | None, bool]]:
    consts = _constants()
    return [r for p in MODULES for r in _reads(p, consts)]


def _fields() -> dict[str, set[str]]:
    """For each line, the attribute names of its ``field`` rows."""
    return {
        line: {n.target.rpartition(".")[2] for n in s.rows if n.use == "field"}
        for line, s in vs.SURFACES.items()
    }


def test_the_scan_sees_the_plugins_modules_and_their_reads() -> None:
    names = {p.name for p in MODULES}
    assert {"connectors.py", "hazards.py", "worker.py", "lmcache.py", "wiring.py"} <= names
    reads = _all_reads()
    assert ("connectors.py", "scheduler_block_sizes") in {
        (m, f) for m, _, f, n, d in reads if n == "block_size"
    }
    assert any(n == "_connectors" and d for _, _, _, n, d in reads)


def test_a_read_with_a_default_is_of_an_own_or_a_listed_optional_attribute() -> None:
    bad = [
        f"{module}:{line}: {name}"
        for module, line, _, name, default in _all_reads()
        if default and name is not None and name not in OWN and name not in vs.OPTIONAL_READS
    ]
    assert bad == []


def test_a_read_naming_its_attribute_by_a_parameter_is_one_of_the_known_few() -> None:
    found = {(module, func) for module, _, func, name, default in _all_reads() if default and name is None}
    assert found == set(DYNAMIC)


def test_a_declared_field_is_read_plainly_never_with_a_default() -> None:
    """A field the line declares (or a switch guards) is read as vLLM has
    it; a default would hide a drift the table reports. (A field name that
    other objects carry optionally, as ``block_size``, is listed in
    ``OPTIONAL_READS`` too; a switched one never is.)"""
    fields = set().union(*_fields().values())
    assert fields >= {"single_type_managers", "lcm_block_size", "_boundary_state_group_ids", "failed_jobs"}
    plain = fields - vs.OPTIONAL_READS
    defaulted = sorted(
        f"{module}:{line}: {name}"
        for module, line, _, name, default in _all_reads()
        if default and name in plain
    )
    assert defaulted == []
    switched = {name for names in vs.SWITCHED.values() for name in names}
    assert switched <= fields and not switched & vs.OPTIONAL_READS


def test_every_declared_field_is_read_by_the_plugin() -> None:
    read = {name for _, _, _, name, default in _all_reads() if not default}
    assert set().union(*_fields().values()) <= read


def test_a_field_some_lines_lack_is_behind_a_switch_each_line_sets_to_match() -> None:
    """A field declared on some lines only is read only behind a switch
    (:data:`SWITCHED`): each line with the switch on declares it, each line
    with it off does not."""
    fields = _fields()
    everywhere = set.intersection(*fields.values())
    switched = {name for names in vs.SWITCHED.values() for name in names}
    assert set().union(*fields.values()) - everywhere <= switched
    for line, surface in vs.SURFACES.items():
        for switch, names in vs.SWITCHED.items():
            on = getattr(surface, switch)
            assert isinstance(on, bool), switch
            for name in names:
                assert (name in fields[line]) is on, (line, switch, name)
