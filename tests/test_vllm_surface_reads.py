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
- A wrapper's plain read of an attribute of the vLLM instance it patches
  (``self.x`` in the wrapper of ``Scheduler.schedule``, the instance
  parameter of a planner, reporter or binder) is of a name some line
  declares on that class or a base; reads on other objects (what a wrapper
  is handed or reaches through an attribute) are not typed statically and
  rest on the ``field`` rows and the vLLM-side tests.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

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


# The plugin's wrapper factories (wiring.py), by the positions of their
# arguments that are called with the patched instance first: a planner's
# ``plan`` and ``before``, a reporter's ``on_reports``, a binder's
# ``default_size``.
FACTORIES = {"_planner": (0, 1), "_reporter": (1,), "_binder": (3,)}

# The patched classes whose instance attributes a wrapper reads from a base
# class the surface declares them on (checked against vLLM's classes where
# vLLM is installed).
BASES = {
    "KVCacheStoreRecvingThread": ("KVTransferThread",),
    "LMCacheConnectorV1": ("KVConnectorBase_V1",),
    "LMCacheMPConnector": ("KVConnectorBase_V1",),
    "NixlBaseConnector": ("KVConnectorBase_V1",),
    "NixlPullConnectorWorker": ("NixlBaseConnectorWorker",),
    "OffloadingConnector": ("KVConnectorBase_V1",),
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


def test_every_listed_optional_attribute_is_still_read_with_a_default() -> None:
    """``OPTIONAL_READS`` lists no name the plugin now reads plainly (or
    not at all)."""
    defaulted = {name for _, _, _, name, default in _all_reads() if default}
    assert sorted(vs.OPTIONAL_READS - defaulted) == []


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


def _class_of(expr: ast.expr, assigned: dict[str, ast.expr]) -> str | None:
    """The class name a ``patch`` call's owner expression names
    (``mod.Scheduler``, ``Scheduler``, or a local assigned one of those)."""
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Name):
        value = assigned.get(expr.id)
        return expr.id if value is None else _class_of(value, {})
    return None


def _instance_reads(
    fn: ast.FunctionDef | ast.Lambda,
    defs: dict[str, ast.FunctionDef] | None = None,
    index: int = 0,
    seen: set[tuple[str, int]] | None = None,
) -> Iterator[ast.Attribute]:
    """The attribute reads on ``fn``'s parameter ``index`` (the instance):
    ``inst.x`` and ``getattr(inst, "x")``, and those of the module's
    functions (``defs``) ``fn`` hands the instance to, followed through
    every such call (``_store_group_sizes(sched, w)`` reads on ``sched``)."""
    if len(fn.args.args) <= index:
        return
    inst = fn.args.args[index].arg
    seen = set() if seen is None else seen
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name)
            and node.value.id == inst
        ):
            yield node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if (
                node.func.id == "getattr"
                and len(args) == 2
                and isinstance(args[0], ast.Name)
                and args[0].id == inst
                and isinstance(args[1], ast.Constant)
                and isinstance(args[1].value, str)
            ):
                yield ast.Attribute(value=args[0], attr=args[1].value, ctx=ast.Load(), lineno=node.lineno)
            elif defs is not None and node.func.id in defs:
                for i, a in enumerate(args):
                    if isinstance(a, ast.Name) and a.id == inst and (node.func.id, i) not in seen:
                        seen.add((node.func.id, i))
                        yield from _instance_reads(defs[node.func.id], defs, i, seen)


def _patched_reads() -> tuple[list[tuple[str, int, str, str]], list[str]]:
    """``(module, line, patched class, attribute)`` for every attribute the
    plugin's wrappers read on the instance of the vLLM class they patch
    (``patch(Class, "method", wrap)``: the ``self`` of the functions ``wrap``
    defines; or a factory of :data:`FACTORIES`: the first parameter of the
    functions it is given), and the ``patch`` calls whose wrapper the scan
    cannot follow."""
    reads: set[tuple[str, int, str, str]] = set()
    unresolved: set[str] = set()
    for path in MODULES:
        tree = ast.parse(path.read_text())
        defs: dict[str, ast.FunctionDef] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                defs.setdefault(node.name, node)
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            assigned = {
                n.targets[0].id: n.value
                for n in ast.walk(fn)
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
            }
            for call in ast.walk(fn):
                if not (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id in ("patch", "_patch")
                    and len(call.args) == 3
                ):
                    continue
                cls = _class_of(call.args[0], assigned)
                wrap = call.args[2]
                if isinstance(wrap, ast.Name) and isinstance(assigned.get(wrap.id), ast.Call):
                    wrap = assigned[wrap.id]
                readers: list[ast.FunctionDef | ast.Lambda] = []
                if isinstance(wrap, ast.Name) and wrap.id in defs:
                    outer = defs[wrap.id]
                    readers = [
                        d
                        for d in ast.walk(outer)
                        if isinstance(d, ast.FunctionDef)
                        and d is not outer
                        and d.args.args
                        and d.args.args[0].arg == "self"
                    ]
                elif (
                    isinstance(wrap, ast.Call)
                    and isinstance(wrap.func, ast.Name)
                    and wrap.func.id in FACTORIES
                ):
                    for i in FACTORIES[wrap.func.id]:
                        arg = wrap.args[i] if i < len(wrap.args) else None
                        if isinstance(arg, ast.Lambda):
                            readers.append(arg)
                        elif isinstance(arg, ast.Name) and arg.id in defs:
                            readers.append(defs[arg.id])
                followed = (isinstance(wrap, ast.Name) and wrap.id in defs) or (
                    isinstance(wrap, ast.Call)
                    and isinstance(wrap.func, ast.Name)
                    and wrap.func.id in FACTORIES
                )
                if cls is None or not followed:
                    unresolved.add(f"{path.name}:{call.lineno}")
                    continue
                for reader in readers:
                    reads.update((path.name, r.lineno, cls, r.attr) for r in _instance_reads(reader, defs))
    return sorted(reads), sorted(unresolved)


def _declared_members() -> dict[str, set[str]]:
    """For each class the surface names, every member any line declares on
    it (its methods, borrowed or wrapped, and its ``field`` rows)."""
    out: dict[str, set[str]] = {}
    for s in vs.SURFACES.values():
        for n in s.rows:
            parts = n.qualname.split(".")
            if len(parts) >= 2:
                out.setdefault(parts[0], set()).add(parts[1])
    return out


def _undeclared(reads: list[tuple[str, int, str, str]]) -> list[str]:
    """``"module:line: Class.attribute"`` for each read of ``reads`` of a
    name no line declares on the class or a base of :data:`BASES` (the
    plugin's own names and ``__dict__`` aside)."""
    members = _declared_members()
    return sorted(
        f"{module}:{line}: {cls}.{attr}"
        for module, line, cls, attr in reads
        if attr not in OWN | {"__dict__"}
        and not any(attr in members.get(c, ()) for c in (cls, *BASES.get(cls, ())))
    )


def test_a_wrapper_reads_on_its_patched_vllm_instance_only_declared_names() -> None:
    """A wrapper's plain read of its vLLM instance's attribute (``self.x``
    in the wrapper of ``Scheduler.schedule``) is of a name some line
    declares on that class or a base (:data:`BASES`), of the plugin's own,
    or of Python's ``__dict__``."""
    reads, unresolved = _patched_reads()
    # The generic patcher (worker.py: patch(owner, attr, make)) alone
    # forwards a wrapper the scan cannot follow.
    assert len(unresolved) == 1 and unresolved[0].startswith("worker.py:")
    classes = {c for _, _, c, _ in reads}
    assert {"Scheduler", "KVCacheManager", "KVCacheCoordinator", "ActiveKVConnector"} <= classes
    assert {
        "MooncakeStoreScheduler",
        "OffloadingConnectorWorker",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
    } <= classes
    assert _undeclared(reads) == []


def test_the_scan_of_wrapper_reads_catches_an_undeclared_name(tmp_path: pathlib.Path) -> None:
    """The scan flags a wrapper's read of a name no line declares on the
    patched class (a doctored copy of a module)."""
    import importlib

    src = (PACKAGE / "worker.py").read_text()
    assert "if self._is_store_writer:" in src
    doctored = tmp_path / "worker.py"
    doctored.write_text(
        src.replace("if self._is_store_writer:", "if self._is_store_writer and self._frobs:", 1)
    )
    mod = importlib.import_module(__name__)
    saved = mod.MODULES
    mod.MODULES = [doctored]
    try:
        reads, _ = _patched_reads()
    finally:
        mod.MODULES = saved
    assert [r.partition(" ")[2] for r in _undeclared(reads)] == ["OffloadingConnectorWorker._frobs"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # a helper the planner hands its instance to (_plan_mooncake -> _store_group_sizes)
        ("ids = sched._store_group_ids or", "ids = sched._frobs or sched._store_group_ids or"),
        # a two-argument getattr is a plain read
        ("ids = sched._store_group_ids or", "ids = getattr(sched, '_frobs') or sched._store_group_ids or"),
    ],
)
def test_the_scan_follows_the_instance_into_helpers_and_getattr(
    tmp_path: pathlib.Path, old: str, new: str
) -> None:
    """A read of an undeclared name on the patched instance is caught in a
    module function the wrapper hands the instance to, and through
    ``getattr(inst, "name")`` (a doctored copy of connectors.py)."""
    import importlib

    src = (PACKAGE / "connectors.py").read_text()
    assert old in src
    doctored = tmp_path / "connectors.py"
    doctored.write_text(src.replace(old, new, 1))
    mod = importlib.import_module(__name__)
    saved = mod.MODULES
    mod.MODULES = [doctored]
    try:
        reads, _ = _patched_reads()
    finally:
        mod.MODULES = saved
    assert [r.partition(" ")[2] for r in _undeclared(reads)] == ["MooncakeStoreScheduler._frobs"]


def test_the_bases_the_scan_assumes_are_vllms() -> None:
    """Each class of :data:`BASES` derives from the classes named (checked
    on the installed vLLM, and LMCache's where LMCache is installed too;
    skipped without vLLM)."""
    pytest.importorskip("vllm")
    targets = {n.qualname.split(".")[0]: n.module for s in vs.SURFACES.values() for n in s.rows}
    checked = []
    for cls, bases in BASES.items():
        try:
            sub = vs.resolve(f"{targets[cls]}:{cls}")
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "lmcache":
                raise
            continue
        for base in bases:
            assert issubclass(sub, vs.resolve(f"{targets[base]}:{base}")), (cls, base)
        checked.append(cls)
    assert {"KVCacheStoreRecvingThread", "NixlPullConnectorWorker", "OffloadingConnector"} <= set(checked)
