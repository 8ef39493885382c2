#!/usr/bin/env bash
# The test suite against the compiled core (BLOCKPOOL_MYPYC=1), run from
# build/compiled-suite: a copy of every other file of the checkout (tests,
# docs, scripts, ... but not blockpool/), so that every test imports the
# compiled build (the session header and BLOCKPOOL_EXPECT_COMPILED=1 check
# it). The build under test comes one of three ways:
#   (default)    the compiled wheel built here into dist-mypyc/ and unpacked
#                into the copy; built in pip's isolated build environment
#                (setuptools and mypy from the package index), or with this
#                Python's setuptools and mypy when BUILD_ISOLATION=0;
#   WHEEL=path   that wheel instead, unpacked into the copy; with VENV=dir,
#                installed instead into a fresh venv at dir (made by
#                $PYTHON, the wheel's extras SUITE_EXTRAS and the
#                requirements SUITE_PIP, word-split, installed with it), the
#                suite run by that venv's Python: the wheel as a user
#                installs it (the tests read the checkout's files from
#                the copy, the package's from where it is installed);
#   INSTALLED=1  the blockpool $PYTHON has installed already (cibuildwheel's
#                test step; the copy holds no package).
# $PYTHON (default: python) needs the test extras, except with VENV. Extra
# arguments go to pytest; `blockpool --version` is printed first.
set -euo pipefail
LOG_TAG=compiled-suite
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # REPO_ROOT (the working directory), log, die, ...
PY=${PYTHON:-python}
D=build/compiled-suite
if [[ "${INSTALLED:-0}" != 1 && -z "${WHEEL:-}" ]]; then
    rm -rf dist-mypyc build/lib.* build/temp.* build/blockpool build/__native*
    iso=(); [ "${BUILD_ISOLATION:-1}" = 0 ] && iso=(--no-build-isolation)
    BLOCKPOOL_MYPYC=1 "$PY" -m pip wheel -q --no-deps "${iso[@]}" -w dist-mypyc .
    WHEEL=$(ls dist-mypyc/blockpool-*.whl)
fi
case "${WHEEL:-}" in *-none-any.whl) die "$WHEEL is a pure wheel" ;; esac
rm -rf "$D" && mkdir -p "$D"
if git ls-files -z >/dev/null 2>&1; then
    git ls-files -co --exclude-standard -z | grep -zv '^blockpool/' | xargs -0 cp --parents -t "$D"
else  # not a git checkout (an sdist, cibuildwheel's copy): all but the package and what builds leave
    tar -cf - --exclude=./blockpool --exclude=./.git --exclude=./build --exclude='./dist*' --exclude='./.venv*' \
        --exclude=./.cache --exclude=./wheelhouse --exclude='*.egg-info' . | tar -xf - -C "$D"
fi
if [[ "${INSTALLED:-0}" == 1 ]]; then
    :
elif [[ -n "${VENV:-}" ]]; then
    VENV="$(abspath "$VENV")"
    log "installing $(basename "$WHEEL")[${SUITE_EXTRAS:-test}] into a fresh venv $VENV"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    read -r -a more <<<"${SUITE_PIP:-}"
    "$VENV/bin/python" -m pip install -q --no-input "$(abspath "$WHEEL")[${SUITE_EXTRAS:-test}]" "${more[@]}"
    PY="$VENV/bin/python"
else
    "$PY" -m zipfile -e "$WHEEL" "$D"
    rm -rf "$D"/blockpool-*.dist-info
fi
# tests that read ../shared (traces, vLLM fixtures) find it as they do here
if [ -d ../shared ] && [ ! -e build/shared ]; then ln -s "$(cd ../shared && pwd)" build/shared; fi
cd "$D"
"$PY" -m blockpool --version  # the build under test, as the suite imports it
BLOCKPOOL_EXPECT_COMPILED=1 "$PY" -m pytest -q -rs "$@"
