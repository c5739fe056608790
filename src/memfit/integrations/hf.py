"""Hugging Face Trainer (transformers 5.x, and trl's SFTTrainer, a Trainer subclass) planned by memfit.

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
    plan = fit_trainer(trainer, budget="6GiB")      # before .train(): plan chosen and installed
    trainer.train()

fit_trainer estimates from the Trainer's own model, arguments and one batch of its data collator,
chooses the plan (memfit.fit), installs it on the model before accelerate wraps it, and sets
per-device batch and accumulation so that per_device_train_batch_size x gradient_accumulation_steps
is unchanged. When the plan offloads the optimizer or keeps master weights, memfit's
TrainingOptimizer becomes the Trainer's optimizer: its backward takes the gradients off the device,
and the logged grad_norm and the clipping (max_grad_norm) are its own.
"""
from __future__ import annotations

import inspect
import types
import warnings
from typing import Any

import torch

from memfit.core.errors import ConfigError
from memfit.integrations.common import (adam_kwargs, mixed_precision, needs_memfit_optimizer, optimizer_name,
                                        plan_batch, replace_checkpointing, tensors_only, to_device,
                                        training_optimizer)
from memfit.plan.plan import Plan

WHERE = "memfit.integrations.hf.fit_trainer"


def _refuse(trainer: Any) -> None:
    """One line for what fit_trainer cannot honour."""
    args = trainer.args
    if args.auto_find_batch_size:
        raise ConfigError("auto_find_batch_size=True: memfit chooses micro-batch x accumulation itself (keeping "
                          "their product); set auto_find_batch_size=False")
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError("a DeepSpeed config is set: fit_trainer plans one device or FSDP2, not DeepSpeed; remove "
                          "deepspeed= (or estimate a rank with `memfit estimate <config.json> --strategy zero3 "
                          "--world N --batch B --seq S`)")
    if args.world_size > 1 and not fsdp_enabled(trainer):
        raise ConfigError(f"world_size={args.world_size} without FSDP: fit_trainer plans one process, or FSDP2 "
                          "ranks (fsdp='full_shard', fsdp_config={'fsdp_version': 2})")


def fsdp_enabled(trainer: Any) -> bool:
    """Whether the Trainer runs FSDP (its accelerator has an FSDP plugin, from fsdp= / fsdp_config)."""
    return bool(getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer.args, "fsdp", None))


def collated_batch(trainer: Any, rows: int) -> dict:
    """`rows` examples of the Trainer's training set through its data collator, with the column filter
    Trainer applies (remove_unused_columns), on the model's device."""
    ds = trainer.train_dataset
    if ds is None:
        raise ConfigError("the Trainer has no train_dataset: fit_trainer plans from one of its batches")
    collator = trainer.data_collator
    try:
        import datasets

        if isinstance(ds, datasets.Dataset):
            ds = trainer._remove_unused_columns(ds, description="training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="training")
    except ImportError:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    if len(ds) < rows:
        raise ConfigError(f"the training set has {len(ds)} examples, fewer than one batch of {rows}")
    batch = collator([ds[i] for i in range(rows)])
    device = next(trainer.model.parameters()).device
    return to_device(tensors_only(dict(batch)), device)


def fit_trainer(trainer: Any, budget: Any, allow: Any = None, keep_effective_batch: bool = True,
                device: Any = None) -> Plan:
    """Plan `trainer`'s model to fit `budget` and set the Trainer up to carry the plan out (call before train()).

    With FSDP (fsdp='full_shard', fsdp_config={'fsdp_version': 2}, under torchrun) the budget is each rank's
    and the plan is memfit.integrations.fsdp's RankPlan (per-device batch, accumulation, recomputation;
    `allow` is not used there).

    allow: the planner's mechanisms (memfit.fit's `allow`; default: its default for the model's device).
    keep_effective_batch: per_device_train_batch_size x gradient_accumulation_steps stays as given (the
    planner chooses both for the whole optimizer step, counting the gradients held between micro-batches);
    False plans the per-device batch as it is (a Trainer accumulation's held gradients are then not priced).
    device: a GPU's name (h100, a100-80gb, ...; memfit.fit's device=) plans the GPU run from this machine
    (budget None: that GPU's capacity); default the model's device.
    Raises PlanError (nothing fits, with the smallest need) or ConfigError (a setting it cannot honour)
    before any step."""
    _refuse(trainer)
    if fsdp_enabled(trainer):  # FSDP2 ranks under torchrun: memfit.integrations.hf_fsdp
        from memfit.integrations.hf_fsdp import fit_trainer_fsdp

        return fit_trainer_fsdp(trainer, budget, collated_batch(trainer, trainer.args.per_device_train_batch_size),
                                keep_effective_batch)
    args, model = trainer.args, trainer.model
    if args.activation_checkpointing:
        warnings.warn(f"{WHERE}: activation_checkpointing=True is turned off; memfit's plan chooses which "
                      "blocks recompute", stacklevel=2)
        args.activation_checkpointing = False
    replace_checkpointing(model, WHERE)
    per_device = args.per_device_train_batch_size
    batch = collated_batch(trainer, per_device)
    optimizer = optimizer_name(args.optim)
    precision = mixed_precision(args.bf16, args.fp16)
    inner = _inner(model)
    own = inner.__dict__.get("forward")
    if own is not None and getattr(getattr(own, "__func__", None), "_memfit_chunked", False):
        own = None  # memfit's chunked head: planned again from the plain one
        del inner.forward
    if own is not None and takes_fused_head(own):
        # trl's fused LM head: its compute_loss calls model(**batch, fused_lm_head=True), so the plan traces
        # that call (trl's tile buffer and fp32 gradient accumulators included), not the plain head
        _refuse_trl_two_forwards(trainer)
        batch = {**batch, "fused_lm_head": True}
    plan = plan_batch(inner, batch, budget, optimizer=optimizer, precision=precision, allow=allow,
                      keep_effective_batch=keep_effective_batch, where=WHERE,
                      exclude=("chunked-head",) if own is not None else (),  # the model's own head stays
                      keep_output=False,  # Trainer's compute_loss returns the loss alone: the output is dropped
                      accumulation=args.gradient_accumulation_steps,  # the plan covers the whole optimizer step
                      device=device)
    plan.install(inner)
    if keep_effective_batch:
        args.per_device_train_batch_size = plan.micro_batch
        args.gradient_accumulation_steps = plan.accumulation
    trainer._train_batch_size = args.train_batch_size
    if needs_memfit_optimizer(plan):
        _install_optimizer(trainer, plan)
    trainer.memfit_plan = plan
    return plan


def takes_fused_head(forward: Any) -> bool:
    """Whether an instance forward is trl's fused LM head (add_fused_lm_head: a `fused_lm_head` keyword)."""
    func = getattr(forward, "__func__", forward)
    try:
        return "fused_lm_head" in inspect.signature(func, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return False


def _refuse_trl_two_forwards(trainer: Any) -> None:
    """trl runs a second, full-logits forward for compute_loss_func and label smoothing; the plan prices one."""
    if getattr(trainer, "compute_loss_func", None) is not None or getattr(trainer, "label_smoother", None) is not None:
        raise ConfigError("SFTTrainer with compute_loss_func or label_smoothing_factor runs a full-logits forward "
                          "besides its fused LM head, which fit_trainer does not plan; remove them (trl deprecates both)")


def _inner(model: Any) -> Any:
    """The model whose blocks the plan acts on: a peft model's base model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _install_optimizer(trainer: Any, plan: Plan) -> None:
    """memfit's TrainingOptimizer as the Trainer's optimizer, with Trainer's two weight-decay groups; the
    Trainer's backward, clipping and logged gradient norm go through it."""
    args, model = trainer.args, trainer.model
    if trainer.optimizer is not None:
        raise ConfigError("the Trainer was given an optimizer; the plan needs memfit's (optimizer offload or "
                          "master weights): build the Trainer without optimizers=")
    decay = set(trainer.get_decay_parameter_names(model))
    no_decay = [n for n, p in model.named_parameters() if p.requires_grad and n not in decay]
    opt = training_optimizer(plan, model, lr=args.learning_rate, weight_decay=args.weight_decay,
                             clip=args.max_grad_norm or None, no_decay=no_decay,
                             **adam_kwargs(plan.optimizer, (args.adam_beta1, args.adam_beta2), args.adam_epsilon))
    trainer.optimizer = opt
    acc = trainer.accelerator
    prepare_optimizer = acc.prepare_optimizer

    def prepare(optimizer, device_placement=None):
        # memfit's optimizer keeps its state where the plan put it: no round trip through the device
        return prepare_optimizer(optimizer, device_placement=False if optimizer is opt else device_placement)

    def backward(loss, **kwargs):
        opt.backward(loss)

    acc.prepare_optimizer = prepare
    acc.backward = backward
    trainer._clip_grad_norm = types.MethodType(lambda self, model: opt.grad_norm(), trainer)
    trainer._get_grad_norm = types.MethodType(
        lambda self, model, grad_norm=None: opt.grad_norm() if grad_norm is None else grad_norm, trainer)

