"""Trace replay: readers, a synthetic workload, a vLLM-like scheduler on a
simulated machine, wait policies, the race oracle's verdict, and the report.

Import the parts you need (this package imports none of them eagerly, and
nothing here imports torch, vLLM, tqdm or matplotlib)::

    from blockpool.replay.traces import read_trace
    from blockpool.replay.run import replay
    report = replay(read_trace("trace.jsonl", limit=200), "exact,blind")

Modules: :mod:`~blockpool.replay.traces` (Mooncake JSONL, Azure CSV),
:mod:`~blockpool.replay.synthetic` (the default workload),
:mod:`~blockpool.replay.keys` (prefix-chain block keys),
:mod:`~blockpool.replay.config`, :mod:`~blockpool.replay.driver` and
:mod:`~blockpool.replay.steps` (the scheduler),
:mod:`~blockpool.replay.machine` (pool + simulator + oracle plumbing),
:mod:`~blockpool.replay.policies`, :mod:`~blockpool.replay.state`,
:mod:`~blockpool.replay.run` (several policies, in parallel),
:mod:`~blockpool.replay.report`, :mod:`~blockpool.replay.plot`,
:mod:`~blockpool.replay.eventlog`, :mod:`~blockpool.replay.fetch` (the public
traces, downloaded and verified).
"""
