"""`memfit train --model CONFIG.json --nproc 2 --strategy tensor|pipeline`: a Hugging Face causal LM
(random weights) trained on 2 gloo ranks follows one process's trajectory, reports per-rank peaks that
`memfit estimate` predicts, resumes bitwise from a save at step 2, and what cannot run fails in one line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_family_configs import write_config
from memfit.cli import main

FAST = ["--seq", "32", "--eval-batches", "2", "--quiet", "--warmup", "1", "--steps", "3", "--device", "cpu"]
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
LAYOUTS = {"tensor": [], "pipeline": ["--schedule", "gpipe", "--microbatches", "2"],
           "1f1b": ["--schedule", "1f1b", "--microbatches", "2"]}
STRATEGY = {"1f1b": "pipeline"}


def _two(config: str, out: Path, strategy: str) -> dict:
    """metrics.json of a 2-rank run with --batch 2 per process (a global batch of 4)."""
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", "--model", config, *FAST, "--batch", "2",
                           "--nproc", "2", "--strategy", STRATEGY.get(strategy, strategy), *LAYOUTS[strategy],
                           "--out", str(out)],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def _estimate(config: str, strategy: str, capsys) -> dict[int, int]:
    """`memfit estimate` of the run's layout: rank -> total bytes."""
    capsys.readouterr()
    assert main(["estimate", config, "--batch", "2", "--seq", "32", "--strategy", STRATEGY.get(strategy, strategy),
                 "--world", "2", *LAYOUTS[strategy], "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    return {r: row["total"] for row in ranks for r in row["rank_ids"]}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: per-head q/k norms summed over the TP ranks
def test_hf_model_parallel_runs_match_one_process_and_the_estimate(tmp_path, capsys, family):
    config = write_config(tmp_path, family)
    assert main(["train", "--model", config, *FAST, "--batch", "4", "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    for strategy in LAYOUTS:
        m = _two(config, tmp_path / strategy, strategy)
        # fp32 reassociation only (the TP ranks' partial sums, the stages' micro-batches), as for memfit's
        # GPT (tests/test_distributed_model_parallel_train.py): observed <= 5e-8 relative over 3 steps
        assert m["steps"]["loss"] == pytest.approx(one["steps"]["loss"], rel=1e-5), strategy
        ranks = m["memory"]["step_breakdown"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        est = _estimate(config, strategy, capsys)
        # To the byte, but for one buffer: the estimate traces the step memfit train runs (its aligned-target
        # loss, the targets held beside the inputs), which the tracker counts deterministically, except that
        # under load a TP rank at times still holds one all-reduce's (rows, seq, hidden) fp32 buffer at its
        # peak (gloo completing it late: seen on either rank, 1 run in 6 on 2 loaded cores). The estimate of
        # transformers' shifted loss read 1,028 B (tensor) to 7.7 KB (gpipe) under, and fails this.
        late = 4 * 32 * 32 * 4 if strategy == "tensor" else 0  # the TP group's 4 rows x seq 32 x hidden 32
        for r in ranks:  # the tracked peak of each rank at the tracked step against the per-rank estimate
            assert r["breakdown"]["params"] < one["memory"]["step_breakdown"]["breakdown"]["params"]
            assert est[r["rank"]] <= r["peak_bytes"] <= est[r["rank"]] + late, (strategy, r, est)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])
def test_hf_resumed_run_continues_the_uninterrupted_trajectory(tmp_path, strategy):
    from memfit.distributed.spawn import run_world
    from reference_run import train_rank

    extra = dict(schedule="gpipe", microbatches=2) if strategy == "pipeline" else {}
    cfg = dict(model=write_config(tmp_path, "llama"), seq=32, batch=2, steps=4, warmup=1, eval_batches=2,
               save_every=2, strategy=strategy, **extra)
    whole = run_world(train_rank, 2, args=({**cfg, "out": str(tmp_path / "whole")}, None, None), timeout_s=300)
    part = tmp_path / "part"
    run_world(train_rank, 2, args=({**cfg, "out": str(part)}, 2, None), timeout_s=300)
    assert json.loads((part / "metrics.json").read_text())["steps"]["step"][-1] == 2
    assert (part / "sharded-2").is_dir()
    resumed = run_world(train_rank, 2, args=(cfg, None, str(part)), timeout_s=300)
    assert len(whole[0]) == len(resumed[0]) == 4
    assert resumed[0] == whole[0]  # the same arithmetic in the same order on the same ranks: bitwise


def test_hf_model_parallel_refusals_are_one_line(tmp_path, capfd):
    """Checked in the launcher from a meta build: nothing is started, exit 2 and one line each."""
    cases = [("gpt2", "tensor", [], "has none"),  # no base_model_tp_plan
             ("gpt2", "pipeline", [], "is not one of them"),  # a family memfit does not cut
             ("llama", "tensor", ["--nproc", "3"], "does not divide the model's 4 attention heads"),
             ("llama", "pipeline", ["--nproc", "3"], "need at least 3 blocks")]  # 2 layers
    for family, strategy, extra, message in cases:
        code = main(["train", "--model", write_config(tmp_path, family), *FAST, "--batch", "2", "--nproc", "2",
                     "--strategy", strategy, "--out", str(tmp_path / "out"), *extra])
        err = capfd.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (family, strategy, err[-2000:])
        assert not (tmp_path / "out").exists()
