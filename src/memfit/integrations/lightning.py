"""Lightning 2.6 planned by memfit: a precision plugin that carries the plan out, and a callback that sets
accumulation and batch size from it and checks the first steps against the budget.

    plan = plan_module(lit.model, example_batch, "6GiB")        # or memfit.fit(...)
    class Lit(L.LightningModule):
        def configure_optimizers(self):
            return memfit_optimizer(plan, self, lr=3e-4)           # the optimizer the plan was made for
    trainer = L.Trainer(plugins=[MemfitPrecision(plan)], callbacks=[MemfitCallback(plan)], gradient_clip_val=1.0)

MemfitPrecision installs the plan in `convert_module` (before any DDP wrapping), autocasts as the plan's
precision says (bf16 or fp32; fp16 is refused: its loss scaling is memfit's, not Lightning's), runs the
closure before the step (memfit's optimizer takes no closure), sends backward and gradient clipping
through memfit's optimizer (with optimizer offload the gradients leave the device during backward).
"""
from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision

from memfit.apply.optimizer import TrainingOptimizer
from memfit.apply.precision import autocast, precision_mode
from memfit.core.errors import ConfigError, DoesNotFitError
from memfit.core.units import format_bytes
from memfit.integrations.common import plan_batch, replace_checkpointing, training_optimizer
from memfit.plan.plan import Plan

WHERE = "memfit.integrations.lightning"


def plan_module(model: torch.nn.Module, example: Any, budget: Any, *, optimizer: str = "adamw",
                precision: str = "32-true", allow: Any = None, keep_effective_batch: bool = True,
                accumulate_grad_batches: int = 1, device: Any = None) -> Plan:
    """memfit.fit for the model a LightningModule trains (example: one batch of the dataloader's size;
    accumulate_grad_batches: the Trainer's, so that the plan covers the whole optimizer step and the
    gradients held between micro-batches; device: a GPU's name such as h100 plans for it from this machine,
    as memfit.fit(device=) does); PlanError before any step when nothing fits."""
    if precision_mode(precision).loss_scaling:
        raise ConfigError(f"precision={precision!r}: fp16 is not planned with Lightning in v1; use bf16-mixed or 32-true")
    return plan_batch(model, example, budget, optimizer=optimizer, precision=precision, allow=allow,
                      keep_effective_batch=keep_effective_batch, where=WHERE, accumulation=accumulate_grad_batches,
                      keep_output=False,  # training_step returns the loss; the model's output is not kept
                      device=device)


def memfit_optimizer(plan: Plan, module: torch.nn.Module, lr: float, weight_decay: float | None = None,
                     no_decay: Any = True, **kwargs: Any) -> TrainingOptimizer:
    """The TrainingOptimizer `plan` was made for (for configure_optimizers); clipping comes from the Trainer's
    gradient_clip_val through MemfitPrecision."""
    return training_optimizer(plan, module, lr=lr, weight_decay=weight_decay, clip=None, no_decay=no_decay, **kwargs)


def planned_module(module: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """The submodule `plan` was made for (plan_module(lit.model, ...): the first of the plan's model class),
    so that its blocks and its LM head (a chunked head replaces that model's forward) are the plan's; the
    LightningModule itself when none is."""
    return next((m for m in module.modules() if type(m).__name__ == plan.model), module)


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)


class MemfitPrecision(Precision):
    """Carries `plan` out inside Lightning's Trainer (see the module docstring)."""

    def __init__(self, plan: Plan) -> None:
        mode = precision_mode(plan.precision)
        if mode.loss_scaling:
            raise ConfigError(f"the plan's precision is {plan.precision}: fp16 is refused with Lightning in v1; "
                              "plan with bf16-mixed or 32-true")
        self.plan, self.mode = plan, mode
        self.precision = "bf16-mixed" if mode.autocast_dtype is not None else "32-true"
        self._device_type = "cpu"

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        replace_checkpointing(module, WHERE)
        self.plan.install(planned_module(module, self.plan))
        p = next(module.parameters(), None)
        self._device_type = p.device.type if p is not None else "cpu"
        return module

    def forward_context(self) -> contextlib.AbstractContextManager:
        dev = "cuda" if torch.cuda.is_available() and self._device_type == "cuda" else "cpu"
        return autocast(self.mode, dev)

    @contextlib.contextmanager
    def train_step_context(self):
        with self.forward_context():
            yield

    def backward(self, tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        opt = _unwrap(optimizer)
        if isinstance(opt, TrainingOptimizer):
            opt.backward(tensor)
        else:
            model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        opt = _unwrap(optimizer)
        if not isinstance(opt, TrainingOptimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        result = closure()  # forward and backward first: memfit's optimizer takes no closure
        self._after_closure(model, optimizer)
        if result is None:  # training_step returned None: skip, as Lightning does
            opt.zero_grad()
            return None
        opt.step()
        return result

    def clip_gradients(self, optimizer, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        opt = _unwrap(optimizer)
        if not isinstance(opt, TrainingOptimizer):
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if clip_val and clip_val > 0:
            if gradient_clip_algorithm is not None and str(getattr(gradient_clip_algorithm, "value", "norm")) != "norm":
                raise ConfigError("gradient_clip_algorithm='value' with memfit's optimizer; it clips by norm")
            opt.clip = float(clip_val)


class MemfitCallback(pl.Callback):
    """Sets accumulate_grad_batches and the LightningModule's (or datamodule's) `batch_size` from the plan at
    setup, and measures the first `check_steps` training steps with memfit's tracker against the budget
    (`self.peaks`; on_exceed "raise" or "warn")."""

    def __init__(self, plan: Plan, check_steps: int = 2, on_exceed: str = "raise") -> None:
        if on_exceed not in ("raise", "warn"):
            raise ConfigError(f"on_exceed={on_exceed!r}; accepted: raise, warn")
        self.plan, self.check_steps, self.on_exceed = plan, check_steps, on_exceed
        self.peaks: list[int] = []
        self._tracker = None
        self._base_accumulation: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        from memfit.integrations.lightning_fsdp import refuse_sharded

        refuse_sharded(trainer)  # FSDP and ModelParallel strategies: lightning_fsdp.plan_fsdp2 plans their ranks
        holders = [h for h in (pl_module, getattr(trainer, "datamodule", None)) if h is not None and hasattr(h, "batch_size")]
        if self._base_accumulation is None:
            self._base_accumulation = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = self._steps(holders[0].batch_size if holders else None)
        for holder in holders:
            holder.batch_size = self.plan.micro_batch

    def _steps(self, rows: int | None) -> int:
        """Accumulation that keeps the optimizer step's rows (batch_size x accumulate_grad_batches) with the
        plan's micro-batch; without a batch_size to read, the Trainer's steps times the plan's."""
        base, micro = self._base_accumulation, self.plan.micro_batch
        if rows is None:
            return base * self.plan.accumulation
        if (rows * base) % micro:
            raise ConfigError(f"batch_size {rows} x accumulate_grad_batches {base} is not a multiple of the plan's "
                              f"micro-batch {micro}: plan with this batch size (plan_module's example)")
        return rows * base // micro

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        at_step_start = batch_idx % trainer.accumulate_grad_batches == 0
        if at_step_start and self._tracker is None and len(self.peaks) < self.check_steps:
            from memfit.core.tracker import track

            opt = trainer.optimizers[0] if trainer.optimizers else None
            self._tracker = track(pl_module, _unwrap(opt) if opt is not None else None)
            self._tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._tracker is None or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self._tracker.__exit__(None, None, None)
        self.peaks.append(self._tracker.peak_bytes)
        self._tracker = None
        pl_module.log("memfit/peak", float(self.peaks[-1]))
        if self.peaks[-1] > self.plan.budget:
            msg = (f"memfit: step {trainer.global_step} peaked at {format_bytes(self.peaks[-1])}, over the budget "
                   f"{format_bytes(self.plan.budget)}")
            if self.on_exceed == "raise":
                raise DoesNotFitError(msg + "; plan again with a lower budget")
            import warnings

            warnings.warn(msg, stacklevel=2)
