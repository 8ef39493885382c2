"""The headline: the trace op log replayed against each pool.

The op log is every pool call the replay driver makes for the first 2,000
requests of ``../shared/traces/conversation_trace.jsonl`` (policy
``exact``, default replay configuration), recorded once per session (see
:mod:`_oplog` for how, and for the call level each pool is given). Each
round builds a fresh pool and its call list (untimed, after dropping the
previous round's), then times one pass over the list: one Python call per
entry. Five rounds; the report takes their median. Before timing, one untimed pass
checks that the pool returns the recorded block ids for every allocation
and lookup and the recorded free counts (the pools do the same work).
"""

from __future__ import annotations

import gc
from typing import Any

from _oplog import OpLog, build_replay, compile_calls, run_calls, validate
from _pools import make_pool

ROUNDS = 5


def test_trace_oplog(benchmark: Any, kind: str, oplog: OpLog) -> None:
    pool = make_pool(kind, oplog.num_blocks)
    calls, checks = compile_calls(oplog, kind, pool)
    checked = validate(calls, checks)
    calls_per_pool = len(calls)
    del calls, checks, pool
    gc.collect()

    # One holder for every round: the setup drops the previous round's pool
    # and calls before building the next (otherwise both are alive while the
    # new one is built, and later rounds run on a more fragmented heap).
    holder: list[Any] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        holder.clear()
        gc.unfreeze()
        gc.collect()
        calls, _ = build_replay(oplog, kind, lambda: make_pool(kind, oplog.num_blocks))
        holder.append(calls)
        return (holder,), {}

    def replay(h: list[Any]) -> None:
        run_calls(h[0])

    scenario = "trace op log: 2,000 requests of conversation_trace.jsonl"
    benchmark.group = scenario
    benchmark.extra_info.update(
        scenario=scenario,
        kind=kind,
        section="trace",
        calls=calls_per_pool,
        results_checked=checked,
        requests=oplog.meta["requests"],
        recorded_ops=oplog.meta["counts"],
        record_wall_s=oplog.meta["record_wall_s"],
    )
    try:
        benchmark.pedantic(replay, setup=setup, rounds=ROUNDS, iterations=1)
    finally:
        holder.clear()
        gc.unfreeze()
