"""Audit mode (``BLOCKPOOL_VLLM_HAZARDS=audit``): fences computed, no wait
added, each wired transfer checked without blocking when it starts and
counted when it would have raced under stock vLLM's waits. The counters
need neither vLLM nor torch; the worker wrappers run on CPU stand-ins
(skipped without vLLM and torch).
"""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest

from blockpool.core.hazards import StreamKind, Token
from blockpool.integrations.vllm.audit import Audit, AuditCounts, RaceExample, device_covered_by

E1 = Token("compute", 1)
D2H = Token("offload_d2h", 4)
GET = Token("mooncake_store", 2, StreamKind.HOST)


def test_a_transfer_started_while_its_fence_runs_is_counted_with_its_example() -> None:
    audit = Audit(rank=3)
    running = audit.observe(
        "offloading",
        "load",
        [E1, D2H],
        lambda t: t == E1,
        token=Token("offload_h2d", 1),
        request_id="req-7",
        block_ids=[5, 6],
    )
    assert running == (D2H,)
    assert audit.counts == {("offloading", "load"): AuditCounts(started=1, fenced=1, raced=1)}
    (ex,) = audit.examples
    assert ex == RaceExample("offloading", "load", "req-7", (5, 6), Token("offload_h2d", 1), (D2H,), ex.at)
    assert audit.to_json()["examples"][0]["running"] == [
        {"token": "offload_d2h:4", "stream": "offload_d2h", "kind": "device"}
    ]


def test_a_transfer_started_after_its_fence_ended_is_not_counted_as_a_race() -> None:
    audit = Audit()
    assert audit.observe("mooncake_store", "load", [E1], lambda t: True, token=GET) == ()
    assert audit.observe("mooncake_store", "load", [], lambda t: False, token=GET) == ()
    assert audit.counts == {("mooncake_store", "load"): AuditCounts(started=2, fenced=1, raced=0)}
    assert audit.examples == [] and audit.totals() == (2, 1, 0)


def test_tokens_vllms_own_stream_wait_orders_first_are_not_races() -> None:
    covered = device_covered_by(frozenset({"compute"}), {"compute": 1}.get)
    assert covered(E1) and not covered(Token("compute", 2)) and not covered(D2H)
    audit = Audit()
    assert (
        audit.observe(
            "offloading", "load", [E1], lambda t: False, token=Token("offload_h2d", 1), covered=covered
        )
        == ()
    )
    assert audit.totals() == (1, 1, 0)


def test_only_the_first_examples_are_kept() -> None:
    audit = Audit(max_examples=2)
    for seq in range(1, 5):
        audit.observe("nixl", "load", [E1], lambda t: False, token=Token("nixl", seq, StreamKind.HOST))
    assert audit.totals() == (4, 4, 4)
    assert [e.token.seq for e in audit.examples] == [1, 2]


def test_the_report_is_one_line_and_a_json_file_per_rank(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    audit = Audit(rank=1, path=str(tmp_path / "audit-{rank}.json"))
    audit.observe("mooncake_store", "store", [E1], lambda t: False, token=GET, request_id="A", block_ids=[1])
    audit.observe("mooncake_store", "load", [], lambda t: False, token=GET)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.blockpool"):
        audit.report()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "blockpool audit (rank 1): 1 of 2 wired transfers started while a conflicting access still ran "
        "under stock vLLM's waits (1 had a non-empty fence); raced/fenced/started: "
        "mooncake_store/load 0/0/1, mooncake_store/store 1/1/1"
    )
    data = json.loads((tmp_path / "audit-1.json").read_text())
    assert (data["rank"], data["started"], data["fenced"], data["would_have_raced"]) == (1, 2, 1, 1)
    assert data["by_connector_and_kind"]["mooncake_store/store"] == {"started": 1, "fenced": 1, "raced": 1}
    assert data["examples"][0]["request_id"] == "A"


def test_reports_come_at_most_once_per_interval_and_only_when_counts_changed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    audit = Audit(interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="vllm.plugins.blockpool"):
        audit.observe("nixl", "load", [], lambda t: True, token=GET)
        now[0] = 11.0
        audit.observe("nixl", "load", [], lambda t: True, token=GET)  # due: logged
        now[0] = 15.0
        audit.observe("nixl", "load", [], lambda t: True, token=GET)  # not due
        now[0] = 30.0
        audit.maybe_report()  # due, counts changed since: logged
        now[0] = 45.0
        audit.maybe_report()  # due, nothing changed: silent
    assert len(caplog.records) == 2


def test_audit_is_configured_by_the_environment() -> None:
    a = Audit.from_env(
        2, {"BLOCKPOOL_VLLM_AUDIT_FILE": "/x/audit-{rank}.json", "BLOCKPOOL_VLLM_AUDIT_INTERVAL": "5"}
    )
    assert (a.rank, a.path, a.interval) == (2, "/x/audit-2.json", 5.0)
    assert Audit.from_env(0, {"BLOCKPOOL_VLLM_AUDIT_INTERVAL": "soon"}).interval == 60.0
    assert Audit.from_env(0, {}).path is None


# ----------------------------------------------------------------------
# the worker wrappers in audit mode, on stand-ins
# ----------------------------------------------------------------------


@pytest.fixture
def rank() -> Any:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    pytest.importorskip("torch")
    from blockpool.integrations.vllm import worker as vw
    from blockpool.worker.standins import StandInDevice
    from blockpool.worker.torch_events import EventLedger

    dev = StandInDevice()
    ns = SimpleNamespace(
        dev=dev, compute=dev.new_stream("compute"), copy=dev.new_stream("copy"), audit=Audit()
    )
    ns.current = ns.compute
    ns.wh = vw.WorkerHazards(
        EventLedger(dev.new_event, streams={"compute": ns.compute}),
        lambda: ns.current,
        timeout=5.0,
        audit=ns.audit,
    )
    vw.install(ns.wh)
    yield ns
    vw.install(None)


def made(installer: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    installer(lambda owner, attr, make: out.__setitem__(attr, make))
    return out


def load_meta(fence: list[Token], token: Token = GET) -> Any:
    from blockpool.core.hazards import Fence
    from blockpool.integrations.vllm import connectors as vc
    from blockpool.integrations.vllm.hazards import Transfer

    meta = SimpleNamespace(req_id="B")
    setattr(meta, vc.META_LOAD, Transfer("B", "load", token, Fence(fence), (3, 4)).to_wire())
    return meta


@pytest.mark.parametrize("ended", [False, True])
def test_audit_mooncake_get_runs_at_once_and_counts_a_race_only_while_its_fence_runs(
    rank: Any, ended: bool
) -> None:
    from blockpool.integrations.vllm import worker as vw

    rank.compute.enqueue(lambda: None, "CoW copy into the GET's block")
    rank.wh.record(E1)
    if ended:
        rank.dev.run()
    ran: list[bool] = []
    handle = made(vw._wire_mooncake)["_handle_request"](lambda thread, m: ran.append(True))
    t = threading.Thread(
        target=handle,
        args=(SimpleNamespace(done_task_lock=threading.Lock(), _failed_requests=set()), load_meta([E1])),
    )
    t.start()
    t.join(10)
    assert ran == [True]
    assert not [op for op in rank.dev.log if op[0] == "synchronize"]  # no wait was added
    assert rank.audit.counts == {("mooncake_store", "load"): AuditCounts(1, 1, 0 if ended else 1)}
    assert [e.running for e in rank.audit.examples] == ([] if ended else [(E1,)])


def test_audit_mooncake_put_keeps_vllms_event_and_is_checked_after_it(rank: Any) -> None:
    from blockpool.core.hazards import Fence
    from blockpool.integrations.vllm import connectors as vc
    from blockpool.integrations.vllm import worker as vw
    from blockpool.integrations.vllm.hazards import StepRecord, Transfer

    class StockEvent:
        def __init__(self) -> None:
            self.event = rank.dev.new_event()

        def record(self) -> None:
            self.event.record(rank.current)

        def synchronize(self) -> None:
            self.event.synchronize()

        def query(self) -> bool:
            return self.event.query()

    step = StepRecord(1, E1)
    req = SimpleNamespace(can_save=True, req_id="A")
    setattr(req, vc.META_STORE, Transfer("A", "store", GET, Fence([E1]), (1, 2)).to_wire())
    meta = SimpleNamespace(requests=[req])
    setattr(meta, vc.META_STEP, (step.to_wire(), Fence().to_wire()))
    sent: list[Any] = []
    store_worker = SimpleNamespace(
        _capacity_only=False, can_put=True, kv_send_thread=SimpleNamespace(add_request=sent.append)
    )
    rank.compute.enqueue(lambda: None, "step 1 forward")
    with patch.object(vw.torch.cuda, "Event", StockEvent):
        made(vw._wire_mooncake)["wait_for_save"](None)(store_worker, meta)
    (r,) = sent
    assert isinstance(r.current_event, vw.AuditedEvent) and isinstance(r.current_event.event, StockEvent)
    assert rank.audit.totals() == (0, 0, 0)  # checked when the send thread starts, not before
    r.current_event.synchronize()  # the send thread: vLLM's own event, then the check
    assert rank.audit.counts == {("mooncake_store", "store"): AuditCounts(1, 1, 0)}


def test_audit_offload_copy_adds_no_stream_wait_and_counts_a_store_still_reading(rank: Any) -> None:
    from blockpool.core.hazards import Fence
    from blockpool.integrations.vllm import worker as vw
    from blockpool.integrations.vllm.hazards import Transfer

    d2h = rank.dev.new_stream("d2h")
    d2h.enqueue(lambda: None, "offload store still reading the blocks")
    rank.wh.record(D2H, d2h)
    rank.compute.enqueue(lambda: None, "step 1 forward")
    rank.wh.record(E1)
    h2d = Token("offload_h2d", 1)
    rank.wh.jobs[("offloading", 7)] = Transfer("B", "load", h2d, Fence([E1, D2H]), (3, 4))

    class Handler:
        def __init__(self) -> None:
            self._transfers: list[Any] = []

        def _swap_blocks_batch(self) -> None:
            rank.copy.enqueue(lambda: None, "h2d copy")

    def transfer_async(self: Any, job_id: int) -> bool:
        self._swap_blocks_batch()
        self._transfers.append(SimpleNamespace(stream=rank.copy))
        return True

    assert vw.offload_transfer_async(transfer_async)(Handler(), 7) is True
    assert not [op for op in rank.dev.log if op[0] == "wait_event"]
    # compute:1 is ordered by vLLM's wait_stream(compute); the d2h store is not.
    assert rank.audit.counts == {("offloading", "load"): AuditCounts(1, 1, 1)}
    assert rank.audit.examples[0].running == (D2H,)
    assert rank.wh.ledger.event_of(h2d) is not None  # its token is still recorded


def test_audit_nixl_read_is_posted_at_once_even_while_its_fence_runs(rank: Any) -> None:
    from blockpool.integrations.vllm import worker as vw

    rank.compute.enqueue(lambda: None, "step 1 still reads the blocks")
    rank.wh.record(E1)
    wrappers = made(vw._wire_nixl)
    posted: list[str] = []
    read = wrappers["_read_blocks_for_req"](lambda self, r, m: posted.append(f"READ {r}"))
    read(SimpleNamespace(), "B", load_meta([E1], Token("nixl", 1, StreamKind.HOST)))
    assert posted == ["READ B"] and rank.wh.deferred == 0
    assert rank.audit.counts == {("nixl", "load"): AuditCounts(1, 1, 1)}


def test_audit_forward_adds_no_wait(rank: Any) -> None:
    from blockpool.core.hazards import Fence
    from blockpool.integrations.vllm import connectors as vc
    from blockpool.integrations.vllm.hazards import StepRecord

    d2h = rank.dev.new_stream("d2h")
    d2h.enqueue(lambda: None, "a store of the partial block the step appends to")
    rank.wh.record(D2H, d2h)
    meta = SimpleNamespace()
    setattr(meta, vc.META_STEP, (StepRecord(1, E1).to_wire(), Fence([D2H]).to_wire()))
    rank.wh.on_bind(meta)
    assert not [op for op in rank.dev.log if op[0] == "wait_event"]
    assert rank.audit.counts == {("compute", "forward"): AuditCounts(1, 1, 1)}


def test_audit_mode_installs_the_wiring_and_says_so_in_the_registration_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("vllm.v1.core.sched.scheduler")
    import os

    from blockpool.integrations import vllm as plugin

    plugin.unregister()
    env = {plugin.ENV_PLUGIN: "1", plugin.ENV_HAZARDS: "audit"}
    try:
        with patch.dict(os.environ, env), caplog.at_level(logging.INFO, logger="vllm.plugins.blockpool"):
            plugin.register()
        assert plugin.install_state().hazards is True and plugin.install_state().connectors
        (line,) = [r.getMessage() for r in caplog.records if "BlockPool is now" in r.getMessage()]
        assert "hazard tracking audit by BLOCKPOOL_VLLM_HAZARDS=audit: fences computed, no wait added" in line
    finally:
        plugin.unregister()


def test_audit_counts_a_put_once_though_the_send_thread_synchronizes_twice(rank: Any) -> None:
    """MooncakeStore's send thread synchronizes ``current_event`` again for
    a PUT's boundary puts: one transfer, one count."""
    from blockpool.core.hazards import Fence
    from blockpool.integrations.vllm import worker as vw
    from blockpool.integrations.vllm.hazards import Transfer

    event = SimpleNamespace(synchronize=lambda: None, query=lambda: True)
    audited = vw.AuditedEvent(rank.wh, Transfer("A", "store", GET, Fence([E1]), (1,)), event)
    audited.synchronize()
    audited.synchronize()
    assert rank.audit.totals() == (1, 1, 1)
