"""The SGLang surface the plugin depends on, declared per release line.

Every SGLang method the plugin wraps (``role="wrap"``) or whose behaviour
it relies on without wrapping it (``role="rely"``) is listed with its
signature and a fingerprint of its body (the first 16 hex digits of the
SHA-256 of its dedented source). :func:`check_surface` compares the running
SGLang with the declared line; :func:`blockpool.integrations.sglang.register`
installs nothing when a single name drifted, and names each one.

Names marked ``optional`` live in modules the plugin does not import
itself (the scheduler's): they are checked, and wrapped, only in a process
that has imported their module already (SGLang's scheduler process calls
``load_plugins()`` from inside ``sglang.srt.managers.scheduler``).

``blockpool check-sglang --surface`` prints :func:`surface_table`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from blockpool.core.errors import InvalidArgumentError

__all__ = [
    "SUPPORTED_SGLANG",
    "Drift",
    "SurfaceEntry",
    "check_surface",
    "fingerprint",
    "installed_version",
    "resolve",
    "surface_for",
    "surface_table",
]

_ALLOC = "sglang.srt.mem_cache.allocator"
_PAGED = f"{_ALLOC}.paged.PagedTokenToKVPoolAllocator"
_TOKEN = f"{_ALLOC}.token.TokenToKVPoolAllocator"
_BASE = f"{_ALLOC}.base.BaseTokenToKVPoolAllocator"
_SWA = f"{_ALLOC}.swa.SWATokenToKVPoolAllocator"
_HICACHE = "sglang.srt.managers.cache_controller.HiCacheController"
_HYBRID = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
_URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_UTC = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"
_RTC = "sglang.srt.mem_cache.rust_tree_core.adapter.RustUnifiedTreeCore"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_DECODE = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin"
_PREFILL = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
_PP = "sglang.srt.managers.scheduler_pp_mixin.SchedulerPPMixin"


@dataclass(frozen=True)
class SurfaceEntry:
    """One SGLang name: ``target`` is the dotted path HookRegistry resolves
    (``module.Class.method``), ``signature`` the text of
    ``inspect.signature``, ``body`` the :func:`fingerprint` of its source,
    ``role`` ``"wrap"`` (an AROUND hook is installed on it) or ``"rely"``
    (its behaviour is mirrored or assumed), ``why`` what depends on it."""

    target: str
    signature: str
    body: str
    role: Literal["wrap", "rely"]
    why: str
    optional: bool = False


@dataclass(frozen=True)
class Drift:
    """A declared name that differs in the running SGLang: ``what`` is
    ``"missing"``, ``"signature"`` or ``"body"``; ``found`` the running
    value (``None`` when missing)."""

    target: str
    what: Literal["missing", "signature", "body"]
    expected: str
    found: str | None

    def __str__(self) -> str:
        if self.what == "missing":
            return f"{self.target}: missing"
        return f"{self.target}: {self.what} {self.found} (declared {self.expected})"


def _e(
    target: str, signature: str, body: str, role: Literal["wrap", "rely"], why: str, **kw: Any
) -> SurfaceEntry:
    return SurfaceEntry(target, signature, body, role, why, **kw)


_SURFACE_0_5_23: tuple[SurfaceEntry, ...] = (
    # The paged allocator: its free list is mirrored as runs (account.py).
    _e(
        f"{_PAGED}._release_page_ids",
        "(self, *page_ids: torch.Tensor)",
        "288a614a3ee6c00b",
        "wrap",
        "every page release: prepended (LIFO) or staged (need_sort); tagged here",
    ),
    _e(
        f"{_PAGED}.alloc",
        "(self, need_size: int)",
        "60eebfb935a9cef9",
        "wrap",
        "takes need_size // page_size pages from the front of free_pages",
    ),
    _e(
        f"{_PAGED}.alloc_extend",
        "(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor, "
        "seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int, num_new_pages: int = None)",
        "122a83017ff83b7f",
        "wrap",
        "takes num_new_pages from the front of free_pages",
    ),
    _e(
        f"{_PAGED}.alloc_decode",
        "(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor)",
        "47a50efa6cab5cde",
        "wrap",
        "takes num_new_pages from the front of free_pages",
    ),
    _e(
        f"{_PAGED}.merge_and_sort_free",
        "(self)",
        "aeec4066e3100508",
        "wrap",
        "a sort of free and staged pages: the account's runs become unknown",
    ),
    _e(
        f"{_PAGED}.clear",
        "(self)",
        "bdd7b3441edfbf83",
        "wrap",
        "free_pages = arange(1, num_pages + 1): the account starts (or restarts) here",
    ),
    _e(
        f"{_PAGED}.free",
        "(self, free_index: torch.Tensor)",
        "70f7446b45b1ced6",
        "rely",
        "releases through _release_page_ids, or defers to the free group",
    ),
    _e(
        f"{_PAGED}.free_page_ids",
        "(self, page_ids: torch.Tensor)",
        "5f5dd750ea43398e",
        "rely",
        "releases through _release_page_ids, or defers to the free group",
    ),
    _e(
        f"{_PAGED}.free_segment",
        "(self, free_index: torch.Tensor, *, start_pos: int)",
        "684a14a85d7900f9",
        "rely",
        "the tree cache's frees: one page id per page, released through free_page_ids",
    ),
    _e(
        f"{_PAGED}.free_group_end",
        "(self)",
        "aa98258589d24de6",
        "rely",
        "deferred frees reach the list through _release_page_ids",
    ),
    # The token allocator (page_size 1): frees are appended (FIFO).
    _e(
        f"{_TOKEN}.alloc",
        "(self, need_size: int)",
        "22f44f70babea56f",
        "wrap",
        "takes need_size from the front of free_pages",
    ),
    _e(
        f"{_TOKEN}.free",
        "(self, free_index: torch.Tensor)",
        "bd52d73c8db5fa85",
        "wrap",
        "every release: appended (FIFO) or staged in release_pages (need_sort)",
    ),
    _e(
        f"{_TOKEN}.clear",
        "(self)",
        "193dbc24f971ad59",
        "wrap",
        "free_pages = arange(1, size + 1): the account starts (or restarts) here",
    ),
    _e(
        f"{_BASE}.merge_and_sort_free",
        "(self)",
        "7a936a2a991aa6d7",
        "wrap",
        "the token allocator's sorted merge: the account's runs become unknown",
    ),
    _e(
        f"{_TOKEN}.free_page_ids",
        "(self, page_ids: torch.Tensor)",
        "8d72639b068c0e0f",
        "rely",
        "releases through free(), or defers to the free group",
    ),
    _e(
        f"{_BASE}.free_segment",
        "(self, free_index: torch.Tensor, *, start_pos: int)",
        "5b4b79c8619aaa6d",
        "rely",
        "the token allocator's segment free is a plain free()",
    ),
    _e(
        f"{_BASE}.free_full",
        "(self, free_index: torch.Tensor)",
        "d87792413315cfce",
        "rely",
        "a single pool's full-only free is a plain free()",
    ),
    _e(
        f"{_BASE}.free_full_segment",
        "(self, free_index: torch.Tensor, *, start_pos: int)",
        "53eb7796b0760543",
        "rely",
        "the tree cache's full-only frees reach free_full()",
    ),
    _e(
        f"{_BASE}.free_segments",
        "(self, segments)",
        "a445e764f0a62138",
        "rely",
        "several segment frees, each through free_segment()",
    ),
    _e(
        f"{_SWA}.alloc",
        "(self, need_size: int)",
        "717c98efc315e4d7",
        "rely",
        "two allocations, its full and its sliding-window allocator's: a load's fence joins both",
    ),
    _e(
        f"{_BASE}.free_group_end",
        "(self)",
        "39393ea47f371852",
        "rely",
        "deferred frees reach the token allocator's list through free()",
    ),
    # The HiCache controllers.
    _e(
        f"{_HICACHE}.load",
        "(self, host_indices: torch.Tensor, priority: Optional[int] = None, node_id: int = -1) "
        "-> Optional[torch.Tensor]",
        "c81be728a2dac4bc",
        "wrap",
        "allocates the load's device pages, queues one CacheOperation",
    ),
    _e(
        f"{_HICACHE}.write",
        "(self, device_indices: torch.Tensor, priority: Optional[int] = None, node_id: int = -1, "
        "extra_pools: Optional[List[PoolTransfer]] = None) -> Optional[torch.Tensor]",
        "a3c67f2ca6a17a77",
        "wrap",
        "queues one CacheOperation, then start_writing()",
    ),
    _e(
        f"{_HICACHE}.start_loading",
        "(self) -> int",
        "402f04e47b4b52dd",
        "wrap",
        "waits host_to_device_stream on load_fence_stream when it is set, then submits",
    ),
    _e(
        f"{_HICACHE}.start_writing",
        "(self) -> None",
        "36718849a5a053db",
        "wrap",
        "waits device_to_host_stream on write_fence_stream when it is set, then submits",
    ),
    _e(
        f"{_HYBRID}.load",
        "(self, host_indices: torch.Tensor, priority: Optional[int] = None, node_id: int = -1, "
        "extra_pools: Optional[list[PoolTransfer]] = None, *, device_indices: Optional[torch.Tensor] = None, "
        "anchor_indices: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]",
        "0b96fd87600b5b85",
        "wrap",
        "allocates through full_attn_allocator.alloc unless rows are given",
    ),
    _e(
        f"{_HYBRID}.write",
        "(self, device_indices: torch.Tensor, priority: Optional[int] = None, node_id: int = -1, "
        "extra_pools: Optional[list[PoolTransfer]] = None, flush: bool = True, "
        "start_owner: Optional[int] = None) -> Optional[torch.Tensor]",
        "e49e62d1b08216af",
        "wrap",
        "queues one CacheOperation, start_writing() when flush",
    ),
    _e(
        "sglang.srt.managers.cache_controller.CacheOperation.merge_ops",
        "(ops: List[CacheOperation]) -> CacheOperation",
        "7818d1061f7e4f14",
        "rely",
        "start_loading/start_writing submit the queued operations as one",
    ),
    # The tree cache.
    _e(
        f"{_URC}.check_hicache_events",
        "(self) -> None",
        "56ec760049eed244",
        "wrap",
        "runs once per scheduler step: binds the forward stream, polls the fence events",
    ),
    _e(
        f"{_URC}.backup_kv_cache",
        "(self, req: Req) -> Optional[RetractionBackup]",
        "e095055ae8c195c4",
        "wrap",
        "submits a device-to-host copy with no write fence: counted as a race",
    ),
    # Radix-node tags (tree.py): the locks, inserts and leaf evictions of the
    # tree cache, and the tree cores' paths.
    _e(
        f"{_URC}.__init__",
        "(self, params: CacheInitParams)",
        "f28465f79ed7d781",
        "rely",
        "disable, tree_components, buffer_pipeline, enable_session_radix_cache, token_to_kv_pool_allocator",
    ),
    _e(
        f"{_URC}.dec_lock_ref",
        "(self, node_id: NodeId, params: DecLockRefParams, skip_swa: bool = False) -> DecLockRefResult",
        "bb36fbdfff1dea70",
        "wrap",
        "a request's lock on its root-to-node path dropped: the path is tagged",
    ),
    _e(
        f"{_URC}.unlock",
        "(self, lock: Optional[TreeLock]) -> None",
        "89ae2d9fbd17118b",
        "rely",
        "a TreeLock is released through dec_lock_ref",
    ),
    _e(
        f"{_URC}.insert",
        "(self, params: InsertParams) -> InsertResult",
        "7059494fdad65977",
        "wrap",
        "the nodes it creates or refills lie on the path to last_device_node: the path is tagged",
    ),
    _e(
        f"{_URC}._evict_device_leaf",
        "(self, node_id: NodeId, tracker: dict[ComponentType, int]) -> Optional[BackupKV]",
        "ca2e6f82afbe7588",
        "wrap",
        "frees one device leaf's pages (demoted or deleted): they carry the leaf's tag",
    ),
    _e(
        f"{_URC}._demote",
        "(self, node_id: NodeId, tracker: dict[ComponentType, int]) -> None",
        "6eb3d4e5d18fbfd1",
        "wrap",
        "frees a backed-up leaf's device pages after a write-back: they carry the leaf's tag",
    ),
    _e(
        f"{_URC}._apply_eviction_result",
        "(self, result: BaseEvictionResult) -> None",
        "73bf60a2f6a2abbf",
        "rely",
        "an eviction's device frees are released before its cache actions",
    ),
    _e(
        f"{_URC}._drain_device_frees",
        "(self, device_frees: dict[ComponentType, list[torch.Tensor]]) -> None",
        "5bc0312ca914c790",
        "rely",
        "device frees reach the allocator per component, in order",
    ),
    _e(
        f"{_URC}._apply_cache_action",
        "(self, action: CacheAction | ComponentAction) -> None",
        "5d6801da995762a0",
        "rely",
        "FreeDeviceKV reaches the allocator's free_segment",
    ),
    _e(
        f"{_UTC}.collect_path_info",
        "(self, end_node_ids: Sequence[NodeId]) -> tuple[tuple[TreePathNodeInfo, ...], ...]",
        "9186e7bb616777de",
        "rely",
        "the root-to-node path with each node's FULL value length (Python tree core)",
    ),
    _e(
        f"{_UTC}._new_node",
        "(self, priority: int = 0) -> UnifiedTreeNode",
        "a7899a8c6fa001b2",
        "rely",
        "every node is built through UnifiedTreeNode (Python tree core)",
    ),
    _e(
        "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeNode.__init__",
        "(self, tree_components: tuple[ComponentType, ...], priority: int = 0)",
        "c95189e72bc30f52",
        "rely",
        "node ids come from a class counter, never reused (Python tree core)",
    ),
    _e(
        f"{_UTC}.evict_device_leaf",
        "(self, node_id: NodeId, is_write_back: bool) -> EvictDeviceLeafResult",
        "b22ae99d3f4f30c7",
        "rely",
        "frees the leaf's own device value (Python tree core)",
    ),
    _e(
        f"{_RTC}.collect_path_info",
        "(self, end_node_ids: Sequence[NodeId]) -> tuple[tuple[TreePathNodeInfo, ...], ...]",
        "49595979228b676a",
        "rely",
        "the root-to-node path with each node's FULL value length (Rust tree core)",
    ),
    _e(
        f"{_RTC}.reset",
        "(self) -> None",
        "d69b49ca42280852",
        "rely",
        "node handles are never re-minted, a reset included (Rust tree core)",
    ),
    # The scheduler: forward launches (older-than-tail fences), where it is loaded.
    _e(
        f"{_SCHED}.run_batch",
        "(self, batch: ScheduleBatch, pp_proxy_tensors: Optional[PPProxyTensors] = None) "
        "-> Union[GenerationBatchResult, EmbeddingBatchResult]",
        "c314c0d4b02c8565",
        "wrap",
        "launches one forward on the forward stream",
        optional=True,
    ),
    # The scheduler loops: each builds a batch and launches it before it
    # builds the next (results may be processed in between): at most one
    # batch built and not launched, so a token stands for the next launch.
    _e(
        f"{_SCHED}.event_loop_normal",
        "(self)",
        "e1b4f1cdca2d5dfd",
        "rely",
        "build, launch, process: one batch built and not launched at most",
        optional=True,
    ),
    _e(
        f"{_SCHED}.event_loop_overlap",
        "(self)",
        "a6c1681f722ae8cc",
        "rely",
        "build N+1, maybe process N, launch N+1: one batch built and not launched at most",
        optional=True,
    ),
    _e(
        f"{_DECODE}.event_loop_normal_disagg_decode",
        "(self: Scheduler)",
        "da89eb8970efb494",
        "rely",
        "PD decode: one batch built and not launched at most",
        optional=True,
    ),
    _e(
        f"{_DECODE}.event_loop_overlap_disagg_decode",
        "(self: Scheduler)",
        "be4d68288fd765bb",
        "rely",
        "PD decode with overlap: one batch built and not launched at most",
        optional=True,
    ),
    _e(
        f"{_PREFILL}.event_loop_normal_disagg_prefill",
        "(self: Scheduler) -> None",
        "4abff1726ded95b0",
        "rely",
        "PD prefill: one batch built and not launched at most",
        optional=True,
    ),
    _e(
        f"{_PREFILL}.event_loop_overlap_disagg_prefill",
        "(self: Scheduler) -> None",
        "64c1e0435c618dbd",
        "rely",
        "PD prefill with overlap: each batch launched as soon as it is built",
        optional=True,
    ),
    _e(
        f"{_PP}.event_loop_pp",
        "(self: Scheduler)",
        "907cc3cb646fce07",
        "rely",
        "pipeline parallelism: each micro-batch launched as soon as it is built",
        optional=True,
    ),
    _e(
        f"{_PP}.event_loop_pp_disagg_prefill",
        "(self: Scheduler)",
        "647020c679ec4103",
        "rely",
        "PP with PD prefill: each micro-batch launched as soon as it is built",
        optional=True,
    ),
    _e(
        f"{_PP}.event_loop_pp_disagg_decode",
        "(self: Scheduler)",
        "aaa9935d47e3682b",
        "rely",
        "PP with PD decode: each micro-batch launched as soon as it is built",
        optional=True,
    ),
)

SUPPORTED_SGLANG: dict[str, tuple[SurfaceEntry, ...]] = {"0.5.23": _SURFACE_0_5_23}
"""Release line → declared surface. Only 0.5.23 is declared."""


def fingerprint(fn: Callable[..., Any]) -> str:
    """First 16 hex digits of the SHA-256 of ``fn``'s dedented source
    (``inspect.getsource``). O(len(source)).

    Raises:
        InvalidArgumentError: the source of ``fn`` cannot be read.
    """
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        raise InvalidArgumentError(f"no source for {fn!r}: {exc}") from None
    return hashlib.sha256(textwrap.dedent(src).encode()).hexdigest()[:16]


_QUALIFIER = re.compile(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])")


def _normal(sig: str) -> str:
    # Annotations render as strings under PEP 563 and as qualified names
    # otherwise: compare them without quotes and module prefixes.
    return _QUALIFIER.sub("", sig.replace("'", ""))


def signature_text(fn: Callable[..., Any]) -> str:
    """``str(inspect.signature(fn))``. O(#parameters)."""
    return str(inspect.signature(fn))


def installed_version() -> str | None:
    """The running SGLang's version (its distribution metadata), ``None``
    when SGLang is not installed. O(1)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def surface_for(version: str | None) -> tuple[SurfaceEntry, ...] | None:
    """The declared surface of ``version``'s release line, ``None`` when
    the line is not declared. O(1)."""
    if version is None:
        return None
    return SUPPORTED_SGLANG.get(version)


def _unwrap(fn: Any) -> Any:
    # HookRegistry's wrappers keep the original in __wrapped__.
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def resolve(target: str, *, import_modules: bool = True) -> Any:
    """The function at ``target`` (``module.Class.method``), unwrapped of
    any HookRegistry wrapper; ``None`` when a name is missing or, with
    ``import_modules=False``, its module is not imported. Imports the
    module otherwise. O(1) plus the import.
    """
    mod_path, cls_name, attr = target.rsplit(".", 2)
    if not import_modules and mod_path not in sys.modules:
        return None
    try:
        mod = importlib.import_module(mod_path)
    except ImportError:
        return None
    cls = getattr(mod, cls_name, None)
    if cls is None:
        return None
    raw = inspect.getattr_static(cls, attr, None)
    if raw is None:
        return None
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    return _unwrap(raw)


def present(entry: SurfaceEntry) -> bool:
    """Whether ``entry`` is checked (and wrapped) in this process: always,
    unless it is optional and its module is not imported. O(1)."""
    return not entry.optional or entry.target.rsplit(".", 2)[0] in sys.modules


def check_surface(surface: tuple[SurfaceEntry, ...]) -> list[Drift]:
    """Compare ``surface`` with the running SGLang: one :class:`Drift` per
    missing, re-signatured or re-bodied name (a body whose source cannot be
    read is a drift, found ``"unreadable"``; optional names whose module is
    not imported are skipped). Imports the modules named.
    O(total source length)."""
    drifts: list[Drift] = []
    for entry in surface:
        if not present(entry):
            continue
        fn = resolve(entry.target)
        if fn is None:
            drifts.append(Drift(entry.target, "missing", entry.signature, None))
            continue
        sig = signature_text(fn)
        if _normal(sig) != _normal(entry.signature):
            drifts.append(Drift(entry.target, "signature", entry.signature, sig))
            continue
        try:
            body = fingerprint(fn)
        except InvalidArgumentError:
            body = "unreadable"  # no source (a build without .py files)
        if body != entry.body:
            drifts.append(Drift(entry.target, "body", entry.body, body))
    return drifts


def surface_table(version: str | None = None) -> list[dict[str, str]]:
    """Rows for ``blockpool check-sglang --surface``: one per declared name
    of ``version``'s line (default: the installed SGLang's, else the newest
    declared), with ``state`` ``ok``, ``missing``, ``signature``, ``body``,
    ``not loaded`` (optional, module not imported) or ``not checked`` (SGLang
    not installed or another version). O(total source length)."""
    running = installed_version()
    line = version or (running if running in SUPPORTED_SGLANG else max(SUPPORTED_SGLANG))
    surface = SUPPORTED_SGLANG.get(line)
    if surface is None:
        raise InvalidArgumentError(
            f"no SGLang surface declared for {line!r}; declared: {sorted(SUPPORTED_SGLANG)}"
        )
    checked = running == line
    drifts = {d.target: d for d in check_surface(surface)} if checked else {}
    rows = []
    for e in surface:
        if not checked:
            state = "not checked"
        elif not present(e):
            state = "not loaded"
        else:
            d = drifts.get(e.target)
            state = "ok" if d is None else d.what
        rows.append(
            {"line": line, "target": e.target, "role": e.role, "body": e.body, "state": state, "why": e.why}
        )
    return rows


def report() -> tuple[int, list[str]]:
    """``blockpool check-sglang --surface``: the exit status and the lines
    of :func:`surface_table` (target, role, state, declared body
    fingerprint). Status 0: every checked name as declared; 1: a drift;
    2: SGLang not installed or its version has no declared line (the newest
    declared line is printed, unchecked). O(total source length)."""
    running = installed_version()
    rows = surface_table()
    line = rows[0]["line"] if rows else "?"
    head = f"SGLang {running or 'not installed'}; declared line {line}"
    if running != line:
        head += f" (not checked: {'no SGLang' if running is None else 'another version'})"
    lines = [head]
    width = max(len(r["target"]) for r in rows)
    for r in rows:
        lines.append(f"{r['target']:<{width}}  {r['role']:<4}  {r['body']}  {r['state']}")
    if running != line:
        return 2, lines
    drifted = [r for r in rows if r["state"] not in ("ok", "not loaded")]
    return (1 if drifted else 0), lines
