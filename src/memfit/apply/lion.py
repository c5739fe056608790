"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): one state, the sign of
an interpolated momentum as the update.

    c = b1 * m + (1 - b1) * g
    p = p - lr * (sign(c) + wd * p)
    m = b2 * m + (1 - b2) * g

torch has no Lion; this is the published rule, per parameter, with the momentum in the parameter's
dtype (as torch's optimizers keep their state). Its update has the same magnitude everywhere, so it
wants a learning rate 3-10x smaller than AdamW's and a weight decay as many times larger.
"""
from __future__ import annotations

import torch

from memfit.core.errors import ConfigError


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ConfigError(f"lion: lr must be positive, got {lr!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"lion: betas must be in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lion_update(p, p.grad, state["exp_avg"], lr, b1, b2, wd)
        return loss


def lion_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float, b1: float, b2: float,
                wd: float) -> None:
    """One Lion step on one tensor, in place (p and m)."""
    c = m.mul(b1).add_(g, alpha=1 - b1).sign_()
    if wd:
        p.mul_(1 - lr * wd)
    p.add_(c, alpha=-lr)
    m.mul_(b2).add_(g, alpha=1 - b2)
