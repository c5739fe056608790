"""accelerate planned by memfit: the plan applied before `Accelerator.prepare`, accumulation and mixed
precision set from it, the optimizer's state left where the plan put it.

    accelerator = Accelerator(mixed_precision="bf16")
    model, opt, plan = prepare(accelerator, model, "6GiB", example=batch, lr=3e-4)
    loader = accelerator.prepare(DataLoader(ds, batch_size=plan.micro_batch, collate_fn=collate))
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # memfit's optimizer clips
            opt.step(); opt.zero_grad()

`find_batch_size` is accelerate's `find_executable_batch_size` that keeps the effective batch: on an
out-of-memory error it halves the micro-batch and doubles the accumulation.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from memfit.apply.precision import autocast, precision_mode
from memfit.core.errors import ConfigError, DoesNotFitError
from memfit.integrations.common import mixed_precision, plan_batch, replace_checkpointing, training_optimizer
from memfit.plan.plan import Plan

WHERE = "memfit.integrations.accelerate.prepare"


def _precision(accelerator: Any) -> str:
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp not in ("no", "bf16", "fp16"):
        raise ConfigError(f"mixed_precision={mp!r}: memfit plans 'no' (fp32), 'bf16' or 'fp16' with accelerate")
    return mixed_precision(mp == "bf16", mp == "fp16")


def _fp16(accelerator: Any, model: Any, precision: str) -> None:
    """fp16: memfit's loss scaler (in its optimizer's backward, clipping and step) replaces accelerate's
    GradScaler, which would scale the same loss a second time and unscale gradients memfit's optimizer
    owns. Where accelerate runs fp16 without autocast (a CPU), the model's forward autocasts as the plan says."""
    if not precision_mode(precision).loss_scaling:
        return
    accelerator.scaler = None
    if not accelerator.native_amp:
        forward = model.forward

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with autocast(precision, next(model.parameters()).device.type):
                return forward(*args, **kwargs)

        model.forward = autocast_forward


def prepare(accelerator: Any, model: torch.nn.Module, budget: Any = None, *, plan: Plan | None = None,
            example: Any = None, optimizer: str = "adamw", lr: float = 1e-3, weight_decay: float | None = None,
            allow: Any = None, keep_effective_batch: bool = True, no_decay: Any = True, device: Any = None,
            **optimizer_kwargs: Any) -> tuple[Any, Any, Plan]:
    """Plan `model` (budget and `example`, one batch of the per-device size) or take `plan`; install it, make the
    TrainingOptimizer it was made for, set the accumulation steps, and prepare both.

    With a budget and keep_effective_batch, the plan is made for a whole optimizer step (the example's rows
    x the accelerator's gradient_accumulation_steps, the gradients held between micro-batches priced) and
    the accelerator's steps become the plan's accumulation; a given `plan` multiplies them.

    With an FSDP2 plugin the plan is each rank's (memfit.integrations.accelerate_fsdp; `budget` is one device's).

    Returns (prepared model, prepared optimizer, plan): build the data loader with plan.micro_batch rows.
    accelerator.backward and accelerator.clip_grad_norm_ go through memfit's optimizer from then on
    (with optimizer offload the gradients leave the device during backward). `device`: a GPU's name
    (h100, ...) plans for that GPU from this machine, as memfit.fit(device=) does."""
    if (budget is None) == (plan is None):
        raise ConfigError("prepare takes a budget (with example=) or a plan, one of them")
    from memfit.integrations.accelerate_fsdp import is_fsdp, prepare_fsdp

    if is_fsdp(accelerator):  # FSDP2 plugin: a per-rank plan, torch's optimizer over the shards
        if plan is not None:
            raise ConfigError("with an FSDP plugin, prepare plans each rank itself: give a budget and example=")
        return prepare_fsdp(accelerator, model, budget, example=example, optimizer=optimizer, lr=lr,
                            weight_decay=weight_decay, keep_effective_batch=keep_effective_batch, **optimizer_kwargs)
    precision = _precision(accelerator)
    replace_checkpointing(model, WHERE)
    if plan is None:
        if example is None:
            raise ConfigError("give example= (one batch as the loop will see it) to plan for the budget")
        base = accelerator.gradient_accumulation_steps
        plan = plan_batch(model, example, budget, optimizer=optimizer, precision=precision, allow=allow,
                          keep_effective_batch=keep_effective_batch, where=WHERE, accumulation=base, device=device)
        # the plan covers the whole optimizer step (example x the accelerator's steps): its accumulation replaces them
        accelerator.gradient_accumulation_steps = plan.accumulation if keep_effective_batch else base
    else:
        accelerator.gradient_accumulation_steps = accelerator.gradient_accumulation_steps * plan.accumulation
    plan.install(model)
    opt = training_optimizer(plan, model, lr=lr, weight_decay=weight_decay, clip=None, no_decay=no_decay,
                             **optimizer_kwargs)
    _route(accelerator, opt)
    model = accelerator.prepare_model(model)
    _fp16(accelerator, model, plan.precision)
    return model, accelerator.prepare_optimizer(opt, device_placement=False), plan


def _route(accelerator: Any, opt: Any) -> None:
    """accelerator.backward and clip_grad_norm_ through memfit's optimizer (it owns the gradients)."""
    def backward(loss, **kwargs):
        opt.backward(loss / accelerator.gradient_accumulation_steps)

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        if norm_type != 2:
            raise ConfigError(f"norm_type={norm_type}: memfit's optimizer clips the 2-norm")
        opt.clip = float(max_norm) if max_norm and max_norm != float("inf") else None
        return torch.tensor(opt.grad_norm())

    accelerator.backward = backward
    accelerator.clip_grad_norm_ = clip_grad_norm_


def _out_of_memory(exc: BaseException) -> bool:
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(exc, DoesNotFitError) or should_reduce_batch_size(exc)


def find_batch_size(function: Callable | None = None, *, effective_batch: int,
                    starting_micro_batch: int | None = None) -> Callable:
    """Decorate `function(micro_batch, accumulation, *args, **kwargs)`: called with the largest micro-batch that
    divides `effective_batch` (from `starting_micro_batch`), and on an out-of-memory error (or memfit's
    DoesNotFitError) again with the next smaller divisor, so micro_batch x accumulation == effective_batch."""
    if function is None:
        return functools.partial(find_batch_size, effective_batch=effective_batch,
                                 starting_micro_batch=starting_micro_batch)
    if effective_batch < 1:
        raise ConfigError(f"effective_batch={effective_batch} must be at least 1")

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        from accelerate.utils.memory import clear_device_cache

        micro = min(starting_micro_batch or effective_batch, effective_batch)
        tried = []
        while micro >= 1:
            if effective_batch % micro:
                micro -= 1
                continue
            try:
                return function(micro, effective_batch // micro, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 (only out-of-memory errors are retried)
                if not _out_of_memory(exc):
                    raise
                tried.append(micro)
                clear_device_cache(garbage_collection=True)
                micro = micro // 2 if micro > 1 else 0
        raise DoesNotFitError(f"no micro-batch fits, tried {tried} (accumulating to {effective_batch}); plan with "
                              "memfit.fit to see what dominates")
    return run
