"""pytest plugin: the few fixtures of vLLM's top-level ``tests/conftest.py``
that the tests run by ``scripts/vllm_parity.sh`` use (``caplog_vllm``,
``default_vllm_config``, ``dist_init``).

The parity script runs vLLM's tests with ``--confcutdir=tests/v1``: the
conftests under ``tests/v1`` load (the connector tests' autouse fixtures live
there), ``tests/conftest.py`` does not (it imports GPU-side packages). The
fixtures below are re-stated from vLLM 0.33.0's ``tests/conftest.py``. The
script puts ``scripts/`` on ``PYTHONPATH`` and loads this module with
``-p vllm_parity_fixtures`` in both passes (plugin off and on), so the two
passes still differ only by the pool plugin; it lives outside the package so
that the plugin-off pass needs nothing of blockpool.

It imports nothing from vLLM at import time and installs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

import pytest


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's logger propagates to the root logger (so ``caplog`` sees it)."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    # The first LLM init in a process reapplies DEFAULT_LOGGING_CONFIG, which
    # would otherwise turn propagation back off mid-test.
    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(
    temporary_enable_log_propagate: None, caplog: pytest.LogCaptureFixture
) -> Generator[Any, None, None]:
    """An INFO-level ``caplog`` that sees vLLM's log records."""
    with caplog.at_level(logging.INFO):
        yield caplog


@pytest.fixture()
def default_vllm_config() -> Generator[Any, None, None]:
    """A default ``VllmConfig`` set as the current config for the test."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture()
def dist_init() -> Generator[None, None, None]:
    """A one-process torch.distributed world (gloo on CPU) and vLLM's model
    parallel groups, torn down after the test."""
    import contextlib
    import os
    import tempfile

    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.platforms import current_platform

    # tests.utils.ensure_current_vllm_config (tests/utils.py imports
    # anthropic, httpx and openai, which this venv lacks): a default config
    # unless the test already set one.
    current = get_current_vllm_config_or_none()
    ensure_current_vllm_config = (
        contextlib.nullcontext if current is not None else lambda: set_current_vllm_config(VllmConfig())
    )

    # Close the fd returned by mkstemp; FileStore opens the path itself.
    fd, temp_file = tempfile.mkstemp()
    os.close(fd)
    try:
        with ensure_current_vllm_config():
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{temp_file}",
                local_rank=0,
                backend="gloo" if current_platform.is_cpu() else "nccl",
            )
            initialize_model_parallel(1, 1)
            yield
        cleanup_dist_env_and_memory()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp_file)
