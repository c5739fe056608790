"""CPU-time budgets for the test tiers (docs/testing.md, "Budgets"), a pytest plugin that
tests/conftest.py registers.

Each test's CPU time is measured from its set-up to its teardown: this process's user+sys time, that
of the children it has reaped, and that of every live descendant (with what they reaped), so the
ranks a multi-process test forks from the forkserver count too. CPU time rather than wall time: on a
shared machine the wall clock measures the neighbours. A default-tier test (not marked slow) over its
budget (DEFAULT_BUDGET_S, its entry in BUDGETS_S, or its `cpu_budget(seconds)` mark) fails in its
teardown when the machine was idle as it started (1-minute load average below IDLE_LOAD per core); on
a loaded machine, or with --cpu-budget=report, it is only listed. The summary gives each tier's total CPU and wall time.

Under pytest-xdist each worker measures its own tests and sends the figures in the test reports;
the controller adds them up. --cpu-json=PATH writes every test's figures (bench and budget work).
"""
from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

DEFAULT_BUDGET_S = 10.0  # CPU seconds (set-up + call + teardown) per default-tier test
TIER_BUDGET_S = 480.0  # CPU seconds for the whole default tier: 4 minutes of wall on 2 cores
IDLE_LOAD = 1.5  # 1-minute load average per core below which budgets are enforced
# A test fails only past twice its budget: its CPU seconds vary with what the other worker runs beside
# it (cache and memory-bandwidth contention: one pair of tests measured 16.5 CPU-s alone and 29.5 beside
# the other worker), so the budget itself is the target that the summary reports, and the failure
# catches a test that has grown, not one that met a busy neighbour.
ENFORCE_FACTOR = 2.0
# Default-tier tests allowed more than DEFAULT_BUDGET_S (CPU seconds, about 1.5 times their time alone on
# a loaded machine): end-to-end runs of several processes, and the one default-tier case of a trace
# grid. Listed here rather than marked in their files, so that docs/testing.md can show them in one place;
# a `cpu_budget(seconds)` mark on a test does the same.
BUDGETS_S = {
    "tests/test_chaos.py::test_kill_9_of_a_rank_during_a_step_with_disk_offload_resumes_bitwise": 40,
    "tests/test_plan_chunked_head.py::test_a_loop_that_keeps_its_output_is_priced_exactly_with_a_chunked_head": 20,
    "tests/test_measure_compose.py::test_composed_equals_full_trace[gpt-32-true]": 18,
    "tests/test_measure_compose.py::test_hf_llama_ends_and_first_checkpointed_block_are_exact": 18,
    "tests/test_distributed_rank_grid.py::test_covering_subset_each_rank_within_its_strategy_tolerance": 18,
    # the default tier's one family through fit and two measured steps (Gemma-2's per-layer attention)
    "tests/test_hf_family_grid.py::test_fit_plans_within_budget_and_the_measured_step_holds_it[gemma2]": 16,
    # `memfit train --nproc 2` in a new interpreter: the launcher and two ranks each import torch
    "tests/test_launch_signals.py::test_a_killed_rank_is_one_line_and_leaves_no_temporary_files": 14,
    "tests/test_launch_options.py::test_nproc_alone_trains_ddp_with_a_note_and_leaves_nothing_behind": 14,
}
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_times(pid: int) -> tuple[float, list[int]]:
    """(utime+stime+cutime+cstime of pid in seconds, its children's pids); (0, []) once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        kids: list[int] = []
        for task in os.listdir(f"/proc/{pid}/task"):
            kids += [int(k) for k in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except (OSError, ValueError):
        return 0.0, []
    fields = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd (state) on; the name may hold spaces
    return sum(int(f) for f in fields[11:15]) / _TICK, kids


def cpu_seconds() -> float:
    """User+sys CPU time of this process, its reaped children and its live descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    if not Path("/proc/self/task").is_dir():
        return total
    _, todo = _proc_times(os.getpid())
    seen = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        t, kids = _proc_times(pid)
        total += t
        todo += kids
    return total


def _idle() -> bool:
    per_core = float(os.environ.get("MEMFIT_TEST_IDLE_LOAD", IDLE_LOAD))  # tests/test_cpu_budget.py sets it
    try:
        return os.getloadavg()[0] < per_core * (os.cpu_count() or 1)
    except OSError:
        return False


def _budget(item: pytest.Item) -> float:
    mark = item.get_closest_marker("cpu_budget")
    if mark:
        return float(mark.args[0])
    return float(BUDGETS_S.get(item.nodeid.split("@")[0], DEFAULT_BUDGET_S))  # xdist's loadgroup adds "@group"


class CpuBudget:
    def __init__(self, config: pytest.Config):
        self.mode = config.getoption("--cpu-budget")
        self.json_path = config.getoption("--cpu-json")
        self.worker = hasattr(config, "workerinput")
        self.rows: list[dict] = []
        self.t0 = time.monotonic()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        item._cpu_start = (cpu_seconds(), time.monotonic(), _idle())  # type: ignore[attr-defined]
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        start = getattr(item, "_cpu_start", None)
        if call.when == "teardown" and start is not None:
            cpu, wall = cpu_seconds() - start[0], time.monotonic() - start[1]
            slow = "slow" in item.keywords
            budget = None if slow else _budget(item)
            item.user_properties.append(("cpu_budget", {
                "cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "tier": "slow" if slow else "default",
                "budget_s": budget, "idle": start[2]}))
        outcome = yield
        report = outcome.get_result()
        if call.when != "teardown" or start is None or self.mode != "enforce" or report.failed:
            return
        row = dict(report.user_properties).get("cpu_budget")
        if row and row["budget_s"] is not None and row["idle"] and row["cpu_s"] > ENFORCE_FACTOR * row["budget_s"] \
                and not item.get_closest_marker("skip"):
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid}: {row['cpu_s']:.1f} CPU-s, over twice the default tier's budget of "
                               f"{row['budget_s']:g} s per test (docs/testing.md, Budgets): shrink it, share "
                               f"its set-up, or mark it slow beside a smaller default-tier test")

    def pytest_runtest_logreport(self, report: pytest.TestReport):
        if report.when != "teardown" or self.worker:
            return
        row = dict(report.user_properties).get("cpu_budget")
        if row:
            self.rows.append({"nodeid": report.nodeid.split("@")[0], **row})  # without loadgroup's "@group"

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if self.worker or not self.rows:
            return
        wall = time.monotonic() - self.t0
        if self.json_path:
            Path(self.json_path).write_text(json.dumps(sorted(self.rows, key=lambda r: -r["cpu_s"]), indent=1))
        tr = terminalreporter
        tr.write_sep("=", "CPU time per tier (tests/cpu_budget.py)")
        for tier in ("default", "slow"):
            rows = [r for r in self.rows if r["tier"] == tier]
            if not rows:
                continue
            cpu = sum(r["cpu_s"] for r in rows)
            line = (f"{tier} tier: {len(rows)} tests, {cpu:.0f} CPU-s, {sum(r['wall_s'] for r in rows):.0f} s of "
                    f"test wall time")
            if tier == "default":
                line += f" (budget {TIER_BUDGET_S:.0f} CPU-s for the whole tier)"
            tr.write_line(line)
        tr.write_line(f"session wall time: {wall:.0f} s; 1-minute load now {os.getloadavg()[0]:.1f} "
                      f"on {os.cpu_count()} cores")
        over = [r for r in self.rows if r["budget_s"] is not None and r["cpu_s"] > r["budget_s"]]
        for r in sorted(over, key=lambda r: -r["cpu_s"]):
            tr.write_line(f"over budget{'' if r['idle'] else ' (machine busy: not enforced)'}: "
                          f"{r['cpu_s']:.1f} > {r['budget_s']:g} CPU-s  {r['nodeid']}")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("cpu budget")
    group.addoption("--cpu-budget", choices=("enforce", "report", "off"), default="enforce",
                    help="enforce: a default-tier test over its CPU budget fails when the machine is idle; "
                         "report: only list it; off: measure nothing")
    group.addoption("--cpu-json", default=None, help="write each test's CPU and wall seconds to this JSON file")


def configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_budget(seconds): this default-tier test's CPU budget, above the "
                                       f"default {DEFAULT_BUDGET_S:.0f} s (docs/testing.md, Budgets)")
    if config.getoption("--cpu-budget") != "off":
        config.pluginmanager.register(CpuBudget(config), "cpu_budget_plugin")
