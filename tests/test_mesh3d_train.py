"""`memfit train --strategy pipeline --engine fsdp2 --pp P --tp T`: the 3-D layout (FSDP2 over dp x the
model's tensor plan over tp x torch's pipelining over pp) trains a Hugging Face Llama (random weights) on 4
gloo ranks along one process's trajectory, each rank's tracked peak within 3% of `memfit estimate` for the
layout, resumes bitwise from a DCP save at step 2, and what cannot run is refused in one line."""
from __future__ import annotations

import json

import pytest

from hf_family_configs import write_config
from hf_layout_runs import FAST, runs_against_one_process
from memfit.cli import main

ENGINE = ["--strategy", "pipeline", "--engine", "fsdp2"]
LAYOUTS = {"pp2-dp2": [*ENGINE, "--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
           "pp2-tp2": [*ENGINE, "--pp", "2", "--tp", "2", "--schedule", "gpipe", "--microbatches", "2"]}


@pytest.mark.multiproc
@pytest.mark.slow
def test_3d_runs_match_one_process_and_the_estimate(tmp_path, capsys):
    for layout, ranks, est in runs_against_one_process(tmp_path, capsys, "llama", 4, LAYOUTS):
        for r in ranks:  # torch's MemTracker peak of each rank at the tracked step against the per-rank estimate
            assert abs(est[r["rank"]] - r["peak_bytes"]) <= 0.03 * r["peak_bytes"], (layout, r, est)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=2, tp=2, schedule="gpipe")], ids=["pp2-dp2", "pp2-tp2"])
def test_3d_resumed_run_continues_the_uninterrupted_trajectory(tmp_path, layout):
    from memfit.distributed.spawn import run_world
    from reference_run import train_rank

    cfg = dict(model=write_config(tmp_path, "llama"), seq=32, batch=2, steps=4, warmup=1, eval_batches=2,
               save_every=2, strategy="pipeline", engine="fsdp2", microbatches=2, **layout)
    whole = run_world(train_rank, 4, args=({**cfg, "out": str(tmp_path / "whole")}, None, None), timeout_s=600)
    part = tmp_path / "part"
    run_world(train_rank, 4, args=({**cfg, "out": str(part)}, 2, None), timeout_s=600)
    assert json.loads((part / "metrics.json").read_text())["steps"]["step"][-1] == 2
    assert (part / "sharded-2" / ".metadata").is_file() and not list(part.glob(".sharded-*.partial"))
    resumed = run_world(train_rank, 4, args=(cfg, None, str(part)), timeout_s=600)
    assert len(whole[0]) == len(resumed[0]) == 4
    assert resumed[0] == whole[0]  # the same arithmetic in the same order on the same ranks: bitwise


def test_3d_refusals_are_one_line_before_any_launch(tmp_path, capfd):
    """Checked in the launcher (from the config, or a meta build): nothing starts, exit 2, one line each."""
    llama = write_config(tmp_path, "llama")
    cases = [(llama, ["--pp", "3"], "does not divide the world of 4"),
             (llama, ["--dp", "2"], "takes --pp and --tp"),
             ("gpt:layers=2,hidden=32,heads=2,vocab=256", ["--tp", "2"], "memfit's GPT runs the 3-D layout with --tp 1")]
    for model, extra, message in cases:
        code = main(["train", "--model", model, *FAST, "--batch", "2", "--nproc", "4", *ENGINE,
                     "--out", str(tmp_path / "out"), *extra])
        err = capfd.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (extra, err[-2000:])
        assert len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()
    code = main(["train", "--model", llama, *FAST, "--nproc", "2", "--strategy", "pipeline", "--pp", "2",
                 "--out", str(tmp_path / "out")])
    err = capfd.readouterr().err
    assert code == 2 and "add --engine fsdp2" in err, err


def test_a_3d_run_resumes_only_in_its_own_layout():
    """The layout checkpoint.pt records (Mesh3DOptimizer.state_dict) against the resumed run's; the
    layouts' own resume is the slow test above."""
    from memfit.core.errors import ConfigError
    from memfit.train.config import TrainConfig
    from memfit.train.model_parallel import check_3d_resume

    ckpt = {"optimizer": {"engine": "fsdp2", "mesh3d": [2, 2, 1]}, "config": {"strategy": "pipeline"}}
    same = TrainConfig(strategy="pipeline", engine="fsdp2", pp=2)
    check_3d_resume(same, ckpt, 4)
    for cfg, world in [(TrainConfig(strategy="pipeline", engine="fsdp2", pp=2, tp=2), 4), (same, 8),
                       (TrainConfig(strategy="zero3", engine="fsdp2"), 4)]:
        with pytest.raises(ConfigError, match="written in the layout pp 2 x dp 2 x tp 1"):
            check_3d_resume(cfg, ckpt, world)
    with pytest.raises(ConfigError, match="layout --strategy zero3"):  # another layout's run into the 3-D one
        check_3d_resume(same, {"optimizer": {"engine": "fsdp2"}, "config": {"strategy": "zero3"}}, 4)
    check_3d_resume(TrainConfig(strategy="zero3", engine="fsdp2"), {"optimizer": {}, "config": {}}, 4)
