"""pytest plugin: what pool vLLM builds while LMCache's tests run, for
``scripts/lmcache_parity.sh``.

Loaded with ``-p lmcache_parity_probe`` (``scripts/`` on ``PYTHONPATH``) in
both passes of the LMCache parity run, after the pool plugin when that is
loaded. At ``pytest_configure`` (last of all plugins, so after
:mod:`blockpool.integrations.vllm.pytest_plugin` installed our pool) it
reads the class that ``vllm.v1.core.block_pool`` and
``vllm.v1.core.kv_cache_coordinator`` bind as ``BlockPool``, and counts the
pools built during the session: through that bound class, and through
vLLM's own ``BlockPool`` class directly (in the plugin-on pass a pool of
vLLM's own built by a test means the test bypassed our pool). The counting
wraps each class's ``__init__`` with a counter that calls the original; no
other behaviour changes.

When the session ends it writes, to the file named by
``LMCACHE_PARITY_PROBE``, a JSON object::

    {"pool_class": "module.QualName", "coordinator_pool_class": "...",
     "pools_built": n, "vllm_pools_built": m,
     "blockpool": null | {"file": path of blockpool/__init__.py,
                          "installed": bool, "hazards": bool,
                          "declared": [connectors the plugin can wire],
                          "connectors": [names wired], "unwired": [names
                          whose wrappers failed],
                          "pools", "allocations", "transfers_fenced",
                          "fences_nonempty": what our pool served}}

(``vllm_pools_built`` counts vLLM's own class; in the plugin-off pass it is
the bound class, so both counts are the same pools). ``blockpool`` is null
unless the pool plugin was imported. Without the variable it does nothing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

import pytest

ENV_PROBE = "LMCACHE_PARITY_PROBE"

_COUNTS: dict[str, int] = {"pools_built": 0, "vllm_pools_built": 0}
_CLASSES: dict[str, str] = {}


def _name(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _count_inits(cls: type, key: str) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        _COUNTS[key] += 1
        init(self, *args, **kwargs)

    cls.__init__ = counted  # type: ignore[misc]


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(ENV_PROBE):
        return
    from vllm.v1.core import block_pool, kv_cache_coordinator

    bound = block_pool.BlockPool
    _CLASSES["pool_class"] = _name(bound)
    _CLASSES["coordinator_pool_class"] = _name(kv_cache_coordinator.BlockPool)
    plugin = sys.modules.get("blockpool.integrations.vllm")
    original = plugin.install_state().original if plugin is not None else None
    _count_inits(bound, "pools_built")
    if original is not None and original is not bound:
        _count_inits(original, "vllm_pools_built")
        _CLASSES["vllm_pool_class"] = _name(original)
    else:  # plugin off: the bound class is vLLM's own
        _CLASSES["vllm_pool_class"] = _CLASSES["pool_class"]


def _blockpool_state() -> dict[str, Any] | None:
    plugin = sys.modules.get("blockpool.integrations.vllm")
    if plugin is None:
        return None
    from blockpool.integrations.vllm.connectors import CONNECTORS
    from blockpool.integrations.vllm.served import SERVED

    state = plugin.install_state()
    served = SERVED.as_dict()
    return {
        "file": sys.modules["blockpool"].__file__,
        "installed": plugin.is_installed(),
        "hazards": bool(state.hazards),
        "declared": sorted(CONNECTORS),
        "connectors": sorted(state.connectors),
        "unwired": sorted(state.unwired),
        **{k: served[k] for k in ("pools", "allocations", "transfers_fenced", "fences_nonempty")},
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(ENV_PROBE)
    if not path or not _CLASSES:
        return
    counts = dict(_COUNTS)
    if _CLASSES["vllm_pool_class"] == _CLASSES["pool_class"]:
        counts["vllm_pools_built"] = counts["pools_built"]
    report = {**_CLASSES, **counts, "blockpool": _blockpool_state()}
    with open(path, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
        f.write("\n")
