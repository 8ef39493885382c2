#!/usr/bin/env bash
# The test suite against the compiled core (BLOCKPOOL_MYPYC=1): build the
# compiled wheel, unpack it into build/compiled-suite beside a copy of every
# other tracked file, and run the README's test command there, so that every
# test imports the compiled modules (the session header and
# BLOCKPOOL_EXPECT_COMPILED=1 check it). Run with the Python of a venv that
# has the test extras; the wheel is built in pip's isolated build
# environment (setuptools and mypy from the package index), or with this
# venv's setuptools and mypy when BUILD_ISOLATION=0; `WHEEL=path.whl` skips
# the build; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
D=build/compiled-suite
if [ -z "${WHEEL:-}" ]; then
    rm -rf dist-mypyc build/lib.* build/temp.* build/blockpool build/__native*
    iso=(); [ "${BUILD_ISOLATION:-1}" = 0 ] && iso=(--no-build-isolation)
    BLOCKPOOL_MYPYC=1 "$PY" -m pip wheel -q --no-deps "${iso[@]}" -w dist-mypyc .
    WHEEL=$(ls dist-mypyc/blockpool-*.whl)
fi
case "$WHEEL" in *-none-any.whl) echo "compiled_suite: $WHEEL is a pure wheel" >&2; exit 1 ;; esac
rm -rf "$D" && mkdir -p "$D"
git ls-files -co --exclude-standard -z | grep -zv '^blockpool/' | xargs -0 cp --parents -t "$D"
"$PY" -m zipfile -e "$WHEEL" "$D"
rm -rf "$D"/blockpool-*.dist-info
# tests that read ../shared (traces, vLLM fixtures) find it as they do here
if [ -d ../shared ] && [ ! -e build/shared ]; then ln -s "$(cd ../shared && pwd)" build/shared; fi
cd "$D"
BLOCKPOOL_EXPECT_COMPILED=1 "$PY" -m pytest -q -rs "$@"
