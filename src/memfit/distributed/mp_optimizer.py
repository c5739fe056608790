"""The step shared by `pipeline` and `tensor`: a TrainingOptimizer over this rank's own tensors, with
fp16 loss scaling, the overflow check and clipping decided across all ranks.

Each rank's stage (pipeline) or shard (tensor) is mirrored by plain parameters that *share the
storage* of the model's (a DTensor's local shard for tensor), gathered in `LocalParams`. An ordinary
TrainingOptimizer updates them, with loss scaling turned off inside it, so master weights, every
torch optimizer and optimizer offload (each rank offloads its own stage's or shard's state:
ZeRO-Offload's per-rank scheme) compose unchanged; an update in place is an update of the model.
At the step the model's gradients are reduced where the strategy needs it (the tied embedding
between the first and last stage; the dp replicas), then one all-reduce of two scalars over the
world carries "some rank holds inf/NaN" and the squared gradient norm: every rank skips the same
steps, halves the same loss scale and clips with the same global norm. The gradients are then
handed to the local parameters as autograd would accumulate them (their post-accumulate hooks run,
so offload moves them to the host there).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn

from memfit.apply.loss_scale import LossScaler
from memfit.apply.optimizer import StepResult, TrainingOptimizer
from memfit.apply.precision import cast_model, precision_mode
from memfit.core.errors import ConfigError
from memfit.distributed import comm
from memfit.distributed.wrapped import WrapsTrainingOptimizer


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class LocalParams(nn.Module):
    """Plain parameters sharing the storage of the model's (its local shards), in the model's order."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.items = nn.ParameterList(nn.Parameter(local(p.data).detach(), requires_grad=True) for p in params)


class ModelParallelOptimizer(WrapsTrainingOptimizer):
    """Base of PipelineOptimizer and TensorParallelOptimizer; subclasses set `group` and call
    `_make_inner`, and may override `_reduce_grads` and `_norm_weights`."""

    group: Any = None
    hf = False
    aligned_targets = False
    """A Hugging Face model's targets: False, transformers' way (labels are the input ids, shifted by one
    inside the loss, -100 skipped); True, memfit's data (`memfit train`: targets aligned with the inputs,
    -1 skipped), as memfit's GPT always takes them."""

    @property
    def shifted(self) -> bool:
        """Whether the targets are labels to shift (see aligned_targets)."""
        return self.hf and not self.aligned_targets

    def _make_inner(self, model: nn.Module, named: list[tuple[str, nn.Parameter]], optimizer: str, lr: float,
                    weight_decay: float, precision: str, clip: float | None, offload: str | None,
                    spill_dir: str | None, loss_scale: LossScaler | dict | None, kw: dict) -> None:
        if clip is not None and not clip > 0:
            raise ConfigError(f"clip={clip} must be a positive gradient-norm limit (or None for no clipping)")
        self.mode = precision_mode(precision)
        self.precision, self.clip = self.mode.name, clip
        cast_model(model, self.mode)  # before LocalParams share the storage: the inner cast is then a no-op
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.local_params = LocalParams(self.params)
        inner_mode = dataclasses.replace(self.mode, loss_scaling=False)  # unscaled, clipped at hand-over
        self.inner = TrainingOptimizer(self.local_params, optimizer, lr=lr, weight_decay=weight_decay,
                                       precision=inner_mode, clip=None, offload=offload, spill_dir=spill_dir, **kw)
        self.scaler: LossScaler | None = None
        if self.mode.loss_scaling:
            self.scaler = loss_scale if isinstance(loss_scale, LossScaler) else LossScaler(**(loss_scale or {}))

    # ------------------------------------------------------------------ what subclasses adapt
    def _reduce_grads(self) -> None:
        """Make the model's gradients final before the step (collectives between ranks)."""

    def _norm_weights(self) -> list[float]:
        """Per parameter, the weight of its squared gradient in the world's sum (so that the sum
        over all ranks counts every gradient element of the model once)."""
        return [1.0] * len(self.params)

    # ------------------------------------------------------------------ the step
    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.scaler.scale if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        self.scaled(loss).backward()

    def step(self) -> StepResult:
        self._reduce_grads()
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = [local(self.params[i].grad) for i in have]
        scale = self.scaler.scale if self.scaler is not None else None
        bad = sq = 0.0
        if self.scaler is not None:
            bad = float(sum(int(not bool(torch.isfinite(g).all())) for g in grads))
        if self.clip is not None:
            weights = self._norm_weights()
            sq = float(sum(weights[i] * float(g.float().pow(2).sum()) for i, g in zip(have, grads)))
        if self.scaler is not None or self.clip is not None:
            bad, sq = comm.control_sum([bad, sq], group=self.group)  # one message: every rank decides alike
            bad = bad if math.isfinite(sq) or self.scaler is None else max(bad, 1.0)
        if self.scaler is not None and not self.scaler.update(bad > 0):
            self.zero_grad()
            return StepResult(stepped=False, loss_scale=scale)
        factor, norm = (1.0 / scale if scale is not None else 1.0), None
        if self.clip is not None:
            norm = math.sqrt(sq) * factor
            factor *= min(1.0, self.clip / (norm + 1e-6))
        if factor != 1.0:
            torch._foreach_mul_(grads, factor)
        self._hand_over(have, grads)
        self.inner.step()
        return StepResult(stepped=True, grad_norm=norm, loss_scale=scale)

    def _hand_over(self, have: list[int], grads: list[torch.Tensor]) -> None:
        """The gradients reach the local parameters as if autograd had accumulated them there."""
        for i, g in zip(have, grads):
            q = self.local_params.items[i]
            q.grad = g
            self.params[i].grad = None
            for hook in list((getattr(q, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(q)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's part of the optimizer state (checkpoints: save_sharded / load_sharded)."""
        state = {"stage": None, "inner": self.inner.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def save_sharded(self, path) -> None:
        """Every rank writes its stage's / shard's weights and optimizer state (torch.distributed.checkpoint)."""
        from memfit.distributed.parallel_checkpoint import save_parallel

        save_parallel(self, path)

    def load_sharded(self, path) -> None:
        """Read a save_sharded checkpoint written by pipeline or tensor with any layout of ranks."""
        from memfit.distributed.parallel_checkpoint import load_parallel

        load_parallel(self, path)

    # ------------------------------------------------------------------ checkpoint layout (subclasses)
    def checkpoint_name(self, i: int) -> str:
        """The name of parameter i in the plain GPT's state dict (the tied matrix: tok.weight)."""
        name = self.names[i]
        return "tok.weight" if name == "head.weight" and getattr(self, "tied_names", False) else name

    def checkpoint_parts(self, i: int, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter i's local tensor `t` (weights or state of its shape) as checkpoint entries."""
        raise NotImplementedError
