"""ShardedOptimizer: TrainingOptimizer's interface over ZeRO stages 1-3.

The rank's slices (memfit.distributed.zero) form a small module; an ordinary TrainingOptimizer
updates it, so master weights, optimizer offload (each rank offloads its own shard: ZeRO-Offload)
and every torch optimizer work unchanged. What must see all ranks lives here: fp16 loss scaling
skips a step when *any* rank's slice holds inf/NaN, and clipping uses the global gradient norm;
both are decided from one all-reduced message of two scalars.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn

from memfit.apply.loss_scale import LossScaler
from memfit.apply.optimizer import StepResult, TrainingOptimizer
from memfit.apply.precision import autocast, cast_model, precision_mode
from memfit.core.errors import ConfigError
from memfit.distributed import comm
from memfit.distributed.zero import ZeroEngine


class Tracked(nn.Module):
    """The model and this rank's shard side by side, for memfit.track: both count as parameters."""

    def __init__(self, model: nn.Module, shard: nn.Module) -> None:
        super().__init__()
        self.model, self.shard = model, shard


class ShardedOptimizer:
    def __init__(
        self,
        model: nn.Module,
        stage: int,
        optimizer: str = "adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        precision: str = "32-true",
        clip: float | None = None,
        offload: str | None = None,
        spill_dir: str | None = None,
        *,
        loss_scale: LossScaler | dict | None = None,
        group=None,
        prefetch: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if clip is not None and not clip > 0:
            raise ConfigError(f"clip={clip} must be a positive gradient-norm limit (or None for no clipping)")
        self.mode = precision_mode(precision)
        self.precision, self.clip, self.group, self.stage = self.mode.name, clip, group, stage
        cast_model(model, self.mode)
        self.model = model
        self.engine = ZeroEngine(model, stage, group, prefetch=prefetch)
        # The inner optimizer sees already unscaled, clipped shard gradients.
        inner_mode = dataclasses.replace(self.mode, loss_scaling=False)
        self.inner = TrainingOptimizer(self.engine.shard_module, optimizer, lr=lr, weight_decay=weight_decay,
                                       precision=inner_mode, clip=None, offload=offload, spill_dir=spill_dir,
                                       **optimizer_kwargs)
        self.scaler: LossScaler | None = None
        if self.mode.loss_scaling:
            self.scaler = loss_scale if isinstance(loss_scale, LossScaler) else LossScaler(**(loss_scale or {}))
        self.tracked_module = Tracked(model, self.engine.shard_module)
        self.device_type = self.engine.device.type

    # ------------------------------------------------------------------ training-loop interface
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.mode, self.device_type)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Stage 2/3 reduce every micro-batch's gradients as backward produces them; stage 1 at the step."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        loss.backward()
        self.engine.finish_backward()

    def step(self) -> StepResult:
        grads = self.engine.reduce_for_step()
        scale = self.scaler.scale if self.scaler is not None else None
        bad = sq = 0.0
        if self.scaler is not None:
            bad = float(sum(int(not bool(torch.isfinite(g).all())) for g in grads))
        if self.clip is not None:
            sq = float(sum(float(g.float().pow(2).sum()) for g in grads))
        if self.scaler is not None or self.clip is not None:
            bad, sq = comm.control_sum([bad, sq], group=self.group)
            bad = bad if math.isfinite(sq) or self.scaler is None else max(bad, 1.0)
        if self.scaler is not None and not self.scaler.update(bad > 0):
            self.engine.zero_grads()
            return StepResult(stepped=False, loss_scale=scale)
        factor, norm = (1.0 / scale if scale is not None else 1.0), None
        if self.clip is not None:
            norm = math.sqrt(sq) * factor
            factor *= min(1.0, self.clip / (norm + 1e-6))
        if factor != 1.0:
            torch._foreach_mul_(grads, factor)
        self._hand_over()
        self.inner.step()
        self.engine.after_step()
        return StepResult(stepped=True, grad_norm=norm, loss_scale=scale)

    def _hand_over(self) -> None:
        """The shard gradients reach the inner optimizer as if autograd had accumulated them: the
        parameters' post-accumulate hooks run (optimizer offload moves gradients to the host there)."""
        self.engine.attach_shard_grads()
        for s in self.engine.shards:
            hooks = getattr(s, "_post_accumulate_grad_hooks", None) or {}
            for hook in list(hooks.values()):
                hook(s)

    def zero_grad(self) -> None:
        self.engine.zero_grads()

    # ------------------------------------------------------------------ memory and state
    def state_tensors(self) -> list[torch.Tensor]:
        return self.inner.state_tensors()

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (see full_state_dict for a world-size-free one)."""
        state = {"precision": self.precision, "stage": self.stage, "inner": self.inner.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def close(self) -> None:
        self.inner.close()
        self.engine.close()

    def __enter__(self) -> "ShardedOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
