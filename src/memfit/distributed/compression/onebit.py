"""Adam with a compressed update: each rank's local Adam direction, error-compensated and averaged.

Adam's update m / (sqrt(v) + eps) is not linear in the gradient: error feedback delivers a
coordinate's gradient in bursts (top-k: T g once every T steps; sign: a flipping residual), and a
v computed from what arrives grows with the burst's square, so the burst moves the weight by a
fraction of what T dense steps would. 1-bit Adam (Tang et al. 2021) and 0/1 Adam (Lu et al.
2022) move the compression past the nonlinearity: they freeze v after a full-precision warm-up
and send the error-compensated momentum. A frozen v needs an uncompressed warm-up of a sizeable
part of the run (v keeps shrinking with the gradients early on), which a short run cannot afford
within a byte budget. So memfit keeps v current instead, where it costs nothing to send: on each
rank.

    warm-up (spec adam=W steps, W >= 0): gradients exchanged through int8 (or fp32); the optimizer
        runs plain Adam(W) on them;
    every step: each rank updates its local Adam moments from its own gradient g_r,
        m_r = b1 m_r + (1 - b1) g_r,  v_r = b2 v_r + (1 - b2) g_r^2,
        y_r = (m_r / bc1) / (sqrt(v_r / bc2) + eps)           (its Adam direction)
    after the warm-up: x = lr y_r + residual;  sent = C(x);  residual = x - sent;  the mean over
        ranks of the decoded `sent` is the step s, the same on every rank; this step applies
        p -= s  (AdamW: p *= 1 - lr wd first). The residual holds lr-scaled steps (spec owe=step,
        the default), so a held-back update is applied at its own step's lr; owe=direction keeps
        y_r unscaled and applies it at the lr of the step that sends it. Top-k's C keeps, per
        tensor, the k elements of largest max(0, x m_r) (first-order gain, select=gain, the
        default; select=agree: max(0, x y_r); select=x: |x|) and sends x there.

The update is linear in what is sent, so error feedback is exact in sum, and every replica
applies the same s. The directions differ from Adam on the mean gradient only in that each rank's
v sees its own batch (at N ranks, the noise of 1/N of the batch); var=batch divides by an
estimate of the batch's v instead (batch_second_moment). The cost is memory: m_r, v_r and the
residual are full-size fp32 buffers per rank, also under ZeRO-2.

s reaches the optimizer as the parameters' .grad scaled by 2^-20 (exact in binary floating point),
so a gradient-norm clip in the optimizer (1.0 in the default job) does not bind on it. The local
gradient is clipped instead before it enters m_r and v_r, at the optimizer's clip norm unless the
spec's clip= names another (clip=inf: off); unclipped early gradients leave v_r too large.

The optimizer is a torch Adam or AdamW whose state sits beside its parameters (what
TrainingOptimizer, memfit's DDP and the ZeRO-1/2 shard optimizer hold without offload or master
weights). attach() replaces that optimizer's step on the instance: plain Adam while
state.update_phase is False, the update above after.
"""
from __future__ import annotations

from typing import Any

import torch

from memfit.core.errors import ConfigError

WIRE_SCALE = 2.0 ** -20
"""s is handed over as s * 2^-20: far below any gradient-norm clip, and undone exactly."""


def batch_second_moment(m_hat: torch.Tensor, v_hat: torch.Tensor, world: int, beta1: float) -> torch.Tensor:
    """The second moment Adam would see on the mean gradient of `world` ranks, from one rank's moments.

    A rank's gradient is g = mu + noise of variance s2 (its 1/N of the batch); the mean over N
    ranks has E[g^2] = mu^2 + s2 / N, while the rank's own v estimates mu^2 + s2: up to N times
    larger where noise dominates, which shrinks the steps. Adam's moments give both parts for
    free: E[m^2] = mu^2 + c s2 with c = (1 - b1) / (1 + b1) (the EMA's own noise), E[v] = mu^2 + s2,
    so s2 = (v - m^2) / (1 - c) and mu^2 + s2 / N = m^2 + k (v - m^2), k = (1 / N - c) / (1 - c).
    N = 1 gives v back; the result lies between m^2 and v, so |m| / sqrt(result) stays bounded.
    Without momentum (b1 = 0) m is the gradient itself and holds no estimate of mu: v as it is.
    """
    if world <= 1 or beta1 <= 0:
        return v_hat
    c = (1 - beta1) / (1 + beta1)
    k = max(0.0, (1 / world - c) / (1 - c))
    m2 = m_hat * m_hat
    return m2.add_((v_hat - m2).mul_(k))


def agreement(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Top-k's ranking weight in adam mode: max(0, sign(x) y), so an element's score is max(0, x y).

    x = the rank's current direction y plus its residual: the update it still owes. Where the
    current direction still points the way x does, the owed update is sent first, the more so
    the firmer the direction (|y| near 1: a steady gradient; small |y|: noise that the EMA
    averages out). Where Adam has since turned (x y < 0) the owed update is stale: it is held
    back and the coming directions cancel it in the residual instead of it being applied. What
    is sent is still x at the chosen elements, so error feedback stays exact.
    """
    return (x.sign() * y).clamp_(min=0)


class LocalAdam:
    """Each rank's Adam moments of its own gradients, per exchanged buffer (keyed like residuals)."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 batch_variance: bool = True) -> None:
        self.betas, self.eps, self.batch_variance = betas, eps, batch_variance
        self.m: dict = {}
        self.v: dict = {}
        self.t: dict = {}

    def direction(self, key, g: torch.Tensor, world: int = 1) -> torch.Tensor:
        """Fold g into the moments of `key`; Adam's bias-corrected direction (a new tensor).

        world: the ranks whose directions are averaged; above 1 (and batch_variance on), the
        denominator estimates the whole batch's second moment (batch_second_moment)."""
        b1, b2 = self.betas
        m, v = self.m.get(key), self.v.get(key)
        if m is None or m.shape != g.shape:
            m, v, self.t[key] = torch.zeros_like(g), torch.zeros_like(g), 0
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        self.m[key], self.v[key] = m, v
        self.t[key] += 1
        t = self.t[key]
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        if world > 1 and self.batch_variance:
            v_hat = batch_second_moment(m_hat, v_hat, world, b1)
        return m_hat.div_(v_hat.sqrt_().add_(self.eps))

    def state_dict(self) -> dict:
        return {"m": {k: x.clone() for k, x in self.m.items()}, "v": {k: x.clone() for k, x in self.v.items()},
                "t": dict(self.t)}

    def load_state_dict(self, state: dict) -> None:
        self.m = {k: x.clone() for k, x in state["m"].items()}
        self.v = {k: x.clone() for k, x in state["v"].items()}
        self.t = dict(state["t"])


def torch_optimizer_of(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that updates the parameters behind memfit's wrappers, or ConfigError."""
    inner = getattr(optimizer, "inner", None)  # memfit's DDPOptimizer, ShardedOptimizer
    if inner is not None:
        optimizer = inner
    if getattr(optimizer, "streamed", None) is not None:
        raise ConfigError("adam= needs the optimizer state beside the parameters; it does not combine with "
                          "optimizer offload or master-weight precisions")
    optimizer = getattr(optimizer, "optimizer", optimizer)  # TrainingOptimizer -> its torch optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(f"adam= works with the adam and adamw optimizers, not {type(optimizer).__name__}; "
                          "use topk/sign without adam= (momentum= for SGD)")
    for group in optimizer.param_groups:
        if group.get("amsgrad") or (type(optimizer) is torch.optim.Adam and group.get("weight_decay")):
            raise ConfigError("adam= supports AdamW, and Adam without weight decay or amsgrad")
    return optimizer


class CompressedAdamStep:
    def __init__(self, state: Any, optimizer: torch.optim.Optimizer) -> None:
        self.state, self.optimizer = state, optimizer
        self.decoupled = type(optimizer) is torch.optim.AdamW
        self.dense_step = optimizer.step
        group = optimizer.param_groups[0]
        state.local_adam.betas, state.local_adam.eps = tuple(group["betas"]), group["eps"]
        optimizer.step = self.step  # instance attribute: the wrappers call optimizer.step()

    def step(self, closure=None):
        if not self.state.update_phase:
            return self.dense_step(closure) if closure is not None else self.dense_step()
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                lr, wd = group["lr"], group["weight_decay"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if wd and self.decoupled:
                        p.mul_(1 - lr * wd)
                    p.add_(p.grad, alpha=-lr / WIRE_SCALE)
        return None


def attach(state: Any, optimizer: Any) -> CompressedAdamStep:
    """Bind `state` (spec with adam=) to the Adam(W) behind `optimizer`; ConfigError if it cannot.

    Without clip= in the spec, the local gradient is clipped at the optimizer's own clip norm
    (memfit's optimizers and strategies keep it as `.clip`): that clip cannot act on the update."""
    if optimizer is None:
        raise ConfigError(f"compression {state.spec}: adam= needs the optimizer; pass "
                          "register_compression(model, spec, optimizer=opt)")
    step = CompressedAdamStep(state, torch_optimizer_of(optimizer))
    state.lr_of = lambda: step.optimizer.param_groups[0]["lr"]
    if state.spec.clip is None:
        state.clip = getattr(optimizer, "clip", getattr(getattr(optimizer, "inner", None), "clip", None))
    return step
