"""Root conftest: keep doctest collection away from modules whose optional
dependencies are not installed (vLLM, torch, matplotlib)."""

import importlib.util

# vllm_pytest installs our pool into vLLM on import: never collect it.
collect_ignore_glob = ["benchmarks/*", "scripts/*", "blockpool/integrations/vllm_pytest.py"]


def _missing(mod: str) -> bool:
    return importlib.util.find_spec(mod) is None


if _missing("vllm"):
    collect_ignore_glob += ["blockpool/integrations/vllm.py", "blockpool/integrations/vllm_pool.py"]
if _missing("torch"):
    collect_ignore_glob += ["blockpool/torch_events.py", "docs/worker.md", "docs/examples/*.py"]
