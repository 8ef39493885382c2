"""A release line as the rows its release changed: ``derive`` builds a line
from the one before it, inheriting every row and switch its delta does not
name; bad deltas are refused with a typed error and the base left as it
was. No vLLM needed."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from blockpool import InvalidArgumentError
from blockpool.integrations.vllm import surface as vs

BP = "vllm.v1.core.block_pool:BlockPool"
SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
MGR = "vllm.v1.core.kv_cache_manager:KVCacheManager"


def _fake_035() -> tuple[vs.Surface, vs.Surface, dict[str, vs.Name]]:
    """A "0.35" line as the delta a new release would need: a wrapped
    step's body changed, the marker ``free_blocks`` gained a parameter, one
    row removed, one added after the pool's ``take_events``, one switch
    flipped."""
    base = vs.SURFACES["0.34"]
    changed = {
        f"{SCHED}.schedule": vs.Name(
            f"{SCHED}.schedule", ("self", "throttle_prefills"), ("0123456789abcdef",), None, "wrapped"
        ),
        f"{BP}.free_blocks": vs.Name(
            f"{BP}.free_blocks",
            ("self", "ordered_blocks", "evict_first", "medium"),
            ("fedcba9876543210",),
            None,
            "marker",
        ),
    }
    added = vs.Name(f"{BP}.take_offload_events", ("self",), ("00000000000000ff",), None, "borrowed")
    line = vs.derive(
        base,
        "0.35",
        changed=tuple(changed.values()),
        added={f"{BP}.take_events": (added,)},
        removed=(f"{MGR}.get_blocks",),
        offloading_failed_jobs=False,
    )
    return base, line, {**changed, added.target: added}


def test_a_fake_035_line_is_its_base_with_only_the_delta_changed() -> None:
    base, line, delta = _fake_035()
    assert line.line == "0.35"
    targets = [n.target for n in line.rows]
    # removed: gone, and nothing else
    assert f"{MGR}.get_blocks" not in targets
    assert len(line.rows) == len(base.rows)  # one removed, one added
    # changed: the delta's rows, in the base's places (the table's order is
    # the base's but for the removed and the added row)
    for target in (f"{SCHED}.schedule", f"{BP}.free_blocks"):
        assert line.row(target) == delta[target] != base.row(target)
    assert [t for t in targets if t != f"{BP}.take_offload_events"] == [
        n.target for n in base.rows if n.target != f"{MGR}.get_blocks"
    ]
    # added: right after its anchor
    assert targets[targets.index(f"{BP}.take_events") + 1] == f"{BP}.take_offload_events"
    assert line.row(f"{BP}.take_offload_events") == delta[f"{BP}.take_offload_events"]
    # inherited: every other row is the base's own, in the base's order
    inherited = [n for n in line.rows if n.target not in delta]
    kept = [n for n in base.rows if n.target not in delta and n.target != f"{MGR}.get_blocks"]
    assert len(inherited) == len(kept) == len(base.rows) - 3
    assert all(a is b for a, b in zip(inherited, kept))
    # markers follow the rows: free_blocks is still a marker, with its new signature
    assert [n.target for n in line.markers] == [n.target for n in base.markers]
    assert line.row(f"{BP}.free_blocks") in line.markers
    # switches: the one given changed, the rest inherited
    assert (line.offloading_failed_jobs, base.offloading_failed_jobs) == (False, True)
    for field in ("event_extra_keys", "lookahead_token_ids", "access_hook_on_null", "weak_pool_ref"):
        assert getattr(line, field) == getattr(base, field), field
    assert (line.evict_first, line.v1_model_runner, line.connectors) == (
        base.evict_first,
        base.v1_model_runner,
        base.connectors,
    )
    # the base is untouched
    assert base.row(f"{MGR}.get_blocks") is not None and base.row(f"{BP}.take_offload_events") is None
    assert vs.SURFACES["0.34"] is base and "0.35" not in vs.SURFACES


def test_the_declared_later_lines_are_deltas_of_the_line_before() -> None:
    """0.33 and 0.34 share every row their release did not change with the
    line before (the same objects, not copies)."""
    for older, newer in (("0.32", "0.33"), ("0.33", "0.34")):
        a, b = vs.SURFACES[older], vs.SURFACES[newer]
        shared = [n for n in b.rows if any(n is m for m in a.rows)]
        differ = [n for n in b.rows if a.row(n.target) != n]
        assert len(shared) + len(differ) == len(b.rows), newer
        assert len(differ) < len(b.rows) // 4, (newer, len(differ))  # a delta, not a copy


# Every switch of a line, off.
OFF: dict[str, Any] = {
    f.name: None if f.name in ("event_extra_keys", "lookahead_token_ids") else False
    for f in attrs.fields(vs.Surface)
    if f.init and f.name not in ("line", "rows", "connectors")
}


def _base() -> vs.Surface:
    return vs.Surface(
        "9.0", (vs.Name("m:f", ("x",), use="marker"), vs.Name("m:g"), vs.Name("m:h", ("y",))), **OFF
    )


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        ({"changed": (vs.Name("m:nope"),)}, "changed row m:nope is not declared in 9.0"),
        ({"changed": (vs.Name("m:g"),)}, "changed row m:g is as 9.0 declares it"),
        ({"added": {"m:g": (vs.Name("m:h"),)}}, "added row m:h is already declared"),
        ({"added": {"m:nope": (vs.Name("m:k"),)}}, "rows added after m:nope, which is not in the table"),
        ({"removed": ("m:nope",)}, "removed rows not in the table: m:nope"),
        (
            {"changed": (vs.Name("m:g", ("z",)),), "removed": ("m:g",)},
            "rows both changed and removed: m:g",
        ),
        ({"evict_frist": True}, "not switches of a surface: evict_frist"),
        ({"evict_first": False}, "switches as 9.0 sets them: evict_first"),
        (
            {"changed": (vs.Name("m:g", ("z",)), vs.Name("m:g", ("w",)))},
            "rows changed twice: m:g",
        ),
        ({"rows": ()}, "not switches of a surface: rows"),
        ({"removed": ("m:f",)}, "no marker row"),
        ({"changed": (vs.Name("m:f", ("x",)),)}, "no marker row"),
    ],
)
def test_a_bad_delta_is_refused_and_the_base_is_unchanged(delta: dict[str, Any], message: str) -> None:
    base = _base()
    rows = base.rows
    with pytest.raises(InvalidArgumentError, match=message):
        vs.derive(base, "9.1", **delta)
    assert base.rows is rows and base == _base()


def test_a_surface_refuses_a_target_declared_twice_and_a_table_without_a_marker() -> None:
    with pytest.raises(InvalidArgumentError, match="rows declared twice: m:g"):
        vs.Surface("9.0", (vs.Name("m:f", use="marker"), vs.Name("m:g"), vs.Name("m:g", ("x",))), **OFF)
    with pytest.raises(InvalidArgumentError, match="no marker row"):
        vs.Surface("9.0", (vs.Name("m:g"),), **OFF)


def test_markers_and_names_split_the_rows_in_table_order() -> None:
    line = vs.derive(
        _base(),
        "9.1",
        changed=(vs.Name("m:h", ("y",), use="marker"),),
        added={"m:f": (vs.Name("m:e"),)},
    )
    assert [n.target for n in line.rows] == ["m:f", "m:e", "m:g", "m:h"]
    assert [n.target for n in line.markers] == ["m:f", "m:h"]
    assert [n.target for n in line.names] == ["m:e", "m:g"]
    assert [n.target for n in line.all_names()] == ["m:f", "m:h", "m:e", "m:g"]
    assert line.declares("m", "e") and not line.declares("m", "nope")
    assert line.row("m:e") == vs.Name("m:e") and line.row("m:nope") is None
