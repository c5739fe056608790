"""Frozen-variance Adam for compressed momentum (1-bit Adam, Tang et al. 2021; 0/1 Adam, Lu et al. 2022).

Adam's update m / (sqrt(v) + eps) is not linear in the gradient: error feedback delivers a
coordinate's gradient in bursts (top-k: T g once every T steps; sign: a flipping residual), and v
then grows with the burst's square, so the burst moves the weight by a fraction of what T dense
steps would. With v frozen the update is linear in m, so error feedback on m is exact in the sum:

    warm-up (spec adam=W steps): gradients exchanged through int8 (or fp32), plain Adam(W) updates
        m and v; each rank also keeps its local momentum u = b1 u + (1 - b1) g_local;
    after:  u = b1 u + (1 - b1) g_local;  x = u / d + residual;  sent = C(x);  residual = x - sent
        with d = sqrt(v / bc2_W) + eps, Adam's denominator frozen at step W (the same on every
        rank); top-k zeroes u where it sent (DGC's momentum masking). The ranks' decoded `sent`
        are averaged (memfit's strategies: summed) into the update direction s, which arrives
        as the parameter's .grad in momentum units, s * d (so gradient clipping sees a momentum);
        this step then applies  p -= (lr / bc1) (s d) / d  (AdamW: p *= 1 - lr wd first).

Compressing u / d rather than u keeps the compressor's shared scale (sign: mean |x| per chunk) in
update units: sent in momentum units, a coordinate whose v is near zero (an embedding row no batch
has used) would get lr * scale / eps. u / d is clamped to [-1, 1] before the residual is added: plain Adam's |m / sqrt(v)| stays near or
below 1 because v follows the gradient's scale, but a frozen v does not, and a coordinate that
saw almost no gradient during the warm-up (a rare token's embedding row) would otherwise take
steps of lr * u / eps once its gradient arrives. Under ZeRO each rank holds v for its shard only, so d is
all-gathered once per bucket when the compressed phase starts (counted in the bytes).

The optimizer is a torch Adam or AdamW whose state sits beside its parameters (what
TrainingOptimizer, memfit's DDP and the ZeRO-1/2 shard optimizer hold without offload or master
weights). attach() replaces that optimizer's step on the instance: plain Adam while
state.momentum_phase is False, the frozen update after. The optimizer's exp_avg receives m and its
step keeps counting, so its state_dict stays a valid Adam state.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from memfit.core.errors import ConfigError


def torch_optimizer_of(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that updates the parameters behind memfit's wrappers, or ConfigError."""
    inner = getattr(optimizer, "inner", None)  # memfit's DDPOptimizer, ShardedOptimizer
    if inner is not None:
        optimizer = inner
    if getattr(optimizer, "streamed", None) is not None:
        raise ConfigError("adam= (frozen-variance Adam) needs the optimizer state beside the parameters; "
                          "it does not combine with optimizer offload or master-weight precisions")
    optimizer = getattr(optimizer, "optimizer", optimizer)  # TrainingOptimizer -> its torch optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ConfigError(f"adam= (frozen-variance Adam) works with the adam and adamw optimizers, not "
                          f"{type(optimizer).__name__}; use topk/sign without adam= (momentum= for SGD)")
    for group in optimizer.param_groups:
        if group.get("amsgrad") or (type(optimizer) is torch.optim.Adam and group.get("weight_decay")):
            raise ConfigError("adam= supports AdamW, and Adam without weight decay or amsgrad")
    return optimizer


class FrozenVarianceAdam:
    def __init__(self, state: Any, optimizer: torch.optim.Optimizer, engine: Any = None) -> None:
        self.state, self.optimizer, self.engine = state, optimizer, engine
        self.decoupled = type(optimizer) is torch.optim.AdamW
        self.dense_step = optimizer.step
        beta1 = optimizer.param_groups[0]["betas"][0]
        state.feedback.momentum = state.feedback.dampening = beta1  # u tracks Adam's m
        self.group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
        self.cache: dict = {}
        state.precondition = self.bucket_denominator
        optimizer.step = self.step  # instance attribute: the wrappers call optimizer.step()

    def denominator(self, p: torch.Tensor) -> torch.Tensor:
        """sqrt(v / bc2_W) + eps for parameter p (v frozen since step W)."""
        group, st = self.group_of[p], self.optimizer.state.get(p, {})
        if "exp_avg_sq" not in st:
            raise ConfigError("adam=: a parameter reached the compressed phase without a warm-up step of "
                              "Adam (its second moment is empty); raise adam=")
        bc2_sqrt = math.sqrt(1 - group["betas"][1] ** self.state.spec.adam)
        return (st["exp_avg_sq"].float().sqrt() / bc2_sqrt).add_(group["eps"])

    def bucket_denominator(self, key, numel: int) -> torch.Tensor:
        """The flat denominator of one exchanged buffer (a DDP bucket in model order, or a ZeRO
        bucket: its shards' denominators all-gathered once); cached, as v is frozen."""
        d = self.cache.get(key)
        if d is None or d.numel() != numel:
            if self.engine is not None:
                d = self._gathered(key, numel)
            else:
                params = self.state.params_at(key)
                d = torch.cat([self.denominator(p).reshape(-1) for p in params])
            self.cache[key] = d
        return d

    def _gathered(self, key: int, numel: int) -> torch.Tensor:
        from memfit.distributed.compression.exchange import allgather_bytes, all_gather_flat

        shard = self.denominator(self.engine.shards[key]).reshape(-1)
        world = self.engine.world
        full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        all_gather_flat(full, shard.contiguous(), group=self.engine.group)
        self.state.traffic.add("all_gather", allgather_bytes(shard.numel() * shard.element_size(), world))
        return full

    def step(self, closure=None):
        if not self.state.momentum_phase:
            return self.dense_step(closure) if closure is not None else self.dense_step()
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                self._update(group)
        return None

    def _update(self, group: dict) -> None:
        beta1, lr, wd = group["betas"][0], group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.optimizer.state[p]
            denom = self.denominator(p)
            st["step"] += 1
            st["exp_avg"].copy_(p.grad)  # m: the state stays a valid Adam state
            if wd and self.decoupled:
                p.mul_(1 - lr * wd)
            p.addcdiv_(p.grad, denom, value=-lr / (1 - beta1 ** float(st["step"])))


def attach(state: Any, optimizer: Any, engine: Any = None) -> FrozenVarianceAdam:
    """Bind `state` (spec with adam=) to the Adam(W) behind `optimizer` (engine: memfit's ZeRO engine,
    whose buckets are keyed by index and whose v is sharded); ConfigError if it cannot."""
    if optimizer is None:
        raise ConfigError(f"compression {state.spec}: adam= needs the optimizer; pass "
                          "register_compression(model, spec, optimizer=opt)")
    return FrozenVarianceAdam(state, torch_optimizer_of(optimizer), engine)
