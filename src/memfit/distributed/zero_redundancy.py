"""ZeRO-1 on torch's engines: DistributedDataParallel and `ZeroRedundancyOptimizer` (ZeRO-R).

    opt = distribute(model, "zero1", engine="zero-redundancy", optimizer="adamw", lr=3e-4)

DDP all-reduces the gradients bucket by bucket in backward (every rank then holds every gradient,
as views into DDP's buckets); ZeroRedundancyOptimizer gives each rank the optimizer state of some
whole parameters and, after its local step, broadcasts each parameter from its owner. The
assignment is torch's and deterministic: each parameter group's tensors sorted largest first, each
given to the rank with the fewest elements so far (ties: the lower rank). `assignment()` reproduces
it for the estimate (memfit.distributed.rank_memory, engine "zero-redundancy"). Overlap of the step
with DDP's backward (`overlap_with_ddp`) is off: it needs a functional optimizer and a hook that
replaces memfit's summing one.

Gradients are summed over the ranks (memfit's convention: divide each rank's loss by the global
token count). Precision: 32-true, bf16-mixed (float32 weights, bf16 autocast) and bf16-true (bf16
weights and state); a master copy (-master) or an fp16 loss scaler is memfit's engine's.

What differs from memfit's own zero1 (memfit.distributed.sharded): memfit slices one flat buffer
evenly (state balanced to an element), ZeRO-R hands out whole tensors (a rank may hold up to one
tensor more); memfit reduce-scatters at the step, DDP all-reduces during backward; optimizer
offload to CPU or disk is memfit's only.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from memfit.apply.optimizer import StepResult
from memfit.apply.optimizers import optimizer_class
from memfit.apply.precision import autocast, precision_mode
from memfit.apply.torch_optim import torch_kwargs
from memfit.core.errors import ConfigError
from memfit.distributed import comm

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def assignment(sizes: Iterable[int], world: int) -> list[int]:
    """The rank ZeroRedundancyOptimizer gives each tensor of one parameter group (`sizes`: their
    element counts, in the group's order): largest first (a stable sort: equal sizes keep their
    order), each to the rank with the fewest elements so far, the lowest such rank on a tie."""
    sizes = list(sizes)
    held, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = min(range(world), key=held.__getitem__)
        owner[i] = rank
        held[rank] += sizes[i]
    return owner


class ZeroRedundancyDDP:
    """See the module docstring. `bucket_mb`: DDP's bucket_cap_mb."""

    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.0,
                 precision: str = "32-true", clip: float | None = None, offload: str | None = None, *,
                 group=None, bucket_mb: float = 25.0, **optimizer_kwargs: Any) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.mode = precision_mode(precision)
        if self.mode.name not in PRECISIONS:
            raise ConfigError(f"precision {precision!r} on the zero-redundancy engine is not supported (it keeps no "
                              f"master copy and no loss scaler); use one of {', '.join(PRECISIONS)}, or the memfit engine")
        if offload not in (None, "none"):
            raise ConfigError(f"offload={offload!r} on the zero-redundancy engine: ZeroRedundancyOptimizer keeps its "
                              "state on the device; leave it out, or use the memfit engine")
        if clip is not None and not clip > 0:
            raise ConfigError(f"clip={clip} must be a positive gradient-norm limit (or None for no clipping)")
        self.precision, self.clip = self.mode.name, clip
        if self.mode.param_dtype != torch.float32:
            model.to(self.mode.param_dtype)
        device = next(model.parameters()).device
        self.device_type = device.type
        self.group = group or dist.group.WORLD
        self.ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                           process_group=group, gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)
        self.ddp.register_comm_hook(self.group, comm.ddp_counting_hook)  # sums (memfit's convention)
        self.params = [p for p in model.parameters() if p.requires_grad]
        kw = torch_kwargs(optimizer, lr, weight_decay, optimizer_kwargs)
        self.inner = ZeroRedundancyOptimizer(self.params, optimizer_class=optimizer_class(optimizer),
                                             process_group=self.group, overlap_with_ddp=False, **kw)
        self.model, self.tracked_module = self.ddp, model

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.mode, self.device_type)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        loss.backward()

    def step(self) -> StepResult:
        norm = None
        if self.clip is not None:  # every rank holds every (all-reduced) gradient: the norm is global
            norm = float(nn.utils.clip_grad_norm_(self.params, self.clip))
            if not math.isfinite(norm):
                self.zero_grad()
                return StepResult(stepped=False, grad_norm=norm)
        self.inner.step()  # the owned parameters' update, then each broadcast from its owner
        self.zero_grad()
        return StepResult(stepped=True, grad_norm=norm)

    def zero_grad(self) -> None:
        # The gradients are views into DDP's buckets, which live between steps whatever .grad holds;
        # zeroing them in place keeps them visible to memfit.track, as the estimate counts them.
        self.inner.zero_grad(set_to_none=False)

    def owned(self) -> list[torch.Tensor]:
        """The parameters whose optimizer state this rank holds."""
        return [p for g in self.inner.optim.param_groups for p in g["params"]]

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.inner.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def state_dict(self) -> dict:
        """This rank's own state (torch's consolidated form would gather every rank's onto one)."""
        return {"precision": self.precision, "engine": "zero-redundancy", "rank": self.inner.rank,
                "inner": self.inner.optim.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rank") != self.inner.rank:
            raise ConfigError(f"this optimizer state is rank {state.get('rank')}'s, not rank {self.inner.rank}'s: "
                              "resume on the same number of ranks")
        self.inner.optim.load_state_dict(state["inner"])

    def close(self) -> None:
        pass

    def __enter__(self) -> "ZeroRedundancyDDP":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
