"""A memfit plan as a DeepSpeed config (the JSON `deepspeed.initialize(config=...)` takes).

What it carries: the ZeRO stage (zero1-3; ddp and one device: stage 0), optimizer offload
(`offload_optimizer` cpu, or nvme for a plan that offloads to disk), precision (bf16-master: DeepSpeed's
`bf16`, 16-bit weights with fp32 master weights in the optimizer; fp16 likewise with its loss scaler;
bf16-mixed: `torch_autocast` over fp32 weights), `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps` (DeepSpeed derives `train_batch_size` = micro x accumulation x data-parallel
ranks, so no figure here depends on the world it starts in), tensor parallelism as AutoTP
(`tensor_parallel.autotp_size`), pipeline stages (`pipeline.stages`, for a PipelineModule) and
`activation_checkpointing` when blocks recompute.

What it cannot: which blocks recompute (DeepSpeed's section configures `deepspeed.checkpointing.checkpoint`,
which the model's code calls per block, or HF's `gradient_checkpointing_enable`), memfit's selective
policy, activation offload and compression per block, a chunked loss head, GPipe's schedule.
"""
from __future__ import annotations

import json

from memfit.integrations.emit_plan import Emitted, PlanView, block_list, common_unexpressed

_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "lion": "Lion", "adagrad": "Adagrad"}


def _precision(view: PlanView, config: dict, missing: list[str]) -> None:
    p = view.precision
    if p in ("bf16-master", "bf16-true"):
        config["bf16"] = {"enabled": True}
        if p == "bf16-true":
            missing.append("bf16-true (no fp32 master weights): DeepSpeed's bf16 keeps fp32 master weights and "
                           "optimizer state, 4 bytes per parameter more than the plan")
    elif p.startswith("16-") or p.startswith("fp16"):
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
        if p != "16-master":
            missing.append(f"{p}: DeepSpeed's fp16 keeps 16-bit weights with fp32 master weights (16-master)")
    elif p == "bf16-mixed":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif p != "32-true":
        missing.append(f"precision {p}: no DeepSpeed equivalent; the config trains in fp32")


def _zero(view: PlanView, missing: list[str]) -> dict:
    stage = view.zero
    zero: dict = {"stage": stage}
    if view.offload_optimizer:
        if stage == 0:  # ZeRO-Offload runs on stage 1-3; one rank's stage 2 shards nothing
            stage = zero["stage"] = 2 if view.dp == 1 else 1
            missing.append(f"optimizer offload without a ZeRO stage: emitted as stage {stage} (DeepSpeed offloads "
                           "only under ZeRO), which on one rank shards nothing")
        if view.offload_optimizer == "disk":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
            if stage != 3:
                zero["stage"] = 3
                missing.append("optimizer offload to disk: DeepSpeed offloads to NVMe only under ZeRO-3; emitted as "
                               "stage 3")
            missing.append("offload_optimizer.nvme_path is a placeholder (/local_nvme): set your disk's folder")
        else:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return zero


def config_of(view: PlanView) -> tuple[dict, list[str]]:
    """(DeepSpeed config dict, what of the plan it cannot carry)."""
    missing = common_unexpressed(view, "DeepSpeed")
    config: dict = {"train_micro_batch_size_per_gpu": view.micro_batch,
                    "gradient_accumulation_steps": view.accumulation}
    name = _OPTIMIZERS.get(view.optimizer)
    if name:
        config["optimizer"] = {"type": name, "params": {}}
    else:
        missing.append(f"optimizer {view.optimizer}: not one DeepSpeed builds; pass your own to deepspeed.initialize")
    _precision(view, config, missing)
    config["zero_optimization"] = _zero(view, missing)
    if view.tp > 1:
        config["tensor_parallel"] = {"autotp_size": view.tp}
        missing.append("tensor parallelism: DeepSpeed's AutoTP shards the linear layers it recognises; memfit's "
                       "layout (attention and MLP, norms replicated) is what was estimated")
    if view.pp > 1:
        config["pipeline"] = {"stages": view.pp, "partition": "uniform"}
        missing.append(f"pipeline: {view.pp} stages need the model as a deepspeed.pipe.PipelineModule; DeepSpeed's "
                       "own schedule (1F1B-like) runs its gradient_accumulation_steps micro-batches"
                       + (f"; {view.schedule} (the plan's schedule) is not offered"
                          if view.schedule in ("gpipe", "interleaved") else ""))
    if view.recomputed:
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False,
                                              "number_checkpoints": view.recomputed}
        missing.append(f"which blocks recompute ({block_list(view)} of {len(view.actions)}): DeepSpeed's config does "
                       "not choose them; call deepspeed.checkpointing.checkpoint on those blocks (or HF's "
                       "gradient_checkpointing_enable, which recomputes every block)")
        if any(a.mode == "selective" for a in view.actions):
            missing.append(f"selective blocks ({block_list(view, lambda a: a.mode == 'selective')}): DeepSpeed "
                           "checkpoints whole blocks; recompute them whole (less memory, more time)")
    return config, missing


def emit(view: PlanView) -> Emitted:
    config, missing = config_of(view)
    launch = (f"deepspeed --num_gpus {view.world} train.py --deepspeed_config ds_config.json"
              if view.world > 1 else "deepspeed --num_gpus 1 train.py --deepspeed_config ds_config.json")
    return Emitted(json.dumps(config, indent=2) + "\n", ".json", missing,
                   extra=[f"launch: {launch} (train_batch_size = {view.micro_batch} x {view.accumulation} x "
                          f"{view.dp} data-parallel ranks = {view.global_batch})"])
