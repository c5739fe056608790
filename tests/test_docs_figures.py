"""Figures in the docs come from a command: a measured figure (a number with a unit of time, memory
or a ratio) sits in a block bench/render.py generates (<!-- bench:NAME --> ... <!-- /bench:NAME -->)
or in a paragraph that names the bench/results JSON it comes from, or in a paragraph marked
<!-- figures: tests/test_x.py --> whose figures that test reproduces (it asserts them or prints them).
A paragraph of settings or constants (a budget, a threshold, a chunk size) says so with
<!-- not measured: WHY -->.

Every doc is checked but docs/BENCHMARKS.md, which bench/render.py writes whole: the last test checks
that it (and every pasted block) is exactly what render.py makes of bench/results/*.json."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHECKED = sorted(p.name for p in DOCS.glob("*.md") if p.name != "BENCHMARKS.md") + ["../README.md"]

_UNIT = r"(?:%|x\b|×|\s?(?:s|ms|µs|min|MiB|GiB|KiB|MB|GB|kB|B)\b)"
FIGURE = re.compile(r"(?<![\w.\-/=:])\d+(?:[.,]\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?" + _UNIT)
BLOCK = re.compile(r"<!-- bench:([\w-]+) -->.*?<!-- /bench:\1 -->", re.S)
JSON = re.compile(r"bench/results/([\w-]+)\.json")
TEST_SOURCE = re.compile(r"<!-- figures: (tests/[\w/]+\.py) -->")


def unsourced(text: str) -> list[tuple[str, str]]:
    """(figure, paragraph start) for each figure outside generated blocks, code and sourced paragraphs."""
    text = re.sub(r"```.*?```", "", BLOCK.sub("", text), flags=re.S)
    out = []
    for para in re.split(r"\n\s*\n", text):
        if "<!-- not measured:" in para:
            continue
        tests = TEST_SOURCE.findall(para)
        if tests and all((ROOT / t).exists() for t in tests):
            continue
        names = JSON.findall(para)
        if names and all((ROOT / "bench" / "results" / f"{n}.json").exists() for n in names):
            continue
        for fig in FIGURE.findall(re.sub(r"`[^`]*`", "", para)):
            out.append((fig, para.strip()[:80]))
    return out


def test_the_check_finds_typed_figures_and_accepts_sourced_ones():
    assert [f for f, _ in unsourced("It took 3.7 s against 1.19 s, 48% less.")] == ["3.7 s", "1.19 s", "48%"]
    assert unsourced("It took 3.7 s (bench/results/gpu_offload.json).") == []
    assert unsourced("It took 3.7 s (bench/results/no_such_bench.json).") != []
    assert unsourced("<!-- bench:x -->\n3.7 s\n<!-- /bench:x -->\n\n`--budget 4GiB` at commit c4f0d41") == []
    assert unsourced("Chunks of 16 MiB. <!-- not measured: a setting -->") == []
    assert unsourced("Peak 1.2 MiB. <!-- figures: tests/test_docs_figures.py -->") == []
    assert unsourced("Peak 1.2 MiB. <!-- figures: tests/test_no_such_file.py -->") != []


@pytest.mark.parametrize("doc", CHECKED)
def test_every_figure_in_the_doc_has_a_source(doc):
    assert unsourced((DOCS / doc).read_text()) == []


def test_generated_blocks_name_a_result():
    """Every generated block is filled by some bench's snippets() (bench/render.py pastes them)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import render

    names = set()
    for f in (ROOT / "bench" / "results").glob("*.json"):
        import json

        result = json.loads(f.read_text())
        module = render._load_bench(result.get("script", result.get("bench", f.stem)))
        if hasattr(module, "snippets"):
            try:
                names |= set(module.snippets(result))
            except (KeyError, TypeError):
                pass
    for doc in DOCS.glob("*.md"):
        for name in BLOCK.findall(doc.read_text()):
            assert name in names, f"{doc.name}: <!-- bench:{name} --> is filled by no bench"


def test_generated_docs_are_what_render_writes():
    """A result rerun without `python bench/render.py` (or a table edited by hand) fails here."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import render

    text, blocks = render.build(render.load_results())
    assert "predates the current" not in text, "a result no longer renders with its bench script"
    assert (DOCS / "BENCHMARKS.md").read_text() == text, "rerun: python bench/render.py"
    for doc in sorted(DOCS.glob("*.md")):
        assert render.paste(doc.read_text(), blocks) == doc.read_text(), f"{doc.name}: rerun bench/render.py"
