"""The SGLang replay (:mod:`blockpool.replay.sglang`) on small workloads
whose counts can be followed by hand, and the counters it shares with audit
mode (:class:`TransferCounters`, :func:`classify`)."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from blockpool.core.errors import InvalidArgumentError
from blockpool.integrations.sglang.account import TransferCounters, classify
from blockpool.replay.sglang import SGLangReplayConfig, main, replay_sglang, tiny_workload
from blockpool.replay.traces import read_trace
from blockpool.sim.costmodel import DEFAULT_STREAM_SPECS, CostModel


def test_one_request_writes_its_prompt_pages() -> None:
    # Admitted at step 1, prefill forward 2, one decode forward 3. Its 4 prompt pages are
    # written when forward 2's result is processed (step 3: the tail is forward 3).
    req = tiny_workload()[:1]
    free = replay_sglang(req, SGLangReplayConfig(device_pages=12, decode_tokens=64))
    assert (free.steps, free.requests, free.evictions) == (4, 1, 0)
    assert (free.counters["writes"], free.counters["writes_early"], free.counters["loads"]) == (4, 0, 0)
    node = replay_sglang(req, SGLangReplayConfig(device_pages=12, tags="node", decode_tokens=64))
    assert node.counters["writes_early"] == 4  # their writer, forward 2, is older than the tail


@pytest.mark.parametrize(
    ("tags", "placement", "loads_early", "load_pages_early", "writes_early"),
    [
        ("free", "lifo", 0, 0, 0),
        ("free", "cold", 1, 2, 0),
        ("node", "lifo", 0, 0, 15),
        ("node", "cold", 1, 2, 15),
    ],
)
def test_tiny_workload(
    tags: str, placement: str, loads_early: int, load_pages_early: int, writes_early: int
) -> None:
    cfg = SGLangReplayConfig(device_pages=12, tags=tags, placement=placement, max_running=2, decode_tokens=64)
    r = replay_sglang(tiny_workload(), cfg)
    assert (r.steps, r.requests, r.skipped, r.evictions) == (13, 6, 0, 9)
    c = r.counters
    assert (c["loads"], c["load_pages"], c["writes"], c["write_pages"]) == (
        2,
        5,
        15,
        15,
    )  # 15 distinct blocks
    assert (c["loads_early"], c["load_pages_early"], c["writes_early"]) == (
        loads_early,
        load_pages_early,
        writes_early,
    )
    assert c["loads_unknown"] == c["writes_unknown"] == 0


def test_simulated_seconds_of_the_tiny_workload() -> None:
    cost, h2d = CostModel(), DEFAULT_STREAM_SPECS["h2d"]
    page = 512 * cost.kv_bytes_per_token
    cfg = SGLangReplayConfig(device_pages=12, placement="cold", max_running=2, decode_tokens=64)
    r = replay_sglang(tiny_workload(), cfg)
    assert (r.counters["loads"], r.counters["load_pages"], r.counters["load_pages_early"]) == (2, 5, 2)
    assert r.load_s == pytest.approx(h2d.transfer_seconds(2 * page) + h2d.transfer_seconds(3 * page))
    # the early load (2 pages) was planned while a decode forward of one 5-page request ran
    assert r.wait_saved_s == pytest.approx(cost.step_seconds(1, 5 * 512))
    assert r.stall_saved_s == pytest.approx(h2d.transfer_seconds(2 * page))  # the copy is the shorter
    stock = replay_sglang(tiny_workload(), attrs.evolve(cfg, placement="lifo"))
    assert (stock.wait_saved_s, stock.stall_saved_s, stock.load_s) == (0.0, 0.0, r.load_s)


def test_requests_larger_than_the_pool_are_skipped() -> None:
    r = replay_sglang(tiny_workload(), SGLangReplayConfig(device_pages=5, max_running=1, decode_tokens=64))
    assert (r.requests, r.skipped) == (3, 3)  # 5-block prompts plus a scratch page do not fit


@pytest.mark.parametrize(
    "kwargs", [{"device_pages": 0}, {"tags": "tail"}, {"placement": "fifo"}, {"max_running": True}]
)
def test_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        SGLangReplayConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_config_type() -> None:
    with pytest.raises(InvalidArgumentError):
        replay_sglang(tiny_workload(), {"device_pages": 4})  # type: ignore[arg-type]


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device-pages", "12", "--max-running", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| tags | placement | loads | early |")
    assert out[4] == "| node | lifo | 2 | 0 (0.0%) | 0.0% | - | 0.0% of 0.007 s | 15 | 15 (100.0%) |"
    assert out[-1].startswith("6 requests (0 too large), 265 forwards")


def test_main_json_carries_the_counters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device-pages", "12", "--max-running", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["config"]["tags"], r["config"]["placement"]) for r in rows] == [
        ("free", "lifo"),
        ("free", "cold"),
        ("node", "lifo"),
        ("node", "cold"),
    ]
    want = replay_sglang(tiny_workload(), SGLangReplayConfig(device_pages=12, tags="node", max_running=2))
    assert rows[2]["counters"] == want.counters and rows[2]["steps"] == want.steps == 265


TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "conversation_trace.jsonl"


def test_conversation_trace_free_time_tags_gain_nothing_node_tags_do() -> None:
    """Mooncake's conversation trace (its first 500 requests, 1,024 device
    pages): under LIFO a load's pages were freed for it, in the step the
    in-flight forward was enqueued, so free-time tags never beat the tail;
    the evicted nodes' own last uses almost always do. The plugin's own
    hooks (radix-node tags, launch tokens) start the node model's early
    loads early, keep ``wait_stream`` for the others (their pages were
    released in the step the load was built in: no forward launched after
    the release yet) and for every write (fenced at ``write``, flushed
    before the next launch)."""
    if not TRACE.exists():
        pytest.skip(f"no copy of the trace at {TRACE}")
    reqs = read_trace(TRACE, limit=500).requests
    free = replay_sglang(reqs, SGLangReplayConfig(device_pages=1024))
    node = replay_sglang(reqs, SGLangReplayConfig(device_pages=1024, tags="node"))
    plugin = replay_sglang(reqs, SGLangReplayConfig(device_pages=1024, tags="node", driver="plugin"))
    assert (free.counters["loads"], free.counters["loads_early"], free.counters["writes_early"]) == (74, 0, 0)
    early = ("loads", "loads_early", "load_pages", "load_pages_early")
    assert [plugin.counters[k] for k in early] == [node.counters[k] for k in early] == [74, 72, 1784, 1747]
    assert plugin.counters["loads_unknown"] == 2 and plugin.counters["writes_early"] == 0
    assert plugin.counters["writes_unknown"] == plugin.counters["writes"] == 11879
    assert plugin.audit is not None
    audit = plugin.audit
    assert (audit["loads"], audit["writes"], audit["exact"], audit["fallback"], audit["gain"]) == (
        74,
        884,
        72,
        886,
        72,
    )
    assert (node.counters["loads"], node.counters["loads_early"]) == (74, 72)
    assert (node.counters["writes"], node.counters["writes_early"]) == (11879, 11384)


def test_the_plugin_driver_agrees_with_the_account_and_reports_audit_counters() -> None:
    """The plugin's own hooks (audit mode) around the list allocator and the
    stand-in radix cache count batches, one per step with loads (2) and per
    step with write-throughs (4), and tag the page of each of the 9 evicted
    nodes with its node's last use. The tiny workload's loads take pages
    released in the step they are built in, and its writes are flushed in
    the step they are queued in: no forward was launched after those
    tokens, so every batch keeps ``wait_stream`` (unknown), where the node
    model says "tail" for the loads: neither starts early."""
    cfg = SGLangReplayConfig(device_pages=12, tags="node", max_running=2)
    account = replay_sglang(tiny_workload(), cfg)
    plugin = replay_sglang(tiny_workload(), attrs.evolve(cfg, driver="plugin"))
    assert (account.counters["loads"], account.counters["loads_early"]) == (2, 0)
    assert (plugin.counters["loads"], plugin.counters["loads_early"], plugin.counters["loads_unknown"]) == (
        2,
        0,
        2,
    )
    assert plugin.counters["writes_unknown"] == plugin.counters["writes"] == 15
    assert plugin.steps == account.steps and plugin.evictions == account.evictions == 9
    assert account.audit is None and plugin.audit is not None
    audit = plugin.audit
    assert (audit["loads"], audit["writes"], audit["exact"], audit["fallback"]) == (2, 4, 0, 6)
    assert (audit["gain"], audit["disarmed"], audit["waits_replaced"], audit["node_tagged"]) == (0, 0, 0, 9)


def test_main_audit_prints_the_plugins_counters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device-pages", "12", "--max-running", "2", "--audit"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["config"]["driver"], row["config"]["tags"]) == ("plugin", "node")
    assert (row["audit"]["loads"], row["audit"]["fallback"], row["audit"]["gain"]) == (2, 6, 0)


@pytest.mark.parametrize("kwargs", [{"tags": "free"}, {"tags": "node", "placement": "cold"}])
def test_the_plugin_driver_refuses_what_the_plugin_does_not_do(kwargs: dict[str, str]) -> None:
    with pytest.raises(InvalidArgumentError):
        SGLangReplayConfig(driver="plugin", **kwargs)  # type: ignore[arg-type]


def test_classify_and_counters() -> None:
    assert classify(frozenset(), 3) == "early"
    assert classify(frozenset({2}), 3) == "early"
    assert classify(frozenset({1, 3}), 3) == "tail"
    assert classify(None, 3) == "unknown"
    c = TransferCounters()
    c.record("load", 3, "early")
    c.record("load", 2, "tail")
    c.record("write", 1, "unknown")
    d = c.as_dict()
    assert (d["loads"], d["loads_early"], d["load_pages"], d["load_pages_early"]) == (2, 1, 5, 3)
    assert (d["writes"], d["writes_unknown"], d["writes_early"]) == (1, 1, 0)
    with pytest.raises(InvalidArgumentError):
        c.record("copy", 1, "early")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        c.record("load", -1, "early")
    assert c.as_dict() == d
