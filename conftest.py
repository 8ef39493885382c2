"""Root conftest: keep doctest collection away from modules whose optional
dependencies are not installed (vLLM, torch, matplotlib)."""

import importlib.util

# vllm_pytest installs our pool into vLLM on import: never collect it.
# blockpool/sanitizer.py is a deprecated alias that warns on import.
collect_ignore_glob = [
    "benchmarks/*",
    "scripts/*",
    "blockpool/integrations/vllm/pytest_plugin.py",
    "blockpool/sanitizer.py",
]


def _missing(mod: str) -> bool:
    return importlib.util.find_spec(mod) is None


if _missing("vllm"):
    collect_ignore_glob += [
        "blockpool/integrations/vllm/__init__.py",
        "blockpool/integrations/vllm/pool.py",
        "blockpool/integrations/vllm/parity.py",
        "blockpool/integrations/vllm/blocks.py",
        "blockpool/integrations/vllm/events.py",
    ]
if _missing("torch"):
    collect_ignore_glob += [
        "blockpool/worker/torch_events.py",
        "blockpool/integrations/vllm/worker.py",
        "docs/worker.md",
        "docs/examples/*.py",
    ]


def _vllm_test_fixtures() -> None:
    """Where vLLM is installed (the parity venv), point the Hugging Face hub
    at a temporary copy of ``../shared/vllm-parity/hf`` (shape-only model
    configs; shared/ is read-only and the hub may write beside its cache),
    offline, before any test imports vLLM. Tests that build a model config
    skip unless ``BLOCKPOOL_TEST_HF_FIXTURES`` is set."""
    import os
    import pathlib
    import shutil
    import tempfile

    src = pathlib.Path(__file__).resolve().parent.parent / "shared" / "vllm-parity" / "hf"
    if os.environ.get("BLOCKPOOL_TEST_HF_FIXTURES") or not src.is_dir():
        return
    dst = pathlib.Path(tempfile.mkdtemp(prefix="blockpool-hf-")) / "hf"
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)
    os.environ.setdefault("HF_HOME", str(dst))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["BLOCKPOOL_TEST_HF_FIXTURES"] = str(dst)


if not _missing("vllm"):
    _vllm_test_fixtures()
