"""What every framework integration shares: the plan for a model and a batch under a budget (one-line
refusal when nothing fits), memfit's names for a framework's optimizer and precision settings, and the
TrainingOptimizer a plan needs when the framework's own optimizer cannot carry it out."""
from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.nn as nn

from memfit.apply.precision import precision_mode
from memfit.core.errors import ConfigError
from memfit.plan.costs import PlanError
from memfit.plan.plan import Plan

# Hugging Face TrainingArguments.optim -> memfit optimizer (memfit.apply.optimizers)
HF_OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "sgd": "sgd",
    "adafactor": "adafactor", "adagrad": "adagrad", "rmsprop": "rmsprop",
    "adamw_torch_8bit": "adamw8bit", "adamw_torch_4bit": "adamw4bit", "adamw_8bit": "adamw8bit",
    "adamw_bnb_8bit": "adamw8bit", "lion_32bit": "lion",
}


def optimizer_name(optim: Any) -> str:
    """memfit's name for a Trainer `optim` value; ConfigError naming the accepted ones otherwise."""
    key = str(getattr(optim, "value", optim)).lower()
    if key not in HF_OPTIMIZERS:
        raise ConfigError(f"memfit cannot plan optim={key!r}; use one of: {', '.join(sorted(HF_OPTIMIZERS))}")
    return HF_OPTIMIZERS[key]


def mixed_precision(bf16: bool, fp16: bool) -> str:
    """memfit's precision for autocast flags with fp32 weights (Trainer's bf16/fp16, accelerate's mixed_precision)."""
    return "bf16-mixed" if bf16 else "16-mixed" if fp16 else "32-true"


def needs_memfit_optimizer(plan: Plan) -> bool:
    """Whether only memfit's TrainingOptimizer carries the plan out: optimizer offload or master weights
    (the gradients leave the device during backward, so the framework's clipping sees none)."""
    return bool(plan.offload_optimizer) or precision_mode(plan.precision).master_dtype is not None


def plan_batch(model: nn.Module, example: Any, budget: Any, *, optimizer: str, precision: str, allow: Any,
               keep_effective_batch: bool, where: str, exclude: tuple[str, ...] = (),
               keep_output: bool = True, accumulation: int = 1, device: Any = None) -> Plan:
    """memfit.fit on `example` (one batch as the framework collates it); with keep_effective_batch the
    planner may split it into micro-batches x accumulation, else it plans the batch as it is. A budget
    nothing fits raises PlanError before any step, with the fit report in one line. `keep_output`:
    whether the loop holds the model's output through backward (memfit.fit's keep_output).
    `accumulation`: the framework's own accumulation steps. With keep_effective_batch the plan is made
    for the whole optimizer step (the example repeated that many times), so the gradients held from one
    micro-batch to the next are in it; the framework then accumulates `plan.accumulation` micro-batches
    of `plan.micro_batch` rows (their product: the example's rows x `accumulation`).
    `device`: where the run will train, as memfit.fit takes it; a GPU's name (h100, a100-80gb, ...) plans
    for that GPU from this machine (default: the model's parameters' device)."""
    from memfit.plan.fit import fit
    from memfit.plan.plan import parse_allow

    if device is not None:
        from memfit.core.device import estimate_device

        estimate_device(device)  # one line for a name that is neither a GPU nor this machine's device
    else:
        device = next((p.device.type for p in model.parameters() if p.device.type != "meta"), "cpu")
    names = parse_allow(allow, device)
    exclude = exclude + (() if keep_effective_batch else ("accumulate",))
    names = tuple(a for a in names if a not in exclude)
    if keep_effective_batch and accumulation > 1:
        example = repeat_rows(example, accumulation)
    try:
        return fit(model, example, budget=budget, optimizer=optimizer, precision=precision, allow=names,
                   keep_output=keep_output, device=device)
    except PlanError as exc:
        msg = " ".join(str(exc).split())
        if "need" not in msg:
            msg += "; " + _smallest_need(model, example, optimizer, precision, names)
        raise PlanError(f"{where}: nothing fits before step 0: {msg}") from None


def repeat_rows(example: Any, times: int) -> Any:
    """The example with its batch dimension repeated `times` times (the rows of a whole optimizer step)."""
    if isinstance(example, torch.Tensor):
        return torch.cat([example] * times) if example.dim() else example
    if isinstance(example, dict):
        return {k: repeat_rows(v, times) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(repeat_rows(v, times) for v in example)
    return example


def _smallest_need(model: nn.Module, example: Any, optimizer: str, precision: str, names: tuple[str, ...]) -> str:
    """The fit report's tail: what one row, every block recomputed (and the optimizer offloaded, when
    allowed) needs, and the category that dominates it."""
    from memfit.core.units import format_bytes
    from memfit.measure.estimate import estimate

    one = {k: v[:1] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in example.items()} \
        if isinstance(example, dict) else example
    off = "cpu" if "optimizer-offload" in names else None
    need = estimate(model, one, optimizer=optimizer, precision=precision, offload_optimizer=off,
                    checkpoint="full" if "recompute" in names else "none").per_device
    top = max((k for k in need if k != "total"), key=need.get)
    how = "micro-batch 1" + (", every block recomputed" if "recompute" in names else "") + \
        (", optimizer offloaded" if off else "")
    return (f"the smallest configuration ({how}) needs {format_bytes(need['total'])}, most of it {top} "
            f"({format_bytes(need[top])}): raise the budget to at least that")


def training_optimizer(plan: Plan, model: nn.Module, *, lr: float, weight_decay: float | None, clip: float | None,
                       no_decay: Iterable[str] | bool | None = None, **kwargs: Any):
    """The TrainingOptimizer `plan` was made for (offload, precision), weight decay off for `no_decay`."""
    from memfit.apply.optimizer import TrainingOptimizer

    return TrainingOptimizer(model, plan.optimizer, lr=lr, weight_decay=weight_decay, precision=plan.precision,
                             clip=clip, offload=plan.offload_optimizer, no_decay=no_decay, **kwargs)


def adam_kwargs(optimizer: str, betas: tuple[float, float], eps: float) -> dict[str, Any]:
    return {"betas": betas, "eps": eps} if optimizer in ("adamw", "adam", "adamw8bit", "adamw4bit") else {}


def replace_checkpointing(model: nn.Module, where: str) -> bool:
    """Turn off Hugging Face's own gradient checkpointing (Trainer's flag, peft's
    prepare_model_for_kbit_training) with a warning: the plan decides which blocks recompute. True if it was on."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    on = any(getattr(m, "gradient_checkpointing", False) is True for m in inner.modules())
    if on:
        disable = getattr(inner, "activation_checkpointing_disable", None)
        if disable is not None:
            disable()
        for m in inner.modules():
            if getattr(m, "gradient_checkpointing", False) is True:
                m.gradient_checkpointing = False
        warnings.warn(f"{where}: the model's own gradient checkpointing is turned off; memfit's plan chooses "
                      "which blocks recompute", stacklevel=3)
        return True
    return False


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def tensors_only(batch: dict) -> dict:
    """A collated batch without the non-tensor entries some collators add."""
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
