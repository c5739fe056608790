"""TrainingOptimizer: everything between a loss and updated weights, behind one small interface.

    opt = TrainingOptimizer(model, "adamw", lr=3e-4, precision="bf16-master", clip=1.0, offload="cpu")
    with opt.autocast():
        logits, loss_sum, n = model(x, y)
    opt.backward(loss_sum / total_tokens)
    result = opt.step()          # check overflow, unscale, clip, update, zero grads

Behind it: the precision mode (memfit.apply.precision casts the model), dynamic loss scaling for
fp16 (memfit.apply.loss_scale), and master weights / optimizer offload (memfit.apply.optim_offload).
Without master weights and offload the torch optimizer updates the parameters directly.

It is a `torch.optim.Optimizer`, so `torch.optim.lr_scheduler` schedulers drive it: they see one
param group (all trainable parameters; one per group with `groups=` / `no_decay=`) whose
hyperparameters (lr, betas, ...) reach the real update in every mode, also when it is streamed over chunk optimizers on the CPU or on disk.
Optimizer arguments left out take torch's defaults (AdamW: betas (0.9, 0.999), eps 1e-8,
weight_decay 0.01, lr 1e-3).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from memfit.apply.loss_scale import InfNanLocator, LossScaler, all_finite, overflow_message, warn_overflow
from memfit.apply import optimizers
from memfit.apply.optim_offload import IOStats, StreamedOptimizer, mark_host
from memfit.apply.param_groups import Grouping, resolve_groups
from memfit.apply.step_in_backward import BackwardStepper, check_step_in_backward
from memfit.apply.precision import PRECISIONS, autocast, cast_model, precision_mode
from memfit.apply.torch_optim import (OPTIMIZERS, GroupMirror, make_torch_optimizer, optimizer_class,
                                      torch_kwargs)
from memfit.core.errors import ConfigError

OFFLOADS = ("none", "cpu", "disk")
__all__ = ["TrainingOptimizer", "StepResult", "make_torch_optimizer", "PRECISIONS", "OPTIMIZERS", "OFFLOADS"]


@dataclass
class StepResult:
    stepped: bool
    """False when the step was skipped (fp16 overflow)."""
    grad_norm: float | None = None
    """Total gradient norm before clipping, unscaled (None when clipping is off)."""
    loss_scale: float | None = None
    """The loss scale used for this step's backward (fp16 modes)."""
    message: str | None = None
    """Set when fp16 overflows persist: where inf/NaN appeared first, and what to try."""


def _value(t: torch.Tensor) -> float | None:
    """A 0-dim tensor's value; None under FakeTensorMode (memory prediction), where there is none."""
    return None if is_fake(t) else float(t)


def _checked_options(mode, offload: str | None, clip: float | None, step_in_backward: bool) -> str | None:
    """The offload (None for "none"); ConfigError (one line) for an option that cannot work."""
    offload = None if offload in (None, "none") else offload
    if offload not in (None, "cpu", "disk"):
        raise ConfigError(f"unknown optimizer offload {offload!r}; accepted: {', '.join(OFFLOADS)}")
    if clip is not None and not clip > 0:
        raise ConfigError(f"clip={clip} must be a positive gradient-norm limit (or None for no clipping)")
    if step_in_backward:
        check_step_in_backward(mode, offload, clip)
    return offload


class TrainingOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        model: nn.Module,
        optimizer: str = "adamw",
        lr: float | None = None,
        weight_decay: float | None = None,
        precision: str = "32-true",
        clip: float | None = None,
        offload: str | None = None,
        spill_dir: str | None = None,
        *,
        chunk_bytes: int | None = None,
        loss_scale: LossScaler | dict | None = None,
        keep_grad_files: bool = False,
        groups: list[dict] | None = None,
        no_decay: Any = None,
        step_in_backward: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        """optimizer: one of OPTIMIZERS; lr, weight_decay and optimizer_kwargs (betas, eps, momentum,
            ...) go to the torch optimizer, torch's defaults where left out (None).
        precision: one of PRECISIONS (memfit.apply.precision); the model is cast in place.
        offload: None / "none" (state beside the model), "cpu" or "disk" (state in host memory or in
            files under spill_dir, gradients moved off the device during backward).
        spill_dir: the spill root for offload="disk"; accepted (and unused) with other offloads, so
            one folder can serve activation and optimizer offload alike.
        chunk_bytes: master bytes per streamed chunk (master / offload modes); None: 16 MiB offloaded,
            one tensor at a time on the device.
        loss_scale: LossScaler or its keyword arguments (fp16 modes), e.g. {"hysteresis": 2}.
        keep_grad_files: offload="disk": keep the gradient files between steps instead of deleting
            them after each step (faster rewrites; the folder is still removed on close).
        groups / no_decay: torch-style parameter groups, or the parameters without weight decay (True:
            biases and norm weights; names; a callable): memfit.apply.param_groups.
        step_in_backward: update each parameter, and free its gradient, as backward produces it
            (memfit.apply.step_in_backward: no global clipping, accumulation or fp16 scaling)."""
        self.mode = precision_mode(precision)
        self.precision = self.mode.name
        offload = _checked_options(self.mode, offload, clip, step_in_backward)
        optimizers.check_available(optimizer)  # ConfigError naming the extra it needs
        cls = optimizer_class(optimizer)
        if self.mode.state_dtype == torch.float16 and optimizers.info(optimizer).name in optimizers.ADAM_FAMILY:
            # fp16 moments: eps=1e-8 is 0 in fp16 and g*g underflows for |g| < 1e-3, so the update
            # lr * m / (sqrt(v) + eps) explodes; eps=1e-4 keeps it bounded (the usual fp16 Adam fix).
            optimizer_kwargs.setdefault("eps", 1e-4)
        kwargs = torch_kwargs(optimizer, lr, weight_decay, optimizer_kwargs)  # checked before casting
        self.model, self.clip, self.offload = model, clip, offload
        cast_model(model, self.mode)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError(f"{type(model).__name__} has no trainable parameters")
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        grouping = Grouping(self.params, *resolve_groups(named, groups, no_decay))
        self.device_type = self.params[0].device.type

        self.scaler: LossScaler | None = None
        if self.mode.loss_scaling:
            self.scaler = loss_scale if isinstance(loss_scale, LossScaler) else LossScaler(**(loss_scale or {}))
        self._locator: InfNanLocator | None = None
        self._norm: torch.Tensor | None = None  # grad_norm() before step(): the streamed total, not recomputed

        make = grouping.maker(lambda ps: cls(ps, **kwargs))
        self.optimizer: torch.optim.Optimizer | None = None
        self.streamed: StreamedOptimizer | None = None
        self._mirror: GroupMirror | None = None
        if self.mode.master_dtype is not None or offload:
            self.streamed = StreamedOptimizer(
                self.params, make, self.mode.state_dtype, offload or "device",
                spill_dir if offload == "disk" else None, chunk_bytes,
                check_finite=self.scaler is not None, keep_grad_files=keep_grad_files,
            )
            streamed = self.streamed
            grouping.split_streamed(streamed.masters, [c.optimizer for c in streamed.chunks])
            self._mirror = GroupMirror(self.params, lambda: streamed.param_groups, grouping.index)
            defaults = self.streamed.chunks[0].optimizer.defaults
        else:
            self.optimizer = make(self.params)
            defaults = self.optimizer.defaults
        self.stepper = BackwardStepper(self.optimizer, self.params) if step_in_backward else None
        self._init_torch_optimizer(defaults)

    def _init_torch_optimizer(self, defaults: dict) -> None:
        """What torch.optim.Optimizer.__init__ sets up, except param_groups and state, which are the
        wrapped optimizer's (see the properties below): defaults and the step/state-dict hooks."""
        self.defaults = defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # step() runs registered step hooks, as a torch optimizer's does

    # ------------------------------------------------------------------ torch.optim.Optimizer interface
    @property
    def param_groups(self) -> list[dict]:
        """One group of all trainable parameters, or one per memfit group (the wrapped torch optimizer's
        own groups, or mirrors that stand for the chunk optimizers' groups). Changing "lr" (or any hyperparameter) here, by hand
        or through a torch.optim.lr_scheduler, changes the next update."""
        return self._mirror.groups if self._mirror is not None else self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """Per-parameter optimizer state held in memory (keyed by the master weight when streamed)."""
        if self.streamed is None:
            return self.optimizer.state
        return {m: s for c in self.streamed.chunks for m, s in c.optimizer.state.items()}

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigError("TrainingOptimizer trains every parameter of its model that requires grad; "
                          "make a new TrainingOptimizer instead of adding a param group")

    def _push_hyperparameters(self) -> None:
        if self._mirror is not None:
            self._mirror.push()

    # ------------------------------------------------------------------ training-loop interface
    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.mode, self.device_type)

    def backward(self, loss: torch.Tensor, *, final: bool | None = None) -> None:
        """loss.backward(), with the loss multiplied by the loss scale in fp16 modes.

        final: this is the last micro-batch before step(). With optimizer offload (and no clipping
        or fp16 loss scaling, which need every gradient before any update) the update of each chunk
        then starts on a worker thread as soon as backward has produced all of its gradients, with the
        hyperparameters (lr, ...) param_groups hold when backward starts: set them before it, as a
        scheduler stepped after step() does. With step_in_backward every backward updates the
        parameters (final=False, accumulation, is refused)."""
        if self.stepper is not None:
            self.stepper.begin(final)
            try:
                loss.backward()
            finally:
                self.stepper.end()
            return
        if self.scaler is not None:
            loss = loss.float() * self.scaler.scale
        if self.streamed is not None:
            self._push_hyperparameters()  # chunks may be updated during this backward
            self.streamed.begin_backward(bool(final) and self.clip is None and self.scaler is None)
        try:
            loss.backward()
        finally:
            if self.streamed is not None:
                self.streamed.end_backward()

    def grad_norm(self) -> float | None:
        """The total gradient norm now (unscaled), for loops that log or clip before step(), wherever the
        gradients are (offloaded ones included); step() clips with this norm instead of computing it again."""
        if self.streamed is not None:
            total = self.streamed.grad_norm()
            self._norm = total
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if self.scaler is not None:
            total = total / self.scaler.scale
        return _value(total)

    def step(self, closure: None = None) -> StepResult:
        """Check fp16 overflow, unscale, clip, update, zero the gradients. (closure: not supported;
        present for torch.optim.Optimizer's signature.)"""
        if closure is not None:
            raise ConfigError("TrainingOptimizer.step() takes no closure; run forward and backward() first")
        self._push_hyperparameters()
        scale = self.scaler.scale if self.scaler is not None else None
        if self.scaler is not None:
            finite, bad = self._grads_finite()
            if not self.scaler.update(not finite):
                return StepResult(stepped=False, loss_scale=scale, message=self._after_overflow(bad))
            self._disarm_locator()
        inv = 1.0 / scale if scale is not None else None
        if self.streamed is not None:
            norm, factor = None, inv
            if self.clip is not None:
                total = self._norm if self._norm is not None else self.streamed.grad_norm()
                if inv is not None:
                    total = total * inv
                # Same expression as torch.nn.utils.clip_grad_norm_, so fp32 offload stays bit-identical.
                coef = torch.clamp(self.clip / (total + 1e-6), max=1.0)
                factor = coef if inv is None else coef * inv
                norm = _value(total)
            self._norm = None
            self.streamed.step(factor)
            self._mark_host()
            return StepResult(stepped=True, grad_norm=norm, loss_scale=scale)

        if self.stepper is not None:
            self.stepper.finish()  # updated during backward; grads of a backward run outside backward() remain
        grads = [p.grad for p in self.params if p.grad is not None]
        if inv is not None:
            torch._foreach_mul_(grads, inv)  # unscale in place: clipping and the update see true gradients
        norm = None
        if self.clip is not None:
            norm = _value(torch.nn.utils.clip_grad_norm_(self.params, self.clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(stepped=True, grad_norm=norm, loss_scale=scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (always set to None: offloaded gradients have no tensor to zero)."""
        self._norm = None
        if self.streamed is not None:
            self.streamed.discard_grads()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ fp16 overflow handling
    def _grads_finite(self) -> tuple[bool, list[int]]:
        if self.streamed is not None:
            return self.streamed.grads_finite()
        bad = [i for i, p in enumerate(self.params) if p.grad is not None and not all_finite(p.grad)]
        return not bad, bad

    def _after_overflow(self, bad: list[int]) -> str | None:
        """Skip this step; when overflows persist, report where inf/NaN came from (the locator was
        armed one step earlier so this step's forward and backward were watched)."""
        self.zero_grad()
        s = self.scaler
        message = None
        if s.overflows_in_a_row >= s.warn_after and s.overflows_in_a_row % s.warn_after == 0:
            message = overflow_message(s, [self.names[i] for i in bad], self._locator)
            warn_overflow(message)
            self._disarm_locator()
        if s.overflows_in_a_row % s.warn_after == s.warn_after - 1 and self._locator is None:
            self._locator = InfNanLocator(self.model)
        return message

    def _disarm_locator(self) -> None:
        if self._locator is not None:
            self._locator.remove()
            self._locator = None

    # ------------------------------------------------------------------ memory and state
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizer keeps between steps: master weights and optimizer state.
        Host-resident ones (offload) are (re)marked for the memory tracker on each call, so a
        tracker that starts after this optimizer still excludes them from device figures."""
        if self.streamed is not None:
            self._mark_host()
            return self.streamed.state_tensors()
        return [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]

    def _mark_host(self) -> None:
        if self.streamed is not None and self.streamed.where != "device":
            for t in self.streamed.state_tensors():
                mark_host(t)

    @property
    def io_stats(self) -> IOStats | None:
        """Disk offload: bytes and seconds of spill-file I/O so far."""
        return self.streamed.io if self.streamed is not None and self.streamed.where == "disk" else None

    def state_dict(self) -> dict:
        """Plain containers and tensors only (loads with torch.load(weights_only=True))."""
        state: dict[str, Any] = {"precision": self.precision, "offload": self.offload or "none"}
        if self.streamed is not None:
            self._push_hyperparameters()  # the chunk groups carry lr & co. into the checkpoint
            state["streamed"] = self.streamed.state_dict()
        else:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("precision", self.precision) != self.precision:
            raise ConfigError(
                f"optimizer checkpoint is for precision {state['precision']!r}, this run uses {self.precision!r}"
            )
        if self.streamed is not None:
            if "streamed" not in state:
                raise ConfigError("optimizer checkpoint has no master weights; resume with the precision it was written with")
            self.streamed.load_state_dict(state["streamed"])
            self._mirror.pull()
        else:
            if "optimizer" not in state:
                raise ConfigError("optimizer checkpoint holds master/offloaded state; resume with the same precision and offload")
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def close(self) -> None:
        """Release resources (spill files, worker threads, hooks). Safe to call twice."""
        self._disarm_locator()
        if self.streamed is not None:
            self.streamed.close()
        if self.stepper is not None:
            self.stepper.close()

    def __enter__(self) -> "TrainingOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
