#!/usr/bin/env bash
# Builds .venv-sglang: Python 3.11, the CPU torch 2.13.0, sglang 0.5.23 without its
# dependencies (they name CUDA kernels and a CUDA torch), the pure-Python modules the
# import chain of the KV-cache classes asks for, a torchvision stand-in, and blockpool
# editable. Every version is pinned in scripts/sglang-constraints.txt. A stamp file
# keyed to this script and the constraints makes a rerun return at once.
#
# Usage: bash scripts/sglang_setup.sh [VENV]   (default: .venv-sglang at the repo root)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
self="$root/scripts/sglang_setup.sh"
venv="${1:-$root/.venv-sglang}"
[[ "$venv" == /* ]] || venv="$PWD/$venv"
LOG_TAG=sglang_setup
# shellcheck source=scripts/lib.sh
. "$root/scripts/lib.sh"
constraints="$root/scripts/sglang-constraints.txt"
stamp="$venv/.stamp"
key="$(cat "$self" "$constraints" "$root/scripts/sglang_stubs/torchvision/__init__.py" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
    log "$venv is up to date"
    exit 0
fi
rm -f "$stamp" "$venv/.ready"
[[ -x "$venv/bin/python" ]] || python3.11 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q -c "$constraints")
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps sglang==0.5.23
# The modules the import chain of sglang.srt.mem_cache.allocator,
# sglang.srt.managers.cache_controller, sglang.srt.mem_cache.unified_radix_cache and
# sglang.srt.plugins.hook_registry asks for, plus the test runner.
"${pip[@]}" triton numpy orjson psutil pybase64 requests packaging pillow starlette msgspec \
    pydantic pyzmq tqdm IPython aiohttp apache-tvm-ffi transformers dill sentencepiece \
    compressed-tensors gguf openai partial-json-parser pytest hypothesis attrs sortedcontainers
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$site/torchvision"
cp -r "$root/scripts/sglang_stubs/torchvision" "$site/torchvision"
"$venv/bin/python" -m pip install -q --no-deps -e "$root"
"$venv/bin/python" - <<'PY'
import warnings

warnings.simplefilter("ignore")
import torch  # noqa: E402

assert torch.__version__.startswith("2.13.0"), torch.__version__
import sglang.srt.managers.cache_controller  # noqa: E402,F401
import sglang.srt.mem_cache.allocator  # noqa: E402,F401
import sglang.srt.mem_cache.unified_radix_cache  # noqa: E402,F401
import sglang.srt.plugins.hook_registry  # noqa: E402,F401
PY
touch "$venv/.ready"
echo "$key" > "$stamp"
log "$venv ready"
