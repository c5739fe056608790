"""accelerate's FSDP2 plugin planned per rank by memfit (memfit.integrations.accelerate.prepare's FSDP path).

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")      # accelerate launch / torchrun
    model, opt, plan = prepare(accelerator, model, "20GiB", example=batch, lr=3e-4)
    loader = accelerator.prepare(DataLoader(ds, batch_size=plan.micro_batch, collate_fn=collate))

The plan (memfit.integrations.fsdp.plan_ranks) is each rank's: the budget is one device's, `example` one
rank's batch. It sets the accelerator's gradient_accumulation_steps, recomputes every decoder layer with
memfit's checkpointing when it must (the plugin's activation_checkpointing is turned off for it), and the
optimizer is torch's (AdamW or SGD), prepared with the model (accelerate puts the shards in it).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from memfit.core.errors import ConfigError
from memfit.integrations.common import replace_checkpointing
from memfit.integrations.fsdp import RankPlan, apply_checkpointing, plan_ranks, read_plugin

WHERE = "memfit.integrations.accelerate.prepare"


def is_fsdp(accelerator: Any) -> bool:
    """Whether the accelerator shards with an FSDP plugin (accelerate turns it on for GPUs and accelerators)."""
    return getattr(accelerator.state, "fsdp_plugin", None) is not None and \
        str(getattr(accelerator, "distributed_type", "")).endswith("FSDP")


def prepare_fsdp(accelerator: Any, model: torch.nn.Module, budget: Any, *, example: Any, optimizer: str,
                 lr: float, weight_decay: float | None, keep_effective_batch: bool,
                 **optimizer_kwargs: Any) -> tuple[Any, Any, RankPlan]:
    """Plan each rank (see the module docstring), shard the model and make the optimizer over its shards."""
    if example is None:
        raise ConfigError("give example= (one rank's batch as the loop will see it) to plan the ranks")
    if optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer={optimizer!r} under FSDP2: memfit estimates the ranks of adamw or sgd")
    plugin = accelerator.state.fsdp_plugin
    setup = read_plugin(plugin, str(accelerator.mixed_precision), accelerator.num_processes)
    main = accelerator.is_main_process
    if setup.checkpointing and main:
        warnings.warn(f"{WHERE}: the plugin's activation_checkpointing is turned off; memfit's plan chooses "
                      "whether each decoder layer recomputes", stacklevel=3)
    plugin.activation_checkpointing = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replace_checkpointing(model, WHERE)
    plan = plan_ranks(model, example, budget, setup, optimizer=optimizer,
                      accumulation=accelerator.gradient_accumulation_steps,
                      keep_effective_batch=keep_effective_batch, where=WHERE)
    apply_checkpointing(model, plan)
    accelerator.gradient_accumulation_steps = plan.accumulation
    kwargs = dict(lr=lr, **optimizer_kwargs)
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(model.parameters(), **kwargs)
    # accelerate shards model and optimizer together (the optimizer's parameters become the shards)
    model, opt = accelerator.prepare(model, opt)
    if main:
        print(plan.summary(), flush=True)
    return model, opt, plan
