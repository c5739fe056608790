"""Every bad input is one line and exit 2; inputs that used to be silently wrong are honoured or refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.train import loop, state

TINY = "gpt:layers=1,hidden=16,heads=2,vocab=256,seq=32"
FAST = ["--model", TINY, "--seq", "16", "--batch", "2", "--eval-batches", "1", "--no-track", "--quiet"]


def _fails(capsys, argv: list[str], needle: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len([l for l in lines if "error:" in l]) == 1, err
    line = next(l for l in lines if "error:" in l)
    assert line.startswith(f"memfit {argv[0]}: error:") and needle in line, line
    return line


# ---------------------------------------------------------------- Hugging Face configs memfit cannot build

_CONFIGS = {
    "t5": {"model_type": "t5", "is_encoder_decoder": True, "vocab_size": 256, "d_model": 16},
    "t5-bare": {"model_type": "t5", "vocab_size": 256},
    "no-type": {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 256},
    "array": [1, 2, 3],
    "not-json": "{model_type: gpt2",
}


@pytest.mark.parametrize("name, needle", [
    ("t5", "is an encoder-decoder (t5)"), ("t5-bare", "'t5' has no causal-LM class"),
    ("no-type", "has no model_type"), ("array", "holds a JSON list, not an object"), ("not-json", "cannot read"),
])
@pytest.mark.parametrize("command", ["estimate", "track", "train"])
def test_hf_configs_memfit_cannot_build(tmp_path, capsys, command, name, needle):
    pytest.importorskip("transformers")
    if command == "estimate" and name.startswith("t5"):
        pytest.skip("estimate builds seq2seq models (tests/test_measure_hf_families.py)")
    path = tmp_path / "config.json"
    content = _CONFIGS[name]
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    extra = ["--steps", "1", "--out", str(tmp_path / "run")] if command == "train" else []
    line = _fails(capsys, [command, "--model", str(path), *extra], needle)
    if name != "not-json":
        assert "decoder-only causal language models" in line and "gpt2, llama" in line  # the supported families
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- numbers that overflow or are not finite


@pytest.mark.parametrize("argv, needle", [
    (["train", "--batch", "99999999999999999999"], "argument --batch: must be a positive integer"),
    (["train", "--seed", str(2**64)], "argument --seed: must be an integer >= 0 (at most 18446744073709551615)"),
    (["train", "--time-limit", "inf"], "argument --time-limit: must be a finite number"),
    (["train", "--weight-decay", "nan"], "argument --weight-decay: must be a finite number"),
    (["train", "--lr", "1e400"], "argument --lr: must be a finite number"),
    (["train", "--model", "gpt:layers=1,hidden=16,heads=2,vocab=256,dropout=-1"], "dropout=-1 must be in [0, 1)"),
    (["train", "--model", "gpt:layers=1,hidden=16,heads=2,vocab=256,dropout=5"], "dropout=5 must be in [0, 1)"),
    (["train", "--model", "gpt:layers=1,hidden=16,heads=2,vocab=256,dropout=nan"], "dropout=nan must be in [0, 1)"),
    (["estimate", "gpt2", "--batch", "99999999999999999999"], "argument --batch: must be a positive integer"),
    (["estimate", "gpt2", "--device-memory", "1e400"], "memory size '1e400' is not a finite number"),
    (["estimate", "--params", "1e400"], "count '1e400' is not a finite number"),
    (["estimate", "gpt:layers=1,hidden=99999999999,heads=1,vocab=256"], "beyond torch's 64-bit sizes"),
    (["estimate", "gpt:layers=1,hidden=64,heads=1,vocab=256,rope_theta=inf"], "rope_theta=inf must be a finite"),
    (["estimate", "gpt:layers=99999999999,hidden=64,heads=1,vocab=256"], "more than memfit builds"),
    (["estimate", "gpt:layers=1,hidden=64,heads=1,vocab=100000000,seq=1024", "--batch", "2147483647"],
     "beyond torch's 64-bit sizes"),
    (["track", "gpt2", "--steps", "99999999999999999999"], "argument --steps: must be a positive integer"),
])
def test_numbers_that_overflow_or_are_not_finite(tmp_path, capsys, argv, needle):
    if argv[0] == "train":
        argv = [*argv, "--steps", "1", "--out", str(tmp_path / "run"), "--quiet"]
    _fails(capsys, argv, needle)
    assert not (tmp_path / "run").exists()


def test_train_config_api_checks_the_same(tmp_path):
    from memfit.core.errors import ConfigError

    for bad in (dict(seed=2**64), dict(time_limit=float("inf")), dict(weight_decay=float("nan")),
                dict(batch=10**20), dict(dropout=1.0), dict(lr=float("nan"))):
        with pytest.raises(ConfigError):
            loop.train(loop.TrainConfig(model=TINY, steps=1, out=str(tmp_path / "r"), **bad), progress=False)
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- inputs that were silently wrong


def test_spec_dropout_is_used_unless_dropout_is_given(tmp_path):
    from memfit.train.setup import build_model

    spec = "gpt:layers=1,hidden=16,heads=2,vocab=256,seq=32,dropout=0.5"
    model = build_model(loop.TrainConfig(model=spec, seq=16))
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.5}
    model = build_model(loop.TrainConfig(model=spec, seq=16, dropout=0.0))
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}
    # And the run differs from one without dropout: the spec's value reaches the training.
    common = dict(seq=16, batch=2, steps=2, eval_batches=1, track=False)
    a = loop.train(loop.TrainConfig(model=spec, out=str(tmp_path / "a"), **common), progress=False, log=print)
    b = loop.train(loop.TrainConfig(model=spec, dropout=0.0, out=str(tmp_path / "b"), **common), progress=False,
                   log=print)
    assert a.metrics["steps"]["loss"] != b.metrics["steps"]["loss"]


def test_estimate_refuses_seq_beyond_the_configs_positions_as_train_does(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 256, "n_positions": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for command in ("estimate", "track", "train"):
        extra = ["--steps", "1", "--out", str(tmp_path / "run")] if command == "train" else []
        line = _fails(capsys, [command, "--model", str(path), "--seq", "65", *extra], "--seq 65 exceeds")
        assert "64 positions; use --seq <= 64" in line
    assert main(["estimate", str(path), "--json"]) == 0  # the default seq is the config's 64
    assert json.loads(capsys.readouterr().out)["seq"] == 64


def test_resume_with_fewer_steps_than_done_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "6", "--out", str(run)]) == 0
    _fails(capsys, ["train", "--resume", str(run), "--steps", "5"], "already at step 6, past --steps 5")


def test_estimate_takes_model_as_option_or_positional(capsys):
    assert main(["estimate", "--model", TINY, "--json"]) == 0
    by_option = json.loads(capsys.readouterr().out)
    assert main(["estimate", TINY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_device"] == by_option["per_device"]
    _fails(capsys, ["estimate", "gpt2", "--model", "gpt2-xl"], "two models given")


# ---------------------------------------------------------------- data paths, checkpoints, /dev/null


def test_relative_data_resumes_from_another_folder_and_by_absolute_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("to be or not to be, that is the question. " * 40)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["train", *FAST, "--data", "data/a.txt", "--steps", "2", "--out", "run"]) == 0
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["corpus"]["paths"] == [str(tmp_path / "data" / "a.txt")]
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", "--resume", "../run", "--steps", "3", "--quiet"]) == 0
    assert main(["train", "--resume", "../run", "--steps", "4", "--data", str(tmp_path / "data" / "a.txt"),
                 "--quiet"]) == 0
    (tmp_path / "other.txt").write_text("different bytes entirely " * 40)
    _fails(capsys, ["train", "--resume", "../run", "--steps", "5", "--data", "../other.txt"], "data of this run changed")


@pytest.mark.parametrize("content, needle", [
    (lambda: torch.zeros(3), "holds a Tensor, not the dict memfit train writes"),
    (lambda: {"step": 1}, "lacks horizon, config, model"),
    (lambda: [1, 2], "holds a list"),
])
def test_foreign_checkpoints(tmp_path, capsys, content, needle):
    torch.save(content(), tmp_path / "checkpoint.pt")
    _fails(capsys, ["train", "--resume", str(tmp_path)], needle)


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c["model"].pop("tok.weight"), "model weights in checkpoint"),
    (lambda c: c["model"].__setitem__("tok.weight", torch.zeros(3)), "model weights in checkpoint"),
    (lambda c: c.__setitem__("step", "seven"), "'step' is a str"),
    (lambda c: c["sampler"].clear(), "data sampler state"),
    (lambda c: c["optimizer"].clear(), "optimizer state"),
    (lambda c: c["config"].__setitem__("batch", -4), "--batch must be a positive integer"),
])
def test_edited_checkpoints(tmp_path, capsys, edit, needle):
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "1", "--out", str(run)]) == 0
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    edit(ckpt)
    state.save_checkpoint(run / "checkpoint.pt", ckpt)  # the checksums saved with it no longer hold
    _fails(capsys, ["train", "--resume", str(run), "--steps", "2"], "is corrupt: ")
    # Without checksums (a checkpoint from before them), the layout checks say what is wrong with it.
    ckpt.pop("checksums")
    state.save_checkpoint(run / "checkpoint.pt", ckpt)
    _fails(capsys, ["train", "--resume", str(run), "--steps", "2"], needle)


def test_dev_null_is_empty_not_missing(tmp_path, capsys):
    if not Path("/dev/null").exists():
        pytest.skip("no /dev/null")
    _fails(capsys, ["train", *FAST, "--data", "/dev/null", "--steps", "1", "--out", str(tmp_path / "r")],
           "data file '/dev/null' is empty")


def test_one_spill_dir_serves_activation_disk_offload_alone(tmp_path, capsys):
    spill = tmp_path / "spill"
    spill.mkdir()
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "2", "--checkpoint", "full+offload:disk", "--spill-dir", str(spill),
                 "--out", str(run)]) == 0, capsys.readouterr().err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 2
    assert not list(spill.iterdir())  # the activation spill folder was removed at the end
