"""A memfit plan as Lightning Trainer settings (a LightningCLI-style YAML: `trainer:` with its strategy's
class_path and init_args), and the loader that turns it into Trainer keyword arguments.

    kw = trainer_kwargs("LIGHTNING.yaml")     # {"devices": 2, "precision": ..., "strategy": FSDPStrategy(...)}
    trainer = lightning.pytorch.Trainer(**kw, max_steps=...)

What it carries: devices and nodes, precision, accumulate_grad_batches, the strategy: FSDPStrategy for
zero1-3 (FULL_SHARD; zero1/zero2: SHARD_GRAD_OP), wrapping and checkpointing the model's block class
(activation_checkpointing_policy), cpu_offload for optimizer offload (parameters and gradients too);
DDP for ddp; ModelParallelStrategy (data x tensor sizes) for tensor. Policies are named by dotted class
path (YAML holds no classes); trainer_kwargs imports them.

What it cannot: the DataLoader's batch size (printed), pipeline parallelism (refused), which blocks
recompute when only some do, per-block offload and compression.
"""
from __future__ import annotations


from memfit.core.errors import ConfigError
from memfit.integrations.emit_accelerate import to_yaml
from memfit.integrations.emit_plan import Emitted, PlanView, block_class, block_list, common_unexpressed

_PRECISION = {"32-true": "32-true", "bf16-mixed": "bf16-mixed", "bf16-master": "bf16-mixed",
              "bf16-true": "bf16-true", "16-mixed": "16-mixed"}
_POLICIES = ("auto_wrap_policy", "activation_checkpointing_policy")


def _strategy(view: PlanView, block: str, missing: list[str]) -> dict | str:
    if view.world == 1:
        return "auto"
    if view.tp > 1:
        missing.append("tensor parallelism: ModelParallelStrategy runs your LightningModule.configure_model, which "
                       "applies the tensor plan (torch's parallelize_module) and fully_shard itself")
        return {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                "init_args": {"data_parallel_size": view.dp, "tensor_parallel_size": view.tp}}
    if view.zero == 0:
        return "ddp"
    if view.zero == 1:
        missing.append("zero1: Lightning's FSDP has no optimizer-only sharding; emitted as SHARD_GRAD_OP (gradients "
                       "sharded too: no more memory than the plan)")
    args: dict = {"sharding_strategy": "FULL_SHARD" if view.zero == 3 else "SHARD_GRAD_OP",
                  "cpu_offload": bool(view.offload_optimizer), "auto_wrap_policy": block}
    if view.offload_optimizer:
        missing.append("optimizer offload: FSDP's cpu_offload moves parameters and gradients to host memory too"
                       + ("; to host memory, not disk" if view.offload_optimizer == "disk" else ""))
    if view.recomputed:
        args["activation_checkpointing_policy"] = block
    return {"class_path": "lightning.pytorch.strategies.FSDPStrategy", "init_args": args}


def config_of(view: PlanView) -> tuple[dict, list[str]]:
    if view.pp > 1:
        raise ConfigError("--emit lightning: Lightning has no pipeline-parallel strategy; use --emit torchtitan or "
                          "--emit deepspeed for this plan, or plan without pipeline")
    missing = common_unexpressed(view, "Lightning")
    module, layer = block_class(view.model)
    block = f"{module}.{layer}"
    precision = _PRECISION.get(view.precision, "32-true")
    if precision != view.precision:
        missing.append(f"{view.precision}: emitted as Lightning's {precision}")
    nodes = view.world // 8 if view.world > 8 and view.world % 8 == 0 else 1
    trainer = {"accelerator": "auto", "devices": view.world // nodes, "num_nodes": nodes, "precision": precision,
               "accumulate_grad_batches": view.accumulation, "strategy": _strategy(view, block, missing)}
    strategy = trainer["strategy"]
    fsdp = isinstance(strategy, dict) and strategy["class_path"].endswith("FSDPStrategy")
    if view.recomputed and not fsdp:
        missing.append("activation checkpointing: outside FSDPStrategy Lightning's config has no switch; call "
                       "model.gradient_checkpointing_enable() or wrap the blocks in configure_model")
    if view.recomputed and view.checkpoint != "full":
        missing.append(f"per-block checkpointing: the plan recomputes blocks {block_list(view)} ({view.recomputed} "
                       f"of {len(view.actions)}, {view.checkpoint}); Lightning checkpoints every {layer} whole")
    return {"trainer": trainer}, missing


def _resolve(name: str) -> type:
    import importlib

    module, _, cls = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import {name} named in the Lightning config ({exc})") from None


def trainer_kwargs(path: str) -> dict:
    """The Trainer keyword arguments of an emitted YAML, its strategy built (policies imported)."""
    import yaml

    with open(path) as f:
        trainer = dict(yaml.safe_load(f)["trainer"])
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict):
        args = dict(strategy.get("init_args") or {})
        for key in _POLICIES:
            if key in args:
                args[key] = {_resolve(args[key])}
        trainer["strategy"] = _resolve(strategy["class_path"])(**args)
    return trainer


def emit(view: PlanView) -> Emitted:
    cfg, missing = config_of(view)
    return Emitted(to_yaml(cfg), ".yaml", missing, extra=[
        f"in your LightningDataModule: batch_size={view.micro_batch} per process (global batch {view.global_batch})",
        "load: memfit.integrations.emit_lightning.trainer_kwargs(PATH) -> lightning.pytorch.Trainer(**kwargs)"])
