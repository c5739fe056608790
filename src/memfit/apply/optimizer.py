"""TrainingOptimizer: everything between a loss and updated weights, behind one small interface.

    opt = TrainingOptimizer(model, "adamw", lr=3e-4, precision="bf16-mixed", clip=1.0)
    with opt.autocast():
        logits, loss_sum, n = model(x, y)
    opt.backward(loss_sum / total_tokens)
    result = opt.step()          # unscale, check, clip, update, zero grads

Foundation version: 32-true and the autocast modes (bf16-mixed, 16-mixed without loss scaling yet)
over a plain torch optimizer. Master weights, loss scaling and offload build on this interface.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from memfit.errors import ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16-master", "16-master")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


@dataclass
class StepResult:
    stepped: bool
    """False when the step was skipped (fp16 overflow)."""
    grad_norm: float | None = None
    """Total gradient norm before clipping (None when clipping is off)."""
    loss_scale: float | None = None


def make_torch_optimizer(name: str, params, lr: float, weight_decay: float = 0.0, **kw: Any) -> torch.optim.Optimizer:
    name = name.lower()
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=kw.get("momentum", 0.9), weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=kw.get("betas", (0.9, 0.999)), weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=kw.get("betas", (0.9, 0.95)), weight_decay=weight_decay)
    raise ConfigError(f"unknown optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}")


class TrainingOptimizer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: str = "adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        precision: str = "32-true",
        clip: float | None = None,
        offload: str | None = None,
        spill_dir: str | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; accepted: {', '.join(PRECISIONS)}")
        if precision not in ("32-true", "bf16-mixed", "16-mixed") or offload:
            raise ConfigError(f"precision {precision!r} with offload={offload!r} is not supported yet")
        self.model, self.precision, self.clip = model, precision, clip
        self.device_type = next(model.parameters()).device.type
        self.optimizer = make_torch_optimizer(optimizer, model.parameters(), lr, weight_decay, **optimizer_kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        if self.precision == "16-mixed":
            return torch.autocast(self.device_type, dtype=torch.float16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> StepResult:
        norm = None
        if self.clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(stepped=True, grad_norm=norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Release resources (spill files, worker threads). Safe to call twice."""

    def __enter__(self) -> "TrainingOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
