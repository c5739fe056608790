"""fit_trainer for a Hugging Face Trainer that runs FSDP2 under torchrun: one plan per rank.

    args = TrainingArguments(..., fsdp="full_shard", fsdp_config={"fsdp_version": 2}, bf16=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    plan = fit_trainer(trainer, budget="20GiB")      # every rank; rank 0 prints the choice
    trainer.train()                                  # torchrun --nproc_per_node N train.py

What is read: the FSDP plugin the Trainer built from fsdp=/fsdp_config (fsdp_version, reshard_after_forward,
activation_checkpointing, cpu_offload), the accelerator's mixed precision (from bf16=/fp16=), the world
size, activation_checkpointing=, optim= and one per-device batch of the Trainer's data collator. The plan
(memfit.integrations.fsdp.plan_ranks) sets per_device_train_batch_size and gradient_accumulation_steps
(their product kept) and whether every decoder layer recomputes; the framework's own checkpointing is
turned off for memfit's, the one the estimate prices.
"""
from __future__ import annotations

import warnings
from typing import Any

from memfit.core.errors import ConfigError
from memfit.integrations.common import optimizer_name, replace_checkpointing
from memfit.integrations.fsdp import RankPlan, apply_checkpointing, plan_ranks, read_plugin

WHERE = "memfit.integrations.hf.fit_trainer"
_PRICED = ("adamw", "adam", "sgd")


def fit_trainer_fsdp(trainer: Any, budget: Any, batch: Any, keep_effective_batch: bool = True) -> RankPlan:
    """fit_trainer's FSDP2 path (see the module docstring); the same plan on every rank. `batch`: one
    per-device batch of the Trainer's collator."""
    args, model = trainer.args, trainer.model
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        raise ConfigError("fsdp= is set but the Trainer's accelerator runs no FSDP here (accelerate turns FSDP on "
                          "for GPUs and accelerators, not CPU processes, where the Trainer trains with DDP); run on "
                          "GPUs (on CPU: one process without fsdp=)")
    setup = read_plugin(plugin, str(trainer.accelerator.mixed_precision), args.world_size)
    optimizer = optimizer_name(args.optim)
    if optimizer not in _PRICED:
        raise ConfigError(f"optim={args.optim!r} under FSDP2: memfit estimates the ranks of adamw or sgd; "
                          "use optim='adamw_torch'")
    main = args.process_index == 0
    asked = setup.checkpointing or bool(args.activation_checkpointing)
    _framework_checkpointing_off(trainer, plugin, warn=main and asked)
    plan = plan_ranks(model, batch, budget, setup, optimizer=optimizer, accumulation=args.gradient_accumulation_steps,
                      keep_effective_batch=keep_effective_batch, where=WHERE)
    apply_checkpointing(model, plan)
    args.per_device_train_batch_size = plan.micro_batch
    args.gradient_accumulation_steps = plan.accumulation
    trainer._train_batch_size = args.train_batch_size
    trainer.memfit_plan = plan
    if main:
        print(plan.summary(), flush=True)
    return plan


def _framework_checkpointing_off(trainer: Any, plugin: Any, warn: bool) -> None:
    """FSDP's activation_checkpointing (torch's checkpoint_wrapper per layer), the Trainer's
    activation_checkpointing and the model's own are turned off: the plan decides, with memfit's."""
    plugin.activation_checkpointing = False
    trainer.args.activation_checkpointing = False
    if isinstance(getattr(trainer.args, "fsdp_config", None), dict):
        trainer.args.fsdp_config["activation_checkpointing"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning, below, on rank 0
        replace_checkpointing(trainer.model, WHERE)
    if warn:
        warnings.warn(f"{WHERE}: the configured activation checkpointing is turned off; memfit's plan chooses "
                      "whether each decoder layer recomputes (memfit's recomputation, the one it estimates)",
                      stacklevel=3)
