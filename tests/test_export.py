"""`memfit export RUN --out DIR`: one consolidated state dict from a run of any layout (save_pretrained
for Hugging Face models); a sharded run's master weights and optimizer state gathered whole."""
from __future__ import annotations

import json

import pytest
import torch

from memfit.cli import main
from memfit.train import loop

TINY = "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=16"


def _train(out, **kw):
    cfg = dict(model=TINY, seq=16, batch=2, steps=2, warmup=1, eval_batches=1, track=False, device="cpu", out=str(out))
    return loop.train(loop.TrainConfig(**{**cfg, **kw}), progress=False, log=lambda m: None)


def test_export_one_process_run_with_masters_and_optimizer(tmp_path, capsys):
    _train(tmp_path / "run", precision="bf16-master", offload_optimizer="disk")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x"), "--optimizer"]) == 0
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    model = torch.load(tmp_path / "x" / "model.pt", weights_only=True)
    assert model.keys() == ckpt["model"].keys()
    assert all(torch.equal(model[k], ckpt["model"][k]) for k in model)
    opt = torch.load(tmp_path / "x" / "optimizer.pt", weights_only=True)
    assert opt["step"] == 2.0
    assert opt["state"]["tok.weight"]["exp_avg"].shape == model["tok.weight"].shape
    info = json.loads((tmp_path / "x" / "export.json").read_text())
    assert info["step"] == 2 and info["dtypes"] == ["bfloat16"] and info["strategy"] == "none"
    # --master: the fp32 masters, which round to the 16-bit weights
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m"), "--master"]) == 0
    master = torch.load(tmp_path / "m" / "model.pt", weights_only=True)
    assert master["blocks.0.attn.qkv.weight"].dtype == torch.float32
    assert torch.equal(master["blocks.0.attn.qkv.weight"].bfloat16(), model["blocks.0.attn.qkv.weight"])
    assert not torch.equal(master["blocks.0.attn.qkv.weight"], model["blocks.0.attn.qkv.weight"].float())
    capsys.readouterr()
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "y")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_export_hugging_face_model_saves_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 32,
              "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _train(tmp_path / "run", model=str(tmp_path / "config.json"), dropout=0.0)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "x"))
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    got = loaded.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ckpt["model"].items() if k in got)
    assert sum(k in got for k in ckpt["model"]) >= len(ckpt["model"]) - 1
