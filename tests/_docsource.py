"""Docstrings for the docs tests in both builds: a compiled (mypyc) class or
method keeps no docstring, so where the object has none it is read from the
``.py`` source the wheel ships beside the compiled module (the same text)."""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import sys
from pathlib import Path


@functools.cache
def _class_nodes(module: str) -> dict[str, ast.ClassDef]:
    mod = sys.modules[module]
    path = Path(str(mod.__file__))
    src = path if path.suffix == ".py" else path.parent / (module.rsplit(".", 1)[-1] + ".py")
    tree = ast.parse(src.read_text(encoding="utf-8"))
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _source_doc(cls: type, name: str | None) -> str:
    node = _class_nodes(cls.__module__).get(cls.__name__)
    if node is None:
        return ""
    if name is None:
        return inspect.cleandoc(ast.get_docstring(node, clean=False) or "")
    for f in node.body:
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == name:
            return inspect.cleandoc(ast.get_docstring(f, clean=False) or "")
    return ""


def doc(cls: type, name: str | None = None) -> str:
    """The docstring of ``cls`` (``name=None``) or of its method ``name``
    (the first class along the MRO that documents it, as ``inspect.getdoc``)."""
    if name is None:
        return inspect.getdoc(cls) or _source_doc(cls, None)
    found = inspect.getdoc(getattr(cls, name))
    if found and found != inspect.getdoc(type(getattr(cls, name))):
        return found
    for c in cls.__mro__:
        if name in vars(c) and c.__module__.startswith("blockpool."):
            text = _source_doc(c, name)
            if text:
                return text
    return ""


def signature(cls: type, name: str) -> inspect.Signature:
    """The signature of ``cls``'s method ``name`` in both builds: a compiled
    (mypyc) method shows only ``(self, /, *args, **kwargs)``, so there the
    first class along the MRO whose source defines ``name`` gives it, its
    defaults evaluated in that module's namespace."""
    sig = inspect.signature(getattr(cls, name))
    if not any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        return sig
    for c in cls.__mro__:
        node = _class_nodes(c.__module__).get(c.__name__) if c.__module__.startswith("blockpool.") else None
        f = (
            next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name), None)
            if node
            else None
        )
        if f is None:
            continue
        stub = copy.deepcopy(f)  # the cached tree stays whole
        stub.body, stub.decorator_list, stub.returns = [ast.Pass()], [], None
        args = stub.args
        for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
            if a is not None:
                a.annotation = None
        code = compile(ast.fix_missing_locations(ast.Module([stub], [])), f"<{c.__module__}>", "exec")
        space = dict(vars(sys.modules[c.__module__]))
        exec(code, space)  # noqa: S102 (the package's own source: its defaults, an empty body)
        return inspect.signature(space[name])
    return sig


def public_methods(cls: type) -> list[str]:
    """Names of the public functions defined in the body of ``cls``."""
    out = []
    for n, v in vars(cls).items():
        f = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
        if not n.startswith("_") and (inspect.isfunction(f) or _compiled_function(f)):
            out.append(n)
    return out


def _compiled_function(f: object) -> bool:
    # mypyc: a method is a callable object of its own generated type, or a builtin
    return (
        callable(f)
        and not isinstance(f, type)
        and (
            inspect.isbuiltin(f)
            or inspect.ismethoddescriptor(f)
            or type(f).__module__.startswith("blockpool.")
        )
    )
