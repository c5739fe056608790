"""kill -9 of a rank at a random moment (a step, a save, a collective, a random time), restarted by
`memfit train --nproc 2 --max-restarts 1`: the job ends bitwise equal to the uninterrupted run
(weights, whole optimizer state and step counter, sampler, every loss). bench/chaos.py does the work
and records the trials in bench/results/chaos.json (docs/reliability.md)."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc")]


def _chaos():
    spec = importlib.util.spec_from_file_location("bench_chaos", BENCH / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kill_9_of_a_rank_during_a_save_with_disk_offload_resumes_bitwise(tmp_path):
    chaos = _chaos()
    ref = chaos.reference(tmp_path, "zero3", "disk")
    assert ref["calls"][0]["save"] > 0 and ref["calls"][1]["collective"] > 0  # the kill switch sees the run
    rec = chaos.trial(tmp_path, ref, "zero3", "disk", random.Random(3), 0, phase="save")
    assert rec["killed"] and rec["outcome"] == "bitwise", rec


@pytest.mark.slow
@pytest.mark.parametrize("strategy,offload", [c for c in (
    [(s, "none") for s in ("ddp", "ps")]
    + [(s, o) for s in ("zero1", "zero2", "zero3", "pipeline", "tensor") for o in ("none", "cpu", "disk")])])
def test_chaos_ten_trials(tmp_path, strategy, offload):
    chaos = _chaos()
    records = chaos.run([(strategy, offload)], 10, seed=sum(map(ord, strategy + offload)), work=tmp_path,
                        log=lambda s: print(s, file=sys.stderr))
    bad = [r for r in records if r["outcome"] != "bitwise"]
    assert not bad, bad
