"""Lightning's FSDP2 (ModelParallelStrategy with fully_shard in configure_model) planned per rank by memfit.

    strategy = ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1)
    plan = plan_fsdp2(model, example_batch, "20GiB", strategy, precision="bf16-mixed")
    class Lit(L.LightningModule):
        def configure_model(self):
            apply_checkpointing(self.model, plan)               # memfit's recomputation, when the plan chose it
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])
    trainer = L.Trainer(strategy=strategy, accumulate_grad_batches=plan.accumulation, ...)
    # DataLoader(..., batch_size=plan.micro_batch)

The plan (memfit.integrations.fsdp.plan_ranks) is each rank's for a Hugging Face causal LM sharded per
decoder layer and at the root, the way the example does. Lightning's FSDPStrategy runs FSDP1
(FullyShardedDataParallel with flat parameters), which memfit does not estimate per rank: it is refused
with one line, as is tensor parallelism inside ModelParallelStrategy.
"""
from __future__ import annotations

import os
from typing import Any

from memfit.core.errors import ConfigError
from memfit.integrations.fsdp import RankPlan, apply_checkpointing, plan_ranks, setup_of

__all__ = ["plan_fsdp2", "apply_checkpointing", "strategy_world", "refuse_sharded"]

WHERE = "memfit.integrations.lightning.plan_fsdp2"


def strategy_world(strategy: Any) -> int:
    """The FSDP2 shard degree of a ModelParallelStrategy (its data_parallel_size; "auto" before Lightning has
    set it up: the launcher's WORLD_SIZE); refusals for FSDPStrategy and tensor parallelism."""
    name = type(strategy).__name__
    if name == "FSDPStrategy":
        raise ConfigError("Lightning's FSDPStrategy runs FSDP1, which memfit does not estimate per rank; use "
                          "ModelParallelStrategy(tensor_parallel_size=1) with fully_shard per decoder layer in "
                          "configure_model (FSDP2)")
    if name != "ModelParallelStrategy":
        raise ConfigError(f"{name}: plan_fsdp2 plans Lightning's ModelParallelStrategy (FSDP2); for one device or "
                          "DDP use plan_module")
    tp = getattr(strategy, "_tensor_parallel_size", 1)
    dp = getattr(strategy, "_data_parallel_size", "auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp == "auto":  # Lightning's default: tensor parallel over a node's processes
        raise ConfigError("ModelParallelStrategy's tensor_parallel_size is 'auto' (tensor parallel over the node); "
                          "set tensor_parallel_size=1 for FSDP2 alone, which memfit plans")
    if int(tp) != 1:
        raise ConfigError(f"tensor_parallel_size={tp}: memfit plans FSDP2 ranks (tensor_parallel_size=1); estimate "
                          "tensor parallelism with `memfit estimate <config.json> --strategy tensor`")
    return world if dp == "auto" else int(dp)


def plan_fsdp2(model: Any, example: Any, budget: Any, strategy: Any, *, precision: str = "32-true",
               optimizer: str = "adamw", accumulate_grad_batches: int = 1,
               keep_effective_batch: bool = True) -> RankPlan:
    """Each rank's plan (micro-batch, accumulation, recomputation) for `model` under `strategy`, `example`
    one rank's batch; PlanError when nothing fits, ConfigError for what is not planned (module docstring)."""
    if optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer={optimizer!r} under FSDP2: memfit estimates the ranks of adamw or sgd")
    setup = setup_of(strategy_world(strategy), precision, True, False)
    return plan_ranks(model, example, budget, setup, optimizer=optimizer, accumulation=accumulate_grad_batches,
                      keep_effective_batch=keep_effective_batch, where=WHERE)


def refuse_sharded(trainer: Any) -> None:
    """A one-device plan (MemfitPrecision, MemfitCallback) under a sharding strategy is refused: its
    figures and its optimizer are one device's."""
    name = type(getattr(trainer, "strategy", None)).__name__
    if name in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy"):
        raise ConfigError(f"{name} shards the model: memfit's one-device plan does not hold there; plan the ranks "
                          "with memfit.integrations.lightning_fsdp.plan_fsdp2 (ModelParallelStrategy, FSDP2)")
