"""bench/mutations.py's list stays runnable: each mutation's text is still in its file (once, so the
mutation lands where it was meant to), its replacement differs, its tests exist, and the CI rotation
comes round to every mutation."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import mutations  # noqa: E402


@pytest.mark.parametrize("m", mutations.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once_and_names_existing_tests(m):
    text = (ROOT / m.file).read_text()
    assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.file}"
    assert m.new != m.old
    paths = [t for t in m.tests if t.startswith("tests/")]
    assert paths
    for t in paths:
        file, _, test = t.partition("::")
        assert (ROOT / file).is_file(), t
        if test:  # the test function is defined there (a parameter id is checked when it runs)
            name = test.split("[")[0]
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / file).read_text(), re.M), t


def test_names_are_unique_and_the_rotation_covers_every_mutation():
    names = [m.name for m in mutations.MUTATIONS]
    assert len(set(names)) == len(names)
    seen = {m.name for day in range(1, 367) for m in mutations.rotation(2, day)}
    assert seen == set(names)
    assert len(mutations.rotation(2)) == 2


def test_a_mutation_whose_text_moved_is_stale_not_survived(tmp_path):
    (tmp_path / "f.py").write_text("x = 1\n")
    m = mutations.Mutation("moved", "area", "f.py", "x = 2", "x = 3", ("tests/none.py",), "what")
    row = mutations.run_one(m, tmp_path, control=False, timeout=10)
    assert row["status"] == "stale" and "occurs 0 times" in row["summary"]
