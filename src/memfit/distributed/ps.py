"""The parameter-server baseline: gradients reduced to rank 0, updated there, weights broadcast.

Rank 0 (the server) holds the whole optimizer state; the other ranks (workers) hold none. Per
step a worker sends its gradients once (Ψ) and the server sends the weights to each worker
((N-1)Ψ): the server's link carries N-1 times a worker's, which is why the scheme gave way to
all-reduce. The server's loss scale decides for everyone (its gradients are the sum, so an
overflow anywhere shows there); it is sent along with the step's outcome.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from memfit.apply.loss_scale import LossScaler
from memfit.apply.optimizer import StepResult, TrainingOptimizer
from memfit.apply.precision import autocast, cast_model, precision_mode
from memfit.core.errors import ConfigError
from memfit.distributed import comm
from memfit.distributed.layout import FlatLayout

ROOT = 0


class ParameterServer:
    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.0,
                 precision: str = "32-true", clip: float | None = None, offload: str | None = None,
                 spill_dir: str | None = None, *, group=None, **kw: Any) -> None:
        if offload not in (None, "none"):
            raise ConfigError("optimizer offload with --strategy ps would move the server's gradients before "
                              "the workers' arrive; use --strategy zero1/zero2/zero3 with offload")
        self.group, self.clip = group, clip
        self.rank = dist.get_rank(group)
        self.mode = precision_mode(precision)
        self.precision = self.mode.name
        cast_model(model, self.mode)
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, ROOT, group=group)  # setup, not counted
        self.model = self.tracked_module = model
        self.layout = FlatLayout(model, 1)
        self.inner: TrainingOptimizer | None = None
        self.scale: float | None = LossScaler().scale if self.mode.loss_scaling else None
        self._groups = [{"lr": lr}]
        if self.rank == ROOT:
            self.inner = TrainingOptimizer(model, optimizer, lr=lr, weight_decay=weight_decay, precision=self.mode,
                                           clip=clip, offload=offload, spill_dir=spill_dir, **kw)
        self.scaler = self.inner.scaler if self.inner is not None else None
        p0 = self.layout.buckets[0].params[0]
        self.dtype, self.device = p0.dtype, p0.device

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups if self.inner is not None else self._groups

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.mode, self.device.type)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        if self.scale is not None:
            loss = loss.float() * (self.inner.scaler.scale if self.inner is not None else self.scale)
        loss.backward()

    def step(self) -> StepResult:
        for b in self.layout.buckets:
            flat = b.flatten([p.grad for p in b.params], self.dtype, self.device)
            comm.reduce(flat, ROOT, group=self.group)
            for p, v in zip(b.params, b.views(flat)):
                p.grad = v if self.rank == ROOT else None
        result = StepResult(stepped=True)
        if self.inner is not None:
            result = self.inner.step()
        outcome = [float(result.stepped), float(result.loss_scale or 0.0), float(result.grad_norm or 0.0),
                   float(self.inner.scaler.scale) if self.inner is not None and self.inner.scaler else 0.0]
        msg = torch.tensor(outcome, dtype=torch.float64)
        comm.TRAFFIC.add("control", msg.numel() * 8 * (dist.get_world_size(self.group) - 1) * (self.rank == ROOT))
        dist.broadcast(msg, ROOT, group=self.group)
        stepped, used, norm, next_scale = msg.tolist()
        if self.scale is not None:
            self.scale = next_scale
        if stepped:
            with torch.no_grad():
                for b in self.layout.buckets:
                    flat = b.flatten([p.detach() for p in b.params], self.dtype, self.device)
                    comm.broadcast(flat, ROOT, group=self.group)
                    if self.rank != ROOT:
                        for p, v in zip(b.params, b.views(flat)):
                            p.copy_(v)
        return StepResult(stepped=bool(stepped), grad_norm=norm if self.clip is not None and stepped else None,
                          loss_scale=used or None)

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return self.inner.state_tensors() if self.inner is not None else []

    def state_dict(self) -> dict:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def __enter__(self) -> "ParameterServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
