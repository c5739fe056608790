"""DDP: PyTorch's DistributedDataParallel behind TrainingOptimizer's interface.

Gradients are all-reduced bucket by bucket during backward by torch's reducer; a communication
hook sums (each rank's loss is already divided by the global token count) and counts the bytes.
`micro_batch(last=False)` is DDP's `no_sync()`: accumulation steps do not communicate. After the
all-reduce every rank holds the same gradients, so TrainingOptimizer's overflow check and clipping
norm are already global.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from memfit.apply.optimizer import StepResult, TrainingOptimizer
from memfit.core.errors import ConfigError
from memfit.distributed import comm


class CommHook:
    """State of the one comm hook DDP allows: memfit's counting all-reduce, or a compressor's hook
    once memfit.distributed.compression.register_compression has set `compression`."""

    def __init__(self, group) -> None:
        self.group = group
        self.compression = None
        """A callable bucket -> Future (the compressor's hook bound to its state), or None."""


def _dispatch(state: CommHook, bucket):
    if state.compression is not None:
        return state.compression(bucket)
    return comm.ddp_counting_hook(state.group, bucket)


class DDPOptimizer:
    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.0,
                 precision: str = "32-true", clip: float | None = None, offload: str | None = None,
                 spill_dir: str | None = None, *, group=None, bucket_mb: float = 25.0, **kw: Any) -> None:
        if offload not in (None, "none"):
            raise ConfigError("optimizer offload with --strategy ddp would move gradients before DDP reduces them; "
                              "use --strategy zero1/zero2/zero3, where each rank offloads its own shard")
        self.inner = TrainingOptimizer(model, optimizer, lr=lr, weight_decay=weight_decay, precision=precision,
                                       clip=clip, **kw)  # casts the model before DDP sees it
        device = next(model.parameters()).device
        self.ddp = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, process_group=group,
            gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb,
        )
        self.comm_hook = CommHook(group or dist.group.WORLD)  # DDP takes one hook, once: it dispatches
        self.ddp.register_comm_hook(self.comm_hook, _dispatch)
        self.model, self.precision, self.mode = self.ddp, self.inner.precision, self.inner.mode
        self.tracked_module = model
        self.scaler = self.inner.scaler

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.inner.autocast()

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        self.inner.backward(loss, final=final)

    def step(self) -> StepResult:
        # The gradients are views into DDP's buckets (gradient_as_bucket_view), which live between
        # steps whether .grad is set or not. Keeping the views, zeroed, costs nothing and lets
        # memfit.track see the buckets from the start of the next step, as the estimate counts them.
        views = [p.grad for p in self.inner.params]
        result = self.inner.step()
        with torch.no_grad():
            for p, g in zip(self.inner.params, views):
                if g is not None and p.grad is None:
                    p.grad = g.zero_()
        return result

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.inner.state_tensors()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> "DDPOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
