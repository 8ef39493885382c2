"""The race harness (``blockpool.checking.harness``) and the pytest plugin
(``blockpool.checking.pytest_plugin``), the latter run through ``pytester``.

Inner runs load the plugin with ``-p blockpool.checking.pytest_plugin`` (the entry
point may not be installed); two tests install the entry point for a
subprocess run to check autoloading and ``-p no:blockpool``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import blockpool
from blockpool.checking.harness import DEFAULT_STREAMS, RaceHarness
from blockpool.checking.race_oracle import RaceViolation, UnrecordedTokenError
from blockpool.core.errors import ForeignBlockError, UnknownStreamError
from blockpool.core.hazards import AccessKind, Token

pytest_plugins = ["pytester"]

R, W = AccessKind.READ, AccessKind.WRITE
# Keep inner runs fast: the hypothesis and benchmark plugins, where installed,
# cost a second per session and play no part here.
QUIET = ("-p", "no:hypothesispytest", "-p", "no:benchmark")
# Load the plugin by module name; block the ``blockpool`` entry point in case
# the package is installed with it (one module cannot register twice).
PLUGIN = ("-p", "no:blockpool", "-p", "blockpool.checking.pytest_plugin", *QUIET)
REPO = pathlib.Path(blockpool.__file__).resolve().parent.parent


@pytest.fixture
def h() -> RaceHarness:
    return RaceHarness(num_gpu_blocks=8)


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


# -- the harness ------------------------------------------------------------------


def test_harness_default_streams_are_compute_h2d_d2h_and_rdma(h: RaceHarness) -> None:
    assert h.pool.streams == dict(DEFAULT_STREAMS) == h.oracle.streams


def test_harness_flags_a_load_that_drops_its_fence(h: RaceHarness) -> None:
    blocks, fence = h.allocate_for(1, "compute")
    e1 = h.step(reads=blocks, waits=fence)
    h.free(blocks, e1)
    again, _ = h.allocate_for(1, "h2d")
    load = h.load(again, "h2d", honour_fence=False)
    assert h.violations == [RaceViolation(ids(again)[0], "WAR", e1, R, "forward", load, W, "load")]


def test_harness_passes_a_load_that_honours_its_fence(h: RaceHarness) -> None:
    blocks, fence = h.allocate_for(1, "compute")
    e1 = h.step(reads=blocks, waits=fence)
    h.free(blocks, e1)
    again, fence = h.allocate_for(1, "h2d")
    h.load(again, "h2d", waits=fence)
    assert h.violations == []


def test_harness_flags_compute_reading_a_host_load_before_it_ended(h: RaceHarness) -> None:
    blocks, _ = h.allocate_for(1, "rdma")
    load = h.load(blocks, "rdma")
    e1 = h.step(reads=blocks)  # the fence h.fence_for(blocks, "compute", READ) was dropped
    assert h.violations == [RaceViolation(ids(blocks)[0], "RAW", load, W, "load", e1, R, "forward")]


def test_harness_passes_compute_reading_a_host_load_after_it_completed(h: RaceHarness) -> None:
    blocks, _ = h.allocate_for(1, "rdma")
    h.complete(h.load(blocks, "rdma"))
    h.step(reads=blocks, waits=h.fence_for(blocks, "compute", R))
    assert h.violations == []


def test_harness_flags_a_store_that_drops_its_fence(h: RaceHarness) -> None:
    blocks, fence = h.allocate_for(1, "compute")
    e1 = h.step(writes=blocks, waits=fence)
    store = h.store(blocks, "d2h", honour_fence=False)
    assert h.violations == [RaceViolation(ids(blocks)[0], "RAW", e1, W, "forward", store, R, "store")]


def test_harness_passes_a_copy_that_honours_its_fence(h: RaceHarness) -> None:
    src, fence = h.allocate_for(1, "h2d")
    h.load(src, "h2d", waits=fence)
    dst, _ = h.allocate_for(1, "compute")
    h.copy([(src[0], dst[0])], "compute")
    assert h.violations == [] and h.last_fence.tokens == (Token("h2d", 1),)


def test_harness_step_on_unknown_stream_raises_and_changes_nothing(h: RaceHarness) -> None:
    blocks, _ = h.allocate_for(1, "compute")
    before = h.pool.snapshot()
    with pytest.raises(UnknownStreamError):
        h.step(reads=blocks, stream="nvme")
    assert h.pool.snapshot() == before and h.oracle.num_accesses == 0


def test_harness_step_with_a_foreign_block_raises_and_changes_nothing(h: RaceHarness) -> None:
    other = RaceHarness(num_gpu_blocks=8)
    foreign, _ = other.allocate_for(1, "compute")
    before = h.pool.snapshot()
    with pytest.raises(ForeignBlockError):
        h.step(reads=foreign)
    assert h.pool.snapshot() == before


def test_harness_step_waiting_on_an_unrecorded_token_raises_and_changes_nothing(h: RaceHarness) -> None:
    before = h.pool.snapshot()
    with pytest.raises(UnrecordedTokenError):
        h.step(waits=[Token("h2d", 1)])
    assert h.pool.snapshot() == before


def test_assert_no_races_lists_a_race_on_several_blocks_once_naming_the_blocks(h: RaceHarness) -> None:
    blocks, _ = h.allocate_for(2, "h2d")
    h.load(blocks, "h2d")
    h.step(reads=blocks)
    with pytest.raises(AssertionError) as info:
        h.assert_no_races()
    lines = str(info.value).splitlines()
    assert lines[0] == "blockpool race oracle: 2 race(s)"
    assert lines[1::3] == [
        "  RAW race on blocks 1-2: forward (read) by compute:1 is not ordered after load (write) by h2d:1"
    ]


def test_assert_no_races_lists_each_access_pair_apart(h: RaceHarness) -> None:
    blocks, _ = h.allocate_for(2, "h2d")
    h.load(blocks[:1], "h2d")
    h.load(blocks[1:], "h2d")
    h.step(reads=blocks)
    with pytest.raises(AssertionError) as info:
        h.assert_no_races()
    assert str(info.value).splitlines()[1::3] == [f"  {v}" for v in h.violations]  # h2d:1 and h2d:2


def test_a_groups_blocks_are_named_as_runs() -> None:
    h = RaceHarness(num_gpu_blocks=16, record_sites=False)
    e1, load = Token("compute", 1), Token("h2d", 1)
    races = [RaceViolation(b, "WAR", e1, R, "forward", load, W, "load") for b in (9, 1, 2, 4, 3, 7)]
    assert h.explain(races).splitlines() == [
        "blockpool race oracle: 6 race(s)",
        "  WAR race on blocks 1-4, 7, 9: load (write) by h2d:1 is not ordered after forward (read) by compute:1",
    ]


def test_expect_races_silences_the_automatic_check(h: RaceHarness) -> None:
    blocks, _ = h.allocate_for(1, "h2d")
    h.load(blocks, "h2d")
    h.step(reads=blocks)
    h.expect_races()
    h.check_new_races()
    assert len(h.violations) == 1


def test_automatic_check_reports_each_violation_once(h: RaceHarness) -> None:
    blocks, _ = h.allocate_for(1, "h2d")
    h.load(blocks, "h2d")
    h.step(reads=blocks)
    with pytest.raises(AssertionError):
        h.check_new_races()
    h.check_new_races()  # nothing new


def test_importing_the_plugin_loads_neither_the_oracle_nor_heavy_modules() -> None:
    code = (
        "import sys, blockpool.checking.pytest_plugin\n"
        "print(sorted(m for m in ('blockpool.checking.race_oracle', 'blockpool.checking.harness', "
        "'torch', 'matplotlib', 'tqdm', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- the plugin, through pytester ---------------------------------------------------

DROPS_FENCE = """
def test_load_reuses_freed_blocks(blockpool_harness):
    h = blockpool_harness
    blocks, fence = h.allocate_for(1, "compute")
    e1 = h.step(reads=blocks, waits=fence)
    h.free(blocks, e1)
    again, fence = h.allocate_for(1, "h2d")
    h.step(writes=again, stream="h2d", what="load")   # forgot waits=fence
"""

HONOURS_FENCE = DROPS_FENCE.replace('what="load")', 'what="load", waits=fence)')


def test_plugin_fails_a_test_that_drops_a_fence_naming_the_race(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(DROPS_FENCE)
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*WAR race on block 1: load (write) by h2d:1 is not ordered after forward (read) by compute:1*"]
    )


def test_plugin_passes_a_test_that_honours_the_fence(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(HONOURS_FENCE)
    pytester.runpytest(*PLUGIN).assert_outcomes(passed=1)


def test_plugin_passes_a_racy_test_that_expects_races(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(DROPS_FENCE + "    h.expect_races()\n")
    pytester.runpytest(*PLUGIN).assert_outcomes(passed=1)


def test_plugin_passes_a_racy_test_marked_blockpool_expect_races(pytester: pytest.Pytester) -> None:
    marked = "import pytest\n" + DROPS_FENCE.replace(
        "def test_", "@pytest.mark.blockpool_expect_races\ndef test_"
    )
    pytester.makepyfile(marked)
    pytester.runpytest(*PLUGIN, "--strict-markers").assert_outcomes(passed=1)


def test_plugin_adds_races_to_the_report_of_a_test_that_failed_otherwise(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(DROPS_FENCE + "    assert False, 'unrelated'\n")
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*blockpool races*", "WAR race on block 1:*"])


def test_plugin_checks_a_harness_reached_through_another_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.fixture\n"
        "def harness(blockpool_harness):\n"
        "    return blockpool_harness\n"
        + DROPS_FENCE.replace("(blockpool_harness)", "(harness)").replace(
            "h = blockpool_harness", "h = harness"
        )
    )
    pytester.runpytest(*PLUGIN).assert_outcomes(failed=1)


def test_plugin_streams_fixture_can_be_overridden(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "import pytest\n"
        "from blockpool import StreamKind\n"
        "@pytest.fixture\n"
        "def blockpool_streams():\n"
        "    return {'compute': StreamKind.DEVICE, 'nic': StreamKind.HOST}\n"
    )
    pytester.makepyfile(
        "def test_streams(blockpool_pool, blockpool_oracle):\n"
        "    assert sorted(blockpool_pool.streams) == sorted(blockpool_oracle.streams) == ['compute', 'nic']\n"
    )
    pytester.runpytest(*PLUGIN).assert_outcomes(passed=1)


def _install_entry_point(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the plugin as the owner's ``pytest11`` entry point ``blockpool``
    does, for a subprocess run (a dist-info folder on its ``PYTHONPATH``)."""
    dist = pytester.mkdir("site").joinpath("blockpool_plugin_probe-0.0.dist-info")
    dist.mkdir()
    dist.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: blockpool-plugin-probe\nVersion: 0.0\n"
    )
    dist.joinpath("entry_points.txt").write_text("[pytest11]\nblockpool = blockpool.checking.pytest_plugin\n")
    monkeypatch.setenv("PYTHONPATH", f"{dist.parent}:{REPO}")
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)


def test_plugin_loads_from_its_entry_point(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_entry_point(pytester, monkeypatch)
    pytester.makepyfile(DROPS_FENCE)
    result = pytester.runpytest_subprocess(*QUIET)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*WAR race on block 1*"])


def test_plugin_is_switched_off_with_p_no_blockpool(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_entry_point(pytester, monkeypatch)
    pytester.makepyfile("def test_x(blockpool_harness):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:blockpool", *QUIET)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'blockpool_harness' not found*"])


def test_plugin_default_pool_has_64_blocks_and_the_default_streams(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "from blockpool import StreamKind\n"
        "def test_pool(blockpool_pool):\n"
        "    assert blockpool_pool.num_gpu_blocks == 64\n"
        "    assert blockpool_pool.streams == {'compute': StreamKind.DEVICE, 'h2d': StreamKind.DEVICE,\n"
        "                                      'd2h': StreamKind.DEVICE, 'rdma': StreamKind.HOST}\n"
    )
    pytester.runpytest(*PLUGIN).assert_outcomes(passed=1)


def test_harness_fixture_drives_the_pool_and_oracle_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "def test_same(blockpool_harness, blockpool_pool, blockpool_oracle):\n"
        "    assert blockpool_harness.pool is blockpool_pool\n"
        "    assert blockpool_harness.oracle is blockpool_oracle\n"
    )
    pytester.runpytest(*PLUGIN).assert_outcomes(passed=1)


def test_plugin_teardown_reports_races_found_after_the_test_body(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.fixture\n"
        "def racy_teardown(blockpool_harness):\n"
        "    yield\n"
        "    h = blockpool_harness\n"
        "    blocks, _ = h.allocate_for(1, 'h2d')\n"
        "    h.load(blocks, 'h2d')\n"
        "    h.step(reads=blocks)\n"
        "def test_x(racy_teardown):\n"
        "    pass\n"
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*RAW race on block 1*"])


# -- races that point at the line ------------------------------------------------


def test_a_race_names_the_file_and_line_of_both_accesses_and_the_fence_that_fixes_it() -> None:
    h = RaceHarness(num_gpu_blocks=8)
    here = pathlib.Path(__file__).resolve()
    first = sys._getframe().f_lineno + 1  # the next line
    blocks, fence = h.allocate_for(1, "compute")
    e1 = h.step(writes=blocks, waits=fence)  # first + 1
    h.free(blocks, e1)  # first + 2
    again, fence = h.allocate_for(1, "h2d")  # first + 3: the fence that fixes it
    h.load(again, "h2d")  # first + 4: forgot waits=fence
    with pytest.raises(AssertionError) as info:
        h.assert_no_races()
    rel = (
        str(pathlib.Path(here).relative_to(pathlib.Path.cwd()))
        if here.is_relative_to(pathlib.Path.cwd())
        else str(here)
    )
    lines = str(info.value).splitlines()
    assert (
        lines[1]
        == "  WAW race on block 1: load (write) by h2d:1 is not ordered after forward (write) by compute:1"
    )
    assert lines[2] == f"    load by h2d:1 at {rel}:{first + 4}; forward by compute:1 at {rel}:{first + 1}"
    assert lines[3] == f"    fix: pass `waits=fence` from `allocate_for` at {rel}:{first + 3}"
    assert len(lines) == 4  # the read by compute:1 recorded at the free is the same token's: one race


def test_a_transfer_that_dropped_its_own_fence_is_told_to_honour_it() -> None:
    h = RaceHarness(num_gpu_blocks=8)
    (b,) = h.pool.get_new_blocks(1)
    e1 = h.step(reads=[b])
    line = sys._getframe().f_lineno + 1
    h.load([b], "rdma", honour_fence=False)
    (v,) = h.violations
    assert h.fix_for(v).startswith("honour the fence of `load` at ") and h.fix_for(v).endswith(
        f":{line} (drop honour_fence=False)"
    )
    assert e1 in h.last_fence


def test_sites_are_off_on_request_and_the_message_is_the_plain_one() -> None:
    h = RaceHarness(num_gpu_blocks=8, record_sites=False)
    blocks, _ = h.allocate_for(1, "h2d")
    h.load(blocks, "h2d")
    h.step(reads=blocks)
    assert h.site_of(h.violations[0].token, 1, h.violations[0].kind) is None
    assert h.explain(h.violations).splitlines() == [
        "blockpool race oracle: 1 race(s)",
        f"  {h.violations[0]}",
    ]


def test_plugin_shows_the_tests_own_lines_for_a_race(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(DROPS_FENCE)  # line 4: the step's read; 5: the free; 6: the fence; 7: the load
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            (
                "*load by h2d:1 at test_plugin_shows_the_tests_own_lines_for_a_race.py:7; "
                "forward by compute:1 at test_plugin_shows_the_tests_own_lines_for_a_race.py:4*"
            ),
            "*fix: pass `waits=fence` from `allocate_for` at test_plugin_shows_the_tests_own_lines_for_a_race.py:6*",
        ]
    )


def test_a_race_on_a_steps_read_names_the_steps_line_not_the_frees() -> None:
    h = RaceHarness(num_gpu_blocks=8)
    blocks, fence = h.allocate_for(1, "compute")
    step_line = sys._getframe().f_lineno + 1
    e1 = h.step(reads=blocks, waits=fence)
    h.free(blocks, e1)  # reports the step's block-table read; not where it was made
    again, _ = h.allocate_for(1, "h2d")
    h.load(again, "h2d")  # forgot waits=fence
    (v,) = h.violations
    assert (v.prior_token, v.prior_kind) == (e1, R)
    site = h.site_of(e1, v.block_id, R)
    assert site is not None and site.endswith(f":{step_line}")


def test_a_block_table_read_the_step_did_not_make_itself_names_the_steps_line() -> None:
    h = RaceHarness(num_gpu_blocks=8)
    (a, b), _ = h.allocate_for(2, "compute")
    step_line = sys._getframe().f_lineno + 1
    e1 = h.step(reads=[a])
    h.free([a, b], e1)  # the step's table held b too: its read of b is the step's
    again, _ = h.allocate_for(2, "h2d")
    h.load(again, "h2d")
    assert {h.site_of(e1, v.block_id, R) for v in h.violations} == {h.site_of(e1, a.block_id, R)}
    assert h.site_of(e1, b.block_id, R).endswith(f":{step_line}")  # type: ignore[union-attr]


def test_a_free_of_a_token_the_harness_did_not_issue_names_the_frees_line() -> None:
    h = RaceHarness(num_gpu_blocks=8)
    blocks, _ = h.allocate_for(1, "compute")
    e1 = h.pool.issue("compute")  # the step issued by the code under test, not the harness
    h.oracle.record(e1)
    free_line = sys._getframe().f_lineno + 1
    h.free(blocks, e1)
    again, _ = h.allocate_for(1, "h2d")
    h.load(again, "h2d")
    (v,) = h.violations
    assert h.site_of(e1, v.block_id, R).endswith(f":{free_line}")  # type: ignore[union-attr]


DROPS_FENCE_ON_FOUR = DROPS_FENCE.replace("allocate_for(1,", "allocate_for(4,")


def test_plugin_names_a_race_on_several_blocks_once(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(DROPS_FENCE_ON_FOUR)
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*blockpool race oracle: 4 race(s)",
            "*WAR race on blocks 1-4: load (write) by h2d:1 is not ordered after forward (read) by compute:1",
            (
                "*load by h2d:1 at test_plugin_names_a_race_on_several_blocks_once.py:7; "
                "forward by compute:1 at test_plugin_names_a_race_on_several_blocks_once.py:4"
            ),
        ]
    )
    assert "race on block " not in result.stdout.str()
