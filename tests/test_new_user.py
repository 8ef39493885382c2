"""Tried as a new user would: one test per expected behaviour.

The CLI's behaviour (outputs, progress, interrupts, the table) is pinned in
``tests/test_cli.py``; packaging in ``tests/test_packaging.py``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from blockpool import AccessKind, BlockRemoved, BlockStored, HazardAwareBlockPool, InvalidArgumentError
from tests.conftest import make_pool

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    return README.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


# The README, read first ----------------------------------------------------


def test_readme_trace_example_creates_the_folders_it_writes_into() -> None:
    cmd = next(x for x in README.splitlines() if x.startswith("mkdir -p ") and "blockpool replay" in x)
    made: set[str] = set()
    for part in cmd.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["mkdir", "-p"]:
            made.update(w.rstrip("/") for w in words[2:])
        else:
            outs = [words[i + 1] for i, w in enumerate(words) if w in ("--json", "--plot", "--events")]
            assert outs and all(str(Path(o).parent) in made for o in outs), cmd


def test_readme_states_how_long_the_replay_the_trace_example_and_the_tests_take() -> None:
    setup = _section("Set-up (two commands)")
    assert "about 40 s on 2 busy cores" in setup
    assert "a few minutes" in setup and "about 5 minutes on 2 cores" in setup


def test_readme_explains_every_column_of_the_replay_table() -> None:
    setup = _section("Set-up (two commands)")
    table = setup.split("<!-- figures:readme-table -->", 1)[1].split("<!-- /figures:readme-table -->", 1)[0]
    header = table.splitlines()[2]  # the fence's first line, then the header
    columns = re.split(r"\s{2,}", header.strip())
    assert columns[:3] == ["policy", "races", "loads"]
    prose = setup.split("<!-- /figures:readme-table -->", 1)[1]
    for col in [*columns[1:], "wall s", "sim", "count"]:
        assert f"`{col}`" in prose, col
    for policy in ("exact", "step-event", "device-sync", "blind"):
        assert f"`{policy}`" in prose, policy


def test_readme_lists_why_tests_are_skipped() -> None:
    skipped = _section("Set-up (two commands)").split("Skipped tests, and why:", 1)[1].split("\n\n", 1)[0]
    mods = set()
    for f in (ROOT / "tests").glob("test_*.py"):
        mods.update(
            m.split(".")[0] for m in re.findall(r'importorskip\("([\w.]+)"', f.read_text(encoding="utf-8"))
        )
    optional = mods - {"torch", "matplotlib", "setuptools"}  # installed by the README's test set-up
    assert optional >= {"vllm", "ray", "msgspec"}
    for mod in optional:
        assert {"vllm": "vLLM", "ray": "`ray`"}.get(mod, f"`{mod}`") in skipped, mod
    assert "CUDA" in skipped and "BLOCKPOOL_DOC_FIGURES=1" in skipped


def test_readme_says_where_to_run_the_usage_example_and_it_runs_there() -> None:
    usage = _section("Usage")
    assert "from the checkout's root" in usage and "(unknown location)" in usage
    code = (
        "import doctest, sys; r = doctest.testfile('README.md', module_relative=False); "
        "sys.exit(1 if r.failed or not r.attempted else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_worker_doc_example_runs_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; import doctest; "
        "r = doctest.testfile('docs/worker.md', module_relative=False); "
        "sys.exit(1 if r.failed or not r.attempted else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def _shell_blocks(doc: str) -> list[str]:
    """The bodies of the fenced blocks of ``doc`` that hold commands (no
    info string, or ``bash``, ``sh``, ``console``), fences paired line by
    line as Markdown pairs them."""
    blocks: list[str] = []
    body: list[str] | None = None
    shell = False
    for line in doc.splitlines():
        if line.startswith("```"):
            if body is None:
                body, shell = [], line[3:].strip() in ("", "bash", "sh", "console")
            else:
                if shell:
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def test_readme_and_both_plugin_pages_install_from_a_checkout() -> None:
    plugin = (ROOT / "docs" / "vllm-plugin.md").read_text(encoding="utf-8")
    sglang = (ROOT / "docs" / "sglang.md").read_text(encoding="utf-8")
    for doc in (README, plugin, sglang):
        assert "pip wheel . --no-deps -w dist" in doc and "pip install /path/to/this/checkout" in doc
        # A command to type installs from the checkout; an index is named in prose only.
        commands = "\n".join(_shell_blocks(doc))
        assert "pip install /path/to/this/checkout" in commands
        assert not re.search(r"pip install (?:-\S+ )*blockpool\b", commands), doc
    assert "0.32.x, 0.33.x" in README and "0.34.x" in README


# Bad prefix-cache arguments are typed errors that change nothing ----------


def test_cache_full_blocks_with_more_cached_than_full_is_an_error_and_changes_nothing() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(4)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="num_cached_blocks <= num_full_blocks"):
        pool.cache_full_blocks(blocks, ["k0", "k1", "k2", "k3"], num_cached_blocks=3, num_full_blocks=1)
    assert pool.snapshot() == before


def test_cache_full_blocks_with_equal_counts_is_a_no_op() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(2)
    before = pool.snapshot()
    pool.cache_full_blocks(blocks, ["k0", "k1"], 1, 1, block_size=16)
    assert pool.snapshot() == before


def test_partial_key_past_the_end_of_a_full_block_is_an_error_and_changes_nothing() -> None:
    pool = make_pool()
    (p,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([p], ["full@16"], 0, 1, block_size=16)
    pool.take_events()
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="cannot cover 99 tokens"):
        pool.cache_partial_block(p, "part@99", num_tokens=99)
    assert pool.snapshot() == before
    assert pool.get_cached_block("part@99") is None
    assert pool.get_cached_block("full@16") is p


def test_partial_key_inside_a_full_block_is_still_an_extra_key() -> None:
    pool = make_pool()
    (p,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([p], ["full@16"], 0, 1, block_size=16)
    assert pool.cache_partial_block(p, "part@8", 8) == "part@8"
    assert pool.get_cached_block("part@8") is p and pool.get_cached_block("full@16") is p


def test_a_longer_partial_key_still_promotes_a_partial_one() -> None:
    pool = make_pool()
    (p,) = pool.get_new_blocks(1)
    pool.cache_partial_block(p, "part@8", 8)
    assert pool.cache_partial_block(p, "part@12", 12) == "part@12"
    assert pool.get_cached_block("part@8") is None and pool.get_cached_block("part@12") is p


@pytest.mark.parametrize("bad", [0, -1, True, 8.0, "8"])
def test_partial_key_with_a_bad_token_count_is_an_error_and_changes_nothing(bad: object) -> None:
    pool = make_pool()
    (p,) = pool.get_new_blocks(1)
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        pool.cache_partial_block(p, "k", bad)  # type: ignore[arg-type]
    assert pool.snapshot() == before


# A key retired by promotion stays retired for its block --------------------


def _promoted(pool: HazardAwareBlockPool):  # type: ignore[no-untyped-def]
    (p,) = pool.get_new_blocks(1)
    pool.cache_partial_block(p, "part@8", 8)
    pool.cache_full_blocks([p], ["full@16"], 0, 1, block_size=16)
    assert pool.take_events() == [
        BlockStored(("part@8",), None, 8, (p.block_id,)),
        BlockRemoved(("part@8",)),
        BlockStored(("full@16",), None, 16, (p.block_id,)),
    ]
    return p


def test_partial_key_retired_by_promotion_is_not_republished() -> None:
    pool = make_pool()
    p = _promoted(pool)
    for _ in range(3):  # the engine's per-step repeat
        assert pool.cache_partial_block(p, "part@8", 8) is None
    assert pool.take_events() == []
    assert pool.get_cached_block("part@8") is None
    assert pool.get_cached_block("full@16") is p
    pool.check()


def test_partial_key_retired_by_a_longer_partial_key_is_not_republished() -> None:
    pool = make_pool()
    (p,) = pool.get_new_blocks(1)
    pool.cache_partial_block(p, "part@8", 8)
    pool.cache_partial_block(p, "part@12", 12)
    pool.take_events()
    assert pool.cache_partial_block(p, "part@8", 8) is None
    assert pool.take_events() == [] and pool.get_cached_block("part@8") is None


def test_retired_key_may_be_published_again_once_the_block_is_reused() -> None:
    pool = make_pool(2)  # one usable block: it comes back
    p = _promoted(pool)
    pool.free_blocks([p])
    (q,) = pool.get_new_blocks(1)
    assert q is p
    pool.take_events()
    assert pool.cache_partial_block(q, "part@8", 8) == "part@8"
    assert pool.take_events() == [BlockStored(("part@8",), None, 8, (q.block_id,))]


def test_retired_key_may_be_published_again_when_the_content_is_replaced() -> None:
    pool = make_pool()
    p = _promoted(pool)
    assert pool.cache_partial_block(p, "part@8", 8, replace_existing_hashes=True) == "part@8"
    assert pool.get_cached_block("part@8") is p and pool.get_cached_block("full@16") is None


def test_retired_keys_move_with_move_block_hashes() -> None:
    pool = make_pool()
    p = _promoted(pool)
    (dst,) = pool.get_new_blocks(1)
    pool.move_block_hashes(p, dst)
    assert pool.cache_partial_block(dst, "part@8", 8) is None
    assert pool.cache_partial_block(p, "part@8", 8) == "part@8"  # src's content now differs
    pool.check()


# A removal event only when the last block holding the key goes ----------


def _two_blocks_under_h3(pool: HazardAwareBlockPool):  # type: ignore[no-untyped-def]
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], ["H3"], 0, 1, block_size=16)
    pool.cache_full_blocks([b], ["H3"], 0, 1, block_size=16)
    pool.take_events()
    return a, b


def test_evicting_one_of_two_blocks_under_a_key_sends_no_removal() -> None:
    pool = make_pool()
    a, b = _two_blocks_under_h3(pool)
    pool.evict_blocks([a.block_id])
    assert pool.take_events() == []
    assert pool.get_cached_block("H3") is b
    pool.evict_blocks([b.block_id])
    assert pool.take_events() == [BlockRemoved(("H3",))]
    assert pool.get_cached_block("H3") is None


def test_reusing_one_of_two_blocks_under_a_key_sends_no_removal() -> None:
    pool = make_pool(3)  # two usable blocks
    a, b = _two_blocks_under_h3(pool)
    pool.free_blocks([a])
    (again,) = pool.get_new_blocks(1)
    assert again is a
    assert pool.take_events() == []
    assert pool.get_cached_block("H3") is b
    pool.free_blocks([b])
    pool.get_new_blocks(1)
    assert pool.take_events() == [BlockRemoved(("H3",))]


# A free without a token is safe by default --------------------------------


def test_free_without_token_tags_the_last_compute_step() -> None:
    pool = make_pool()
    b, _ = pool.allocate_for(2, "compute")
    e1 = pool.issue("compute")
    pool.free_blocks(b)
    again, fence = pool.allocate_for(2, "h2d")
    assert sorted(x.block_id for x in again) == sorted(x.block_id for x in b)
    assert list(fence) == [e1]


def test_free_with_token_none_opts_out() -> None:
    pool = make_pool()
    b, _ = pool.allocate_for(2, "compute")
    pool.issue("compute")
    pool.free_blocks(b, token=None)
    again, fence = pool.allocate_for(2, "h2d")
    assert sorted(x.block_id for x in again) == sorted(x.block_id for x in b) and not fence


def test_free_without_token_before_any_step_or_after_it_ended_records_nothing() -> None:
    pool = make_pool()
    b, _ = pool.allocate_for(2, "compute")
    pool.free_blocks(b)  # no step issued yet
    b, fence = pool.allocate_for(2, "h2d")
    assert not fence
    e1 = pool.issue("compute")
    pool.complete(e1)
    pool.free_blocks(b)
    _, fence = pool.allocate_for(2, "h2d")
    assert not fence


def test_free_without_token_equals_the_explicit_last_token() -> None:
    def run(explicit: bool):  # type: ignore[no-untyped-def]
        pool = make_pool()
        b, _ = pool.allocate_for(3, "compute")
        pool.issue("compute")
        pool.issue("compute")
        if explicit:
            pool.free_blocks(b, token=pool.last_token("compute"))
        else:
            pool.free_blocks(b)
        return pool.snapshot()

    assert run(True) == run(False)


def test_free_without_token_on_a_pool_without_hazards_or_compute_stream_records_nothing() -> None:
    from blockpool import StreamKind

    plain = make_pool(track_hazards=False)
    b, _ = plain.allocate_for(2, "compute")
    plain.issue("compute")
    plain.free_blocks(b)
    assert all(x.readers is None for x in b)
    other = make_pool(streams={"gpu": StreamKind.DEVICE})
    b, _ = other.allocate_for(2, "gpu")
    other.issue("gpu")
    other.free_blocks(b)
    assert not other.allocate_for(2, "gpu")[1]


# Reset while running, removal reasons, "allocatable if freed" ------------


def test_reset_while_running_withdraws_every_key_and_keeps_in_use_blocks() -> None:
    from blockpool import AllBlocksCleared

    pool = make_pool()
    used = pool.get_new_blocks(2)
    free = pool.get_new_blocks(1)
    pool.cache_full_blocks(used, ["a", "b"], 0, 2, block_size=16)
    pool.cache_full_blocks(free, ["c"], 0, 1, block_size=16)
    pool.free_blocks(free)
    e1 = pool.issue("compute")
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # vLLM's behaviour stays the default
    before = pool.snapshot()
    assert pool.reset_prefix_cache(while_running=True) is True
    after = pool.snapshot()
    assert all(pool.get_cached_block(k) is None for k in "abc")
    assert pool.take_events() == [AllBlocksCleared()]
    assert (after.ref_counts, after.free_queue, after.held, after.shadows) == (
        before.ref_counts,
        before.free_queue,
        before.held,
        before.shadows,
    )
    assert after.cache == ()
    pool.free_blocks(used, token=e1)
    pool.check()


def test_removal_events_carry_a_reason() -> None:
    pool = make_pool(3)
    (p,) = pool.get_new_blocks(1)
    pool.cache_partial_block(p, "part@8", 8)
    pool.cache_full_blocks([p], ["full@16"], 0, 1, block_size=16)
    pool.cache_partial_block(p, "in@4", 4)
    pool.cache_partial_block(p, "new@8", 8, replace_existing_hashes=True)
    (q,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([q], ["q"], 0, 1, block_size=16)
    pool.evict_blocks([q.block_id])
    pool.free_blocks([p])
    pool.get_new_blocks(1)
    removed = [(e.block_hashes[0], e.reason) for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [
        ("part@8", "promoted"),
        ("full@16", "replaced"),
        ("in@4", "replaced"),
        ("q", "evicted"),
        ("new@8", "evicted"),
    ]


def test_removal_reason_of_a_failed_load() -> None:
    pool = make_pool()
    blocks, _ = pool.allocate_for(1, "h2d")
    tok, _ = pool.begin_load(blocks, "h2d")
    pool.cache_full_blocks(blocks, ["L"], 0, 1, block_size=16)
    pool.take_events()
    pool.fail(tok)
    assert [(e.block_hashes, e.reason) for e in pool.take_events()] == [(("L",), "load_failed")]


def test_allocatable_if_freed_answers_without_changing_anything() -> None:
    from blockpool import RefCountError

    pool = make_pool()
    a, b, c = pool.get_new_blocks(3)
    pool.touch([b])  # b: two references
    rd = pool.issue("rdma")
    pool.tag([c], rd, AccessKind.READ)  # a host engine still reads c
    pool.issue("compute")  # a device step in flight does not hold a block back
    before = pool.snapshot()
    assert pool.allocatable_if_freed([a, b, c, pool.null_block]) == [True, False, False, False]
    assert pool.allocatable_if_freed([b, b]) == [True, True]
    with pytest.raises(RefCountError):
        pool.allocatable_if_freed([a, a])
    assert pool.snapshot() == before
    pool.complete(rd)
    assert pool.allocatable_if_freed([c]) == [True]
    pool.free_blocks([a, b, b, c])
    assert pool.held_block_ids() == [] and pool.get_num_free_blocks() == 9


def test_allocatable_if_freed_agrees_with_free_blocks() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(4)
    rd = pool.issue("rdma")
    pool.tag(blocks[:2], rd, AccessKind.READ)
    answer = pool.allocatable_if_freed(blocks)
    pool.free_blocks(blocks)
    free = {b.block_id for b in pool.free_block_queue}
    assert answer == [b.block_id in free for b in blocks] == [False, False, True, True]


def test_removal_events_each_reproduces_vllm_per_block_removals() -> None:
    pool = make_pool(removal_events="each")
    a, b = _two_blocks_under_h3(pool)
    pool.evict_blocks([a.block_id])
    assert pool.take_events() == [BlockRemoved(("H3",))]
    assert pool.get_cached_block("H3") is b


def test_removal_events_must_be_last_or_each() -> None:
    with pytest.raises(InvalidArgumentError, match="removal_events"):
        make_pool(removal_events="some")
