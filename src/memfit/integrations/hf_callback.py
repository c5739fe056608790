"""MemfitCallback for Hugging Face Trainer: the plan is still installed, the first steps stay within the
prediction and the budget, and on CUDA a step that nears the budget saves a checkpoint and stops.

    trainer = Trainer(..., callbacks=[MemfitCallback(budget="6GiB")])     # plans at train begin
    trainer = Trainer(..., callbacks=[MemfitCallback(plan=plan)])         # checks a plan fit_trainer made
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import TrainerCallback

from memfit.core.errors import ConfigError, DoesNotFitError
from memfit.core.units import format_bytes, parse_bytes
from memfit.plan.plan import Plan

GUARD = 0.95
"""On CUDA, a step whose reserved memory passes this share of the budget saves and stops."""


def reserved_bytes(device: torch.device) -> int | None:
    """The caching allocator's high-water mark of reserved memory on a CUDA device (what a memory limit
    refuses, and what the guard watches); None elsewhere, where the guard is off."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device)


def installed(model: Any, plan: Plan) -> str | None:
    """None if `plan` is installed on `model` (a peft model: its base model), else what is missing."""
    from memfit.apply.checkpoint import applied
    from memfit.apply.head_swap import head_chunks
    from memfit.apply.policy import to_string

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    got = applied(inner)
    want = to_string(plan.actions)
    have = to_string(got.actions) if got is not None else None
    if have != want and not (got is None and all(a.mode == "keep" and not a.offload for a in plan.actions)):
        return f"block actions {have or 'none'} instead of {want}"
    if (head_chunks(inner) or None) != (plan.head_chunks or None):
        return f"head chunks {head_chunks(inner)} instead of {plan.head_chunks}"
    return None


class MemfitCallback(TrainerCallback):
    """budget (plan=None): fit_trainer's plan at train begin is not possible from a callback (accelerate has
    wrapped the model by then), so give a `plan` from fit_trainer, or a budget to check steps against.
    check_steps: steps measured with memfit's tracker (peaks in `self.peaks`, logged as memfit/peak).
    on_exceed: "raise" (DoesNotFitError) or "warn" when a checked step passes the budget."""

    def __init__(self, budget: Any = None, plan: Plan | None = None, check_steps: int = 2,
                 on_exceed: str = "raise") -> None:
        if (budget is None) == (plan is None):
            raise ConfigError("MemfitCallback takes budget= or plan=, one of them")
        if on_exceed not in ("raise", "warn"):
            raise ConfigError(f"on_exceed={on_exceed!r}; accepted: raise, warn")
        self.plan = plan
        self.budget = plan.budget if plan is not None else parse_bytes(budget)
        self.check_steps, self.on_exceed = check_steps, on_exceed
        self.peaks: list[int] = []
        self._tracker = None
        self._model = self._optimizer = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self._model, self._optimizer = model, optimizer
        if self.plan is not None and model is not None:
            missing = installed(model, self.plan)
            if missing:
                raise ConfigError(f"the memfit plan is no longer installed on the model ({missing}); call "
                                  "fit_trainer(trainer, ...) after anything that rebuilds the model")

    def on_step_begin(self, args, state, control, **kw):
        if len(self.peaks) < self.check_steps and self._model is not None:
            from memfit.core.tracker import track

            self._tracker = track(self._model, self._optimizer)
            self._tracker.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peaks.append(self._tracker.peak_bytes)
            self._tracker = None
            if self.peaks[-1] > self.budget:
                self._exceeded(f"step {state.global_step} peaked at {format_bytes(self.peaks[-1])}, over the "
                               f"budget {format_bytes(self.budget)}")
        self._guard(args, control)

    def _guard(self, args, control) -> None:
        """Save and stop before the allocator's reserve crosses the budget (the OOM-after-hours guard)."""
        reserved = reserved_bytes(getattr(args, "device", torch.device("cpu")))
        if reserved is None:
            return
        if reserved > GUARD * self.budget:
            warnings.warn(f"memfit: reserved {format_bytes(reserved)} passed {GUARD:.0%} of the budget "
                          f"{format_bytes(self.budget)}: saving a checkpoint and stopping", stacklevel=2)
            control.should_save = True
            control.should_training_stop = True

    def _exceeded(self, msg: str) -> None:
        if self.on_exceed == "raise":
            raise DoesNotFitError(f"memfit: {msg}; plan again with a lower budget or check what else holds memory")
        warnings.warn(f"memfit: {msg}", stacklevel=3)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs is not None and self.peaks:
            logs["memfit/peak"] = self.peaks[-1]
            if self.plan is not None:
                logs["memfit/predicted"] = self.plan.predicted_peak
