"""`memfit train --plan FILE` takes its shape from the plan and refuses what contradicts it; `--budget`
refuses the options it chooses; a run that ends over its budget exits 3 with one line, its run folder kept."""
from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.plan.fit import model_digest
from memfit.train.budget import OVER_BUDGET, plan_config
from memfit.train.config import TrainConfig

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=64"
RUN = ["--eval-batches", "1", "--quiet", "--device", "cpu", "--steps", "2"]


def _plan_file(tmp_path, **over) -> str:
    plan = {"model": TINY, "budget": 64 * 2**20, "actions": "recompute,keep", "micro_batch": 2, "accumulation": 2,
            "optimizer": "adamw", "precision": "32-true", "offload_optimizer": None, "predicted_peak": 2**20,
            "predicted_time": 1.0, "n_blocks": 2, "seq": 32, "global_batch": 4, "model_digest": model_digest(TINY),
            "device": "cpu", "keep_output": False, **over}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": plan}))
    return str(path)


def test_a_plan_file_sets_the_whole_shape(tmp_path):
    cfg, plan = plan_config(TrainConfig(model=TINY), plan_file=_plan_file(tmp_path))
    assert (cfg.batch, cfg.accum, cfg.seq, cfg.checkpoint, cfg.precision) == (2, 2, 32, "recompute,keep", "32-true")
    # options that agree with the plan are accepted
    agree = TrainConfig(model=TINY, batch=4, accum=1, seq=32, precision="32-true")
    assert plan_config(agree, plan_file=_plan_file(tmp_path), given={"batch", "accum", "seq", "precision"})[0].seq == 32


@pytest.mark.parametrize("field, value, needle", [
    ("batch", 8, "--batch 8 x --accum 1"), ("seq", 64, "--seq 64"), ("checkpoint", "full", "--checkpoint full"),
    ("precision", "bf16-mixed", "--precision bf16-mixed"), ("optimizer", "sgd", "--optimizer sgd"),
])
def test_a_conflicting_option_is_refused_in_one_line(tmp_path, field, value, needle):
    cfg = TrainConfig(model=TINY, **{field: value})
    with pytest.raises(ConfigError, match="conflicts with plan file") as err:
        plan_config(cfg, plan_file=_plan_file(tmp_path), given={field})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_plan_for_another_configuration_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="another configuration"):
        plan_config(TrainConfig(model=TINY), plan_file=_plan_file(tmp_path, model_digest="0" * 16))


@pytest.mark.parametrize("flag, value", [("--checkpoint", "full"), ("--offload-optimizer", "cpu")])
def test_budget_refuses_what_it_chooses(flag, value, capsys):
    assert main(["train", "--model", TINY, "--budget", "64MiB", flag, value, *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} is chosen by --budget" in err and "--allow" in err


def test_allow_without_budget_is_refused(capsys):
    assert main(["train", "--model", TINY, "--allow", "recompute", *RUN]) == 2
    assert "--budget" in capsys.readouterr().err


def test_a_run_over_its_budget_exits_3_with_one_line_and_keeps_its_folder(tmp_path, capsys):
    """The plan file's budget is set below what its shape needs: the run trains, measures, says so."""
    out = tmp_path / "run"
    rc = main(["train", "--model", TINY, "--plan", _plan_file(tmp_path, budget=2**16), "--out", str(out), *RUN])
    assert rc == OVER_BUDGET
    err = capsys.readouterr().err.strip().splitlines()
    assert sum("over the budget" in line for line in err) == 1 and str(out) in err[-1]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["budget"]["over_budget"] and metrics["budget"]["measured_peak_bytes"] > 2**16
    assert metrics["config"]["batch"] == 2 and metrics["config"]["accum"] == 2 and metrics["config"]["seq"] == 32
    assert (out / "checkpoint.pt").exists()


def test_plan_and_train_share_their_shape_defaults():
    import argparse

    from memfit.cli import plan as plan_cli
    from memfit.train.config import DEFAULT_MODEL

    sub = argparse.ArgumentParser().add_subparsers()
    args = plan_cli.add_parser(sub).parse_args([DEFAULT_MODEL, "--budget", "1GiB"])
    d = TrainConfig()
    assert plan_cli.single_device_batch(args) == d.batch * d.accum and plan_cli.default_seq(DEFAULT_MODEL) == d.seq
    assert plan_cli.default_seq("gpt:layers=1,hidden=32,heads=2,vocab=256,seq=64") == 64  # at most the model's
