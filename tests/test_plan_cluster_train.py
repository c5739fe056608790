"""A model too big for one process at the budget: the cluster plan trains on 2 and on 4 gloo
processes (`memfit train --plan FILE` starts them), and every rank's tracked step peak is within
the budget."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.plan.cluster_fit import plan_cluster
from memfit.plan.cluster_search import candidates

TINY = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=384,vocab=256"
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "MEMFIT_NO_CACHE": "1"}

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # ~2-4 min on 2 busy cores


@pytest.mark.parametrize("budget,gpus", [("8MiB", 2), ("6MiB", 4)])
def test_cluster_plan_trains_within_the_budget_on_every_rank(tmp_path, budget, gpus):
    cp = plan_cluster(TINY, budget, "auto", batch=4, seq=32, device="cpu")
    assert cp.gpus == gpus
    from memfit.plan.cluster_fit import problem_of

    p = problem_of(TINY, budget, None, None, 4, 32, "32-true", "adamw", None, "cpu", None)
    assert not any(r.feasible for r in candidates(p, 1))  # too big for one process at this budget
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": cp.plan, "cluster": cp.to_json()}))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", "--model", TINY, "--plan", str(path), "--seq", "32",
                           "--steps", "2", "--warmup", "1", "--eval-batches", "1", "--device", "cpu", "--quiet",
                           "--out", str(out)], env=ENV, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the plan runs {gpus} processes" in proc.stderr and "torchrun --nproc-per-node" in proc.stderr
    step = json.loads((out / "metrics.json").read_text())["memory"]["step_breakdown"]
    assert step["world"] == gpus and step["strategy"] == cp.layout["strategy"]
    peaks = [r["peak_bytes"] for r in step["ranks"]]
    assert len(peaks) == gpus and max(peaks) <= cp.budget, (peaks, cp.budget)
