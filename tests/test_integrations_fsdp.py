"""FSDP2 ranks planned by memfit where frameworks shard with it: the HF Trainer's fsdp=, accelerate's FSDP2
plugin (memfit.integrations.fsdp, hf_fsdp, accelerate_fsdp). The default tier reads the frameworks'
configurations and plans in one process; the slow tier runs 2 gloo processes under torchrun and compares
the plan's per-rank peak with torch's MemTracker."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import tiny_llama as tl  # noqa: E402
from memfit.core.errors import ConfigError  # noqa: E402
from memfit.integrations.fsdp import FsdpSetup, held_gradients, hf_spec, rank_estimate, read_plugin  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def plugin_of(tmp_path, **kw):
    """The FSDP plugin the Trainer builds from these TrainingArguments (what its accelerator holds)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)
    return FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)


def test_the_trainers_fsdp_config_is_read_and_what_is_not_priced_refused(tmp_path):
    def v2(**kw):  # a fresh dict each time: TrainingArguments fills the one it is given
        return {"fsdp_version": 2, **kw}

    full = plugin_of(tmp_path, fsdp="full_shard", fsdp_config=v2())
    assert read_plugin(full, "no", 2) == FsdpSetup(2)
    got = read_plugin(plugin_of(tmp_path, fsdp="full_shard", fsdp_config=v2(activation_checkpointing=True)), "bf16", 4)
    assert (got.world, got.precision, got.checkpointing) == (4, "bf16-mixed", True)
    assert read_plugin(plugin_of(tmp_path, fsdp="shard_grad_op", fsdp_config=v2()), "no", 2).reshard is False
    with pytest.raises(ConfigError, match="CPU offload"):
        read_plugin(plugin_of(tmp_path, fsdp="full_shard offload", fsdp_config=v2()), "no", 2)
    half = types.SimpleNamespace(fsdp_version=2, cpu_offload=None, reshard_after_forward=2)
    assert read_plugin(half, "no", 4).reshard == 2 and read_plugin(half, "no", 2).reshard is True  # 2 of 2: all
    with pytest.raises(ConfigError, match="divisor of the world size"):
        read_plugin(types.SimpleNamespace(fsdp_version=2, cpu_offload=None, reshard_after_forward=3), "no", 4)
    with pytest.raises(ConfigError, match="fsdp_version 1"):  # (accelerate builds FSDP1's plugin on GPUs only)
        read_plugin(types.SimpleNamespace(fsdp_version=1), "no", 2)
    with pytest.raises(ConfigError, match="fp16"):
        read_plugin(full, "fp16", 2)
    with pytest.raises(ConfigError, match="2 or more"):
        read_plugin(full, "no", 1)


def cpu_fsdp(trainer):
    """The Trainer's accelerator set to FSDP as on a GPU (accelerate leaves it off on CPU processes)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def test_fit_trainer_plans_each_fsdp2_rank_and_sets_the_trainer(tmp_path, monkeypatch, capsys):
    from transformers.training_args import ParallelMode

    from memfit.integrations.hf import fit_trainer
    from test_integrations_hf import make_trainer

    # the Trainer as rank 0 of 2 sees itself (it refuses fsdp= outside distributed training)
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    distributed = property(lambda self: ParallelMode.DISTRIBUTED)
    monkeypatch.setattr(transformers.TrainingArguments, "parallel_mode", distributed)
    trainer = make_trainer(tl.model(), tmp_path, fsdp="full_shard",
                           fsdp_config={"fsdp_version": 2, "activation_checkpointing": True})
    with pytest.raises(ConfigError, match="runs no FSDP here"):  # on CPU processes accelerate runs DDP
        fit_trainer(trainer, "1GiB")
    cpu_fsdp(trainer)
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    spec, setup = hf_spec(trainer.model, str(spec_dir)), FsdpSetup(2)
    whole = rank_estimate(spec, 4, tl.SEQ, setup, "adamw", "none").per_device["total"]
    half = rank_estimate(spec, 2, tl.SEQ, setup, "adamw", "none").per_device["total"] + held_gradients(spec, setup)
    assert half < whole  # (the split step, its held unsharded gradients included, needs less)
    with pytest.warns(UserWarning, match="activation checkpointing is turned off"):
        plan = fit_trainer(trainer, half)  # the whole batch does not fit, two micro-batches of 2 do
    assert (plan.micro_batch, plan.accumulation, plan.checkpoint, plan.predicted) == (2, 2, "none", half)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 2)
    assert trainer.accelerator.state.fsdp_plugin.activation_checkpointing is False
    assert "micro-batch 2 x accumulation 2 per rank" in capsys.readouterr().out  # rank 0 says it


def test_the_advice_in_the_refusals_is_a_command_that_parses():
    """The refusals point at `memfit estimate <config.json> --strategy zero3 --world N ...` (there is no
    `memfit plan --strategy`)."""
    from memfit.cli import build_parser

    text = (ROOT / "src/memfit/integrations/hf.py").read_text()
    assert "memfit plan --strategy" not in text
    advice = text.split("`memfit estimate ", 1)[1].split("`", 1)[0].replace('"\n', "").replace('"', "")
    argv = ["estimate"] + [w for w in shlex.split(" ".join(advice.split())) if not w.startswith("<")]
    args = build_parser().parse_args([a if a not in ("N", "B", "S") else "2" for a in argv] + ["llama:tiny"])
    assert (args.strategy, args.world) == ("zero3", 2)


def torchrun(script: str, *args: str, port: int) -> list[dict]:
    """Run `script` on 2 gloo processes; each rank's RESULT json."""
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2", "--master_port", str(port),
           script, *args]
    # TMPDIR: torchrun's log folder (torchelastic_*), which torchrun never removes, goes in one that is removed.
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": scratch}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    text, decoder = out.stdout, json.JSONDecoder()
    rows = [decoder.raw_decode(text, i + 7)[0] for i in range(len(text)) if text.startswith("RESULT ", i)]
    assert out.returncode == 0 and len(rows) == 2, out.stderr[-3000:]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_fsdp2_under_torchrun_each_rank_within_the_prediction():
    rows = torchrun(str(ROOT / "bench/trainer_fsdp2.py"), "--worker", "64MiB", "plain", port=29517)
    for r in rows:
        assert (r["micro_batch"], r["accumulation"], r["checkpoint"]) == (4, 1, "none")
        # the Trainer's step peaks below the same model under fully_shard directly (which the estimate
        # matches within 0.1%); 10%: the larger gap seen, 6.5%, with room for the tracker's categories
        assert r["measured"]["Total"] <= r["predicted"] <= 1.10 * r["measured"]["Total"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_accelerate_fsdp2_plugin_under_torchrun_each_rank_as_predicted():
    rows = torchrun(str(ROOT / "tests/fsdp_worker.py"), "accelerate", "64MiB", port=29519)
    for r in rows:
        assert (r["micro_batch"], r["accumulation"]) == (4, 1)
        # the estimate is the bare fully_shard step's to 0.1%; the loop's own tensors (its batch, the
        # losses) add 0.6% here: 2% bounds both
        assert abs(r["predicted"] / r["measured"] - 1) <= 0.02
    assert rows[0]["losses"] != rows[1]["losses"]  # each rank trained on its own rows


def test_lightning_model_parallel_strategy_planned_per_rank_and_fsdp1_refused():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from memfit.integrations.lightning import MemfitCallback
    from memfit.integrations.lightning_fsdp import plan_fsdp2

    model, example = tl.model(), tl.batch(4)
    plan = plan_fsdp2(model, example, "1GiB", ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    assert (plan.world, plan.micro_batch, plan.accumulation, plan.checkpoint) == (2, 4, 1, "none")
    with __import__("tempfile").TemporaryDirectory() as folder:
        assert plan.predicted == rank_estimate(hf_spec(model, folder), 4, tl.SEQ, FsdpSetup(2), "adamw",
                                               "none").per_device["total"]
    for strategy, words in ((FSDPStrategy(), "FSDP1"), (ModelParallelStrategy(2, 2), "tensor_parallel_size=2")):
        with pytest.raises(ConfigError, match=words):
            plan_fsdp2(model, example, "1GiB", strategy)
    # a one-device plan's callback under a sharding strategy: refused, its figures are one device's
    with pytest.raises(ConfigError, match="plan_fsdp2"):
        MemfitCallback(plan_stub()).setup(types.SimpleNamespace(strategy=ModelParallelStrategy(2, 1)), None, "fit")


def plan_stub():
    return types.SimpleNamespace(micro_batch=4, accumulation=1, budget=1 << 30)


@pytest.mark.slow
@pytest.mark.multiproc
def test_lightning_model_parallel_fsdp2_under_torchrun_each_rank_as_predicted():
    pytest.importorskip("lightning")
    rows = torchrun(str(ROOT / "tests/fsdp_worker.py"), "lightning", "64MiB", port=29521)
    for r in rows:
        assert (r["micro_batch"], r["accumulation"]) == (4, 1)
        # as accelerate's: the bare fully_shard step to 0.1%, the loop's own tensors 0.6% more here
        assert abs(r["predicted"] / r["measured"] - 1) <= 0.02
    assert rows[0]["losses"] != rows[1]["losses"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_accelerate_fsdp2_recompute_losses_equal_and_each_rank_lower():
    plain = torchrun(str(ROOT / "tests/fsdp_worker.py"), "accelerate", "64MiB", port=29523)
    mine = torchrun(str(ROOT / "tests/fsdp_worker.py"), "accelerate", "2.4MiB", port=29525)
    for p, m in zip(plain, mine):
        assert (m["micro_batch"], m["accumulation"], m["checkpoint"]) == (4, 1, "full")
        assert m["losses"] == p["losses"]  # memfit's recomputation is bit-exact under FSDP2 too
        assert m["measured"] < p["measured"]
        assert m["measured"] <= 2.4 * 2**20  # within the budget
        # memfit's recomputation is what the estimate prices: 0.5% below the measured peak here (the loop's
        # own tensors), 2% as for the runs without it
        assert abs(m["predicted"] / m["measured"] - 1) <= 0.02
