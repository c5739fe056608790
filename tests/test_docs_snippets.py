"""Every Python snippet in README.md and every example in docs/integrations.md runs as written."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def snippets(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), flags=re.S)


def run(code: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})


SLOW_README = {0, 2}  # gpt2's estimate and memfit.fit trace for tens of seconds on 2 cores


@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.slow) if i in SLOW_README else i
                               for i in range(len(snippets("README.md")))])
def test_readme_snippet_runs(i, tmp_path, monkeypatch):
    run(snippets("README.md")[i], tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(snippets("docs/integrations.md"))))
def test_integrations_example_runs(i, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    run(snippets("docs/integrations.md")[i], tmp_path, monkeypatch)


def test_every_snippet_file_has_snippets():
    assert len(snippets("README.md")) >= 3 and len(snippets("docs/integrations.md")) >= 4
    assert os.path.exists(ROOT / "docs" / "integrations.md")
