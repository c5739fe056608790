"""A memfit plan as an accelerate config file (the YAML `accelerate launch --config_file` reads).

What it carries: the process count, FSDP2 (`fsdp_version: 2`) over the data-parallel ranks for zero1-3
(zero3 resharding after forward, zero1/zero2 not: whole weights from forward to backward),
DDP (MULTI_GPU) for ddp, tensor parallelism through accelerate's `parallelism_config` (tp_size, with the
model's own Hugging Face tp_plan), mixed precision (bf16, fp16 or no), activation checkpointing of every
decoder layer, optimizer offload as FSDP's `fsdp_offload_params` (CPUOffloadPolicy: parameters and
gradients go to host memory too).

What it cannot: micro-batch and accumulation (the config file has no field for them: your DataLoader's
batch_size and `Accelerator(gradient_accumulation_steps=...)`, printed with the file), pipeline
parallelism (refused), which blocks recompute when only some do, per-block offload and compression.
"""
from __future__ import annotations

import math

from memfit.core.errors import ConfigError
from memfit.integrations.emit_plan import Emitted, PlanView, block_class, block_list, common_unexpressed

_PRECISION = {"32-true": "no", "bf16-mixed": "bf16", "bf16-master": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}


def config_of(view: PlanView) -> tuple[dict, list[str]]:
    """(accelerate ClusterConfig fields, what of the plan it cannot carry)."""
    if view.pp > 1:
        raise ConfigError("--emit accelerate: accelerate has no pipeline-parallel training; use --emit torchtitan "
                          "or --emit deepspeed for this plan, or plan without pipeline")
    missing = common_unexpressed(view, "accelerate")
    precision = _PRECISION.get(view.precision, "bf16" if "bf16" in view.precision else "no")
    if view.precision not in ("32-true", "bf16-mixed", "16-mixed"):
        missing.append(f"{view.precision}: accelerate's {precision} keeps fp32 weights (FSDP2: fp32 shards cast "
                       "to 16 bits per layer), not the plan's exact weight dtypes")
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False, "use_cpu": False,
                 "mixed_precision": precision, "num_processes": view.world,
                 "num_machines": max(1, math.ceil(view.world / 8)) if view.world % 8 == 0 else 1,
                 "machine_rank": 0, "main_training_function": "main", "rdzv_backend": "static",
                 "same_network": True}
    fsdp = view.zero > 0 or view.tp > 1 or (view.offload_optimizer and view.world > 1)
    if view.world == 1:
        cfg["distributed_type"] = "NO"
    elif fsdp:
        cfg["distributed_type"] = "FSDP"
    else:
        cfg["distributed_type"] = "MULTI_GPU"
    module, layer = block_class(view.model)
    if cfg["distributed_type"] == "FSDP":
        if view.zero == 1:
            missing.append("zero1: accelerate's FSDP2 shards gradients too; emitted as FSDP2 without resharding "
                           "after forward (no more memory than the plan)")
        cfg["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": view.zero == 3,
                              "fsdp_offload_params": bool(view.offload_optimizer),
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_transformer_layer_cls_to_wrap": layer,
                              "fsdp_activation_checkpointing": view.recomputed > 0,
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                              "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True}
        if view.offload_optimizer:
            missing.append("optimizer offload: accelerate's fsdp_offload_params (FSDP2's CPUOffloadPolicy) moves "
                           "parameters and gradients to host memory as well"
                           + ("; to host memory, not disk" if view.offload_optimizer == "disk" else ""))
    elif view.offload_optimizer:
        missing.append(f"optimizer offload to {view.offload_optimizer} on {view.world} process(es) without FSDP: "
                       "not in accelerate's config (memfit.integrations.accelerate.prepare installs memfit's)")
    if view.tp > 1:
        cfg["parallelism_config"] = {"parallelism_config_dp_replicate_size": 1,
                                     "parallelism_config_dp_shard_size": view.dp,
                                     "parallelism_config_tp_size": view.tp, "parallelism_config_cp_size": 1}
        missing.append("tensor parallelism: accelerate applies the model's Hugging Face tp_plan, with FSDP2 over "
                       "the data-parallel ranks (less memory than the plan's replicas)")
    if view.recomputed:
        if cfg["distributed_type"] != "FSDP":
            missing.append("activation checkpointing: outside FSDP accelerate's config has no switch; call "
                           "model.gradient_checkpointing_enable() (every layer)")
        if view.checkpoint != "full":
            missing.append(f"per-block checkpointing: the plan recomputes blocks {block_list(view)} "
                           f"({view.recomputed} of {len(view.actions)}, {view.checkpoint}); accelerate checkpoints "
                           f"every {layer} whole (less memory, more time)")
    return cfg, missing


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    # YAML 1.1 reads no/yes/on/off as booleans: accelerate's own files quote them ('no', 'NO')
    if isinstance(v, str) and (v.lower() in ("no", "yes", "on", "off", "true", "false", "null", "")
                               or not v.replace("_", "").isalnum()):
        return '"' + v.replace('"', '\\"') + '"'
    return str(v)


def to_yaml(cfg: dict, indent: str = "") -> str:
    """Plain YAML of nested dicts of scalars (no PyYAML needed to write it)."""
    out = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.append(f"{indent}{k}:\n" + to_yaml(v, indent + "  "))
        else:
            out.append(f"{indent}{k}: {_scalar(v)}\n")
    return "".join(out)


def emit(view: PlanView) -> Emitted:
    cfg, missing = config_of(view)
    return Emitted(to_yaml(cfg), ".yaml", missing, extra=[
        f"in your script: DataLoader(batch_size={view.micro_batch}) and "
        f"Accelerator(gradient_accumulation_steps={view.accumulation}) (global batch {view.global_batch})",
        "launch: accelerate launch --config_file ACCELERATE.yaml train.py"])
