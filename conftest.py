"""Root conftest: keep doctest collection away from modules whose optional
dependencies are not installed (vLLM, torch, matplotlib)."""

import importlib.util

collect_ignore_glob = ["benchmarks/*", "scripts/*"]


def _missing(mod: str) -> bool:
    return importlib.util.find_spec(mod) is None


if _missing("vllm"):
    collect_ignore_glob += ["blockpool/integrations/vllm*.py"]
if _missing("torch"):
    collect_ignore_glob += ["blockpool/torch_events.py", "docs/worker.md", "docs/examples/*.py"]
