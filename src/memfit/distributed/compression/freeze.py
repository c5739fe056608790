"""Freeze Adam's second moment after a warm-up, as 1-bit Adam does (Tang et al. 2021).

Adam's step m / sqrt(v) is not linear in the gradient, and error feedback relies on linearity: a
top-k coordinate arrives as one burst of about T steps' gradient once every T steps, Adam's v jumps
by T^2 g^2 and the burst moves the weight by a fraction of what T dense steps would have. With v
frozen, the step is linear (m is a running mean of what arrives, divided by a fixed sqrt(v)), so a
delayed burst moves the weight as far as the dense steps would have. v is estimated during the
first `freeze` steps and kept from then on; 1-bit Adam observes that it settles early. Under top-k
many elements got nothing yet when v is frozen; they are floored at FLOOR x their tensor's mean.
"""
from __future__ import annotations

import types

import torch

FLOOR = 0.1


def freeze_second_moment(optimizer: torch.optim.Optimizer) -> bool:
    """Replace `optimizer.step` (torch Adam or AdamW, after at least one step) with one that keeps
    each exp_avg_sq and its bias correction as they are now; False when it is not such an optimizer."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or not optimizer.state:
        return False
    decoupled = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay", False)
    frozen = {}
    for group in optimizer.param_groups:
        beta2 = group["betas"][1]
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st:
                root = (st["exp_avg_sq"] / (1 - beta2 ** float(st["step"]))).sqrt_()
                # an element that got no gradient yet (v = 0) takes a tenth of its tensor's mean scale
                frozen[p] = root.clamp_min_(max(float(root.mean()) * FLOOR, torch.finfo(root.dtype).tiny))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, _), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None or p not in frozen:
                    continue
                st, g = self.state[p], p.grad
                st["step"] += 1
                if wd and decoupled:
                    p.mul_(1 - lr * wd)
                elif wd:
                    g = g.add(p, alpha=wd)
                st["exp_avg"].lerp_(g, 1 - beta1)
                p.addcdiv_(st["exp_avg"], frozen[p] + eps, value=-lr / (1 - beta1 ** float(st["step"])))
        return None

    optimizer.step = types.MethodType(step, optimizer)
    return True
