#!/usr/bin/env bash
# LMCache parity: run LMCache's own vLLM-adapter tests (from its sdist) on
# this CPU machine twice, with vLLM's own BlockPool ("plugin off") and with
# ours installed by the plugin, hazard tracking on ("plugin on"), and fail
# unless both passes pass exactly the same tests. Runs after
# scripts/vllm_parity.sh in CI (whose 0.34 venv it clones).
#
# Usage (from anywhere):   bash scripts/lmcache_parity.sh
#   e.g. only plugin off:  LMCACHE_PARITY_PASSES=off bash scripts/lmcache_parity.sh
#
# The venv, $LMCACHE_VENV (.venv-lmcache): a hard-linked clone of the vLLM
# 0.34 parity venv $VLLM034_VENV (seconds, no extra disk; built first by
# `VLLM_PARITY_VERSION=0.34.0 scripts/vllm_parity.sh` when missing), re-cloned
# when that venv or the list below changes (a stamp file). Into the clone
# only: LMCache installed as a user on a machine without CUDA would, its
# wheel with --no-deps plus exactly what its vLLM adapter and its tests
# import (LMCACHE_PINS below; each --no-deps, so nothing of vLLM's moves),
# and blockpool (editable, from this checkout) when the clone does not
# import it from here already. Left out of LMCache's declared dependencies:
#   cupy-cuda13x, cuda-python   CUDA 13 runtime bindings: no CUDA driver or
#                               device here; LMCache's CPU device spec does
#                               not import them
#   cufile-python               GPUDirect Storage (libcufile): CUDA only,
#                               used by the GDS backend's I/O, not imported
#   nvtx                        NVIDIA profiler ranges; not imported on CPU
#   nixl (extra)                the P/D transfer library, an optional extra
#   grpcio, grpcio-observability  the MP server's gRPC transport; the
#                               adapter's default transport is ZMQ (pyzmq,
#                               already in the venv); see the exclusions
#   awscrt, google-cloud-bigtable, google-api-core, opentelemetry-sdk and
#   exporters, aiofiles, httptools, setuptools_scm
#                               storage backends, telemetry and build tools
#                               that neither the adapter nor these tests
#                               import
# and LMCache's "numpy<=2.2.6" pin is not applied: the venv's numpy (vLLM's)
# stays; numba 0.68 (LMCache's CPU kernels) supports it.
#
# The tests: LMCache's sdist (its tests live only there; its wheel has
# none), fetched from pip's index page for lmcache (the URL and
# its sha256 from the page's link, checked against LMCACHE_SDIST_SHA256)
# into $LMCACHE_SRC_CACHE, unpacked once. Each run copies its tests/ and
# pytest.ini into a fresh directory and runs pytest there (not from the
# sdist root, whose lmcache/ source tree, without the compiled extensions,
# would shadow the installed package), with LMCache's own conftest.py (its
# CPU mocks: Redis, 3FS, the shared 5 GB host allocator).
#
# Both passes: VLLM_TARGET_DEVICE=cpu, VLLM_PLUGINS= (no vLLM entry-point
# plugin loads), -p no:blockpool, -o log_cli=false (LMCache's pytest.ini
# streams every log line), through scripts/vllm_parity_pass.py (a hung test
# costs that test, not the pass) and with -p lmcache_parity_probe
# (scripts/lmcache_parity_probe.py: the class vLLM binds as BlockPool, the
# pools built, what our pool served). Plugin off: BLOCKPOOL_VLLM_PLUGIN=0
# too. Plugin on: -p blockpool.integrations.vllm.pytest_plugin (installs our
# pool before collection) and BLOCKPOOL_VLLM_HAZARDS unset (the default:
# hazard tracking and connector wiring on).
#
# What each pass must show (the probe's JSON), besides the test outcomes:
#   off  vLLM's own BlockPool bound; blockpool not imported;
#   on   ours bound (in vllm.v1.core.block_pool and the coordinator), from
#        this checkout, hazards on; every pool built went through our class
#        (none of vLLM's built directly) and as many pools as plugin off
#        built. LMCache 0.5.6's adapter tests build none: they drive the
#        adapters with stub pools (MagicMock), so the on pass proves that
#        our install and the connector wiring it adds leave LMCache's
#        adapters behaving as LMCache's tests expect; every connector the
#        plugin declares (blockpool.integrations.vllm.connectors.CONNECTORS)
#        must be wired, none left unwired by a failed wrapper.
#
# Output: "lmcache-plugin-off: N passed, N failed" (and -on), the probe's
# findings, and last one line:
#   lmcache-parity: off P passed, F failed, S skipped; on P passed, F failed,
#   S skipped; pass-set diff D (O only off, N only on)
# plus, under $LMCACHE_PARITY_RESULTS: NAME.log, NAME.outcomes
# ("nodeid<TAB>outcome", sorted), NAME.unexpected, NAME.probe.json,
# pass-set-diff.txt, and the timings of each step.
# Exit status: 0 = both passes ran, plugin off failed nothing, the pass sets
# are identical and both probes show what they must; 1 = otherwise;
# 2 = setup error (venv, install, fetch).
#
# Environment knobs (all optional):
#   LMCACHE_VENV             the clone                         [.venv-lmcache]
#   VLLM034_VENV             the vLLM 0.34 parity venv cloned  [.venv-vllm034]
#   LMCACHE_SRC_CACHE        where the sdist is kept/unpacked  [.cache/lmcache-src]
#   LMCACHE_PARITY_RESULTS   logs, outcome lists, probes       [.cache/lmcache-parity]
#   LMCACHE_PARITY_PASSES    "off", "on" or both               [off on]
#   LMCACHE_PARITY_TIMEOUT   seconds allowed per pass          [600]
#   LMCACHE_PARITY_TEST_TIMEOUT seconds allowed per test       [120; the
#                            slowest takes about 20 s here, most of it the
#                            5 GB allocator of LMCache's conftest]
#   LMCACHE_PARITY_PYTHON    interpreter that asks pip for its index [python3.11]
set -euo pipefail

LOG_TAG=lmcache-parity
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # REPO_ROOT (the working directory), log, die, timed, ...

LMCACHE_VERSION=0.5.6
# sha256 of lmcache-0.5.6.tar.gz, as the index publishes it.
LMCACHE_SDIST_SHA256=d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e
VLLM_VERSION=0.34.0
# What LMCache's vLLM adapter (lmcache.integration.vllm: vllm_v1_adapter,
# lmcache_mp_connector) and its tests' conftest import that the vLLM venv
# lacks; each --no-deps.
LMCACHE_PINS=(
  "lmcache==$LMCACHE_VERSION"
  numba==0.68.1          # LMCache's CPU kernels (lmcache.device_ops on CPU)
  llvmlite==0.50.0       # numba's
  aiofile==3.12.3        # the GDS / local-disk backends, imported by the engine
  caio==0.12.10          # aiofile's
  cryptography==50.0.2   # the remote serde's AES-GCM, imported by the engine
  cffi==2.1.1            # cryptography's
  uvicorn==0.54.0        # the adapter's internal API server
  click==8.5.1           # uvicorn's
  redis==8.1.0           # LMCache's conftest patches redis.* in every test
)

VENV="$(abspath "${LMCACHE_VENV:-.venv-lmcache}")"
BASE_VENV="$(abspath "${VLLM034_VENV:-.venv-vllm034}")"
SRC_CACHE="$(abspath "${LMCACHE_SRC_CACHE:-.cache/lmcache-src}")"
RESULTS_DIR="$(abspath "${LMCACHE_PARITY_RESULTS:-.cache/lmcache-parity}")"
PASSES="${LMCACHE_PARITY_PASSES:-off on}"
PASS_TIMEOUT="${LMCACHE_PARITY_TIMEOUT:-600}"
TEST_TIMEOUT="${LMCACHE_PARITY_TEST_TIMEOUT:-120}"
STALL_TIMEOUT=$(( TEST_TIMEOUT + 120 ))
BASE_PYTHON="${LMCACHE_PARITY_PYTHON:-python3.11}"
VENV_PY="$VENV/bin/python"
SDIST_ROOT="$SRC_CACHE/lmcache-$LMCACHE_VERSION"
SCRIPTS_DIR="$REPO_ROOT/scripts"
PLUGIN_MODULE=blockpool.integrations.vllm.pytest_plugin

# The tests, relative to the sdist root: those of LMCache's vLLM
# integration (lmcache.integration.vllm) that run on CPU: the in-process
# adapter (scheduler and worker sides, layerwise save, preemption, sync
# loads), the multi-process connector and its adapters (lookup, store and
# retrieve ops, KV roles, autostart, metrics, multimodal keys), KV cache
# groups and layouts, and the MP adapter's engine-driven transfer context.
TEST_PATHS=(
  tests/v1/test_vllm_dcp_support.py
  tests/v1/test_vllm_kv_cache_group_edits.py
  tests/v1/test_vllm_kv_cache_group_edits_mla.py
  tests/v1/test_vllm_kv_cache_groups.py
  tests/v1/test_vllm_kv_layout_discovery.py
  tests/v1/test_vllm_layerwise_wait_for_save.py
  tests/v1/test_vllm_local_rank.py
  tests/v1/test_vllm_mamba_unified_view_layouts.py
  tests/v1/test_vllm_mp_adapter.py
  tests/v1/test_vllm_sync_load_pin_cleanup.py
  tests/v1/test_v1_adapter_request_finished_scheduler_role.py
  tests/v1/test_v1_adapter_state_desync.py
  tests/v1/test_decode_save_and_preemption.py
  tests/v1/test_mp_connector_autostart.py
  tests/v1/test_mp_connector_kv_roles.py
  tests/v1/test_mp_connector_layout_preference.py
  tests/v1/test_mp_connector_metrics.py
  tests/v1/test_mp_connector_mm_keys.py
  tests/v1/test_mp_nonblocking_lookup.py
  tests/v1/test_mp_server_autostart.py
  tests/v1/test_mp_tracker_mamba_skipped_slots.py
  tests/v1/test_kv_cache_groups.py
  tests/v1/test_blocks_first_group_construction.py
  tests/v1/multiprocess/test_engine_driven_transfer.py
  tests/v1/multiprocess/test_free_locks.py
)
# Left out, with the reason (the other test files of the sdist that import
# lmcache.integration.vllm or vLLM):
#   tests/v1/test_mp_mem_kernels.py        CUDA kernels (lmcache.cuda_ops
#                                          needs libc10_cuda.so)
#   tests/v1/test_vllm_integration.py      holds no test (a placeholder)
#   tests/v1/test_pos_kernels.py           vLLM's rotary-embedding custom op,
#                                          absent on CPU (skips)
#   tests/v1/test_ec_connector.py          the encoder-cache connector: no KV
#                                          blocks (and 35 s)
#   tests/v1/test_experimental_dispatcher.py, tests/sdk/test_dispatcher.py
#                                          LMCache's experimental request
#                                          dispatcher: no connector path
#   tests/v1/test_mm_hash_utils.py, tests/v1/test_manager.py,
#   tests/v1/test_config.py                LMCache's config and hashing
#                                          helpers (import vLLM utils only)
#   tests/v1/multiprocess/test_autostart_health.py
#                                          starts a real LMCache server
#                                          process (20 s); the launcher's
#                                          logic is test_mp_server_autostart
#   tests/v1/multiprocess/test_blocked_scale_format.py
#                                          a kernel's format (names vLLM in
#                                          a docstring only)
#   tests/v1/platform/devices/{musa,rbln}, tests/v1/compute/attention/
#   test_triton_sparse_e2e.py              other devices, Triton on a GPU
# and single tests:
DESELECT=(
  # The MP server's gRPC transport: grpcio is not installed (the adapter
  # talks ZMQ); the test's ZMQ case runs.
  "tests/v1/multiprocess/test_free_locks.py::test_free_locks_request_transport[grpc]"
)

# ---------------------------------------------------------------------------
# 1. the venv: a clone of the vLLM 0.34 parity venv, plus LMCache
# ---------------------------------------------------------------------------
base_venv_ok() {
  [[ -x "$BASE_VENV/bin/python" ]] && "$BASE_VENV/bin/python" -W ignore - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys, importlib.metadata as md
assert md.version("vllm") == sys.argv[1]
from vllm.v1.core.block_pool import BlockPool  # noqa: F401
EOF
}

ensure_base_venv() {
  base_venv_ok && return 0
  build_parity_venv "$VLLM_VERSION" "$BASE_VENV" "about 2 min, 2.1 GB"
  base_venv_ok || die "vllm $VLLM_VERSION does not import in $BASE_VENV"
}

venv_imports_ok() {
  (cd / && "$VENV_PY" -W ignore - "$LMCACHE_VERSION" "$VLLM_VERSION" <<'EOF') >/dev/null 2>&1
import sys, importlib.metadata as md
assert md.version("lmcache") == sys.argv[1] and md.version("vllm") == sys.argv[2]
from lmcache import device_ops  # noqa: F401  (CPU ops: numba)
import lmcache.integration.vllm.vllm_v1_adapter  # noqa: F401
import lmcache.integration.vllm.lmcache_mp_connector  # noqa: F401
import redis  # noqa: F401
EOF
}

# Re-cloned when the parity venv changes (its requirements stamp, or its
# site-packages' entries) or the pins do. Nothing in the clone is written in
# place (pip replaces files), so the parity venv's files stay as they are.
clone_stamp() {
  local base; base="$(venv_stamp "$BASE_VENV")"
  [[ $base != none ]] || { echo none; return 0; }
  printf '%s %s\n' "$base" "$(printf '%s\n' "${LMCACHE_PINS[@]}" | sha256sum | cut -d' ' -f1)"
}

build_venv() {
  local stamp; stamp="$(clone_stamp)"
  if [[ $stamp != none && "$(cat "$VENV/.lmcache-clone-stamp" 2>/dev/null)" == "$stamp" ]] && venv_imports_ok; then
    log "venv $VENV (a clone of $BASE_VENV with lmcache $LMCACHE_VERSION) is ready"
    return 0
  fi
  ensure_base_venv
  stamp="$(clone_stamp)"
  clone_venv "$BASE_VENV" "$VENV"
  mkdir -p "$RESULTS_DIR"
  log "pip install --no-deps ${LMCACHE_PINS[*]}"
  "$VENV_PY" -m pip install --no-input --no-deps "${LMCACHE_PINS[@]}" >"$RESULTS_DIR/pip-install.log" 2>&1 \
    || { tail -n 20 "$RESULTS_DIR/pip-install.log" >&2; die "pip install failed, see $RESULTS_DIR/pip-install.log"; }
  venv_imports_ok || {
    (cd / && "$VENV_PY" -c 'import lmcache.integration.vllm.vllm_v1_adapter, lmcache.integration.vllm.lmcache_mp_connector') 2>&1 | tail -n 5 >&2
    die "LMCache's vLLM adapter does not import in $VENV"
  }
  printf '%s\n' "$stamp" >"$VENV/.lmcache-clone-stamp"
}

# blockpool from this checkout (CI's parity venv has it already, installed
# editable by scripts/vllm_parity.sh); from / so the checkout itself is not
# on sys.path.
# (install_blockpool, scripts/lib.sh; its vLLM plugin must import after an
# install.)

# ---------------------------------------------------------------------------
# 2. LMCache's sdist (its tests), from pip's index, sha256-checked
# ---------------------------------------------------------------------------
# (fetch_sdist, scripts/lib.sh: unpacked into $SDIST_ROOT, this file its
# marker.)
SDIST_MARKER=tests/conftest.py

# ---------------------------------------------------------------------------
# 3. the passes
# ---------------------------------------------------------------------------
TEST_ROOT=""  # a fresh copy of the sdist's tests/ and pytest.ini (set in main)

# run_pass NAME [env VAR=value ...] -- [extra pytest args ...]
run_pass() {
  local name=$1; shift
  local envs=()
  while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  local probe="$RESULTS_DIR/$name.probe.json" deselect=() d
  rm -f "$probe"
  for d in "${DESELECT[@]}"; do deselect+=(--deselect "$d"); done
  log "pass $name: pytest $* <${#TEST_PATHS[@]} test files> (log: $RESULTS_DIR/$name.log)"
  runner_pass "$name" "$TEST_ROOT" -u BLOCKPOOL_VLLM_HAZARDS -u BLOCKPOOL_VLLM_UNWIRED -u BLOCKPOOL_VLLM_PLUGIN \
      VLLM_TARGET_DEVICE=cpu VLLM_PLUGINS= HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
      LMCACHE_TRACK_USAGE=false PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$SCRIPTS_DIR" \
      LMCACHE_PARITY_PROBE="$probe" KNOWN_IDS= KNOWN_MSGS= FLAKY_IDS= "${envs[@]}" \
    -- --merge-json-env LMCACHE_PARITY_PROBE -- \
      -p vllm_parity_progress -p no:cacheprovider -p no:blockpool "$@" -p lmcache_parity_probe \
      -o log_cli=false --timeout="$TEST_TIMEOUT" --timeout-method=thread -q -rfEs \
      "${deselect[@]}" "${TEST_PATHS[@]}" \
    || return 0
  if [[ -s "$RESULTS_DIR/$name.unexpected" && $name == lmcache-plugin-off ]]; then
    log "$name: $(wc -l <"$RESULTS_DIR/$name.unexpected") tests fail with vLLM's own pool (an environment problem):"
    head -n 20 "$RESULTS_DIR/$name.unexpected" >&2
    PASS_RC[$name]=1
  fi
  check_probe "$name" "$probe" || PASS_RC[$name]=1
}

# check_probe NAME FILE: the pass ran on the pool it claims (see the header).
check_probe() {
  local name=$1 probe=$2
  [[ -f "$probe" ]] || { log "$name: $probe was not written (did the probe plugin load?)"; return 1; }
  "$VENV_PY" - "$name" "$probe" "$REPO_ROOT/blockpool" "$RESULTS_DIR/lmcache-plugin-off.probe.json" <<'EOF'
import json, os, sys
name, path, checkout, off_path = sys.argv[1:]
r = json.load(open(path))
bp = r["blockpool"]
bad = []
print(f"{name}: vLLM binds {r['pool_class']} (coordinator: {r['coordinator_pool_class']}); "
      f"{r['pools_built']} pools built through it, {r['vllm_pools_built']} of vLLM's own class")
if name.endswith("-off"):
    if not r["pool_class"].startswith("vllm.") or r["pool_class"] != r["coordinator_pool_class"]:
        bad.append("vLLM's own BlockPool is not the one bound")
    if bp is not None:
        bad.append("blockpool's vLLM plugin was imported")
else:
    if bp is None:
        bad.append("blockpool's vLLM plugin was not imported")
    else:
        print(f"{name}: blockpool {os.path.dirname(bp['file'])}, installed {bp['installed']}, "
              f"hazards {bp['hazards']}; connectors wired: {', '.join(bp['connectors']) or 'none'}"
              + (f"; left unwired: {', '.join(bp['unwired'])}" if bp["unwired"] else ""))
        print(f"{name}: our pool served {bp['allocations']} allocations in {bp['pools']} pools; "
              f"{bp['transfers_fenced']} connector transfers fenced ({bp['fences_nonempty']} non-empty fences)")
        if not bp["installed"]:
            bad.append("our pool was not bound in vLLM")
        if not bp["hazards"]:
            bad.append("hazard tracking was off")
        # Every connector the plugin declares imports in this venv (LMCache's
        # too, once declared), so every one must be wired.
        missing = sorted(set(bp["declared"]) - set(bp["connectors"]))
        if missing:
            bad.append(f"connectors declared but not wired: {', '.join(missing)}")
        if os.path.dirname(bp["file"]) != checkout:
            bad.append(f"blockpool came from {bp['file']}, not {checkout}")
    if r["pool_class"].startswith("vllm.") or r["pool_class"] != r["coordinator_pool_class"]:
        bad.append("our pool is not the one vLLM binds")
    if r["vllm_pools_built"]:
        bad.append(f"{r['vllm_pools_built']} pools of vLLM's own class were built")
    if os.path.exists(off_path):
        off = json.load(open(off_path))
        if off["pools_built"] != r["pools_built"]:
            bad.append(f"{r['pools_built']} pools built, {off['pools_built']} with plugin off")
    if bp is not None and r["pools_built"] and not bp["allocations"]:
        bad.append("pools were built but ours served no allocation")
    if not r["pools_built"]:
        print(f"{name}: no test built vLLM's BlockPool (LMCache's tests drive its adapters with stub pools)")
for b in bad:
    print(f"{name}: PROOF FAILED: {b}")
sys.exit(1 if bad else 0)
EOF
}

count_outcomes() { # count_outcomes FILE -> "passed failed skipped"
  awk -F'\t' '{ n[$2]++ } END { printf "%d %d %d\n", n["passed"], n["failed"] + n["error"] + n["hung"], n["skipped"] }' "$1"
}

# The pass sets: the tests each pass passed; any difference fails.
compare_passes() {
  local off="$RESULTS_DIR/lmcache-plugin-off.outcomes" on="$RESULTS_DIR/lmcache-plugin-on.outcomes"
  [[ -f "$off" && -f "$on" ]] || return 0
  local report="$RESULTS_DIR/pass-set-diff.txt" only_off only_on
  { passed_not_in "$off" "$on" | cut -f1 | sed 's/^/only off\t/'
    passed_not_in "$on" "$off" | cut -f1 | sed 's/^/only on\t/'
  } >"$report"
  only_off=$(grep -c '^only off' "$report" || true)
  only_on=$(grep -c '^only on' "$report" || true)
  read -r p_off f_off s_off < <(count_outcomes "$off")
  read -r p_on f_on s_on < <(count_outcomes "$on")
  if [[ -s "$report" ]]; then
    log "the pass sets differ, see $report:"
    head -n 20 "$report" >&2
    PASS_RC[pass-sets]=1
  else
    PASS_RC[pass-sets]=0
  fi
  printf 'lmcache-parity: off %d passed, %d failed, %d skipped; on %d passed, %d failed, %d skipped; pass-set diff %d (%d only off, %d only on)\n' \
    "$p_off" "$f_off" "$s_off" "$p_on" "$f_on" "$s_on" $(( only_off + only_on )) "$only_off" "$only_on"
}

main() {
  local start; start=$(now)
  log "lmcache $LMCACHE_VERSION on vLLM $VLLM_VERSION: venv $VENV, results $RESULTS_DIR, passes: $PASSES"
  mkdir -p "$RESULTS_DIR"
  # Nothing of an earlier run is compared.
  rm -f "$RESULTS_DIR"/lmcache-plugin-*.{outcomes,probe.json,passed} "$RESULTS_DIR/pass-set-diff.txt"
  timed "venv" build_venv
  timed "blockpool install" install_blockpool "$VENV" "$RESULTS_DIR/pip-blockpool.log" "$PLUGIN_MODULE"
  timed "sdist fetch" fetch_sdist lmcache "$LMCACHE_VERSION" "$LMCACHE_SDIST_SHA256" "$SRC_CACHE" "$SDIST_MARKER"
  TEST_ROOT="$(mktemp -d "${TMPDIR:-/tmp}/lmcache-tests.XXXXXX")"
  trap 'rm -rf "$TEST_ROOT"' EXIT
  cp -r "$SDIST_ROOT/tests" "$SDIST_ROOT/pytest.ini" "$TEST_ROOT/"
  local p
  for p in $PASSES; do
    case "$p" in
      off) timed "plugin-off tests" run_pass lmcache-plugin-off BLOCKPOOL_VLLM_PLUGIN=0 -- ;;
      on) timed "plugin-on tests" run_pass lmcache-plugin-on -- -p "$PLUGIN_MODULE" ;;
      *) die "unknown pass '$p' in LMCACHE_PARITY_PASSES" ;;
    esac
  done
  compare_passes
  log_timings "$start"
  passes_verdict
}

main "$@"
