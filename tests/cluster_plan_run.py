"""A cluster plan written to plan.json and trained by `memfit train --plan` (which starts its processes):
the run the cluster planner's train tests share (tests/test_plan_cluster_train.py,
tests/test_plan_cluster_interleaved.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "MEMFIT_NO_CACHE": "1"}


def train_cluster_plan(model: str, cp, tmp_path: Path) -> tuple[str, dict]:
    """Two steps of `model` under the cluster plan `cp` at seq 32; (the run's stderr, metrics.json's step
    breakdown), after checking that every rank's tracked peak is within the plan's budget."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": cp.plan, "cluster": cp.to_json()}))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", "--model", model, "--plan", str(path), "--seq", "32",
                           "--steps", "2", "--warmup", "1", "--eval-batches", "1", "--device", "cpu", "--quiet",
                           "--out", str(out)], env=ENV, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = json.loads((out / "metrics.json").read_text())["memory"]["step_breakdown"]
    peaks = [r["peak_bytes"] for r in step["ranks"]]
    assert len(peaks) == step["world"] and max(peaks) <= cp.budget, (peaks, cp.budget)
    return proc.stderr, step
