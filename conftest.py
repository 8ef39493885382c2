"""Root conftest: keep doctest collection away from modules whose optional
dependencies are not installed (vLLM, torch, matplotlib)."""

import importlib.util

# The vLLM pytest plugin installs our pool into vLLM on import: never collect it.
collect_ignore_glob = [
    "benchmarks/*",
    "scripts/*",
    "blockpool/integrations/vllm/pytest_plugin.py",
]


def _missing(mod: str) -> bool:
    return importlib.util.find_spec(mod) is None


if _missing("vllm"):
    collect_ignore_glob += [
        "blockpool/integrations/vllm/__init__.py",
        "blockpool/integrations/vllm/pool.py",
        "blockpool/integrations/vllm/parity.py",
        "blockpool/integrations/vllm/blocks.py",
        "blockpool/integrations/vllm/events.py",
    ]
# blockpool/worker/torch_events.py imports torch only where it makes events,
# so its doctests and docs/worker.md's (CPU stand-ins) run without torch.
if _missing("torch"):
    collect_ignore_glob += [
        "blockpool/integrations/vllm/worker.py",
        "docs/examples/*.py",
    ]


def _vllm_test_fixtures() -> None:
    """Where vLLM is installed (the parity venv), point the Hugging Face hub
    at a temporary copy of ``../shared/vllm-parity/hf`` (shape-only model
    configs; shared/ is read-only and the hub may write beside its cache),
    offline, before any test imports vLLM. Tests that build a model config
    skip unless ``BLOCKPOOL_TEST_HF_FIXTURES`` is set."""
    import os
    import pathlib
    import shutil
    import tempfile

    src = pathlib.Path(__file__).resolve().parent.parent / "shared" / "vllm-parity" / "hf"
    if os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES") or not src.is_dir():
        return
    dst = pathlib.Path(tempfile.mkdtemp(prefix="blockpool-hf-")) / "hf"
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)
    os.environ.setdefault("HF_HOME", str(dst))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["BLOCKPOOL_TEST_HF_FIXTURES"] = str(dst)


if not _missing("vllm"):
    _vllm_test_fixtures()


def pytest_report_header(config: object) -> str:
    """Name the build under test (``blockpool.__compiled__``) and fail fast
    when ``BLOCKPOOL_EXPECT_COMPILED=1`` (``scripts/compiled_suite.sh``) but
    the imported core is the pure one."""
    import os

    import blockpool

    build = "compiled (mypyc)" if blockpool.__compiled__ else "pure Python"
    if os.environ.get("BLOCKPOOL_EXPECT_COMPILED") == "1" and not blockpool.__compiled__:
        raise RuntimeError(f"BLOCKPOOL_EXPECT_COMPILED=1 but {blockpool.__file__} has the pure-Python core")
    return f"blockpool {blockpool.__version__}: {build} core, {os.path.dirname(blockpool.__file__)}"


def _compiled_core() -> bool:
    import blockpool

    return bool(blockpool.__compiled__)


if _compiled_core():
    import pytest
    from _pytest import doctest as _pytest_doctest

    class _CompiledCoreDoctests(_pytest_doctest.DoctestModule):
        """The doctests of a compiled core module: the examples are read from
        its ``.py`` source (a compiled function keeps no source for doctest's
        finder) and run against the compiled module's globals."""

        def collect(self):  # type: ignore[no-untyped-def]
            import ast
            import doctest
            import importlib

            parts = self.path.with_suffix("").relative_to(self.config.rootpath).parts
            modname = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            module = importlib.import_module(modname)
            assert not str(module.__file__).endswith(".py"), module.__file__
            runner = _pytest_doctest._get_runner(
                verbose=False,
                optionflags=_pytest_doctest.get_optionflags(self.config),
                checker=_pytest_doctest._get_checker(),
                continue_on_failure=_pytest_doctest._get_continue_on_failure(self.config),
            )
            parser = doctest.DocTestParser()
            tree = ast.parse(self.path.read_text(encoding="utf-8"))

            def walk(node: ast.AST, prefix: str):  # type: ignore[no-untyped-def]
                doc = ast.get_docstring(node, clean=False) if hasattr(node, "body") else None  # type: ignore[arg-type]
                if doc and isinstance(
                    node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
                ):
                    yield prefix, doc, node.body[0].lineno - 1  # type: ignore[attr-defined]
                for child in getattr(node, "body", []):
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        yield from walk(child, f"{prefix}.{child.name}")

            for name, doc, lineno in walk(tree, modname):
                test = parser.get_doctest(doc, dict(module.__dict__), name, str(self.path), lineno)
                if test.examples:
                    yield _pytest_doctest.DoctestItem.from_parent(
                        self, name=test.name, runner=runner, dtest=test
                    )

    @pytest.hookimpl(wrapper=True)
    def pytest_collect_file(file_path, parent):  # type: ignore[no-untyped-def]
        """Compiled build: the core's doctests through :class:`_CompiledCoreDoctests`."""
        found = yield
        if (
            file_path.suffix == ".py"
            and file_path.parent.name == "core"
            and file_path.parent.parent.name == "blockpool"
        ):
            # nothing else (a .py named on the command line is also a test module to pytest)
            found = []
            if parent.config.getoption("doctestmodules"):
                found.append(_CompiledCoreDoctests.from_parent(parent, path=file_path))
        return found


_PURE_ONLY: list[str] = []


def pytest_collection_modifyitems(config: object, items: list) -> None:  # type: ignore[type-arg]
    """Compiled build: skip the tests marked ``pure_python_only`` (they
    patch the core's internals: a compiled module's functions and a native
    instance's methods cannot be replaced from Python), and count them.
    None is marked today (``docs/performance.md``, "The compiled core")."""
    if not _compiled_core():
        return
    import pytest

    skip = pytest.mark.skip(reason="pure_python_only: patches the core's internals (compiled build)")
    for item in items:
        if item.get_closest_marker("pure_python_only"):
            item.add_marker(skip)
            _PURE_ONLY.append(item.nodeid)


def pytest_terminal_summary(terminalreporter: object) -> None:
    if _PURE_ONLY:
        terminalreporter.write_line(  # type: ignore[attr-defined]
            f"blockpool compiled build: {len(_PURE_ONLY)} pure_python_only tests skipped: "
            + ", ".join(_PURE_ONLY)
        )
