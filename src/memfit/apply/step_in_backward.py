"""The optimizer step in backward: each parameter is updated, and its gradient freed, as soon as
backward has accumulated that gradient (a post-accumulate-grad hook per parameter). The whole
gradient buffer never exists: during backward the device holds one parameter's gradient and that
parameter's optimizer temporaries at a time, beside the activations still waiting.

    opt = TrainingOptimizer(model, "adamw", lr=3e-4, precision="bf16-true", step_in_backward=True)
    opt.backward(loss)      # updates every parameter during this backward
    opt.step()              # nothing left to update: ends the step (hooks such as schedulers run)

The choices it makes, and what the others would cost:

* **Clipping.** Clipping by the global norm needs every gradient before the first update, which is
  the buffer this removes. `clip` is refused. The alternatives: clipping each parameter's gradient
  by its own norm (no extra memory, but a different update: the direction of the whole gradient is
  not kept), or clipping by the previous step's global norm (a running sum of squares, one scalar;
  a spike is clipped one step late). Neither is implemented: both change the numbers a run computes.
* **Accumulation.** Each backward updates the parameters, so one backward per step: a later
  micro-batch would need a gradient buffer for all but the last one, the peak this removes. A
  second `backward()` before `step()`, or `backward(final=False)`, is refused.
* **fp16 loss scaling** (16-mixed, 16-true, 16-master) needs every gradient checked for inf/NaN
  before any update: refused. bf16 and fp32 modes need no scaling.
* **Master weights and optimizer offload** (bf16-master, offload="cpu"/"disk") keep the update in
  the streamed optimizer, which already updates each chunk as soon as its gradients are complete
  when offloaded (TrainingOptimizer.backward(final=True)): refused here.
* **LoRA** and frozen parameters: only trainable parameters get a hook; nothing else changes.

The update is the wrapped torch optimizer's own step() over the one parameter (its group narrowed to
that parameter for the call), so state, state_dict, param_groups and lr schedulers are the same
objects as without it, and the arithmetic per parameter is the same as a whole step's on a device
where that step runs per tensor (CPU: bit-identical; CUDA's multi-tensor kernels round the same
operations the same way per element).
"""
from __future__ import annotations

import functools
import weakref

import torch

from memfit.core.errors import ConfigError

__all__ = ["BackwardStepper", "check_step_in_backward"]


def check_step_in_backward(mode, offload: str | None, clip: float | None) -> None:
    """ConfigError (one line) for a setting the step in backward cannot run with."""
    if clip is not None:
        raise ConfigError("step in backward cannot clip by the global gradient norm (the gradients are freed as "
                          "they arrive): turn clipping off (--clip 0 / clip=None) or drop step in backward")
    if mode.loss_scaling:
        raise ConfigError(f"step in backward cannot run with {mode.name}: fp16 loss scaling checks every gradient "
                          "before any update; use bf16-true, bf16-mixed or 32-true")
    if mode.master_dtype is not None:
        raise ConfigError(f"step in backward runs without master weights, not {mode.name}: use bf16-true, "
                          "bf16-mixed or 32-true (or --offload-optimizer cpu, which updates chunks during backward)")
    if offload is not None:
        raise ConfigError(f"step in backward updates on the device, not with optimizer offload {offload!r}: "
                          "offload already updates each chunk during backward; drop one of the two")


def _hook(ref: "weakref.ref[BackwardStepper]", p: torch.Tensor) -> None:
    stepper = ref()
    if stepper is not None:
        stepper.take(p)


class BackwardStepper:
    """Hooks that run `optimizer`'s update on each parameter as its gradient arrives, while armed."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        self.optimizer, self.params = optimizer, params
        self.armed = False
        self.pending = False  # a backward updated the parameters; step() not called yet
        self._hooks: list = []
        self._group_of: dict[int, int] = {}

    def begin(self, final: bool | None) -> None:
        if final is False:
            raise ConfigError("step in backward updates the parameters in every backward: gradient accumulation "
                              "(backward(final=False), --accum > 1) needs step_in_backward off")
        if self.pending:
            raise ConfigError("step in backward: call step() after each backward() (a second backward would update "
                              "the parameters again; gradient accumulation needs step_in_backward off)")
        # param -> its group, read each backward: load_state_dict replaces the group dicts
        self._group_of = {id(q): i for i, g in enumerate(self.optimizer.param_groups) for q in g["params"]}
        if not self._hooks:
            # Registered at the first backward, so hooks registered before it (a memory tracker's,
            # which files each gradient as it arrives) run before the update frees the gradient.
            ref = weakref.ref(self)  # the hooks must not keep an abandoned optimizer alive
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, ref)) for p in self.params]
        self.armed = True

    def end(self) -> None:
        if self.armed:
            self.pending = True
        self.armed = False

    def take(self, p: torch.Tensor) -> None:
        if not self.armed or p.grad is None:
            return  # a backward outside TrainingOptimizer.backward(): step() updates as usual
        opt = self.optimizer
        groups = opt.param_groups
        group = groups[self._group_of[id(p)]]
        params = group["params"]
        opt.param_groups, group["params"] = [group], [p]
        try:
            opt.step()
        finally:
            group["params"], opt.param_groups = params, groups
        p.grad = None

    def finish(self) -> None:
        self.pending = False

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
