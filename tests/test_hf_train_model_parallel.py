"""`memfit train --model CONFIG.json --nproc 2 --strategy tensor|pipeline`: a Hugging Face causal LM
(random weights) trained on 2 gloo ranks follows one process's trajectory, reports per-rank peaks that
`memfit estimate` predicts, resumes bitwise from a save at step 2, and what cannot run fails in one line."""
from __future__ import annotations

import json

import pytest

from hf_family_configs import write_config
from hf_layout_runs import FAST, runs_against_one_process
from memfit.cli import main

LAYOUTS = {"tensor": ["--strategy", "tensor"],
           "pipeline": ["--strategy", "pipeline", "--schedule", "gpipe", "--microbatches", "2"],
           "1f1b": ["--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "2"]}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: per-head q/k norms summed over the TP ranks
def test_hf_model_parallel_runs_match_one_process_and_the_estimate(tmp_path, capsys, family):
    for strategy, ranks, est in runs_against_one_process(tmp_path, capsys, family, 2, LAYOUTS):
        # To the byte, but for one buffer: the estimate traces the step memfit train runs (its aligned-target
        # loss, the targets held beside the inputs), which the tracker counts deterministically, except that
        # under load a TP rank at times still holds one all-reduce's (rows, seq, hidden) fp32 buffer at its
        # peak (gloo completing it late: seen on either rank, 1 run in 6 on 2 loaded cores). The estimate of
        # transformers' shifted loss read 1,028 B (tensor) to 7.7 KB (gpipe) under, and fails this.
        late = 4 * 32 * 32 * 4 if strategy == "tensor" else 0  # the TP group's 4 rows x seq 32 x hidden 32
        for r in ranks:  # the tracked peak of each rank at the tracked step against the per-rank estimate
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
