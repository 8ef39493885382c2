#!/usr/bin/env python3
"""vLLM's scheduler CPU time per step with hazard tracking at work: a wired KV connector.

On vLLM's CPU engine no wired connector runs (the offloading connectors
need CUDA on the worker), so ``engine_pool_time.py`` measures the pool
without any transfer to fence. This script drives vLLM's real
``Scheduler`` (the scheduler side alone: no model, no worker) with vLLM's
``OffloadingConnector``, whose scheduler half runs on any machine, and
plays the worker's part: every load and store job the connector plans is
reported done (``kv_connector_worker_meta.completed_jobs``, and
``finished_recving`` for an asynchronous load) ``--transfer-steps`` steps
after the step that planned it; jobs the connector flushes and
synchronous loads in the step itself. With the plugin on (hazards on),
every step issues its tokens, every job begins on the pool with its fence,
and every report ends a token: the per-step figure then holds the hazard
tracking's cost, not only the pool's.

Workload: the engine check's prompts (``build_prompts``: ``--prefixes``
shared prefixes of ``--prefix-blocks`` blocks, a suffix of each request's
own; request ``i`` takes prefix ``i % prefixes``) all queued at once,
``--max-tokens`` generated each. The connector stores every full block to
its CPU tier. By default the pool (480 blocks) is too small to keep the
prefixes no running request uses: they are evicted before their next use,
and each request after the first ``--prefixes`` loads its whole prefix
back from the CPU tier (an external prefix hit; none in the pool's own
prefix cache). A pool large enough to keep them (640 blocks here) turns
every such load into a hit in the pool's prefix cache, with no load.
Generated token ids are a function of the request and its length only,
the same in every mode.

Modes: ``off`` (``BLOCKPOOL_VLLM_PLUGIN=0``: vLLM's own ``BlockPool``),
``on`` (our pool, hazards on, the connector wired), ``hazards-off``
(``BLOCKPOOL_VLLM_HAZARDS=0``). Each run is its own process
(``PYTHONHASHSEED=0``); ``--repeat`` rounds run one run per mode each, in
an order rotated from round to round. A step's figure is the process CPU
time (:func:`time.process_time_ns`) of its ``schedule()`` plus its
``update_from_output()``. Every call into the pool (the ``BlockPool``
methods vLLM's scheduler calls: vLLM's own with the plugin off, our
``VllmBlockPool`` with it on) and into the wiring (:class:`StepHazards`,
the connector's :class:`ConnectorWiring`) is timed too, per outermost call
(``engine_pool_time.time_calls``, about 0.1 µs a call, in the step's
figure): where the extra time goes. The table is ``engine_pool_time``'s:
per mode, µs per step in the pool and the wiring, the medians over rounds
of each run's median and mean CPU µs per step, the **paired** ratios (each
round's run over the same round's ``off`` run, the median over rounds) and
the per-method split.

Every run must schedule what the first run (``off`` by default)
scheduled, step by step: the same requests with the same token counts,
block counts per request, prefix hits (computed tokens of each new
request), preemptions, finished requests, and the same load and store
jobs (request, blocks); a run that differs stops the script (exit 1). In
an on-mode run every job must carry its transfer and every step its
record, else the wiring did not bind the pool (exit 1); the counts of
steps issued and ended, transfers begun and non-empty fences are printed.

Run from a checkout with vLLM 0.34's venv::

    .venv-vllm034/bin/python benchmarks/scheduler_connector_time.py --repeat 5
    .venv-vllm034/bin/python benchmarks/scheduler_connector_time.py --repeat 5 --blockpool build/compiled-suite

``--blockpool DIR`` serves from another build of the package (the compiled
wheel unpacked by ``scripts/compiled_suite.sh``); every run must report the
build asked for, else the script stops. The model is the engine check's
tiny Llama (``--model-dir``, built there if missing; only its
configuration is read).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _engine_pool_time() -> Any:
    """``engine_pool_time.py`` beside this file, loaded by path (the
    benchmarks are scripts, not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_pool_time.py")
    spec = importlib.util.spec_from_file_location("engine_pool_time", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ept = _engine_pool_time()
time_calls = _ept.time_calls

MODES = ("off", "on", "hazards-off")
"""The modes a run can serve in (see the module docstring)."""

STEP_HAZARDS_METHODS = (*_ept.WIRING_METHODS, "begin_load", "begin_store", "finish", "blocks_of")
"""The :class:`StepHazards` calls timed (``wiring.``)."""

CONNECTOR_WIRING_METHODS = ("begin_step", "load", "store", "report", "finish")
"""The :class:`ConnectorWiring` calls timed (``connector.``)."""

OFFLOAD_BLOCK_BYTES = 1 << 30
"""``cpu_bytes_to_use`` of the connector's CPU tier: every block fits."""


def mode_env(mode: str, environ: dict[str, str]) -> dict[str, str]:
    """A run's environment: ``environ`` with the mode's plugin switches,
    a fixed hash seed and an offline hub. O(len(environ))."""
    from blockpool.integrations import vllm as plugin

    env = {k: v for k, v in environ.items() if k not in (plugin.ENV_PLUGIN, plugin.ENV_HAZARDS)}
    env.update(
        PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE=env.get("VLLM_TARGET_DEVICE", "cpu")
    )
    if mode == "off":
        env[plugin.ENV_PLUGIN] = "0"
    elif mode == "hazards-off":
        env[plugin.ENV_HAZARDS] = "0"
    return env


# ----------------------------------------------------------------------
# one run (a child process)
# ----------------------------------------------------------------------


def build_scheduler(spec: dict[str, Any]) -> Any:
    """vLLM's ``Scheduler`` with the ``OffloadingConnector`` over
    ``spec["num_blocks"]`` blocks of the tiny model's full-attention KV
    cache (one group), prefix caching on, chunked prefill."""
    from unittest.mock import MagicMock, patch

    import torch
    import vllm.triton_utils as tu
    from vllm import config as vcfg
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    w = spec["workload"]
    bs = w["block_size"]
    init_none_hash(sha256)
    model = vcfg.ModelConfig(
        model=spec["model_dir"],
        dtype="float32",
        seed=0,
        max_model_len=w["max_model_len"],
        skip_tokenizer_init=True,
    )
    sched = vcfg.SchedulerConfig(
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        max_model_len=w["max_model_len"],
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = vcfg.CacheConfig(block_size=bs, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    transfer = vcfg.KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": OFFLOAD_BLOCK_BYTES, "block_size": bs},
    )
    # vLLM 0.34's CPU platform refuses to build a config on an x86 CPU
    # without triton-cpu; this run executes no kernel, so that one check
    # sees Triton present while the config is built.
    with patch.object(tu, "HAS_TRITON", True):
        config = vcfg.VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                                 kv_transfer_config=transfer, device_config=vcfg.DeviceConfig("cpu"))  # fmt: skip
    kv_spec = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=w["num_blocks"], kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], kv_spec)])  # fmt: skip
    config.cache_config.num_gpu_blocks = w["num_blocks"]
    with vcfg.set_current_vllm_config(config):
        return Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=True,
                         structured_output_manager=MagicMock(), block_size=bs)  # fmt: skip


class OffloadWorker:
    """The worker's part for the ``OffloadingConnector``: reports each job
    the scheduler planned done ``transfer_steps`` steps after the step that
    planned it (stores at least one step later: the worker submits them at
    the next step's start), a flushed job and a synchronous load in its own
    step."""

    def __init__(self, transfer_steps: int) -> None:
        self.transfer_steps = transfer_steps
        self.due: dict[int, tuple[int, str | None]] = {}  # job id -> (step reported, request to resume)

    def plan(self, step: int, meta: Any) -> None:
        """Take the step's jobs from its connector metadata. O(jobs)."""
        for job_id, job in meta.load_jobs.items():
            sync = getattr(job, "sync", False)
            self.due[job_id] = (step, None) if sync else (step + self.transfer_steps, job.req_id)
        for job_id in meta.store_jobs:
            self.due[job_id] = (step + max(1, self.transfer_steps), None)
        for job_id in meta.jobs_to_flush or ():
            if job_id in self.due:
                self.due[job_id] = (step, self.due[job_id][1])

    def report(self, step: int) -> Any:
        """The step's ``KVConnectorOutput``: the jobs due by ``step``, and
        the requests whose asynchronous loads they end. O(jobs in flight)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        done = sorted(j for j, (at, _) in self.due.items() if at <= step)
        recving = {self.due[j][1] for j in done if self.due[j][1] is not None}
        for j in done:
            del self.due[j]
        meta = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(done, 1)) if done else None
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta)


def model_output(scheduler: Any, out: Any, connector_output: Any) -> Any:
    """The step's ``ModelRunnerOutput``: one sampled token for each request
    whose prompt is computed by this step (none for a partial prefill),
    ``1 + (request number * 7 + tokens so far) % 997``."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([1 + (int(rid) * 7 + req.num_tokens) % 997] if done else [])
    extra: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # vLLM 0.32, 0.33
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=None, kv_connector_output=connector_output, **extra)  # fmt: skip


def step_signature(out: Any, meta: Any) -> tuple[list[Any], list[int]]:
    """What a step scheduled, as JSON values: ``[[request, tokens], ...]``,
    new requests ``[request, computed tokens, blocks per group]``, cached
    requests' new blocks per group, preempted and finished requests, load
    and store jobs ``[job, request, blocks]``; and the block ids handed out
    (compared apart: vLLM's and our pool need not number blocks alike).
    O(scheduled requests + jobs)."""
    ids: list[int] = []
    new = []
    for r in out.scheduled_new_reqs:
        new.append([r.req_id, r.num_computed_tokens, [len(g) for g in r.block_ids]])
        ids.extend(b for g in r.block_ids for b in g)
    cached = out.scheduled_cached_reqs
    grown = []
    for rid, blocks in zip(cached.req_ids, cached.new_block_ids):
        if blocks is not None:
            grown.append([rid, [len(g) for g in blocks]])
            ids.extend(b for g in blocks for b in g)
    jobs = [[sorted([j, job.req_id, len(_spec_ids(job.dst_spec))] for j, job in meta.load_jobs.items())],
            [sorted([j, job.req_id, len(_spec_ids(job.src_spec))] for j, job in meta.store_jobs.items())],
            sorted(meta.jobs_to_flush or ())]  # fmt: skip
    sig = [
        sorted([r, n] for r, n in out.num_scheduled_tokens.items()),
        new,
        sorted(grown),
        sorted(out.preempted_req_ids or ()),
        sorted(out.finished_req_ids or ()),
        jobs,
    ]
    for _, job in sorted(meta.load_jobs.items()):
        ids.extend(_spec_ids(job.dst_spec))
    return sig, ids


def _spec_ids(spec: Any) -> list[int]:
    ids = getattr(spec, "block_ids", None)  # an array
    return [] if ids is None else [int(b) for b in ids]


def wiring_counts(meta: Any, counts: dict[str, int]) -> None:
    """Add what the wiring put on the step's connector metadata to
    ``counts``: step records and non-empty forward fences, loads and stores
    begun on the pool (a wire form on the job) and those with a non-empty
    fence, and jobs left without one. O(jobs)."""
    from blockpool.integrations.vllm import connectors as vc
    from blockpool.integrations.vllm.hazards import Fence, Transfer

    step = getattr(meta, vc.META_STEP, None)
    if step is not None:
        counts["step_records"] += 1
        counts["forward_fences_nonempty"] += bool(Fence.from_wire(step[1]).tokens)
    for kind, jobs, attr in (
        ("load", meta.load_jobs, vc.META_LOAD),
        ("store", meta.store_jobs, vc.META_STORE),
    ):
        for job in jobs.values():
            wire = getattr(job, attr, None)
            if wire is None:
                counts[f"{kind}s_unfenced"] += 1
                continue
            counts[f"{kind}s_begun"] += 1
            counts[f"{kind}_fences_nonempty"] += bool(Transfer.from_wire(wire).fence.tokens)


def _child(spec_path: str, out_path: str) -> int:
    """One run: build the scheduler in this process's mode, serve the
    workload, write the result as JSON."""
    from blockpool.checking import vllm_engine as ec
    from blockpool.integrations import vllm as plugin
    from blockpool.integrations.vllm import connectors as vc

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    w = ec.Workload(**spec["workload"])
    plugin.register()  # as vLLM loads it: BLOCKPOOL_VLLM_PLUGIN=0 changes nothing
    scheduler = build_scheduler(spec)
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    pool = scheduler.kv_cache_manager.block_pool
    hz = getattr(pool, "hazards", None)
    totals: dict[str, list[int]] = {}
    depth = [0]
    time_calls(pool, _ept.POOL_METHODS, "pool.", totals, depth)
    if hz is not None:
        time_calls(hz, STEP_HAZARDS_METHODS, "wiring.", totals, depth)
        time_calls(vc.ConnectorWiring, CONNECTOR_WIRING_METHODS, "connector.", totals, depth)
    hasher = get_request_block_hasher(w.block_size, sha256)
    params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, None)
    for i, prompt in enumerate(p for wave in ec.build_prompts(w) for p in wave):
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                      pooling_params=None, mm_features=None, block_hasher=hasher))  # fmt: skip
    worker = OffloadWorker(spec["transfer_steps"])
    counts = dict.fromkeys(("step_records", "forward_fences_nonempty", "loads_begun", "load_fences_nonempty",
                            "loads_unfenced", "stores_begun", "store_fences_nonempty", "stores_unfenced"), 0)  # fmt: skip
    cpu_ns: list[int] = []
    steps: list[Any] = []
    block_ids: list[list[int]] = []
    clock = time.process_time_ns
    gc.collect()
    gc.freeze()
    gc_before = [g["collections"] for g in gc.get_stats()]
    t_wall = time.perf_counter()
    step = 0
    while scheduler.has_requests():
        step += 1
        if step > spec["max_steps"]:
            raise RuntimeError(f"still serving after {spec['max_steps']} steps")
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        meta = out.kv_connector_metadata
        worker.plan(step, meta)
        output = model_output(scheduler, out, worker.report(step))
        t2 = clock()
        scheduler.update_from_output(out, output)
        t3 = clock()
        cpu_ns.append(t1 - t0 + t3 - t2)
        sig, ids = step_signature(out, meta)
        steps.append(sig)
        block_ids.append(ids)
        if hz is not None:
            wiring_counts(meta, counts)
    wall = time.perf_counter() - t_wall
    us = [x / 1e3 for x in cpu_ns]
    result: dict[str, Any] = {
        "mode": spec["mode"],
        "core_build": ec.core_build(),
        "pool_class": f"{type(pool).__module__}.{type(pool).__qualname__}",
        "hazards": hz is not None,
        "timing": {
            "steps": len(us),
            "cpu_per_step_median_us": round(statistics.median(us), 1),
            "cpu_per_step_mean_us": round(statistics.fmean(us), 1),
            "cpu_total_ms": round(sum(us) / 1e3, 1),
            "wall_s": round(wall, 2),
        },
        "gc_collections": [g["collections"] - b for g, b in zip((s for s in gc.get_stats()), gc_before)],
        "steps": steps,
        "block_ids": block_ids,
        "pool_time": totals,
    }
    if hz is not None:
        served = sys.modules["blockpool.integrations.vllm.served"].SERVED
        result["wiring"] = {
            **counts,
            "steps_issued": hz.steps_issued,
            "steps_ended": hz.steps_ended,
            "transfers_begun": hz.transfers_begun,
            "fences_nonempty": hz.fences_nonempty,
            "transfers_pending_at_end": len(hz.pending_transfers()),
            "served": served.as_dict(),
        }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


# ----------------------------------------------------------------------
# the rounds and the report
# ----------------------------------------------------------------------


def first_difference(ref: dict[str, Any], run: dict[str, Any]) -> str | None:
    """Where ``run`` scheduled differently from ``ref`` (step signatures,
    :func:`step_signature`), as one line; ``None`` when every step agrees.
    O(steps)."""
    a, b = ref["steps"], run["steps"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            names = ("scheduled tokens", "new requests", "new blocks", "preempted", "finished", "jobs")
            what = next(n for n, u, v in zip(names, x, y) if u != v)
            return f"step {i + 1}: {what} differ: {ref['mode']} {x[names.index(what)]} vs {run['mode']} {y[names.index(what)]}"
    if len(a) != len(b):
        return f"{ref['mode']} ran {len(a)} steps, {run['mode']} {len(b)}"
    return None


def wiring_fault(run: dict[str, Any]) -> str | None:
    """Why an on-mode run shows the wiring not bound to the pool (a job
    without its transfer, a step without its record, no transfer at all,
    transfers still pending once every job was reported), else ``None``.
    O(1)."""
    w = run.get("wiring")
    if w is None:
        return "no hazard tracking in the scheduler's pool"
    if w["loads_unfenced"] or w["stores_unfenced"]:
        return f"{w['loads_unfenced']} load and {w['stores_unfenced']} store job(s) without a transfer on the pool"
    if not (w["loads_begun"] and w["stores_begun"]):
        return f"{w['loads_begun']} loads and {w['stores_begun']} stores begun on the pool: the workload moves nothing"
    if w["steps_issued"] != w["step_records"] or w["steps_ended"] != w["steps_issued"]:
        return (
            f"{w['steps_issued']} steps issued, {w['step_records']} records shipped, {w['steps_ended']} ended"
        )
    if w["transfers_pending_at_end"]:
        return f"{w['transfers_pending_at_end']} transfer(s) still pending after every job was reported"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"] and len(argv) == 3:
        return _child(argv[1], argv[2])
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--modes", default="off,on", help="modes, comma-separated (default off,on; also hazards-off)"
    )
    p.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--requests", type=int, default=768, help="requests (default 768)")
    p.add_argument("--prefixes", type=int, default=32, help="shared prefixes (default 32)")
    p.add_argument("--prefix-blocks", type=int, default=16, help="blocks per prefix (default 16)")
    p.add_argument(
        "--suffix-tokens", type=int, default=96, help="longest suffix of a request's own (default 96)"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument(
        "--num-blocks", type=int, default=480, help="blocks in the pool, null block included (default 480)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=16, help="requests running at once at most (default 16)"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step at most (default 2048)"
    )
    p.add_argument(
        "--transfer-steps", type=int, default=1, help="steps from a job's plan to its report (default 1)"
    )
    p.add_argument(
        "--blockpool", metavar="DIR", help="serve from the package in DIR (e.g. build/compiled-suite)"
    )
    p.add_argument("--model-dir", default=os.path.join(ROOT, ".cache", "vllm-engine", "tiny-llama"))
    p.add_argument("--log-dir", help="keep specs, logs and results here (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.transfer_steps < 0:
        p.error("--repeat must be >= 1 and --transfer-steps >= 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r} (known: {', '.join(MODES)})")

    import attrs

    from blockpool.checking import vllm_engine as ec

    model = ec.ModelSpec()
    w = ec.Workload(name="connector", num_blocks=args.num_blocks, requests=args.requests, prefixes=args.prefixes,
                    prefix_blocks=args.prefix_blocks, suffix_tokens=args.suffix_tokens, max_tokens=args.max_tokens,
                    max_num_seqs=args.max_num_seqs, kv_connector="offloading")  # fmt: skip
    w.validate(model)
    work = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="blockpool-scheduler-connector-time-"))
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.abspath(args.model_dir)
    ec._ensure_model(model_dir, model)
    pkg = os.path.abspath(args.blockpool) if args.blockpool else ROOT
    want = None
    if args.blockpool:
        so = any(f.endswith(".so") for f in os.listdir(os.path.join(pkg, "blockpool", "core")))
        want = "compiled (mypyc)" if so else "pure Python"
    plan = [(rnd, m) for rnd in range(1, args.repeat + 1) for m in _ept._rotated(modes, rnd)]
    runs: list[dict[str, Any]] = []
    ref: dict[str, Any] | None = None
    loads: list[float] = []
    for rnd, mode in plan:
        tag = f"{mode}-{rnd}"
        spec_path, out_path, log_path = (
            os.path.join(work, f"{tag}.{x}") for x in ("spec.json", "result.json", "log")
        )
        spec = {"mode": mode, "workload": attrs.asdict(w), "model_dir": model_dir,
                "transfer_steps": args.transfer_steps, "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_steps": 100 * args.requests * (args.max_tokens + 1)}  # fmt: skip
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        env = mode_env(mode, dict(os.environ))
        env["PYTHONPATH"] = os.pathsep.join(x for x in (pkg, env.get("PYTHONPATH", "")) if x)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", spec_path, out_path]
        t0 = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            rc = subprocess.run(
                cmd, check=False, env=env, cwd=pkg, stdout=log, stderr=subprocess.STDOUT, timeout=1800
            ).returncode
        loads.append(os.getloadavg()[0])
        try:
            with open(out_path, encoding="utf-8") as f:
                r = json.load(f)
        except (OSError, ValueError):
            print(f"{tag}: no result, exit status {rc} (log: {log_path})", file=sys.stderr)
            return 1
        if want is not None and r.get("core_build") != want:
            print(f"{tag}: served by {r.get('core_build')}, not {want}", file=sys.stderr)
            return 1
        r["round"] = rnd
        ref = ref or r  # the first run: every other one must schedule as it did
        diff = first_difference(ref, r)
        if diff is not None:
            print(f"{tag}: scheduled differently from {ref['mode']}-{ref['round']}: {diff}", file=sys.stderr)
            return 1
        if r["block_ids"] != ref["block_ids"]:
            r["block_ids_differ"] = True
        fault = wiring_fault(r) if mode == "on" else None
        if fault is not None:
            print(f"{tag}: the wiring did not run: {fault}", file=sys.stderr)
            return 1
        t = r["timing"]
        print(f"{tag}: {time.perf_counter() - t0:.0f} s, {t['steps']} steps, median {t['cpu_per_step_median_us']} µs,"
              f" mean {t['cpu_per_step_mean_us']} µs, load {loads[-1]:.2f}", file=sys.stderr)  # fmt: skip
        if r is not ref:
            del r["steps"], r["block_ids"]  # the first run's are the reference
        runs.append(r)
    summary = _ept.summarize(runs)
    on = next((r for r in runs if r["mode"] == "on"), None)
    wiring = on.get("wiring") if on is not None else None
    print(_ept.format_table(summary))
    if wiring is not None:
        print("\nwiring (" + ", ".join(f"{k} {v}" for k, v in wiring.items() if k != "served") + ")")
    same_ids = not any(r.get("block_ids_differ") for r in runs)
    print(f"\nevery run scheduled the same requests, block counts, prefix hits and jobs each step as the first;"
          f" block ids {'identical' if same_ids else 'differ between modes'};"
          f" load average (1 min) after each run: {', '.join(f'{x:.2f}' for x in loads)}")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"workload": attrs.asdict(w), "repeat": args.repeat, "transfer_steps": args.transfer_steps,
                       "summary": summary, "wiring": wiring, "block_ids_identical": same_ids,
                       "load_average": loads}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
