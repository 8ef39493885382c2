#!/usr/bin/env bash
# SGLang parity: run SGLang's own CPU tests of the classes the blockpool
# plugin wraps (its allocator, radix-cache and plugin unit tests) three times
# in .venv-sglang, with the plugin loaded through SGLang's load_plugins() and
# BLOCKPOOL_SGLANG=0, audit and on, and fail unless the three passes give
# every test the same outcome.
#
# Usage: bash scripts/sglang_parity.sh [TEST_FILE_OR_DIR ...]
#   default: every test_*.py under $SGLANG_TESTS_DIR
#   ($XDG_CACHE_HOME/blockpool/sglang-tests, or ~/.cache/blockpool/sglang-tests)
#
# SGLang's unit tests live in its repository only (test/registered/unit/...:
# mem_cache/test_allocator_cpu.py, mem_cache/test_radix_cache_unit.py,
# plugins/test_hook_registry.py, plugins/test_load_plugins.py); neither its
# wheel nor PyPI carries them, and 0.5.23 has no sdist. Put them in
# $SGLANG_TESTS_DIR (or name them on the command line); where none are
# present this script says so and exits 0 without running anything.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SGLANG_VENV:-$root/.venv-sglang}"
dir="${SGLANG_TESTS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/blockpool/sglang-tests}"
bash "$root/scripts/sglang_setup.sh" "$venv" >/dev/null
if [[ $# -gt 0 ]]; then
    tests=("$@")
else
    mapfile -t tests < <(find "$dir" -name 'test_*.py' 2>/dev/null | sort)
fi
if [[ ${#tests[@]} -eq 0 ]]; then
    echo "sglang_parity: no SGLang test files under $dir: nothing run"
    exit 0
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for mode in 0 audit on; do
    # -rA lists every outcome; the outcome sets are compared below.
    (cd "$out" && BLOCKPOOL_SGLANG="$mode" PYTHONPATH="$root/scripts${PYTHONPATH:+:$PYTHONPATH}" \
        "$venv/bin/python" -W ignore -m pytest -q -rA -p no:cacheprovider -p sglang_parity_plugin \
        "${tests[@]}" >"$out/$mode.log" 2>&1) || true
    grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) [^ ]+::' "$out/$mode.log" | sed 's/ - .*//' | sort >"$out/$mode.outcomes" || true
    echo "sglang_parity: BLOCKPOOL_SGLANG=$mode: $(grep -E '^=* ?[0-9]+ (passed|failed|error)' "$out/$mode.log" | tail -n 1)"
    grep '^sglang-parity:' "$out/$mode.log" | tail -n 1 || true
done
if [[ ! -s "$out/0.outcomes" ]]; then
    echo "sglang_parity: no test outcomes with the plugin off:" >&2
    tail -n 30 "$out/0.log" >&2
    exit 1
fi
status=0
for mode in audit on; do
    if ! diff -u "$out/0.outcomes" "$out/$mode.outcomes" >"$out/$mode.diff"; then
        echo "sglang_parity: outcomes differ between BLOCKPOOL_SGLANG=0 and $mode:" >&2
        cat "$out/$mode.diff" >&2
        status=1
    fi
done
[[ $status -eq 0 ]] && echo "sglang_parity: $(wc -l <"$out/0.outcomes") tests, identical outcomes off, audit and on"
exit $status
