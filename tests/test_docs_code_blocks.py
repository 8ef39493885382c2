"""Every ```python block of the README and docs runs.

Blocks written as doctests (starting with ``>>>``) already run through
pytest's ``--doctest-glob=*.md`` (``pyproject.toml``); this module runs the
others: each is executed in a fresh namespace, and a ``test_*`` function it
defines is called with the fixtures it names (``blockpool_harness``: a
:class:`~blockpool.checking.harness.RaceHarness`, checked for races afterwards).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from blockpool import HazardAwareBlockPool, StreamKind
from blockpool.checking.harness import RaceHarness
from blockpool.core.errors import UnknownStreamError, UnknownTokenError
from blockpool.core.hazards import Token

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, int, str, bool]]:
    out = []
    for f in FILES:
        text = f.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            body = m.group(1)
            out.append((str(f.relative_to(ROOT)), line, body, body.lstrip().startswith(">>>")))
    return out


BLOCKS = _blocks()
PLAIN = [pytest.param(body, id=f"{f}:{line}") for f, line, body, doctest in BLOCKS if not doctest]


def test_every_python_block_is_a_doctest_or_runs_here() -> None:
    assert BLOCKS and any(doctest for *_, doctest in BLOCKS)
    for f, line, body, doctest in BLOCKS:
        if doctest:  # doctests must not mix in plain lines that would never run
            code = [x for x in body.splitlines() if x.strip()]
            assert code[0].startswith(">>>"), f"{f}:{line}"


@pytest.mark.parametrize("body", PLAIN)
def test_plain_python_block_runs(body: str) -> None:
    ns: dict[str, object] = {"__name__": "docs_block"}
    exec(compile(body, "<docs block>", "exec"), ns)  # noqa: S102 - running the docs is the point
    for name, fn in list(ns.items()):
        if name.startswith("test_") and inspect.isfunction(fn):
            params = inspect.signature(fn).parameters
            kwargs: dict[str, object] = {}
            for p in params:
                if p == "blockpool_harness":
                    kwargs[p] = RaceHarness(num_gpu_blocks=8)
                else:  # pragma: no cover - a new fixture name: teach this test
                    pytest.fail(f"docs block test {name} needs fixture {p!r}")
            fn(**kwargs)
            if "blockpool_harness" in kwargs:
                kwargs["blockpool_harness"].assert_no_races()  # type: ignore[attr-defined]


# complete() raises what docs/api.md says ----------------------------------


def test_complete_of_a_token_never_issued_raises_unknown_token() -> None:
    pool = HazardAwareBlockPool(4, streams={"compute": StreamKind.DEVICE})
    before = pool.snapshot()
    with pytest.raises(UnknownTokenError):
        pool.complete(Token("compute", 5))
    with pytest.raises(UnknownStreamError):
        pool.complete(Token("h2d", 1))
    assert pool.snapshot() == before


def test_api_doc_names_the_errors_of_complete() -> None:
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    row = next(x for x in api.splitlines() if x.startswith("| `complete(token)`"))
    assert "UnknownTokenError" in row and "UnknownStreamError" in row


def test_readme_usage_names_the_step_it_prints_and_declares_only_used_streams() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    usage = BLOCK.search(readme.split("## Usage", 1)[1]).group(1)  # type: ignore[union-attr]
    assert "step 1 (compute:1)" in usage and "'compute:1'" in usage and "step 7" not in usage
    for stream in re.findall(r'"(\w+)": StreamKind', usage):
        assert usage.count(f'"{stream}"') >= 2, f"stream {stream} declared but not used"


def test_docs_cite_no_file_outside_the_repository() -> None:
    for f in FILES:
        assert "shared/design" not in f.read_text(encoding="utf-8"), f
