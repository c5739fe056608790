"""memfit plan --emit: a plan as torchtitan's, accelerate's, Lightning's and DeepSpeed's own configs,
loaded back by accelerate's and Lightning's own classes (installed here) and by memfit's torchtitan
reader; DeepSpeed's and torchtitan's own classes check them in tests/test_emit_validate.py (their venvs).
`memfit estimate --deepspeed` reads a DeepSpeed config."""
from __future__ import annotations

import json

import pytest

from memfit.cli import main

GPT = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq=64"


def plan_doc(strategy="zero3", dp=2, tp=1, pp=1, precision="bf16-master", offload=None,
             actions="recompute*2,keep*2", micro=2, accum=4, rows=2, schedule="1f1b", head_chunks=None) -> dict:
    """The JSON `memfit plan --json` writes (a cluster plan when dp x tp x pp > 1)."""
    plan = {"model": GPT, "budget": 2**22, "actions": actions, "micro_batch": micro, "accumulation": accum,
            "optimizer": "adamw", "precision": precision, "offload_optimizer": offload, "predicted_peak": 2**21,
            "predicted_time": 0.01, "n_blocks": 4, "head_chunks": head_chunks, "seq": 64}
    if dp * tp * pp == 1:
        return {"plan": plan}
    lay = {"strategy": strategy, "dp": dp, "tp": tp, "pp": pp, "rows": rows, "accum": accum, "schedule": schedule}
    return {"plan": plan, "cluster": {"gpus": dp * tp * pp, "layout": lay}}


def emitted(doc: dict, target: str):
    from memfit.integrations.emit_plan import emit, plan_view

    return emit(plan_view(doc), target)


def test_deepspeed_config_carries_stage_offload_precision_and_batch():
    out = emitted(plan_doc(offload="cpu", head_chunks=4), "deepspeed")
    cfg = json.loads(out.text)
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)
    assert "train_batch_size" not in cfg  # DeepSpeed derives it from the world it starts in
    assert cfg["activation_checkpointing"]["number_checkpoints"] == 2
    said = " ".join(out.unexpressed)
    assert "which blocks recompute (0-1 of 4)" in said and "loss head in 4 chunks" in said
    one = json.loads(emitted(plan_doc(dp=1, offload="cpu", precision="bf16-mixed", actions="keep"), "deepspeed").text)
    assert one["zero_optimization"]["stage"] == 2 and one["torch_autocast"]["dtype"] == "bfloat16"
    assert "activation_checkpointing" not in one


def test_torchtitan_job_reads_back_with_the_plans_degrees(tmp_path):
    from memfit.integrations.torchtitan import read_job

    out = emitted(plan_doc(strategy="pipeline", dp=2, pp=2, rows=1, accum=8, schedule="gpipe",
                           actions="recompute*4"), "torchtitan")
    path = tmp_path / "job.toml"
    path.write_text(out.text)
    job = read_job(str(path), world=4)
    assert (job.shard, job.replicate, job.pp, job.tp, job.ac_mode) == (2, 1, 2, 1, "full")
    assert job.batch == 8 and job.seq == 64  # a replica's 8 sequences, in micro-batches of 1
    assert 'pipeline_parallel_schedule = "GPipe"' in out.text and "pipeline_parallel_microbatch_size = 1" in out.text
    zero2 = emitted(plan_doc(strategy="zero2", actions="keep*2,recompute*2"), "torchtitan")
    assert 'fsdp_reshard_after_forward = "never"' in zero2.text and 'selective_ac_option = "2"' in zero2.text
    assert "global_batch_size = 16" in zero2.text  # 2 x 4 micro-steps x 2 ranks: torchtitan's accumulation


def test_accelerate_yaml_builds_accelerates_fsdp2_plugin(tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "accelerate.yaml"
    path.write_text(emitted(plan_doc(offload="cpu"), "accelerate").text)
    cfg = load_config_from_file(str(path))
    assert (cfg.distributed_type, cfg.num_processes, cfg.mixed_precision) == ("FSDP", 2, "bf16")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    for key, value in prepare_multi_gpu_env(args).items():  # what `accelerate launch` hands each process
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True and plugin.activation_checkpointing
    assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy" and plugin.transformer_cls_names_to_wrap == ["Block"]
    ddp = emitted(plan_doc(strategy="ddp", precision="32-true", actions="keep"), "accelerate")
    assert "distributed_type: MULTI_GPU" in ddp.text and "mixed_precision: \"no\"" in ddp.text


def test_lightning_yaml_constructs_fsdp_strategy(tmp_path):
    from lightning.pytorch.strategies import FSDPStrategy

    from memfit.integrations.emit_lightning import trainer_kwargs
    from memfit.models.gpt import Block

    path = tmp_path / "lightning.yaml"
    path.write_text(emitted(plan_doc(strategy="zero2", offload="cpu"), "lightning").text)
    kw = trainer_kwargs(str(path))
    strategy = kw["strategy"]
    assert isinstance(strategy, FSDPStrategy) and strategy.sharding_strategy.name == "SHARD_GRAD_OP"
    assert strategy.cpu_offload.offload_params
    assert Block in strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes
    assert (kw["devices"], kw["precision"], kw["accumulate_grad_batches"]) == (2, "bf16-mixed", 4)


def test_cli_emit_from_a_plan_file_and_its_refusals(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_doc(strategy="pipeline", dp=1, pp=2)))
    out = tmp_path / "ds.json"
    assert main(["plan", "--from-plan", str(plan), "--emit", "deepspeed", "--emit-to", str(out)]) == 0
    assert json.loads(out.read_text())["pipeline"]["stages"] == 2
    assert "deepspeed cannot express" in capsys.readouterr().out
    for argv, said in ((["--from-plan", str(plan), "--emit", "accelerate"], "no pipeline-parallel"),
                       (["--from-plan", str(plan)], "go with --emit"),
                       (["--from-plan", str(tmp_path / "none.json"), "--emit", "lightning"], "no such file")):
        assert main(["plan", *argv]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_estimate_deepspeed_reads_the_config(tmp_path, capsys):
    from memfit.integrations.deepspeed import read_config
    from memfit.measure.estimate import estimate

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                      "reduce_bucket_size": 1000}}))
    job = read_config(str(path), world=2)
    assert (job.stage, job.micro_batch, job.accumulation, job.precision, job.offload_optimizer) == \
        (2, 4, 2, "bf16-master", "cpu")
    assert main(["estimate", "--deepspeed", str(path), GPT, "--world", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = estimate(GPT, batch=4, accum=2, precision="bf16-master", strategy="zero2", world=2,
                    offload_optimizer="cpu")
    # memfit's ZeRO-2 plus DeepSpeed's gradient bucket: 1000 elements of bf16 (its fp32 partition is the
    # master weights memfit counts, and offloaded here)
    assert got["per_device"]["total"] == want.per_device["total"] + 1000 * 2 and got["zero"] == 2
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    assert main(["estimate", "--deepspeed", str(path), GPT, "--world", "2"]) == 2
    assert "offload_param" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed"])
def test_every_target_names_per_block_offload(target):
    out = emitted(plan_doc(actions="recompute+offload:cpu*2,keep+compress:int8*2"), target)
    said = " ".join(out.unexpressed)
    assert "activation offload to cpu of blocks 0-1" in said and "compressed saved activations of blocks 2-3" in said
