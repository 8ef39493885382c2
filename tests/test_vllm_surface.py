"""The vLLM surface: one declaration per release line, chosen by the line's
own names, checked at ``register()`` and by ``blockpool check-vllm
--surface``; a doctored vLLM is refused whole or has the connector left
unwired, and is left exactly as it was."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from blockpool import BlockPoolError, InvalidArgumentError
from blockpool.cli import main as cli_main
from blockpool.integrations import vllm as plugin
from blockpool.integrations.vllm import surface as vs

LOGGER = "vllm.plugins.blockpool"
# Every test here reads vLLM's surface or refuses an install before the core
# is reached: the compiled build's run skips them (tests/conftest.py).
pytestmark = pytest.mark.build_independent

# ----------------------------------------------------------------------
# the declarations (no vLLM needed)
# ----------------------------------------------------------------------


def test_each_supported_line_has_one_declaration_and_the_plugin_supports_exactly_those() -> None:
    assert list(vs.SURFACES) == ["0.32", "0.33", "0.34"]
    assert plugin.SUPPORTED_VLLM_LINES == tuple(vs.SURFACES)
    assert all(s.line == line for line, s in vs.SURFACES.items())


@pytest.mark.parametrize("line", ["0.32", "0.33", "0.34"])
def test_a_line_declares_each_name_once(line: str) -> None:
    targets = [n.target for n in vs.SURFACES[line].all_names()]
    assert len(targets) == len(set(targets))


@pytest.mark.parametrize("line", ["0.32", "0.33", "0.34"])
def test_a_line_is_recognised_by_its_own_markers_not_by_another_lines(line: str) -> None:
    """Every marker of a line is a name (with its signature) that no other
    line declares the same way: present in its release, so no other line's
    markers can all match it."""
    mine = {(n.target, n.params) for n in vs.SURFACES[line].markers}
    assert mine
    for other, surface in vs.SURFACES.items():
        if other != line:
            theirs = {(n.target, n.params) for n in surface.all_names()}
            assert not mine <= theirs, other


def test_the_lines_differ_where_vllm_changed() -> None:
    s32, s33, s34 = (vs.SURFACES[x] for x in ("0.32", "0.33", "0.34"))
    assert (s32.event_extra_keys, s33.event_extra_keys, s34.event_extra_keys) == (
        None,
        "_generate_event_extra_keys",
        "generate_event_extra_keys",
    )
    assert (s32.lookahead_token_ids, s33.lookahead_token_ids, s34.lookahead_token_ids) == (
        None,
        "_lookahead_token_ids",
        "get_lookahead_token_ids",
    )
    assert [s.weak_pool_ref for s in (s32, s33, s34)] == [False, False, True]
    assert [s.evict_first for s in (s32, s33, s34)] == [False, False, True]
    assert [s.v1_model_runner for s in (s32, s33, s34)] == [True, True, False]
    assert [s.access_hook_on_null for s in (s32, s33, s34)] == [True, False, False]
    assert [s.offloading_failed_jobs for s in (s32, s33, s34)] == [False, False, True]
    assert [s.offloading_sync_loads for s in (s32, s33, s34)] == [False, True, True]


def test_every_connector_function_the_wiring_wraps_has_a_body_fingerprint() -> None:
    for surface in vs.SURFACES.values():
        for n in surface.names:
            if (
                n.connector in vs.CONNECTOR_NAMES
                and n.use == "wrapped"
                and ".bind_gpu_block_pool" not in n.target
            ):
                assert n.fingerprints, (surface.line, n.target)


# The bodies a replaced wait or a step wrapper relies on, with the group a
# drift of each affects (None: the install is refused whole).
_MOONCAKE_W = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
_RELIED_ON = {
    f"{_MOONCAKE_W}:KVCacheStoreSendingThread._handle_request": "mooncake_store",
    f"{_MOONCAKE_W}:KVCacheStoreSendingThread._maybe_offload_boundary_states": "mooncake_store",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.take_kv_cache_block_copies": None,
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": None,
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": None,
    "vllm.v1.core.sched.scheduler:Scheduler._drain_deferred_frees": None,
}


@pytest.mark.parametrize("line", ["0.32", "0.33", "0.34"])
def test_every_line_fingerprints_the_bodies_a_replaced_wait_or_a_step_wrapper_relies_on(line: str) -> None:
    declared = {n.target: n for n in vs.SURFACES[line].names}
    for target, connector in _RELIED_ON.items():
        assert target in declared, target
        assert declared[target].fingerprints, target
        assert declared[target].connector == connector, target


def _function(tmp_path: Any, name: str, source: str) -> Any:
    """``f`` of a module written from ``source`` (``inspect.getsource``
    needs a file)."""
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.f


def test_fingerprint_ignores_comments_docstrings_and_layout_but_not_the_body(tmp_path: Any) -> None:
    a = _function(tmp_path, "a", 'def f(x):\n    """Doc."""\n    return x + 1  # a comment\n')
    b = _function(tmp_path, "b", "def f(x):\n\n    return (x +\n            1)\n")
    c = _function(tmp_path, "c", "def f(x):\n    return x + 2\n")
    assert vs.fingerprint(a) == vs.fingerprint(b) != vs.fingerprint(c)
    assert len(vs.fingerprint(a) or "") == 16
    assert vs.fingerprint(len) is None  # no Python source


def test_fingerprint_source_gives_the_imported_functions_fingerprint_decorators_included(
    tmp_path: Any,
) -> None:
    source = (
        "import functools\n\n"
        "class C:\n"
        "    @staticmethod\n"
        "    @functools.lru_cache\n"
        "    def f(x):\n"
        '        """Doc."""\n'
        "        return x + 1\n\n"
        "def f(x):\n    return x\n\n"
        "def f(x):\n    return x + 2  # the last definition wins\n"
    )
    module = _function(tmp_path, "m", source + "f = C.__dict__['f'].__func__\n")
    assert vs.fingerprint_source(source, "C.f") == vs.fingerprint(module)
    assert vs.fingerprint_source(source, "f") == vs.fingerprint(
        _function(tmp_path, "n", "def f(x):\n    return x + 2\n")
    )
    assert vs.fingerprint_source(source, "C.g") is None
    assert vs.fingerprint_source(source, "C") is None  # a class, not a function
    with pytest.raises(InvalidArgumentError):
        vs.fingerprint_source("def f(:\n", "f")


def test_a_field_row_is_found_in_the_class_source_or_reported_missing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance attribute is declared present when the class or a base
    assigns ``self.<name>`` (plain or annotated), declares it as a dataclass
    field or annotation, or has it as a class attribute; otherwise it is a
    drift naming the class."""
    (tmp_path / "fieldmod.py").write_text(
        "import dataclasses\n\n"
        "class Base:\n"
        "    def __init__(self):\n"
        "        self.inherited = 1\n\n"
        "class C(Base):\n"
        "    klass = 0\n"
        "    def setup(self):\n"
        "        self.plain = 2\n"
        "        self.annotated: int | None = None\n"
        "        other = self\n"
        "        other.not_self = 3\n\n"
        "@dataclasses.dataclass\n"
        "class D:\n"
        "    field_without_default: int\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [
        vs.Name(f"fieldmod:{owner}.{attr}", use="field")
        for owner, attr in [
            ("C", "inherited"),
            ("C", "klass"),
            ("C", "plain"),
            ("C", "annotated"),
            ("D", "field_without_default"),
            ("C", "not_self"),
            ("C", "nope"),
            ("Nope", "x"),
        ]
    ]
    drifts = vs.check(vs.SURFACES["0.34"], rows)
    assert [d.status for d in drifts] == ["ok"] * 5 + ["missing"] * 3
    assert drifts[0].expected == drifts[0].found == "attribute"
    assert drifts[6].found == "no attribute nope in fieldmod.C or its bases"
    assert "Nope" in drifts[7].found


def test_resolve_names_an_attribute_path_and_raises_for_a_missing_one() -> None:
    assert vs.resolve("blockpool.integrations.vllm.surface:Surface.declares") is vs.Surface.declares
    with pytest.raises(AttributeError):
        vs.resolve("blockpool.integrations.vllm.surface:Surface.nope")
    with pytest.raises(ImportError):
        vs.resolve("blockpool.no_such_module:x")


def test_select_refuses_an_undeclared_line_unless_asked_to_try() -> None:
    with pytest.raises(vs.SurfaceError, match="no declared surface"):
        vs.select("0.35.0")
    assert issubclass(vs.SurfaceError, BlockPoolError)


def test_surface_report_without_vllm_says_so_with_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setattr("blockpool.integrations.vllm.wiring.vllm_version", lambda: None)
    assert cli_main(["check-vllm", "--surface"]) == 2
    assert capsys.readouterr().out == "vLLM is not installed here\n"


# ----------------------------------------------------------------------
# against the installed vLLM
# ----------------------------------------------------------------------


@pytest.fixture
def vllm_installed() -> str:
    pytest.importorskip("vllm.v1.core.block_pool")
    pytest.importorskip("torch")
    version = plugin.vllm_version()
    if not plugin.is_supported_vllm_version(version):
        pytest.skip(f"vLLM {version} is not a supported version")
    assert version is not None
    return version


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (plugin.ENV_PLUGIN, plugin.ENV_HAZARDS, plugin.ENV_ANY_VERSION, "BLOCKPOOL_VLLM_UNWIRED"):
        monkeypatch.delenv(name, raising=False)
    plugin.unregister()
    yield
    plugin.unregister()


@pytest.fixture
def log() -> Iterator[list[tuple[str, str]]]:
    got: list[tuple[str, str]] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append((record.levelname, record.getMessage()))

    lg, h = logging.getLogger(LOGGER), H(logging.DEBUG)
    level = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    try:
        yield got
    finally:
        lg.removeHandler(h)
        lg.setLevel(level)


def test_the_installed_vllm_matches_its_lines_declaration(vllm_installed: str) -> None:
    surface = vs.select(vllm_installed)
    assert surface.line == ".".join(vllm_installed.split(".")[:2])
    # "unavailable": a connector's own package is not installed here (it cannot run here)
    assert [d for d in vs.check(surface) if not d.ok and d.status != "unavailable"] == []


def test_check_vllm_surface_prints_the_table_with_status_0(vllm_installed: str, capsys: Any) -> None:
    assert cli_main(["check-vllm", "--surface"]) == 0
    out = capsys.readouterr().out.splitlines()
    surface = vs.select(vllm_installed)
    count = len(surface.all_names())
    assert out[0] == f"vLLM {vllm_installed}: declared surface of vLLM {surface.line} ({count} names)"
    absent = [row for row in out[2:] if row.startswith("unavailable here")]
    assert len(out) == len(surface.all_names()) + 3 + len(absent)
    assert all(row.startswith(("ok ", "unavailable ")) for row in out[2 : -1 - len(absent)])


def test_fingerprint_source_agrees_with_the_import_on_every_fingerprinted_vllm_name(
    vllm_installed: str,
) -> None:
    """The rows of a line not installed here are fingerprinted from its
    release's source with :func:`fingerprint_source`: on the installed line
    it gives what the import gives, for every fingerprinted name vLLM's
    class defines itself."""
    import importlib

    checked = 0
    for n in vs.select(vllm_installed).all_names():
        if not n.fingerprints or not n.module.startswith("vllm."):
            continue
        path = importlib.import_module(n.module).__file__
        assert path is not None
        with open(path, encoding="utf-8") as f:
            from_source = vs.fingerprint_source(f.read(), n.qualname)
        if from_source is None:  # inherited (a connector API default hook)
            assert n.qualname.endswith(".bind_gpu_block_pool"), n.target
            continue
        assert from_source == vs.fingerprint(vs.resolve(n.target)), n.target
        checked += 1
    assert checked > 50


def test_check_vllm_surface_lists_the_bodies_a_replaced_wait_or_a_step_wrapper_relies_on(
    vllm_installed: str, capsys: Any
) -> None:
    assert cli_main(["check-vllm", "--surface"]) == 0
    rows = capsys.readouterr().out.splitlines()
    surface = vs.select(vllm_installed)
    for target, connector in _RELIED_ON.items():
        (name,) = [n for n in surface.names if n.target == target]
        (row,) = [r for r in rows if f" {target} | " in r]
        assert row.split()[:3] == ["ok", name.use, connector or "-"], row
        assert row.endswith(f"body {vs.fingerprint(vs.resolve(target))}")
        assert vs.fingerprint(vs.resolve(target)) in name.fingerprints


_VALID = "valid: mooncake_store, offloading, simple_cpu_offload, nixl, lmcache, lmcache_mp, or all"


@pytest.mark.parametrize(
    ("setting", "status", "last"),
    [
        (
            "mooncake,nixl",
            1,
            (
                f"BLOCKPOOL_VLLM_UNWIRED names no known KV connector: 'mooncake' ({_VALID}): "
                "the plugin leaves every KV connector as vLLM built it"
            ),
        ),
        (
            "nixl, offloading",
            0,
            "BLOCKPOOL_VLLM_UNWIRED=nixl, offloading: the plugin leaves offloading, nixl as vLLM built them",
        ),
    ],
)
def test_check_vllm_surface_says_what_the_unwired_setting_leaves_unwired_and_refuses_an_unknown_name(
    monkeypatch: pytest.MonkeyPatch, vllm_installed: str, capsys: Any, setting: str, status: int, last: str
) -> None:
    monkeypatch.setenv("BLOCKPOOL_VLLM_UNWIRED", setting)
    assert cli_main(["check-vllm", "--surface"]) == status
    assert capsys.readouterr().out.splitlines()[-1] == last


def _snapshot() -> dict[Any, Any]:
    """Every vLLM module's BlockPool binding, and every class attribute the
    plugin may wrap (by identity)."""
    snap: dict[Any, Any] = {
        name: mod.__dict__.get("BlockPool")
        for name, mod in list(sys.modules.items())
        if name.startswith("vllm")
    }
    for n in vs.active().names:
        module, _, qualname = n.target.partition(":")
        owner_path, _, attr = qualname.rpartition(".")
        if owner_path and module in sys.modules:
            try:
                owner = vs.resolve(f"{module}:{owner_path}")
            except (ImportError, AttributeError):  # a name this vLLM lacks: nothing to snapshot
                continue
            snap[n.target] = getattr(owner, "__dict__", {}).get(attr)
    return snap


def _doctor(monkeypatch: pytest.MonkeyPatch, target: str, fn: Any) -> None:
    module, _, qualname = target.partition(":")
    owner_path, _, attr = qualname.rpartition(".")
    monkeypatch.setattr(vs.resolve(f"{module}:{owner_path}"), attr, fn)


def test_a_resignatured_core_name_refuses_the_install_whole_naming_it(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: list[tuple[str, str]], vllm_installed: str
) -> None:
    from vllm.v1.core.block_pool import BlockPool

    def get_new_blocks(self: Any, num_blocks: int, group: int = 0) -> list[Any]:  # a new argument
        return []

    plugin.register()  # choose the line's surface first, as a process would; then start afresh
    plugin.unregister()
    log.clear()
    _doctor(monkeypatch, "vllm.v1.core.block_pool:BlockPool.get_new_blocks", get_new_blocks)
    before = _snapshot()
    plugin.register()
    assert _snapshot() == before
    state = plugin.install_state()
    assert (state.installed, state.refused, state.patched) == (False, "surface", [])
    assert BlockPool.get_new_blocks is get_new_blocks
    errors = [m for lvl, m in log if lvl == "ERROR"]
    assert len(errors) == 1 and len(log) == 1
    assert "vllm.v1.core.block_pool:BlockPool.get_new_blocks: signature" in errors[0]
    assert "found (self, num_blocks, group)" in errors[0]


def test_a_renamed_core_name_refuses_the_install_whole(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: list[tuple[str, str]], vllm_installed: str
) -> None:
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.setattr(BlockPool, "get_usage_fraction", BlockPool.get_usage, raising=False)
    monkeypatch.delattr(BlockPool, "get_usage")
    before = _snapshot()
    plugin.register()
    assert _snapshot() == before
    assert plugin.install_state().refused == "surface" and not plugin.is_installed()
    (line,) = [m for lvl, m in log if lvl == "ERROR"]
    assert (
        "BlockPool.get_usage: missing" in line and "get_usage_fraction" in line
    )  # members: the new name shown


def test_a_changed_body_of_a_borrowed_core_helper_refuses_the_install(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: list[tuple[str, str]], vllm_installed: str
) -> None:
    from vllm.v1.core.block_pool import BlockPool

    orig = BlockPool._emit_block_removed_events

    def _emit_block_removed_events(self: Any, block_hashes: Any) -> None:
        orig(self, list(block_hashes)[:1])  # same parameters, another body

    _doctor(
        monkeypatch,
        "vllm.v1.core.block_pool:BlockPool._emit_block_removed_events",
        _emit_block_removed_events,
    )
    plugin.register()
    assert plugin.install_state().refused == "surface"
    (line,) = [m for lvl, m in log if lvl == "ERROR"]
    assert "BlockPool._emit_block_removed_events: body" in line


def test_a_changed_body_of_a_connector_function_leaves_that_connector_unwired_and_untouched(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: list[tuple[str, str]], vllm_installed: str
) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker")
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker

    def wait_for_save(self: Any, metadata: Any) -> None:
        return None  # same parameters, another body

    monkeypatch.setattr(worker.MooncakeStoreWorker, "wait_for_save", wait_for_save)
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import scheduler

    sched_before = dict(scheduler.MooncakeStoreScheduler.__dict__)
    plugin.register()
    state = plugin.install_state()
    assert plugin.is_installed()
    assert "mooncake_store" not in state.connectors and "mooncake_store" in state.unwired
    assert "wait_for_save (body)" in state.unwired["mooncake_store"]
    assert worker.MooncakeStoreWorker.__dict__["wait_for_save"] is wait_for_save
    assert dict(scheduler.MooncakeStoreScheduler.__dict__) == sched_before
    warnings = [m for lvl, m in log if lvl == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "blockpool: KV connector mooncake_store left unwired: "
    )


def test_the_plugin_wraps_no_name_its_line_does_not_declare(
    monkeypatch: pytest.MonkeyPatch, clean: None, vllm_installed: str
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    plugin.register()
    assert plugin.is_installed()
    surface = plugin.install_state().surface
    for owner, attr, _ in plugin.install_state().patched:
        assert surface.declares(owner.__module__, f"{owner.__qualname__}.{attr}"), (owner, attr)
    with pytest.raises(AttributeError, match="is not declared in the surface of vLLM"):
        plugin._patch(Scheduler, "add_request", lambda orig: orig)
    assert "__blockpool_wrapped__" not in vars(Scheduler.__dict__["add_request"])


def test_a_changed_body_of_the_mooncake_send_threads_handle_request_leaves_mooncake_store_unwired(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: list[tuple[str, str]], vllm_installed: str
) -> None:
    """The send thread's ``_handle_request`` synchronizes on the event the
    wiring replaces and reads the range the wiring copies: another body
    there leaves MooncakeStore as vLLM built it, naming the function."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker")
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker

    def _handle_request(self: Any, req_meta: Any) -> None:
        return None  # same parameters, another body: no wait at all

    target = f"{_MOONCAKE_W}:KVCacheStoreSendingThread._handle_request"
    _doctor(monkeypatch, target, _handle_request)
    (drift,) = [d for d in vs.check(vs.select(vllm_installed)) if d.name.target == target]
    assert (drift.status, drift.found) == ("body", f"body {vs.fingerprint(_handle_request)}")
    plugin.register()
    state = plugin.install_state()
    assert plugin.is_installed()
    assert "mooncake_store" not in state.connectors
    assert "KVCacheStoreSendingThread._handle_request (body)" in state.unwired["mooncake_store"]
    assert "offloading" in state.connectors
    assert "__blockpool_wrapped__" not in vars(worker.MooncakeStoreWorker.__dict__["wait_for_save"])


def _same_call(orig: Any, name: str) -> Any:
    """A stand-in for ``orig`` with its parameters and another body (it calls
    ``orig``): what a vLLM release that edited the body looks like."""
    if name == "schedule":

        def schedule(self: Any, throttle_prefills: bool = False) -> Any:
            return orig(self, throttle_prefills=throttle_prefills)

        return schedule
    if name == "update_from_output":

        def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
            return orig(self, scheduler_output, model_runner_output)

        return update_from_output
    if name == "_drain_deferred_frees":

        def _drain_deferred_frees(self: Any) -> Any:
            return None  # the deferred frees never come back

        return _drain_deferred_frees

    def take_kv_cache_block_copies(self: Any) -> Any:
        copies, retained = orig(self)
        return copies, [tuple(retained[i : i + 2]) for i in range(0, len(retained), 2)]  # pairs, not flat

    return take_kv_cache_block_copies


@pytest.mark.parametrize(
    "target",
    [
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        "vllm.v1.core.sched.scheduler:Scheduler._drain_deferred_frees",
        "vllm.v1.core.kv_cache_manager:KVCacheManager.take_kv_cache_block_copies",
    ],
)
def test_a_changed_body_of_a_scheduler_step_method_the_plugin_wraps_refuses_the_install_naming_it(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: list[tuple[str, str]], vllm_installed: str, target: str
) -> None:
    """The step wrappers hang every fence on these bodies (the step's record
    after ``schedule``, its end in ``update_from_output``, the deferred
    frees tagged with their steps, the CoW copies as flat ``[src, dst,
    ...]`` pairs), and the preemption deferral on the
    allocation loop of ``schedule``: another body refuses the install whole
    (vLLM keeps its own pool, as stock) rather than guess which part changed."""
    plugin.register()  # choose the line's surface first, as a process would; then start afresh
    plugin.unregister()
    log.clear()
    orig = vs.resolve(target)
    _doctor(monkeypatch, target, _same_call(orig, target.rpartition(".")[2]))
    before = _snapshot()
    plugin.register()
    assert _snapshot() == before
    state = plugin.install_state()
    assert (state.installed, state.refused, state.patched) == (False, "surface", [])
    (line,) = [m for lvl, m in log if lvl == "ERROR"]
    assert f"{target}: body, expected " in line
