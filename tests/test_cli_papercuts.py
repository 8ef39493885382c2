"""What a new user meets first, from a fresh clone: the public trace fetched
and verified (``blockpool fetch-trace``), the files ``replay`` says it
wrote, a plot of a run without loads, errors naming the option as typed,
``--help`` that fits a terminal, the constructor's parameter list in
``docs/api.md``, and the versions the GPU results in ``docs/worker.md``
ran on. The rest of the command line: ``tests/test_cli.py``."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from blockpool import HazardAwareBlockPool, InvalidArgumentError, RefCountError
from blockpool.cli import build_parser, main
from blockpool.replay import fetch as fetch_mod
from blockpool.replay.fetch import TRACES, TraceFetchError, default_dir, fetch, sha256_of
from tests import _docsource

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SMALL = ["--limit", "40", "--num-blocks", "1024", "--jobs", "1", "--quiet"]
FETCH = '"$(blockpool fetch-trace mooncake)"'


# -- blockpool fetch-trace --------------------------------------------------------------


@pytest.fixture()
def published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, bytes]]:
    """``mooncake`` published at a ``file://`` URL (a small trace of our own,
    its real checksum); yields the source file and its bytes."""
    body = b"".join(
        json.dumps(
            {"timestamp": 10 * i, "input_length": 600, "output_length": 5, "hash_ids": [1, 2 + i]}
        ).encode()
        + b"\n"
        for i in range(8)
    )
    src = tmp_path / "published" / "conversation_trace.jsonl"
    src.parent.mkdir()
    src.write_bytes(body)
    entry = attrs.evolve(
        TRACES["mooncake"], url=src.as_uri(), sha256=hashlib.sha256(body).hexdigest(), size=len(body)
    )
    monkeypatch.setitem(fetch_mod.TRACES, "mooncake", entry)
    yield src, body


def test_fetch_trace_downloads_verifies_and_prints_only_the_path(
    tmp_path: Path, published: tuple[Path, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    src, body = published
    cache = tmp_path / "cache"
    assert main(["fetch-trace", "mooncake", "--dir", str(cache)]) == 0
    out, err = capsys.readouterr()
    path = cache / "conversation_trace.jsonl"
    assert out == f"{path}\n"  # stdout is the path alone: "$(blockpool fetch-trace mooncake)"
    assert path.read_bytes() == body
    assert sorted(p.name for p in cache.iterdir()) == ["conversation_trace.jsonl"]  # no part file
    assert err.splitlines() == [
        f"blockpool fetch-trace: downloading {src.as_uri()} (0.0 MB, Apache-2.0) to {path}",
        f"blockpool fetch-trace: {path}: sha256 verified",
    ]


def test_fetched_trace_replays(tmp_path: Path, published: tuple[Path, bytes]) -> None:
    path = fetch("mooncake", tmp_path, say=lambda _: None)
    report = tmp_path / "r.json"
    assert main(["replay", str(path), *SMALL, "--policy", "exact", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["trace"]["requests"] == 8


def test_a_verified_copy_is_used_without_downloading(tmp_path: Path, published: tuple[Path, bytes]) -> None:
    _, body = published
    first = fetch("mooncake", tmp_path, say=lambda _: None)
    said: list[str] = []

    def no_network(url: str, timeout: float) -> io.BytesIO:
        raise AssertionError("downloaded again")

    assert fetch("mooncake", tmp_path, say=said.append, opener=no_network) == first
    assert said == [f"{first}: sha256 verified"] and first.read_bytes() == body


def test_a_download_with_another_checksum_is_refused_and_nothing_is_written(
    tmp_path: Path, published: tuple[Path, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    src, body = published
    src.write_bytes(body + b"\n")  # the published file changed
    cache = tmp_path / "cache"
    assert main(["fetch-trace", "mooncake", "--dir", str(cache)]) == 3
    out, err = capsys.readouterr()
    got = hashlib.sha256(body + b"\n").hexdigest()
    assert out == "" and list(cache.iterdir()) == []
    assert err.splitlines()[-1] == (
        f"blockpool fetch-trace: error: {src.as_uri()}: sha256 {got}, not the published "
        f"{TRACES['mooncake'].sha256}; nothing written"
    )


def test_a_copy_with_another_checksum_is_downloaded_again(
    tmp_path: Path, published: tuple[Path, bytes]
) -> None:
    _, body = published
    stale = tmp_path / "conversation_trace.jsonl"
    stale.write_bytes(b"{}\n")
    was = hashlib.sha256(b"{}\n").hexdigest()
    said: list[str] = []
    assert fetch("mooncake", tmp_path, say=said.append) == stale
    assert stale.read_bytes() == body
    assert (
        said[0]
        == f"{stale}: sha256 {was}, not the published {TRACES['mooncake'].sha256}: downloading it again"
    )


def test_an_unreachable_url_fails_naming_it_and_where_to_put_a_copy(
    tmp_path: Path, published: tuple[Path, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    src, _ = published
    src.unlink()
    assert main(["fetch-trace", "mooncake", "--dir", str(tmp_path / "c")]) == 3
    err = capsys.readouterr().err.splitlines()[-1]
    path = tmp_path / "c" / "conversation_trace.jsonl"
    assert err.startswith(f"blockpool fetch-trace: error: cannot download {src.as_uri()}: ")
    assert err.endswith(f"download it by hand to {path} and run this again to verify it")
    assert list((tmp_path / "c").iterdir()) == []


def test_an_interrupted_download_leaves_nothing(tmp_path: Path, published: tuple[Path, bytes]) -> None:
    class Interrupted(io.BytesIO):
        def read(self, n: int | None = -1) -> bytes:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch("mooncake", tmp_path, say=lambda _: None, opener=lambda url, timeout: Interrupted())
    assert list(tmp_path.iterdir()) == [tmp_path / "published"]


def test_an_unknown_trace_is_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["fetch-trace", "sharegpt"])
    assert e.value.code == 2 and "invalid choice: 'sharegpt'" in capsys.readouterr().err
    with pytest.raises(
        InvalidArgumentError, match="unknown trace 'sharegpt'; choose from mooncake, azure-code"
    ):
        fetch("sharegpt")


def test_a_directory_that_cannot_be_created_is_a_fetch_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(TraceFetchError, match="cannot write into"):
        fetch("mooncake", tmp_path / "file" / "traces", say=lambda _: None)


def test_the_cache_follows_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_dir() == tmp_path / "blockpool" / "traces"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_dir() == tmp_path / "home" / ".cache" / "blockpool" / "traces"


@pytest.mark.parametrize("name", list(TRACES))
def test_the_pinned_checksums_are_those_of_the_published_traces(name: str) -> None:
    """The copies the test suite reads (``../shared/traces``, as published)
    have the size and SHA-256 :data:`TRACES` pins."""
    t = TRACES[name]
    copy = SHARED / t.file
    if not copy.exists():
        pytest.skip(f"no copy of {t.file} at {SHARED}")
    assert (copy.stat().st_size, sha256_of(copy)) == (t.size, t.sha256)
    assert t.url.startswith(f"https://raw.githubusercontent.com/{t.repository.split('/', 1)[1]}/")
    assert t.url.endswith(f"/{t.file}")


def test_fetch_trace_from_the_published_copy_over_file_urls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real entry, its URL swapped for the local copy: the checksum holds."""
    copy = SHARED / TRACES["mooncake"].file
    if not copy.exists():
        pytest.skip(f"no copy at {copy}")
    monkeypatch.setitem(fetch_mod.TRACES, "mooncake", attrs.evolve(TRACES["mooncake"], url=copy.as_uri()))
    path = fetch("mooncake", tmp_path, say=lambda _: None)
    assert path.read_bytes() == copy.read_bytes()


# -- the docs name the trace the same way, with its source and checksum ---------------


def test_no_doc_names_a_trace_path_a_new_user_does_not_have() -> None:
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "shared/traces" not in text, doc.name
        local = text.replace(f"FAST25-release/traces/{TRACES['mooncake'].file}", "")  # its place upstream
        assert not re.search(r"[\w./-]+/conversation_trace\.jsonl", local), doc.name


def test_every_doc_command_on_the_mooncake_trace_fetches_it_the_same_way() -> None:
    commands = 0
    for doc in DOCS:
        text = " ".join(doc.read_text(encoding="utf-8").split())
        for m in re.finditer(r"(blockpool (?:replay|sweep)|docfigures --trace) (\S+)", text):
            if m.group(2).startswith('"$('):
                assert text[m.start(2) :].startswith(FETCH), (doc.name, m.group(0))
                commands += 1
    assert commands >= 4  # README, replay.md and guarantees.md replay it


def test_readme_gives_the_trace_public_source_and_checksum_as_pinned() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cmd = next(x for x in readme.splitlines() if x.startswith("mkdir -p ") and "blockpool replay" in x)
    assert cmd.split("blockpool replay ", 1)[1].startswith(FETCH)
    t = TRACES["mooncake"]
    flat = " ".join(readme.split())
    assert t.url in flat and t.sha256 in flat and f"{t.size:,} bytes" in flat and t.license in flat


# -- replay names what it wrote; --plot of a run without loads --------------------------


def test_replay_prints_the_path_of_every_file_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    outs = {
        o: tmp_path / f"r.{ext}" for o, ext in (("--json", "json"), ("--plot", "png"), ("--events", "jsonl"))
    }
    args = [x for o, p in outs.items() for x in (o, str(p))]
    assert main(["replay", *SMALL, "--policy", "exact,blind", *args]) == 0
    tail = capsys.readouterr().out.splitlines()[-3:]
    assert tail == [f"wrote {outs['--events']}", f"wrote {outs['--json']}", f"wrote {outs['--plot']}"]
    assert all(p.stat().st_size > 0 for p in outs.values())


def test_replay_without_outputs_prints_no_wrote_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *SMALL, "--policy", "exact"]) == 0
    assert "wrote" not in capsys.readouterr().out


def test_sweep_prints_the_path_of_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert main(["sweep", "--limit", "5", "--jobs", "1", "--quiet", "--json", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out}"
    assert json.loads(out.read_text())["schema"] == "blockpool.sweep/1"


def test_the_plot_of_a_run_without_loads_says_so_on_its_axes() -> None:
    pytest.importorskip("matplotlib")
    from blockpool.replay.plot import figure
    from blockpool.replay.report import ReplayReport

    report = ReplayReport("synthetic", "synthetic", 3, (), {}, (), 0.0)
    fig = figure(report)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["no policy made a load: no load-start delays to draw"]
    assert fig.axes[0].get_legend() is None


# -- errors name the option as typed; plurals; --help fits a terminal ------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["replay", "--num-blocks", "1"], "blockpool replay: error: --num-blocks must be >= 2, got 1"),
        (["replay", "--block-size", "0"], "blockpool replay: error: --block-size must be >= 1, got 0"),
        (["replay", "--limit", "0"], "blockpool replay: error: --limit must be >= 1, got 0"),
        (["replay", "--jobs", "0"], "blockpool replay: error: --jobs must be >= 1, got 0"),
        (["sweep", "--num-blocks", "1024,1"], "blockpool sweep: error: --num-blocks must be >= 2, got 1"),
        (["sweep", "--block-size", "0"], "blockpool sweep: error: --block-size must be >= 1, got 0"),
        (["sweep", "--limit", "0"], "blockpool sweep: error: --limit must be >= 1, got 0"),
        (["sweep", "--jobs", "0"], "blockpool sweep: error: --jobs must be >= 1, got 0"),
    ],
)
def test_a_bad_value_is_refused_before_the_run_naming_the_option_as_typed(
    argv: list[str], line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import blockpool.replay.run as run_mod
    import blockpool.replay.sweep as sweep_mod

    monkeypatch.setattr(run_mod, "replay", lambda *a, **k: pytest.fail("the replay started"))
    monkeypatch.setattr(sweep_mod, "sweep", lambda *a, **k: pytest.fail("the sweep started"))
    assert main([*argv, "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", line + "\n")


@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_an_empty_trace_argument_says_a_fetch_may_have_failed(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``blockpool replay "$(blockpool fetch-trace mooncake)"`` after a failed
    fetch passes an empty TRACE: refused, saying where an empty one comes from."""
    assert main([command, "", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"blockpool {command}: error: TRACE is an empty string: give a trace file (an empty one is what "
        '"$(blockpool fetch-trace NAME)" gives when the fetch failed: see its error above)\n'
    )


def test_a_pool_too_small_for_any_request_is_named_by_its_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--num-blocks", "3", "--limit", "5", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("blockpool replay: error: --num-blocks 3 is too small for any")


def test_ref_count_errors_count_in_words_that_agree_with_the_number() -> None:
    pool = HazardAwareBlockPool(8)
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(RefCountError, match=r"listed twice|listed 2 times") as e:
        pool.allocatable_if_freed([b, b])
    assert str(e.value) == f"block {b.block_id} is listed 2 times but referenced once"
    pool.free_blocks([b])
    with pytest.raises(RefCountError) as e:
        pool.free_blocks([b])
    assert str(e.value) == f"free_blocks would take block {b.block_id}'s ref count below zero (listed once)"


@pytest.mark.parametrize("command", [None, "replay", "sweep", "fetch-trace", "check-vllm"])
def test_every_help_line_fits_80_columns(command: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    if command is not None:
        sub = next(a for a in parser._actions if a.dest == "command")
        parser = sub.choices[command]  # type: ignore[index]
    text = parser.format_help()
    assert [x for x in text.splitlines() if len(x) > 80] == []
    if command == "replay":
        assert "Replay a trace on a simulated GPU" in text and "blockpool fetch-trace mooncake" in text


# -- docs/api.md: the constructor's parameters, one entry each --------------------------


def _construction() -> str:
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return api.split("## Construction", 1)[1].split("\n## ", 1)[0]


def test_api_md_lists_every_constructor_parameter_once_in_signature_order() -> None:
    section = _construction()
    listed = re.findall(r"^- `(\w+)`:", section, re.MULTILINE)
    params = [p for p in _docsource.signature(HazardAwareBlockPool, "__init__").parameters if p != "self"]
    assert listed == params


def test_api_md_signature_block_is_the_constructor_signature() -> None:
    block = _construction().split("```\n", 2)[1]
    shown = re.sub(r"\s+", " ", block).replace("( ", "(").strip()
    sig = _docsource.signature(HazardAwareBlockPool, "__init__")
    parts = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        if p.default is p.empty:
            parts.append(p.name)
        elif callable(p.default):
            parts.append(f"{p.name}=time.{p.default.__name__}")
        else:
            parts.append(f"{p.name}={json.dumps(p.default) if p.default is not None else 'None'}")
    assert shown == f"HazardAwareBlockPool({', '.join(parts)})".replace("=true", "=True").replace(
        "=false", "=False"
    )


def test_api_md_table_cells_stay_readable() -> None:
    rows = [x for x in _construction().splitlines() if x.startswith("| `")]
    assert rows and max(len(x) for x in rows) < 300


# -- docs/worker.md: the GPU results say what they ran on ---------------------------------


def test_worker_gpu_results_name_the_gpu_torch_and_cuda_they_ran_on() -> None:
    text = (ROOT / "docs" / "worker.md").read_text(encoding="utf-8")
    section = text.split("## GPU results", 1)[1]
    data = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    torch_version = data["torch"]  # e.g. 2.11.0+cu130
    cuda = re.fullmatch(r"[\d.]+\+cu(\d+)(\d)", torch_version)
    assert cuda is not None, torch_version
    prose = section.split("```", 1)[0]
    flat = " ".join(prose.split())
    assert (
        f"Ran on: one {data['device']}, torch {torch_version} (CUDA {cuda.group(1)}.{cuda.group(2)})" in flat
    )
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "README.md").read_text(encoding="utf-8"))
    assert pin is not None and f"The tests pin torch {pin.group(1)}" in flat


def test_worker_gpu_section_has_no_history_words() -> None:
    text = (ROOT / "docs" / "worker.md").read_text(encoding="utf-8")
    gpu = text.split("## The GPU check", 1)[1]
    prose = re.sub(r"```.*?```", "", gpu, flags=re.DOTALL).lower()
    for words in ("previously", "at the time", "predate", "not yet", "no longer", "used to"):
        assert words not in prose, words
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", prose)


# -- the vLLM pool names every release line it serves -----------------------------------


def test_the_vllm_pool_module_names_every_supported_line() -> None:
    spec = importlib.util.find_spec(
        "blockpool.integrations"
    )  # the package as imported; its parents import no vLLM
    assert spec is not None and spec.submodule_search_locations
    src = (Path(next(iter(spec.submodule_search_locations))) / "vllm" / "pool.py").read_text(encoding="utf-8")
    assert src.splitlines()[0].startswith('"""vLLM\'s ``BlockPool`` surface (0.32, 0.33 and 0.34)')
