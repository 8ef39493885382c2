"""Proof by serving a model: a real vLLM engine, plugin off and on.

``python -m blockpool.checking.vllm_engine`` (or ``blockpool
check-vllm``) starts vLLM's engine in this environment on a tiny Llama built
locally (random weights, seeded; nothing from a model hub) and serves the
same workload of token-id prompts once per mode (:data:`MODES`), each run in its own
subprocess (the plugin's state is per process):

================ ==============================================================
mode             environment of the run
================ ==============================================================
``off``          ``BLOCKPOOL_VLLM_PLUGIN=0`` (``--off-by allowlist``:
                 ``VLLM_PLUGINS=""``): vLLM's own ``BlockPool``
``on``           the plugin as installed: :class:`VllmBlockPool`, hazards on
``hazards-off``  ``BLOCKPOOL_VLLM_HAZARDS=0``: our pool without hazard tracking
``audit``        ``BLOCKPOOL_VLLM_HAZARDS=audit``: fences computed, no wait added
================ ==============================================================

Each run uses ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core, and so
the scheduler, live in the run's own process) and ``PYTHONHASHSEED=0``
(vLLM's block hashes are then the same in every process), and records:

- the generated token ids of every request (greedy sampling);
- prefix-cache hits: ``RequestOutput.num_cached_tokens`` per request, and
  the scheduler's prefix-cache stats (requests, queries, hits) summed over
  the steps;
- the KV cache event stream (``kv_events_config`` with the ``null``
  publisher, whose ``publish`` is wrapped): every ``BlockStored``,
  ``BlockRemoved`` and ``AllBlocksCleared`` with all its fields (block
  hashes, parent, token ids, ...), and how many events each step published;
- the class of the scheduler's ``kv_cache_manager.block_pool``, whether it
  tracks hazards (``pool.hazards``), and what the plugin says it served
  (:data:`~blockpool.integrations.vllm.served.SERVED`);
- the plugin's own lines in the engine's log (the registration line, the
  "disabled" line, a KV connector's "not wired" warning);
- the scheduler's time per step: ``Scheduler.schedule`` and
  ``Scheduler.update_from_output`` of the engine's scheduler, wrapped with
  :func:`time.perf_counter` and :func:`time.thread_time` (wall clock and
  the thread's CPU time; the plugin's own wrappers included).

The check passes when tokens, hits and events are identical in every mode,
the pool is vLLM's ``BlockPool`` with the plugin off and
:class:`VllmBlockPool` (hazards on / off as the mode says, and the core
served allocations) with it on. A missing plugin log line is a warning, not
a failure (the pool's class is checked in the engine process either way).

Workloads (``--workload``, comma-separated): ``quick`` (the default: long
shared prefixes, a 48-block pool so that cached blocks are evicted, three
waves of requests so that later waves hit what earlier ones cached, some
prompts repeated whole) and ``timing`` (a pool of thousands of blocks and
hundreds of requests: many scheduler steps, for the per-step figure). The
size flags (``--num-blocks``, ``--requests``, ...) override the field in
every selected workload. ``--connector`` adds a run with the plugin on and
vLLM's ``ExampleConnector`` (synchronous, on disk; runs on CPU) on the first
workload: its tokens must equal the ``off`` run's, and the plugin is
expected to log that the connector is not wired. ``--repeat N`` runs every
mode N times, interleaved: every run must agree with the first ``off`` run,
and the reported time per step is each mode's best repetition (on a shared
machine one run's figure is noisy).

Output: a report on stdout (``--json PATH`` writes it as JSON, schema
:data:`SCHEMA`), progress on stderr. Exit status: :data:`EXIT_PASS` (0) the
modes agree, :data:`EXIT_MISMATCH` (1) they do not (the first differences
are printed) or an on-mode run failed, :data:`EXIT_SETUP` (2) setup error
(vLLM, torch or transformers missing, the ``off`` run failed, bad flags).

On a machine without CUDA the runs set ``VLLM_TARGET_DEVICE=cpu`` unless it
is set. vLLM's CPU backend needs a block size that is a multiple of 32 and
head sizes of at least 32, hence the model's shape. Importing this module
imports neither torch nor vLLM; only the runs do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "EXIT_MISMATCH",
    "EXIT_PASS",
    "EXIT_SETUP",
    "KV_CONNECTORS",
    "KV_CPU_BYTES",
    "MODES",
    "SCHEMA",
    "WORKLOADS",
    "Difference",
    "ModelSpec",
    "Workload",
    "add_arguments",
    "build_prompts",
    "compare_runs",
    "core_build",
    "exit_status",
    "format_report",
    "main",
    "mode_env",
    "normalize_event",
    "plugin_line_warnings",
    "plugin_lines",
    "run",
    "step_stats",
]

SCHEMA = "blockpool.check-vllm/1"
"""The ``schema`` field of the JSON report."""

EXIT_PASS = 0
"""Exit status: every mode gave the same tokens, hits and events."""
EXIT_MISMATCH = 1
"""Exit status: the modes differ, a pool is not the expected class, or an on-mode run failed."""
EXIT_SETUP = 2
"""Exit status: setup error (vLLM or its model stack missing, the ``off`` run failed, bad flags)."""

MODES = ("off", "on", "hazards-off", "audit")
"""The modes every workload runs in, the reference (``off``) first: the
plugin off, on, on with hazards off (``BLOCKPOOL_VLLM_HAZARDS=0``), and on
in audit mode (``BLOCKPOOL_VLLM_HAZARDS=audit``: fences computed, no wait
added; on a CPU worker nothing is audited, so this run checks that the
scheduler side changes nothing vLLM does and measures its cost)."""
CONNECTOR_MODE = "on+example"
"""The optional run with the plugin on and vLLM's ``ExampleConnector`` (``--connector``)."""

VLLM_POOL = "vllm.v1.core.block_pool.BlockPool"
OUR_POOL = "blockpool.integrations.vllm.pool.VllmBlockPool"

_ENV_PLUGIN = "BLOCKPOOL_VLLM_PLUGIN"  # = blockpool.integrations.vllm.ENV_PLUGIN
_ENV_HAZARDS = "BLOCKPOOL_VLLM_HAZARDS"  # = blockpool.integrations.vllm.ENV_HAZARDS
_ENV_UNWIRED = "BLOCKPOOL_VLLM_UNWIRED"


@attrs.frozen
class ModelSpec:
    """The tiny Llama every run serves, built by ``transformers`` with random
    weights from ``seed`` (float32, saved as safetensors). Its shape suits
    vLLM's CPU attention backend (head size 32). With ``sliding_window``
    (tokens, > 0) it is a tiny hybrid model instead: a Gemma 2 of the same
    shape whose layers alternate sliding-window and full attention, which
    vLLM serves with two KV cache groups (``HybridKVCacheCoordinator``)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1000
    max_position_embeddings: int = 1024
    seed: int = 0
    sliding_window: int = 0


@attrs.frozen
class Workload:
    """One serving workload: the engine's settings and the prompts.

    Prompts are token ids drawn from ``random.Random(seed)``
    (:func:`build_prompts`): ``prefixes`` shared prefixes of
    ``prefix_blocks`` full blocks each; request ``i`` takes prefix
    ``i % prefixes`` and a suffix of its own, of ``suffix_tokens // 2`` to
    ``suffix_tokens`` tokens (so most prompts end in a partial block). The
    requests are served in ``waves`` calls of ``LLM.generate``; from the
    second wave on, every fourth request repeats a prompt of the wave
    before it whole (a full-prompt hit). Each request generates
    ``max_tokens`` tokens (greedy, EOS ignored).

    Attributes:
        name: The workload's name in the report.
        num_blocks: ``num_gpu_blocks_override``: blocks in the pool (the null
            block included).
        block_size: Tokens per block (a multiple of 32 on vLLM's CPU backend).
        max_num_seqs: Requests scheduled at once at most.
        max_model_len: vLLM's ``max_model_len`` (at most the model's
            positions); every prompt plus ``max_tokens`` must fit.
        kv_connector: A KV connector every mode serves with
            (:data:`KV_CONNECTORS`: ``offloading``, ``simple_cpu_offload``;
            both need CUDA in vLLM 0.32 and 0.33), or ``None``.
        sliding_window: Tokens; > 0 serves the tiny hybrid model
            (:class:`ModelSpec` ``sliding_window``) instead of the Llama.
    """

    name: str
    num_blocks: int
    requests: int
    prefixes: int
    prefix_blocks: int
    suffix_tokens: int
    max_tokens: int
    waves: int = 1
    max_num_seqs: int = 8
    block_size: int = 32
    max_model_len: int = 1024
    seed: int = 0
    kv_connector: str | None = None
    sliding_window: int = 0

    def validate(self, model: ModelSpec) -> None:
        """Raise ValueError naming the first field that cannot work. O(1)."""
        for field in ("num_blocks", "requests", "prefixes", "suffix_tokens", "max_tokens", "waves",
                      "max_num_seqs", "block_size", "max_model_len"):  # fmt: skip
            if getattr(self, field) < 1:
                raise ValueError(f"workload {self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.prefix_blocks < 0:
            raise ValueError(f"workload {self.name}: prefix_blocks must be >= 0, got {self.prefix_blocks}")
        if self.waves > self.requests:
            raise ValueError(f"workload {self.name}: {self.waves} waves for {self.requests} requests")
        if self.max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"workload {self.name}: max_model_len {self.max_model_len} > the model's "
                f"{model.max_position_embeddings} positions"
            )
        longest = self.prefix_blocks * self.block_size + self.suffix_tokens + self.max_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"workload {self.name}: a request needs up to {longest} tokens > max_model_len {self.max_model_len}"
            )
        if (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(
                f"workload {self.name}: {self.num_blocks} blocks of {self.block_size} tokens cannot hold one "
                f"request of max_model_len {self.max_model_len} (vLLM refuses to start)"
            )

    def describe(self) -> str:
        """One line for the report. O(1)."""
        return (
            f"{self.requests} requests in {self.waves} wave(s), {self.prefixes} shared prefixes of "
            f"{self.prefix_blocks} blocks, suffixes up to {self.suffix_tokens} tokens, {self.max_tokens} "
            f"generated each; {self.num_blocks} blocks of {self.block_size} tokens, "
            f"max_num_seqs {self.max_num_seqs}"
            + (f"; KV connector {KV_CONNECTORS[self.kv_connector]}" if self.kv_connector else "")
            + (
                f"; tiny hybrid model, sliding window {self.sliding_window} tokens"
                if self.sliding_window
                else ""
            )
        )


KV_CONNECTORS: Mapping[str, str] = {
    "offloading": "OffloadingConnector",
    "simple_cpu_offload": "SimpleCPUOffloadConnector",
}
"""``--kv-connector`` names and the vLLM connectors they serve with (the
GPU check of the asynchronous connectors: CPU offloading needs CUDA)."""
KV_CPU_BYTES = 1 << 30
"""``cpu_bytes_to_use`` of a ``--kv-connector`` run (1 GiB of host memory)."""

WORKLOADS: Mapping[str, Workload] = {
    "quick": Workload(
        name="quick", num_blocks=48, requests=24, prefixes=6, prefix_blocks=6, suffix_tokens=40,
        max_tokens=16, waves=3, max_num_seqs=8,
    ),
    "timing": Workload(
        name="timing", num_blocks=2048, requests=768, prefixes=16, prefix_blocks=16, suffix_tokens=96,
        max_tokens=32, waves=1, max_num_seqs=32,
    ),
    "hybrid": Workload(
        name="hybrid", num_blocks=96, requests=24, prefixes=6, prefix_blocks=6, suffix_tokens=40,
        max_tokens=16, waves=3, max_num_seqs=8, sliding_window=64,
    ),
}  # fmt: skip
"""The built-in workloads: ``quick`` (correctness: hits and evictions in a
48-block pool, about half a minute per mode), ``timing`` (many steps on
thousands of blocks, for the scheduler's time per step) and ``hybrid``
(``quick``'s prompts on the tiny hybrid model: a full-attention and a
sliding-window KV cache group in one pool)."""

_SIZE_FLAGS = ("num_blocks", "requests", "prefixes", "prefix_blocks", "suffix_tokens", "max_tokens",
               "waves", "max_num_seqs", "seed")  # fmt: skip


def build_prompts(w: Workload) -> list[list[list[int]]]:
    """The workload's prompts as token ids, wave by wave (see
    :class:`Workload`). Deterministic in ``w``; token ids in ``[1, 1000)``.
    O(total prompt tokens).

    >>> waves = build_prompts(WORKLOADS["quick"])
    >>> [len(x) for x in waves], waves[0][0][:192] == waves[0][6][:192]
    ([8, 8, 8], True)
    """
    import random

    rng = random.Random(w.seed)
    prefix_len = w.prefix_blocks * w.block_size
    prefixes = [[rng.randrange(1, 1000) for _ in range(prefix_len)] for _ in range(w.prefixes)]
    sizes = [w.requests // w.waves + (1 if i < w.requests % w.waves else 0) for i in range(w.waves)]
    waves: list[list[list[int]]] = []
    i = 0
    for size in sizes:
        wave = []
        for j in range(size):
            if waves and j % 4 == 3 and j < len(waves[-1]):
                wave.append(list(waves[-1][j]))  # the same prompt again: a full-prompt hit
            else:
                n = rng.randint(max(1, w.suffix_tokens // 2), w.suffix_tokens)
                wave.append(prefixes[i % w.prefixes] + [rng.randrange(1, 1000) for _ in range(n)])
            i += 1
        waves.append(wave)
    return waves


def mode_env(mode: str, environ: Mapping[str, str], off_by: str = "env") -> dict[str, str]:
    """The environment of one run: ``environ`` with the mode's switches set
    (and the other modes' cleared), the in-process engine core, a fixed hash
    seed and an offline hub. O(len(environ)).

    ``off_by="env"`` turns the plugin off with ``BLOCKPOOL_VLLM_PLUGIN=0``
    (every other vLLM plugin still loads, so the modes differ in one thing);
    ``"allowlist"`` with ``VLLM_PLUGINS=""`` (no plugin loads at all). In the
    on-modes a ``VLLM_PLUGINS`` allowlist that leaves ``blockpool`` out gets
    it added.

    >>> env = mode_env("hazards-off", {"VLLM_PLUGINS": "other"})
    >>> env["VLLM_PLUGINS"], env["BLOCKPOOL_VLLM_HAZARDS"], env["VLLM_ENABLE_V1_MULTIPROCESSING"]
    ('other,blockpool', '0', '0')
    """
    if mode not in (*MODES, CONNECTOR_MODE):
        raise ValueError(f"unknown mode {mode!r}")
    if off_by not in ("env", "allowlist"):
        raise ValueError(f"off_by must be 'env' or 'allowlist', got {off_by!r}")
    env = dict(environ)
    for k in (_ENV_PLUGIN, _ENV_HAZARDS, _ENV_UNWIRED):
        env.pop(k, None)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1")
    if mode == "off":
        if off_by == "env":
            env[_ENV_PLUGIN] = "0"
        else:
            env["VLLM_PLUGINS"] = ""
        return env
    if "VLLM_PLUGINS" in env:
        names = [x.strip() for x in env["VLLM_PLUGINS"].split(",") if x.strip()]
        if "blockpool" not in names:
            env["VLLM_PLUGINS"] = ",".join([*names, "blockpool"])
    if mode == "hazards-off":
        env[_ENV_HAZARDS] = "0"
    elif mode == "audit":
        env[_ENV_HAZARDS] = "audit"
    return env


# ---------------------------------------------------------------------------
# What a run records (called in the engine process)
# ---------------------------------------------------------------------------


def _plain(x: Any) -> Any:
    """``x`` as JSON values: bytes as hex, tuples and sets as lists, msgspec
    structs and dataclasses as dicts of their fields."""
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).hex()
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((_plain(v) for v in x), key=repr)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    fields = getattr(x, "__struct_fields__", None) or getattr(x, "__dataclass_fields__", None)
    if fields is not None:
        return {"type": type(x).__name__, **{f: _plain(getattr(x, f)) for f in fields}}
    return repr(x)


def normalize_event(event: Any) -> dict[str, Any]:
    """A KV cache event (vLLM's ``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``: msgspec structs) as a JSON dict: ``type`` (the class
    name) and every field, hashes as hex. O(size of the event).

    >>> class BlockRemoved:
    ...     __struct_fields__ = ("block_hashes", "medium")
    ...     def __init__(self): self.block_hashes, self.medium = [b"\\x01\\xff"], "GPU"
    >>> normalize_event(BlockRemoved())
    {'type': 'BlockRemoved', 'block_hashes': ['01ff'], 'medium': 'GPU'}
    """
    out = _plain(event)
    if not isinstance(out, dict):
        return {"type": type(event).__name__, "repr": out}
    return out


def _per_step(schedule_s: Sequence[float], update_s: Sequence[float]) -> list[float]:
    """Each step's microseconds, sorted: ``schedule_s[i] + update_s[i]``."""
    n = len(schedule_s)
    return sorted((schedule_s[i] + (update_s[i] if i < len(update_s) else 0.0)) * 1e6 for i in range(n))


def step_stats(
    schedule_s: Sequence[float],
    update_s: Sequence[float],
    cpu_schedule_s: Sequence[float] | None = None,
    cpu_update_s: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Summary of the scheduler's time: ``schedule_s[i]`` and ``update_s[i]``
    are the wall-clock seconds (:func:`time.perf_counter`) of step ``i``'s
    ``Scheduler.schedule`` and ``Scheduler.update_from_output`` calls, the
    ``cpu_`` lists the same calls' CPU seconds (:func:`time.thread_time`:
    what the scheduler's thread itself ran, which other processes on a
    shared machine inflate less). A step's time is the sum of the two (a
    ``schedule`` without its update counts alone). Times in microseconds,
    totals in milliseconds. O(n log n).

    >>> s = step_stats([0.001, 0.003], [0.001, 0.001])
    >>> s["steps"], s["per_step_median_us"], s["per_step_mean_us"], s["total_ms"]
    (2, 3000.0, 3000.0, 6.0)
    """
    us = _per_step(schedule_s, update_s)
    out: dict[str, Any] = {
        "steps": len(schedule_s),
        "updates": len(update_s),
        "total_ms": round((sum(schedule_s) + sum(update_s)) * 1e3, 3),
        "schedule_ms": round(sum(schedule_s) * 1e3, 3),
        "update_ms": round(sum(update_s) * 1e3, 3),
        "per_step_median_us": round(statistics.median(us), 1) if us else None,
        "per_step_mean_us": round(statistics.fmean(us), 1) if us else None,
        "per_step_p90_us": round(us[min(len(us) - 1, int(0.9 * len(us)))], 1) if us else None,
    }
    if cpu_schedule_s is not None:
        cpu = _per_step(cpu_schedule_s, cpu_update_s or ())
        out["cpu_total_ms"] = round((sum(cpu_schedule_s) + sum(cpu_update_s or ())) * 1e3, 3)
        out["cpu_per_step_median_us"] = round(statistics.median(cpu), 1) if cpu else None
        out["cpu_per_step_mean_us"] = round(statistics.fmean(cpu), 1) if cpu else None
    return out


_PLUGIN_LINE = re.compile(r"(?:^|\] )(blockpool\b[ :].*)$")


def plugin_lines(log_text: str) -> list[str]:
    """The plugin's own lines in a vLLM log: messages that begin with
    ``blockpool`` (every line the plugin logs does: ``blockpool 0.1.0:
    vLLM ...'s BlockPool is now ...``, ``blockpool: plugin disabled ...``,
    ``blockpool: KV connector X is not wired ...``), without vLLM's prefix.
    O(len(log_text)).

    >>> plugin_lines("(EngineCore pid=1) INFO 12-01 10:00:00 [__init__.py:153] blockpool 0.1.0: vLLM x\\nother")
    ['blockpool 0.1.0: vLLM x']
    """
    out = []
    for line in log_text.splitlines():
        m = _PLUGIN_LINE.search(line.rstrip())
        if m:
            out.append(m.group(1))
    return out


_TROUBLE = ("cannot install", "cannot wire", "not a supported version")


def plugin_line_warnings(mode: str, lines: Sequence[str], off_by: str = "env") -> list[str]:
    """Warnings about the plugin's log lines of one run: the line the mode
    should produce is missing, or the plugin says it could not install or
    wire something, or refused this vLLM's version (each such line
    repeated). Warnings only: the pool's class is checked in the engine
    itself. O(lines).

    >>> plugin_line_warnings("on", [])
    ["on: the plugin's registration line ('... BlockPool is now ...') is not in the log"]
    """
    out = [f"{mode}: the plugin says: {x}" for x in lines if any(k in x for k in _TROUBLE)]
    text = "\n".join(lines)
    if mode == "off":
        if off_by == "env" and "plugin disabled by" not in text:
            out.append(f"{mode}: the plugin's 'plugin disabled by {_ENV_PLUGIN}=0' line is not in the log")
        return out
    if "BlockPool is now" not in text:
        out.append(f"{mode}: the plugin's registration line ('... BlockPool is now ...') is not in the log")
    elif mode == "hazards-off" and "hazard tracking off" not in text:
        out.append(f"{mode}: the registration line does not say 'hazard tracking off'")
    elif mode == "audit" and "hazard tracking audit" not in text:
        out.append(f"{mode}: the registration line does not say 'hazard tracking audit'")
    if mode == CONNECTOR_MODE and "not wired" not in text:
        out.append(f"{mode}: no 'KV connector ... is not wired' warning for ExampleConnector in the log")
    return out


# ---------------------------------------------------------------------------
# Comparing the runs (pure functions on the runs' JSON)
# ---------------------------------------------------------------------------


@attrs.frozen
class Difference:
    """One way a run differs from the reference run (``off``) or from what
    its mode expects.

    Attributes:
        workload: The workload's name.
        mode: The run that differs.
        what: ``tokens``, ``hits``, ``events``, ``pool``, ``served`` or ``run``.
        detail: The first difference, in words.
    """

    workload: str
    mode: str
    what: str
    detail: str

    def __str__(self) -> str:
        return f"{self.workload}/{self.mode}: {self.what}: {self.detail}"


def _short(x: Any, limit: int = 160) -> str:
    s = json.dumps(x, sort_keys=True)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _first_token_diff(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> str | None:
    if len(ref) != len(got):
        return f"{len(got)} requests, reference {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, got)):
        if list(a) != list(b):
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (
                f"request {i}, token {k}: {list(b[k : k + 4])} where the reference has {list(a[k : k + 4])} "
                f"({len(b)} vs {len(a)} tokens)"
            )
    return None


def _first_event_diff(ref: Sequence[Any], got: Sequence[Any]) -> str | None:
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            return f"event {i} ({', '.join(keys)} differ): {_short(b)} where the reference has {_short(a)}"
    if len(ref) != len(got):
        i = min(len(ref), len(got))
        extra = got[i] if len(got) > len(ref) else ref[i]
        return f"{len(got)} events, reference {len(ref)}; first unmatched: {_short(extra)}"
    return None


def core_build() -> str:
    """Which build of the core this process imports: ``"compiled (mypyc)"``
    or ``"pure Python"`` (``blockpool.__compiled__``). Every run's report
    records its own, and a run on the other build than the parent's is a
    difference (a run's subprocess imports ``blockpool`` as the parent
    does, from the same path: a compiled tree first on ``PYTHONPATH``
    serves every mode). O(1).

    >>> core_build() in ("compiled (mypyc)", "pure Python")
    True
    """
    import blockpool

    return "compiled (mypyc)" if blockpool.__compiled__ else "pure Python"


def _expectations(mode: str, r: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(what, detail) for each way run ``r`` is not what its mode promises."""
    out = []
    pool = r.get("pool_class")
    if mode == "off":
        if pool != VLLM_POOL:
            out.append(("pool", f"the scheduler's pool is {pool}, expected vLLM's {VLLM_POOL}"))
        return out
    if not r.get("pool_is_ours"):
        out.append(("pool", f"the scheduler's pool is {pool}, expected {OUR_POOL}"))
        return out
    build, own = r.get("core_build"), core_build()
    if build is not None and build != own:
        out.append(("build", f"the run's blockpool core is {build}, this process's {own}"))
    want_hazards = mode != "hazards-off"
    if bool(r.get("pool_hazards")) != want_hazards:
        has = "set" if r.get("pool_hazards") else "None"
        out.append(("pool", f"pool.hazards is {has} with hazards {'on' if want_hazards else 'off'}"))
    served = r.get("served") or {}
    if not served.get("allocations"):
        out.append(("served", f"the core served no allocations ({_short(served)})"))
    # Steps the wiring saw: with step tokens, or without (no stream but the
    # compute stream: nothing could wait on one; StepHazards.step_tokens).
    seen = (served.get("steps_issued") or 0) + (served.get("steps_untokened") or 0)
    if want_hazards and not seen:
        out.append(("served", f"hazards on, but the scheduler wiring saw no step ({_short(served)})"))
    # A wired KV connector registers its streams: every step must get a token.
    untokened = served.get("steps_untokened") or not served.get("steps_issued")
    if want_hazards and r.get("kv_connector") and untokened:
        out.append(
            (
                "served",
                f"KV connector {r['kv_connector']} wired, but steps went without tokens ({_short(served)})",
            )
        )
    if not want_hazards and seen:
        out.append(("served", f"hazards off, but the scheduler wiring saw {seen} steps"))
    return out


def compare_runs(workload: str, runs: Mapping[str, Mapping[str, Any]]) -> list[Difference]:
    """Every difference of one workload's runs: each run against the
    reference (``runs["off"]``: tokens, per-request cached tokens, the
    scheduler's prefix-cache stats, events and events per step), and each
    against its mode's expectations (pool class, hazards, served counters;
    a run keyed ``MODE#N``, a repetition, is judged as ``MODE``).
    The connector run (:data:`CONNECTOR_MODE`) is compared on tokens only
    (its hits and events include the connector's). A run that failed
    (``"error"`` in it) is one ``run`` difference. At most one difference of
    each kind per run. O(total tokens + events).
    """
    diffs: list[Difference] = []
    ref = runs.get("off")

    def add(mode: str, what: str, detail: str | None) -> None:
        if detail:
            diffs.append(Difference(workload, mode, what, detail))

    for mode, r in runs.items():
        base = mode.split("#", 1)[0]
        if "error" in r:
            add(
                mode, "run", str(r["error"]).strip().splitlines()[-1] if str(r["error"]).strip() else "failed"
            )
            continue
        for what, detail in _expectations("on" if base == CONNECTOR_MODE else base, r):
            add(mode, what, detail)
        if mode == "off" or ref is None or "error" in ref:
            continue
        add(mode, "tokens", _first_token_diff(ref["tokens"], r["tokens"]))
        if base == CONNECTOR_MODE:
            continue
        cached_ref, cached = ref["num_cached_tokens"], r["num_cached_tokens"]
        if cached != cached_ref:
            i = next((i for i, (a, b) in enumerate(zip(cached_ref, cached)) if a != b), None)
            where = (
                f"request {i}: {cached[i]} cached tokens, reference {cached_ref[i]}; "
                if i is not None
                else ""
            )
            add(
                mode,
                "hits",
                f"{where}total {sum(x or 0 for x in cached)}, reference {sum(x or 0 for x in cached_ref)}",
            )
        elif r.get("prefix_cache_stats") != ref.get("prefix_cache_stats"):
            add(mode, "hits", f"prefix-cache stats {_short(r.get('prefix_cache_stats'))}, reference "
                              f"{_short(ref.get('prefix_cache_stats'))}")  # fmt: skip
        detail = _first_event_diff(ref["events"], r["events"])
        if detail is None and r.get("events_per_batch") != ref.get("events_per_batch"):
            a, b = ref.get("events_per_batch") or [], r.get("events_per_batch") or []
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            detail = f"the same events, published in other steps (from batch {i}: {b[i : i + 5]} vs {a[i : i + 5]})"
        add(mode, "events", detail)
    return diffs


def exit_status(diffs: Iterable[Difference], runs_by_workload: Mapping[str, Mapping[str, Any]]) -> int:
    """:data:`EXIT_SETUP` when some workload's ``off`` run failed or is
    missing (vLLM itself did not serve: nothing to compare with),
    :data:`EXIT_MISMATCH` when there is any difference, else
    :data:`EXIT_PASS`. O(diffs + workloads).

    >>> exit_status([], {"quick": {"off": {"tokens": []}}})
    0
    >>> exit_status([], {"quick": {"off": {"error": "no vllm"}}})
    2
    """
    for runs in runs_by_workload.values():
        if "off" not in runs or "error" in runs["off"]:
            return EXIT_SETUP
    return EXIT_MISMATCH if any(True for _ in diffs) else EXIT_PASS


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------


def _event_counts(events: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    c = {"events": len(events), "blocks_stored": 0, "blocks_removed": 0, "cleared": 0}
    for e in events:
        t = e.get("type")
        if t == "BlockStored":
            c["blocks_stored"] += len(e.get("block_hashes") or ())
        elif t == "BlockRemoved":
            c["blocks_removed"] += len(e.get("block_hashes") or ())
        elif t == "AllBlocksCleared":
            c["cleared"] += 1
    return c


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable report of :func:`run`'s JSON report. O(size)."""
    env = report.get("environment", {})
    lines = [
        (
            f"blockpool check-vllm: vLLM {env.get('vllm_version', '?')}, torch {env.get('torch_version', '?')}, "
            f"Python {env.get('python', '?')}, {env.get('device', '?')}, {env.get('machine', '?')}; "
            f"blockpool core: {env.get('core_build', '?')}"
        ),
        f"model: tiny Llama with random weights ({_short(report.get('model'), 200)})",
    ]
    for name, w in report.get("workloads", {}).items():
        lines.append("")
        lines.append(f"workload {name}: {w.get('description', '')}")
        hdr = (f"  {'mode':<12} {'pool':<14} {'tokens':>7} {'cached':>7} {'stored':>7} {'evicted':>7} "
               f"{'events':>7} {'steps':>6} {'sched us/step median':>21} {'mean':>7} {'cpu median':>10} "
               f"{'total ms':>9} {'run s':>6}")  # fmt: skip
        lines.append(hdr)
        for mode, r in w.get("runs", {}).items():
            if "error" in r:
                lines.append(f"  {mode:<12} FAILED: {str(r['error']).strip().splitlines()[-1][:150]}")
                continue
            c = _event_counts(r.get("events", []))
            t = r.get("timing_best") or r.get("timing", {})
            tc = r.get("timing_best_cpu") or r.get("timing", {})
            pool = str(r.get("pool_class", "?")).rsplit(".", 1)[-1]
            lines.append(
                f"  {mode:<12} {pool:<14} {sum(len(x) for x in r.get('tokens', [])):>7} "
                f"{sum(x or 0 for x in r.get('num_cached_tokens', [])):>7} {c['blocks_stored']:>7} "
                f"{c['blocks_removed']:>7} {c['events']:>7} {t.get('steps', 0):>6} "
                f"{_fmt_us(t.get('per_step_median_us')):>21} {_fmt_us(t.get('per_step_mean_us')):>7} "
                f"{_fmt_us(tc.get('cpu_per_step_median_us')):>10} {t.get('total_ms', 0):>9,.1f} {r.get('wall_s', {}).get('total', 0):>6.1f}"
            )
        nrep = max((len(r.get("timing_repeats", ())) for r in w.get("runs", {}).values()), default=0)
        if nrep > 1:
            lines.append(
                f"  scheduler time per step: each mode's best of {nrep} repetitions (lowest median; wall clock "
                "and thread CPU time chosen separately)"
            )
        diffs = w.get("differences", [])
        if diffs:
            lines.append("  differences (first of each kind):")
            lines.extend(f"    {d['mode']}: {d['what']}: {d['detail']}" for d in diffs)
        else:
            modes = ", ".join(w.get("runs", {}))
            lines.append(
                f"  identical in {modes}: tokens, cached tokens, prefix-cache stats, KV events; pools as expected"
            )
        for mode, r in w.get("runs", {}).items():
            for pl in r.get("plugin_lines", [])[:3]:
                lines.append(f"  log {mode}: {pl[:200]}")
    if report.get("warnings"):
        lines.append("")
        lines.append("warnings:")
        lines.extend(f"  {x}" for x in report["warnings"])
    lines.append("")
    verdict = {EXIT_PASS: "PASS", EXIT_MISMATCH: "FAIL", EXIT_SETUP: "SETUP ERROR"}
    lines.append(
        f"check-vllm: {verdict.get(report.get('exit_status'), '?')} in {report.get('wall_s', 0):.0f} s"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The engine run (child process)
# ---------------------------------------------------------------------------


def _ensure_model(model_dir: str, spec: ModelSpec) -> None:
    """Build and save the tiny model (:class:`ModelSpec`) into ``model_dir`` unless it is there.
    Written beside it and renamed, so a half-written model is never used."""
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    shape = {
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
    }
    if spec.sliding_window:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        layers = ["sliding_attention", "full_attention"] * spec.num_hidden_layers
        cfg: Any = Gemma2Config(
            **shape, sliding_window=spec.sliding_window, layer_types=layers[: spec.num_hidden_layers]
        )
        model: Any = Gemma2ForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    model = model.to(torch.float32).eval()
    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".model-", dir=parent)
    model.save_pretrained(tmp, safe_serialization=True)
    try:
        os.replace(tmp, model_dir)
    except OSError:  # model_dir exists (empty dir made by the caller): move the files in
        for f in os.listdir(tmp):
            os.replace(os.path.join(tmp, f), os.path.join(model_dir, f))
        os.rmdir(tmp)


def _find_scheduler(llm: Any) -> Any:
    """The scheduler of an in-process engine core: ``llm.llm_engine.
    engine_core`` is vLLM's ``InprocClient``, its ``engine_core`` the
    ``EngineCore`` (vLLM 0.32 and 0.33)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    sched = getattr(core, "scheduler", None)
    if sched is None or not hasattr(sched, "kv_cache_manager"):
        raise RuntimeError(
            f"no in-process scheduler under LLM.llm_engine.engine_core ({type(client).__name__}); "
            "is VLLM_ENABLE_V1_MULTIPROCESSING=0 honoured by this vLLM?"
        )
    return sched


def _timed(fn: Any, wall: list[float], cpu: list[float]) -> Any:
    """``fn`` recording each call's wall-clock and thread CPU seconds."""
    import functools

    clock, cpu_clock = time.perf_counter, time.thread_time

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = clock(), cpu_clock()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu.append(cpu_clock() - c0)
            wall.append(clock() - t0)

    return wrapper


def _child(spec_path: str, out_path: str) -> int:
    """One run: serve the workload of ``spec_path`` in this process and write
    what it recorded to ``out_path``. Exit 0, or 2 with ``"error"`` written."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    result: dict[str, Any] = {"mode": spec["mode"]}
    t_start = time.perf_counter()
    try:
        _serve(spec, result)
        status = 0
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which judges it)
        import traceback

        result["error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
        status = 2
    result.setdefault("wall_s", {})["total"] = round(time.perf_counter() - t_start, 2)
    with open(out_path + ".part", "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(out_path + ".part", out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's in-process engine can hang in interpreter shutdown (its threads
    # and finalizers); the result is written, so leave at once.
    os._exit(status)


def _serve(spec: Mapping[str, Any], result: dict[str, Any]) -> None:
    w = Workload(**spec["workload"])
    model = ModelSpec(**spec["model"])
    t0 = time.perf_counter()
    _ensure_model(spec["model_dir"], model)
    import torch

    if "VLLM_TARGET_DEVICE" not in os.environ and not torch.cuda.is_available():
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # pragma: no cover (older layouts)
        from vllm.inputs.data import TokensPrompt  # type: ignore[no-redef]

    result["vllm_version"] = getattr(vllm, "__version__", "?")
    result["torch_version"] = torch.__version__
    result["device"] = os.environ.get("VLLM_TARGET_DEVICE") or ("cuda" if torch.cuda.is_available() else "?")
    kwargs: dict[str, Any] = {
        "model": spec["model_dir"],
        "skip_tokenizer_init": True,
        "enable_prefix_caching": True,
        "block_size": w.block_size,
        "num_gpu_blocks_override": w.num_blocks,
        "max_num_seqs": w.max_num_seqs,
        "max_model_len": w.max_model_len,
        "enforce_eager": True,
        "dtype": "float32",
        "gpu_memory_utilization": spec.get("gpu_memory_utilization", 0.2),
        "seed": 0,
        "disable_log_stats": False,  # the scheduler keeps its prefix-cache stats
        "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    }
    kv = spec["workload"].get("kv_connector")
    if kv is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=KV_CONNECTORS[kv],
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": KV_CPU_BYTES},
        )
    if spec.get("connector_dir"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["connector_dir"]},
        )
    t1 = time.perf_counter()
    llm = LLM(**kwargs)
    t2 = time.perf_counter()
    sched = _find_scheduler(llm)
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    cls = type(pool)
    result["pool_class"] = f"{cls.__module__}.{cls.__qualname__}"
    result["pool_mro"] = [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__]
    result["pool_is_ours"] = any(n == OUR_POOL for n in result["pool_mro"])
    result["pool_hazards"] = getattr(pool, "hazards", None) is not None
    result["kv_connector"] = spec["workload"].get("kv_connector")
    result["core_build"] = core_build()
    result["scheduler_class"] = f"{type(sched).__module__}.{type(sched).__qualname__}"
    connector = getattr(sched, "connector", None)
    result["connector_class"] = type(connector).__name__ if connector is not None else None

    schedule_s: list[float] = []
    update_s: list[float] = []
    cpu_schedule_s: list[float] = []
    cpu_update_s: list[float] = []
    sched.schedule = _timed(sched.schedule, schedule_s, cpu_schedule_s)
    sched.update_from_output = _timed(sched.update_from_output, update_s, cpu_update_s)

    # Inside update_from_output, which is timed: keep the events as they
    # are (vLLM does not reuse them) and convert them after the run.
    batches: list[list[Any]] = []
    publisher = sched.kv_event_publisher
    publish = publisher.publish

    def capture(batch: Any) -> Any:
        batches.append(list(batch.events))
        return publish(batch)

    publisher.publish = capture

    stats_keys = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")
    stats = dict.fromkeys(stats_keys, 0)
    make_stats = kvm.make_prefix_cache_stats

    def take_stats() -> Any:
        s = make_stats()
        if s is not None:
            for k in stats_keys:
                stats[k] += int(getattr(s, k, 0) or 0)
        return s

    kvm.make_prefix_cache_stats = take_stats

    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    outputs = []
    for wave in build_prompts(w):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in wave]
        outputs.extend(llm.generate(prompts, params, use_tqdm=False))
    t3 = time.perf_counter()
    # A last step's stats may still be in the manager: take them.
    take_stats()

    result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    result["num_cached_tokens"] = [getattr(o, "num_cached_tokens", None) for o in outputs]
    result["prefix_cache_stats"] = stats
    result["events"] = [normalize_event(e) for b in batches for e in b]
    result["events_per_batch"] = [len(b) for b in batches]
    result["timing"] = step_stats(schedule_s, update_s, cpu_schedule_s, cpu_update_s)
    result["wall_s"] = {
        "imports": round(t1 - t0, 2),
        "engine_start": round(t2 - t1, 2),
        "generate": round(t3 - t2, 2),
    }
    plugin = sys.modules.get("blockpool.integrations.vllm")
    if plugin is not None:
        st = plugin.install_state()
        result["install_state"] = {
            "installed": st.installed, "disabled": st.disabled, "hazards": st.hazards,
            "modules": list(st.modules), "connectors": list(st.connectors),
        }  # fmt: skip
    served = sys.modules.get("blockpool.integrations.vllm.served")
    if served is not None:
        result["served"] = served.SERVED.as_dict()
    worker = sys.modules.get("blockpool.integrations.vllm.worker")
    wh = getattr(worker, "_CURRENT", None) if worker is not None else None
    if wh is not None:  # the in-process worker's waits (a CUDA worker; none on CPU)
        result["worker_hazards"] = {
            "waits": wh.waits, "tokens_waited": wh.tokens_waited, "deferred": wh.deferred,
            "stock_fallbacks": wh.stock_fallbacks, "copy_fences_unwaited": wh.copy_fences_unwaited,
            "out_of_order": wh.out_of_order, "skipped": sum(len(v) for v in wh.skipped.values()),
            "audit": wh.audit.to_json() if wh.audit is not None else None,
        }  # fmt: skip


# ---------------------------------------------------------------------------
# The parent: one subprocess per run
# ---------------------------------------------------------------------------


def _progress(msg: str) -> None:
    print(f"check-vllm: {msg}", file=sys.stderr, flush=True)


def _run_one(
    mode: str,
    w: Workload,
    model: ModelSpec,
    model_dir: str,
    work: str,
    off_by: str,
    timeout: float,
    rep: int = 1,
) -> dict[str, Any]:
    """Run one mode of one workload (repetition ``rep``) in a subprocess;
    its result, with ``plugin_lines`` from its log and ``log`` (the log's
    path)."""
    tag = f"{w.name}-{mode}".replace("+", "-") + (f"-{rep}" if rep > 1 else "")
    spec_path, out_path, log_path = (
        os.path.join(work, f"{tag}.{x}") for x in ("spec.json", "result.json", "log")
    )
    if w.sliding_window:  # the tiny hybrid model, beside the Llama
        model = attrs.evolve(model, sliding_window=w.sliding_window)
        model_dir = f"{model_dir.rstrip(os.sep)}-hybrid-sw{w.sliding_window}"
    spec: dict[str, Any] = {"mode": mode, "workload": attrs.asdict(w), "model": attrs.asdict(model),
                            "model_dir": model_dir}  # fmt: skip
    if mode == CONNECTOR_MODE:
        spec["connector_dir"] = tempfile.mkdtemp(prefix=f"{tag}-kv-", dir=work)
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    env = mode_env(mode, os.environ, off_by)
    cmd = [sys.executable, "-m", "blockpool.checking.vllm_engine", "--child", spec_path, out_path]
    name = f"{w.name}/{mode}" + (f" (repetition {rep})" if rep > 1 else "")
    _progress(f"{name}: starting vLLM (log: {log_path})")
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    result: dict[str, Any]
    try:
        with open(out_path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        tail = "\n".join(text.splitlines()[-15:])
        result = {
            "mode": mode,
            "error": f"the run exited with status {rc} and wrote no result; log tail:\n{tail}",
        }
    if "error" in result and rc == 0:
        result["error"] = str(result["error"])
    result["plugin_lines"] = plugin_lines(text)
    result["log"] = log_path
    result["process_wall_s"] = round(wall, 1)
    status = "failed" if "error" in result else "done"
    _progress(f"{name}: {status} in {wall:.1f} s")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the check's options to ``p`` (``blockpool check-vllm`` and this
    module's ``__main__``). O(1)."""
    p.add_argument(
        "--workload", default="quick", metavar="NAME[,NAME]",
        help=f"workloads to serve, comma-separated: {', '.join(WORKLOADS)} (default quick)",
    )  # fmt: skip
    for field in _SIZE_FLAGS:
        p.add_argument(
            "--" + field.replace("_", "-"), type=int, default=None, dest=field,
            help=f"override the workload's {field} (quick: {getattr(WORKLOADS['quick'], field)}, "
            f"timing: {getattr(WORKLOADS['timing'], field)})",
        )  # fmt: skip
    p.add_argument(
        "--modes", default=",".join(MODES),
        help=f"modes to run, comma-separated; 'off' is the reference and always runs (default {','.join(MODES)})",
    )  # fmt: skip
    p.add_argument(
        "--off-by", choices=("env", "allowlist"), default="env",
        help="how the off run turns the plugin off: BLOCKPOOL_VLLM_PLUGIN=0 (env, default) or VLLM_PLUGINS='' "
        "(allowlist: no vLLM plugin loads)",
    )  # fmt: skip
    p.add_argument(
        "--connector", action="store_true",
        help="also run the first workload with the plugin on and vLLM's ExampleConnector (tokens must match)",
    )  # fmt: skip
    p.add_argument(
        "--kv-connector", metavar="NAMES", default="",
        help="also serve every workload with these KV connectors, comma-separated, in every mode "
        f"({', '.join(KV_CONNECTORS)}; CUDA only): tokens, hits and events must match the off run with "
        "the same connector; the report adds the worker's fenced waits",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    p.add_argument(
        "--model-dir", metavar="DIR", help="build (or reuse) the tiny model here (default: a temp dir)"
    )
    p.add_argument(
        "--log-dir", metavar="DIR", help="keep each run's log, spec and result here (default: a temp dir)"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default 900)")
    p.add_argument(
        "--repeat", type=int, default=1, metavar="N",
        help="run every mode N times, interleaved; every run must agree with the first off run, and the "
        "report's scheduler time per step is each mode's best repetition (lowest median; default 1)",
    )  # fmt: skip


def _workloads(args: argparse.Namespace) -> list[Workload]:
    names = [x.strip() for x in args.workload.split(",") if x.strip()]
    if not names:
        raise ValueError("--workload names nothing")
    out = []
    for n in dict.fromkeys(names):
        if n not in WORKLOADS:
            raise ValueError(f"unknown workload {n!r} (known: {', '.join(WORKLOADS)})")
        over = {f: getattr(args, f) for f in _SIZE_FLAGS if getattr(args, f, None) is not None}
        out.append(attrs.evolve(WORKLOADS[n], **over))
    kvs = [x.strip() for x in (getattr(args, "kv_connector", "") or "").split(",") if x.strip()]
    bad = [k for k in kvs if k not in KV_CONNECTORS]
    if bad:
        raise ValueError(f"unknown --kv-connector {', '.join(bad)} (known: {', '.join(KV_CONNECTORS)})")
    out += [
        attrs.evolve(w, name=f"{w.name}+{k}", kv_connector=k) for k in dict.fromkeys(kvs) for w in list(out)
    ]
    return out


def _modes(spec: str) -> list[str]:
    names = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [n for n in names if n not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {', '.join(bad)} (known: {', '.join(MODES)})")
    return ["off", *[m for m in MODES if m in names and m != "off"]]


def _serve_workload(
    w: Workload,
    modes: Sequence[str],
    connector: bool,
    model: ModelSpec,
    model_dir: str,
    work: str,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[Difference]]:
    """Run every mode of ``w`` ``args.repeat`` times, interleaved (off, on,
    hazards-off, off, ...; the connector run once), and compare them. The
    first repetition's runs are kept whole; every later run is compared
    with the first ``off`` run (so repetitions of one mode must agree too)
    and keeps only its timing, in ``timing_repeats`` of its mode's run;
    ``timing_best`` is the repetition with the lowest per-step median
    (``timing_best_cpu``: the lowest CPU-time median).
    Stops at a failed first ``off`` run (nothing to compare with)."""
    runs: dict[str, Any] = {}
    diffs: list[Difference] = []
    for rep in range(1, args.repeat + 1):
        for mode in [*modes, CONNECTOR_MODE] if connector and rep == 1 else modes:
            r = _run_one(mode, w, model, model_dir, work, args.off_by, args.timeout, rep)
            if rep == 1:
                runs[mode] = r
                if mode == "off" and "error" in r:
                    return runs, compare_runs(w.name, runs)
                continue
            again = compare_runs(w.name, {"off": runs["off"], f"{mode}#{rep}": r})
            diffs.extend(d for d in again if d.mode != "off")
            first = runs.get(mode, {})
            if "error" not in r and "error" not in first:
                first.setdefault("timing_repeats", [first["timing"]]).append(r["timing"])
    for r in runs.values():
        reps = [t for t in r.get("timing_repeats", ()) if t.get("per_step_median_us") is not None]
        if reps:
            r["timing_best"] = min(reps, key=lambda t: t["per_step_median_us"])
            cpu = [t for t in reps if t.get("cpu_per_step_median_us") is not None]
            if cpu:
                r["timing_best_cpu"] = min(cpu, key=lambda t: t["cpu_per_step_median_us"])
    return runs, compare_runs(w.name, runs) + diffs


def run(args: argparse.Namespace) -> int:
    """The check with parsed ``args`` (:func:`add_arguments`): run every
    mode of every workload, print the report, write ``--json``; return the
    exit status (module docstring)."""
    t0 = time.perf_counter()
    model = ModelSpec()
    try:
        workloads = _workloads(args)
        modes = _modes(args.modes)
        for w in workloads:
            w.validate(model)
        if args.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {args.timeout}")
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        if args.json and os.path.isdir(args.json):
            raise ValueError(f"--json {args.json}: is a directory")
    except ValueError as e:
        print(f"blockpool check-vllm: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    missing = [m for m in ("vllm", "torch", "transformers") if _find_spec(m) is None]
    if missing:
        print(
            f"blockpool check-vllm: error: {', '.join(missing)} not importable in {sys.executable}",
            file=sys.stderr,
        )
        return EXIT_SETUP

    work = args.log_dir or tempfile.mkdtemp(prefix="blockpool-check-vllm-")
    os.makedirs(work, exist_ok=True)
    model_dir = args.model_dir or os.path.join(work, "tiny-llama")
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": attrs.asdict(model),
        "model_dir": model_dir,
        "log_dir": work,
        "off_by": args.off_by,
        "workloads": {},
        "warnings": [],
    }
    runs_by_workload: dict[str, dict[str, Any]] = {}
    all_diffs: list[Difference] = []
    try:
        for wi, w in enumerate(workloads):
            runs, diffs = _serve_workload(w, modes, args.connector and wi == 0, model, model_dir, work, args)
            for mode, r in runs.items():
                if "error" not in r:
                    report["warnings"].extend(
                        f"{w.name}/{x}" for x in plugin_line_warnings(mode, r["plugin_lines"], args.off_by)
                    )
            all_diffs.extend(diffs)
            runs_by_workload[w.name] = runs
            report["workloads"][w.name] = {
                "spec": attrs.asdict(w),
                "description": w.describe(),
                "runs": runs,
                "differences": [attrs.asdict(d) for d in diffs],
            }
            if "error" in runs["off"]:
                break
    finally:
        if not args.log_dir and not any(
            "error" in r for runs in runs_by_workload.values() for r in runs.values()
        ):
            shutil.rmtree(work, ignore_errors=True)
            report["log_dir"] = None
    first = next((r for runs in runs_by_workload.values() for r in runs.values() if "error" not in r), {})
    report["environment"] = {
        "vllm_version": first.get("vllm_version", "?"),
        "torch_version": first.get("torch_version", "?"),
        "device": first.get("device", "?"),
        "python": platform.python_version(),
        "core_build": core_build(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "executable": sys.executable,
    }
    status = exit_status(all_diffs, runs_by_workload)
    report["exit_status"] = status
    report["passed"] = status == EXIT_PASS
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(format_report(report))
    if args.json:
        tmp = args.json + ".part"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.json)
    for d in all_diffs[:20]:
        print(f"blockpool check-vllm: {d}", file=sys.stderr)
    return status


def _find_spec(name: str) -> Any:
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m blockpool.checking.vllm_engine [options]``: parse
    ``argv`` and :func:`run`. (``--child SPEC OUT`` is the run subprocess.)"""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"] and len(argv) == 3:
        return _child(argv[1], argv[2])
    p = argparse.ArgumentParser(
        prog="python -m blockpool.checking.vllm_engine",
        description="Serve a tiny model on this vLLM with the blockpool plugin off, on, and on without hazard "
        "tracking; compare tokens, prefix-cache hits and KV events.",
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
