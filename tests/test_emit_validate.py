"""Configs that `memfit plan --emit` writes, loaded by DeepSpeed's and torchtitan's own config classes in
their own venvs (bash bench/setup_deepspeed.sh, bash bench/setup_torchtitan.sh); skipped without them.
The emitted DeepSpeed configs also train on 2 gloo ranks in bench/deepspeed_config.py."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from test_emit import emitted, plan_doc
from test_pipeline_interleaved import interleaved_plan

pytestmark = pytest.mark.slow
CHECKS = Path(__file__).with_name("emit_checks.py")
DS = Path(os.environ.get("MEMFIT_DS_VENV", "/work/dsvenv")) / "bin" / "python"
TT = Path(os.environ.get("MEMFIT_TT_VENV", "/work/ttvenv")) / "bin" / "python"
CASES = {  # name -> the plan
    "zero3 cpu offload bf16": plan_doc(offload="cpu"),
    "zero2 disk offload fp16": plan_doc(strategy="zero2", offload="disk", precision="16-mixed"),
    "zero1 bf16-mixed": plan_doc(strategy="zero1", precision="bf16-mixed"),
    "ddp fp32": plan_doc(strategy="ddp", precision="32-true", actions="keep"),
    "tensor": plan_doc(strategy="tensor", dp=1, tp=2),
    "pipeline gpipe": plan_doc(strategy="pipeline", dp=2, pp=2, rows=1, accum=8, schedule="gpipe"),
    "pipeline interleaved": interleaved_plan(),
    "one device": plan_doc(dp=1, actions="selective*4"),
}


def _env() -> dict:
    """The side venv sees the running suite's packages (torch, memfit) first: its own .pth names the
    venv it was made from, which may have moved or been removed since (a worktree, a fresh clone)."""
    paths = [*site.getsitepackages(), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _usable(python: Path, kind: str) -> None:
    """Skip, saying why, unless the side venv exists and imports its framework beside this suite's torch."""
    if not python.exists():
        pytest.skip(f"{python} missing: bash bench/setup_{kind}.sh")
    module = {"deepspeed": "deepspeed", "torchtitan": "torchtitan.config"}[kind]
    probe = subprocess.run([str(python), str(CHECKS), "--probe", module], capture_output=True, text=True,
                           timeout=300, env=_env(), cwd=CHECKS.parent)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import {module} ({probe.stderr.strip().splitlines()[-1:]}): "
                    f"bash bench/setup_{kind}.sh")


def _load(python: Path, kind: str, path: Path) -> dict:
    _usable(python, kind)
    got = subprocess.run([str(python), str(CHECKS), kind, str(path)], capture_output=True, text=True, timeout=300,
                         env=_env(), cwd=path.parent)
    assert got.returncode == 0, got.stderr[-2000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_deepspeed_config_validates_in_deepspeed(name, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(emitted(CASES[name], "deepspeed").text)
    got = _load(DS, "deepspeed", path)
    want = json.loads(path.read_text())
    assert got["stage"] == want["zero_optimization"]["stage"]
    assert (got["micro"], got["accum"]) == (want["train_micro_batch_size_per_gpu"], want["gradient_accumulation_steps"])
    assert got["bf16"] == ("bf16" in want) and got["fp16"] == ("fp16" in want) and got["autocast"] == ("torch_autocast" in want)
    assert got["offload"] == want["zero_optimization"].get("offload_optimizer", {}).get("device")
    assert got["autotp"] == want.get("tensor_parallel", {}).get("autotp_size", 0)
    assert got["stages"] == want.get("pipeline", {}).get("stages", "auto")


@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_job_loads_in_torchtitans_config_manager(name, tmp_path):
    import tomllib

    path = tmp_path / "job.toml"
    path.write_text(emitted(CASES[name], "torchtitan").text)
    got = _load(TT, "torchtitan", path)
    want = tomllib.loads(path.read_text())
    for table in ("parallelism", "training", "activation_checkpoint"):
        for key, value in want[table].items():
            assert got[table][key] == value, (table, key)


def test_torchtitan_manager_refuses_a_key_it_lacks(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(emitted(CASES["tensor"], "torchtitan").text + "\n[parallelism_typo]\ntensor = 2\n")
    _usable(TT, "torchtitan")
    got = subprocess.run([str(TT), str(CHECKS), "torchtitan", str(path)], capture_output=True, text=True, timeout=300,
                         env=_env(), cwd=tmp_path)
    assert got.returncode != 0  # so the loads above are checks, not a parser that takes anything


def test_hugging_face_model_names_its_decoder_layer(tmp_path):
    import transformers

    from memfit.integrations.emit_lightning import trainer_kwargs

    transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=512, head_dim=16).save_pretrained(tmp_path)
    doc = plan_doc()
    doc["plan"].update(model=str(tmp_path / "config.json"), n_blocks=2, actions="recompute*2", precision="bf16-mixed")
    acc = emitted(doc, "accelerate")
    assert "fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer" in acc.text and not acc.unexpressed
    path = tmp_path / "lightning.yaml"
    path.write_text(emitted(doc, "lightning").text)
    policy = trainer_kwargs(str(path))["strategy"]._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer in policy._module_classes
