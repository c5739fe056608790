"""`memfit train --strategy pipeline|tensor --nproc 2`: the launcher, the trajectory of one process
with the global batch, validation, metrics.json per rank, and impossible configs failing fast."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli import main

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"
FAST = ["--model", TINY, "--seq", "32", "--eval-batches", "2", "--quiet", "--warmup", "1", "--steps", "3",
        "--device", "cpu"]  # gloo ranks on the CPU, also on a machine with GPUs
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def _two(tmp_path, *extra):
    out = tmp_path / "-".join(extra).replace("-", "")
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", *FAST, "--batch", "2", "--nproc", "2",
                           "--out", str(out), *extra], env=ENV, capture_output=True, text=True, timeout=300)
    return proc, out


@pytest.mark.multiproc
@pytest.mark.slow
def test_pipeline_and_tensor_runs_match_one_process(tmp_path):
    one = tmp_path / "one"
    assert main(["train", *FAST, "--batch", "4", "--out", str(one)]) == 0
    m1 = json.loads((one / "metrics.json").read_text())
    for extra in (["--strategy", "pipeline", "--schedule", "gpipe", "--microbatches", "2"], ["--strategy", "tensor"]):
        proc, out = _two(tmp_path, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        m2 = json.loads((out / "metrics.json").read_text())
        # fp32 reassociation only (tests/test_distributed_pipeline.py, test_distributed_tensor.py)
        assert m2["steps"]["loss"] == pytest.approx(m1["steps"]["loss"], rel=1e-5), extra
        # validation reads --batch rows per evaluation batch (2 here, 4 in one process): recorded, not compared
        assert len(m2["val"]["loss"]) == len(m1["val"]["loss"]) and all(v < 10 for v in m2["val"]["loss"])
        ranks = m2["memory"]["step_breakdown"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        single = m1["memory"]["step_breakdown"]["breakdown"]
        for r in ranks:
            assert r["breakdown"]["params"] < single["params"]  # each rank holds a stage / a shard
            assert r["bytes_sent"]["total"] > 0


@pytest.mark.parametrize("extra, message", [
    (["--strategy", "pipeline", "--model", "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=32"], "need at least 2 blocks"),
    (["--strategy", "pipeline", "--microbatches", "3"], "does not split into 3 micro-batches"),
    (["--strategy", "pipeline", "--dp", "3"], "--dp 3 does not divide the 2 processes"),
    (["--strategy", "zero2", "--dp", "2"], "--dp applies to --strategy pipeline, not --strategy zero2"),
    (["--strategy", "tensor", "--model", "gpt:layers=2,hidden=24,heads=3,vocab=256,seq=32"], "does not divide"),
])
def test_impossible_model_parallel_configs_fail_fast(tmp_path, capfd, extra, message):
    # in this process (a new interpreter's imports were most of each case); capfd also reads what any
    # rank the launcher started would write
    code = main(["train", *FAST, "--batch", "2", "--nproc", "2", "--out", str(tmp_path / "out"), *extra])
    err = capfd.readouterr().err
    assert code == 2, err[-2000:]
    assert message in err and err.count("memfit") <= 2 and "Traceback" not in err


@pytest.mark.multiproc
@pytest.mark.slow
def test_dp_x_pp_run_matches_one_process(tmp_path):
    """--nproc 4 --dp 2: two replicas of a 2-stage pipeline, batch 1 per process (global 4)."""
    one = tmp_path / "one"
    assert main(["train", *FAST, "--batch", "4", "--out", str(one)]) == 0
    out = tmp_path / "dppp"
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", *FAST, "--batch", "1", "--nproc", "4", "--dp", "2",
                           "--strategy", "pipeline", "--microbatches", "2", "--out", str(out)],
                          env=ENV, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, out))
    assert m2["steps"]["loss"] == pytest.approx(m1["steps"]["loss"], rel=1e-5)
    assert [r["rank"] for r in m2["memory"]["step_breakdown"]["ranks"]] == [0, 1, 2, 3]
