"""The connector registry (blockpool.integrations.vllm.wiring): every
connector module registers its connector and worker half at import, and a
second, different registration under a taken name is refused with the
registry unchanged. Needs neither vLLM nor torch."""

from __future__ import annotations

import pytest

from blockpool import StreamKind
from blockpool.core.errors import InvalidArgumentError
from blockpool.integrations.vllm import lmcache, lmcache_mp, wiring
from blockpool.integrations.vllm.connectors import MOONCAKE


def test_every_connector_module_registered_its_connector_in_the_order_the_package_imports_them() -> None:
    assert list(wiring.CONNECTORS) == [
        "mooncake_store",
        "offloading",
        "simple_cpu_offload",
        "nixl",
        "lmcache",
        "lmcache_mp",
    ]
    assert wiring.CONNECTORS["lmcache"].patch is lmcache.patch_scheduler
    assert wiring.WORKER_HALVES["lmcache"] is lmcache.wire_worker
    assert wiring.WORKER_HALVES["lmcache_mp"] is lmcache_mp.wire_worker


def test_registering_the_same_spec_again_changes_nothing() -> None:
    before = dict(wiring.CONNECTORS)
    wiring.register_connector(
        "lmcache", wiring.ConnectorSpec(lmcache.MODULE, lmcache.STREAMS, lmcache.patch_scheduler)
    )
    wiring.register_worker_half("lmcache", lmcache.wire_worker)
    assert wiring.CONNECTORS == before and wiring.WORKER_HALVES["lmcache"] is lmcache.wire_worker


def test_another_spec_under_a_taken_name_is_refused_and_the_registry_is_unchanged() -> None:
    before, halves = dict(wiring.CONNECTORS), dict(wiring.WORKER_HALVES)
    other = wiring.ConnectorSpec("some.module", {"x": StreamKind.HOST}, lambda mod, patch: None)
    with pytest.raises(InvalidArgumentError, match="'mooncake_store' is registered already"):
        wiring.register_connector(MOONCAKE, other)
    with pytest.raises(InvalidArgumentError, match="worker half of KV connector 'lmcache'"):
        wiring.register_worker_half("lmcache", lambda patch: None)
    assert wiring.CONNECTORS == before and wiring.WORKER_HALVES == halves
