"""The differential run (``benchmarks/differential.py``) in small: a few
hundred random sequences with failures of every writer kind, every fence
counted against the independent model; and a control that the counts do
move when the pool hands out a wrong fence."""

from __future__ import annotations

from tests import differential
from tests.test_stateful import _DroppingPool, _PaddingPool


def test_differential_run_counts_no_missed_redundant_or_unsafe_fence() -> None:
    out = differential.run(500)
    assert out["sequences"] >= 500 and out["fences"] > 1000 and out["handed_out"] > 0
    assert {k: out[k] for k in differential.FIGURES} == dict.fromkeys(differential.FIGURES, 0), out
    reports = out["reports"]
    assert isinstance(reports, dict)
    # failures of every writer kind occurred, some of them late
    for kind in ("tag-write", "free-write", "load", "copy", "store", "step"):
        assert any(k.startswith(f"fail {kind}") for k in reports), (kind, reports)
    assert any(k.endswith("(late)") for k in reports), reports


def _with_pool(pool_cls: type) -> dict[str, int]:
    """The counts of a short run on ``pool_cls``, up to the stateful
    invariant's failure if a wrong fence made the pool and the reference
    model part ways."""
    machine = differential.DifferentialMachine
    saved = machine.pool_cls
    machine.pool_cls = pool_cls
    try:
        differential.run(60)
    except AssertionError:
        pass
    finally:
        machine.pool_cls = saved
    return dict(differential.COUNTS)


def test_counts_catch_a_dropped_fence_token() -> None:
    out = _with_pool(_DroppingPool)
    assert out["missed"] and out["unsafe_accesses"]


def test_counts_catch_a_padded_fence() -> None:
    out = _with_pool(_PaddingPool)
    assert out["redundant"] and not out["missed"]


def test_the_run_draws_no_constants_from_the_checkouts_source() -> None:
    """Hypothesis draws constants from the source of the local modules a
    process imported: the run turns that off, so its sequences do not
    depend on what the process imported (the documented figures)."""
    from hypothesis.internal.conjecture import providers

    saved = providers._get_local_constants
    assert saved().integers  # this process imported local modules with int literals
    with differential._no_local_constants():
        assert not providers._get_local_constants().integers
    assert providers._get_local_constants is saved
