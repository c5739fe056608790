"""Dynamic loss scaling for fp16, and finding the modules that produced inf/NaN.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
scale S keeps them representable; the optimizer sees grads / S. Too large an S overflows to inf,
so the scale adapts:

    start 2**16; after `growth_interval` clean steps in a row: S *= 2
    overflow (any inf/NaN in the grads): skip the update; with hysteresis h, the first h-1
    overflows in a row keep S, the h-th halves it (never below `min_scale`, and the run goes on
    at the minimum rather than exiting as some frameworks do)

When overflows persist (`warn_after` in a row), `InfNanLocator` is armed for the next step: it
records the first module whose forward output and the first module whose output gradient held
inf/NaN, and `LossScaler.report()` turns that into a message that also suggests bf16.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from memfit.core.errors import ConfigError


class OverflowWarning(RuntimeWarning):
    """fp16 overflows kept happening; the message names the modules where inf/NaN appeared first."""


@dataclass
class LossScaler:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    """Overflows in a row tolerated before the scale is cut (1: cut on every overflow)."""
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    warn_after: int = 10
    """Consecutive overflowing steps after which the locator is armed and a warning issued."""

    scale: float = field(init=False)
    clean_steps: int = field(init=False, default=0)
    overflows_in_a_row: int = field(init=False, default=0)
    hysteresis_left: int = field(init=False)
    skipped_steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise ConfigError(f"loss scale init_scale={self.init_scale} must be a positive finite number")
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ConfigError("loss scale needs growth_factor > 1 and 0 < backoff_factor < 1")
        if self.growth_interval < 1 or self.hysteresis < 1 or self.warn_after < 1:
            raise ConfigError("loss scale growth_interval, hysteresis and warn_after must be >= 1")
        if not 0 < self.min_scale <= self.init_scale <= self.max_scale:
            raise ConfigError("loss scale needs 0 < min_scale <= init_scale <= max_scale")
        self.scale = float(self.init_scale)
        self.hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> bool:
        """Advance the state machine after a backward pass; returns True when the step may be applied."""
        if found_inf:
            self.clean_steps = 0
            self.overflows_in_a_row += 1
            self.skipped_steps += 1
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return False
        self.overflows_in_a_row = 0
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
        return True

    @property
    def persistent(self) -> bool:
        return self.overflows_in_a_row >= self.warn_after

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "overflows_in_a_row": self.overflows_in_a_row,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("scale", "clean_steps", "overflows_in_a_row", "hysteresis_left", "skipped_steps"):
            setattr(self, key, type(getattr(self, key))(state[key]))


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def all_finite(t: torch.Tensor) -> bool:
    """True when t holds no inf/NaN. Under FakeTensorMode (memfit's no-allocation step trace) values
    do not exist: the same ops run (so their memory is predicted) and the step is taken as clean."""
    ok = torch.isfinite(t).all()
    return True if is_fake(ok) else bool(ok)


def _nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not all_finite(t)


class InfNanLocator:
    """Hooks every module; records where inf/NaN first appears in forward and in backward.

    Forward: a forward hook checks each module's outputs; modules finish in execution order, so the
    first hit is the innermost module that produced the first non-finite value. Backward: a tensor
    hook on each module input sees the gradient the module's backward produced for it; the first
    non-finite one names the module whose backward first produced inf/NaN (when nested modules share
    an input, the innermost, whose hook is registered last, wins). Costly (a reduction per module
    output), so it is only armed on demand.
    """

    def __init__(self, model: nn.Module) -> None:
        self.first_forward: str | None = None
        self.first_backward: str | None = None
        self._first_grad: torch.Tensor | None = None
        self._handles = []
        for name, m in model.named_modules():
            name = name or type(model).__name__
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(m.register_forward_hook(self._forward_hook(name)))

    def _pre_hook(self, name: str):
        def hook(module, args):
            for t in _tensors(args):
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name))
        return hook

    def _forward_hook(self, name: str):
        def hook(module, args, output):
            if self.first_forward is None and any(_nonfinite(t.detach()) for t in _tensors(output)):
                self.first_forward = name
        return hook

    def _grad_hook(self, name: str):
        def hook(grad):
            if grad is None:
                return
            if self.first_backward is None and _nonfinite(grad):
                self.first_backward, self._first_grad = name, grad
            elif self._first_grad is grad:  # same gradient, a module registered later: more inner
                self.first_backward = name
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._first_grad = None


def overflow_message(scaler: LossScaler, bad_grads: list[str], locator: InfNanLocator | None) -> str:
    where = []
    if locator is not None and locator.first_forward:
        where.append(f"forward output of {locator.first_forward!r}")
    if locator is not None and locator.first_backward:
        where.append(f"backward of {locator.first_backward!r}")
    if bad_grads:
        shown = ", ".join(bad_grads[:5]) + (", ..." if len(bad_grads) > 5 else "")
        where.append(f"parameter grads {shown}")
    found = "; first inf/NaN in " + "; ".join(where) if where else ""
    return (
        f"fp16 overflow in {scaler.overflows_in_a_row} steps in a row (loss scale now {scaler.scale:g}, "
        f"{scaler.skipped_steps} steps skipped){found}. bf16 has fp32's exponent range: try "
        f"precision='bf16-mixed' or 'bf16-master'."
    )


def warn_overflow(message: str) -> None:
    warnings.warn(message, OverflowWarning, stacklevel=3)
