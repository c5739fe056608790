"""A pipeline run reports the whole model's parameters (banner and run.params), not stage 0's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.models.spec import parse_model

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


@pytest.mark.multiproc
def test_pipeline_run_reports_the_whole_models_parameters(tmp_path):
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", "--model", MODEL, "--seq", "32", "--batch", "2",
                           "--steps", "1", "--warmup", "1", "--eval-batches", "1", "--no-track", "--device", "cpu",
                           "--strategy", "pipeline", "--nproc", "2", "--out", str(out)],
                          env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = sum(p.numel() for p in parse_model(MODEL).build(seq=32).parameters())
    assert json.loads((out / "metrics.json").read_text())["run"]["params"] == whole
    assert f"{whole / 1e6:.2f}M-parameter model" in proc.stdout + proc.stderr
