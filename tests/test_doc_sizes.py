"""The long pages stay short enough for their reader to hold, the sections
the code cites in them exist, and docs/replay.md's example verdict is the
one the default run prints.

A page's reader: the operator (``vllm-plugin.md``), the maintainer
(``vllm-design.md``: the decisions and their reasons), the user of the
replay (``replay.md``: tutorial, how-to, reference), whoever compares
figures (``performance.md``: the current figures, each with its command)
and whoever upgrades (``CHANGELOG.md``: the user-visible changes). What
does not fit is git's history, not the page's.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from blockpool.replay import docfigures

ROOT = Path(__file__).resolve().parents[1]

LIMITS = {
    "docs/vllm-design.md": 25_000,
    "docs/replay.md": 20_000,
    "docs/vllm-plugin.md": 15_000,
    "docs/performance.md": 10_000,
    "CHANGELOG.md": 10_000,
}
"""The most bytes (UTF-8) each page may hold."""

CITED = tuple(sorted(p.name for p in (ROOT / "docs").glob("*.md")))
"""The pages whose sections the code may cite by name: every page of docs/."""

_CITE = re.compile(r'docs/([\w-]+\.md)`*,\s*(?:#\s*)?"([^"\n]+(?:\n\s*#?\s*[^"\n]+)?)"')


@pytest.mark.parametrize("page", sorted(LIMITS))
def test_the_page_is_within_its_size(page: str) -> None:
    size = len((ROOT / page).read_bytes())
    assert size <= LIMITS[page], f"{page}: {size:,} bytes, over its {LIMITS[page]:,}"


def _citations() -> list[tuple[str, str, str]]:
    """``(citing file, page, section)`` for every ``docs/PAGE.md``, "Section"
    in the package, the benchmarks, the scripts and the tests."""
    out = []
    spec = importlib.util.find_spec("blockpool")  # the package as imported: the checkout's or a wheel's
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    for base, top in (
        (package.parent, "blockpool"),
        (ROOT, "benchmarks"),
        (ROOT, "scripts"),
        (ROOT, "tests"),
    ):
        for path in sorted((base / top).rglob("*")):
            if path.suffix not in (".py", ".sh") or not path.is_file():
                continue
            for m in _CITE.finditer(path.read_text(encoding="utf-8", errors="replace")):
                section = " ".join(re.sub(r"\n\s*#?\s*", " ", m.group(2)).split())
                if m.group(1) in CITED:
                    out.append((str(path.relative_to(base)), m.group(1), section))
    return out


def test_the_code_cites_the_pages_sections_by_name() -> None:
    found = {(page, section) for _, page, section in _citations()}
    assert ("vllm-design.md", "Hazard wiring (scheduler side)") in found  # the scan sees citations
    assert ("performance.md", "The compiled core") in found


@pytest.mark.parametrize("citing, page, section", _citations())
def test_every_section_the_code_cites_exists(citing: str, page: str, section: str) -> None:
    lines = (ROOT / "docs" / page).read_text(encoding="utf-8").splitlines()
    headings = [line.lstrip("#").strip() for line in lines if line.startswith("#")]
    assert any(h.startswith(section) for h in headings), (
        f'{citing} cites {page}, "{section}": no such section'
    )


def test_the_example_verdict_in_replay_md_is_the_default_runs_own_line() -> None:
    # The README's table is generated from the default run and checked against
    # it (tests/test_doc_figures.py); its last line is that run's verdict.
    readme = docfigures.blocks_of((ROOT / "README.md").read_text(encoding="utf-8"))["readme-table"]
    verdict = next(line for line in readme.splitlines() if line.startswith("exact: "))
    assert re.fullmatch(
        r"exact: 0 races in [\d,]+ checked accesses; blind \(no waits\): [\d,]+ races", verdict
    )
    replay = " ".join((ROOT / "docs" / "replay.md").read_text(encoding="utf-8").split())
    examples = re.findall(r"`(exact: \d+ races in [^`]*)`", replay)
    assert examples == [verdict], (
        f"replay.md's example verdicts {examples} are not the default run's {verdict!r}"
    )
