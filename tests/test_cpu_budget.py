"""The default tier's CPU budgets (tests/cpu_budget.py, docs/testing.md "Budgets"): a child process's CPU
time counts, and a default-tier test over its budget fails on an idle machine, not on a busy one."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cpu_budget

pytest_plugins = ["pytester"]

def burn(seconds: float) -> str:
    """Code that spends `seconds` of CPU time."""
    return f"import time\nt = time.process_time()\nwhile time.process_time() - t < {seconds}: pass\n"


BURN = burn(0.4)


def test_a_live_and_a_reaped_child_process_count():
    before = cpu_budget.cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BURN + "time.sleep(30)\n"])
    try:
        deadline = time.monotonic() + 20
        while cpu_budget.cpu_seconds() - before < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpu_budget.cpu_seconds() - before >= 0.4  # alive: read through /proc
    finally:
        child.kill()
        child.wait()
    assert cpu_budget.cpu_seconds() - before >= 0.4  # reaped: in this process's children's time


@pytest.mark.parametrize("idle,failed", [("1000", 1), ("0", 0)])
def test_a_test_over_its_budget_fails_only_on_an_idle_machine(pytester, monkeypatch, idle, failed):
    monkeypatch.setenv("MEMFIT_TEST_IDLE_LOAD", idle)  # load below 1000 per core: idle; below 0: never
    monkeypatch.syspath_prepend(str(pytester.path))
    pytester.makeconftest("import cpu_budget\n"
                          "def pytest_addoption(parser):\n    cpu_budget.add_options(parser)\n"
                          "def pytest_configure(config):\n    cpu_budget.configure(config)\n")
    # test_burns fails past twice its 0.1 s (ENFORCE_FACTOR): 0.3 s is over that; the others burn a little
    pytester.makepyfile(f"""
import pytest

@pytest.mark.cpu_budget(0.1)
def test_burns():
    exec({burn(0.3)!r})

@pytest.mark.cpu_budget(5)
def test_within():
    exec({burn(0.05)!r})

@pytest.mark.slow
def test_slow_has_no_budget():
    exec({burn(0.05)!r})
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=3, errors=failed)
    result.stdout.fnmatch_lines(["*default tier: 2 tests*", "*slow tier: 1 tests*",
                                 "over budget*test_burns*"])
    if failed:
        result.stdout.fnmatch_lines(["*over twice the default tier's budget of 0.1 s per test*"])


def test_every_listed_budget_names_a_test_that_exists():
    root = Path(__file__).resolve().parents[1]
    for nodeid in cpu_budget.BUDGETS_S:
        path, name = nodeid.split("::")
        assert f"def {name.split('[')[0]}(" in (root / path).read_text(), nodeid
