"""Any nn.Module with an example micro-batch, traced without allocating.

    memfit.estimate(model, {"input_ids": x, "labels": x}, optimizer="adamw", precision="bf16-mixed")

`model` is a module with real weights, a module on the meta device, or a zero-argument factory.
A module is copied structurally with every parameter and buffer replaced by a fake tensor of the
same shape, dtype and `requires_grad` (tied weights stay tied), so its real weights are never
touched and nothing is allocated. `example` is one micro-batch: a dict of keyword arguments
(Hugging Face style), a tuple of positional arguments or one tensor; its tensors (real, meta or
`torch.empty`) stand for their shapes and dtypes only. The loss is `loss_fn(output, example)` when
given, else `output.loss`, else `output[1]`, else the output itself when it is a single number.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.core.tracker import MemoryTracker

Step = Callable[[nn.Module, Any], None]


def _meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy whose parameters and buffers are meta tensors (nothing is copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(model, memo)


def _materialise(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace every parameter and buffer by an empty tensor on `device` (fake under FakeTensorMode)."""
    new: dict[int, Any] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            mod._parameters[name] = new[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in new:
                new[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
            mod._buffers[name] = new[id(b)]
    return model


def module_builder(model: Any) -> Callable[[], nn.Module]:
    """A zero-argument builder to call inside FakeTensorMode and a torch.device context."""
    if isinstance(model, nn.Module):
        template = _meta_copy(model)

        def build() -> nn.Module:
            dev = torch.empty(0).device  # the surrounding torch.device context
            # The template's meta tensors are shared, not copied: _materialise replaces each one anyway, and
            # deep-copying a plain meta buffer under FakeTensorMode fails (HF Llama's rotary inv_freq).
            memo = {id(t): t for t in (*template.parameters(), *template.buffers())}
            return _materialise(copy.deepcopy(template, memo), dev)

        return build
    if callable(model):
        def build_factory() -> nn.Module:
            try:
                m = model()
            except ConfigError:
                raise
            except Exception as exc:  # e.g. peft moves weights with swap_tensors, which fake tensors refuse
                m = _on_meta_then_fake(model, exc)
            if not isinstance(m, nn.Module):
                raise ConfigError(f"the model factory returned {type(m).__name__}, not an nn.Module")
            return m

        return build_factory
    raise ConfigError(f"model must be an nn.Module or a zero-argument factory, got {type(model).__name__}")


def _on_meta_then_fake(factory: Callable[[], Any], first: Exception) -> Any:
    """Build on the meta device with fake tensors set aside, then give the result fake weights on the device."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    dev = torch.empty(0).device  # the surrounding torch.device context
    try:
        with unset_fake_temporarily(), torch.device("meta"):
            m = factory()
    except ConfigError:
        raise
    except Exception:
        raise ConfigError(f"the model factory failed: {type(first).__name__}: {_one_line(first)}") from None
    return _materialise(m, dev) if isinstance(m, nn.Module) else m


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _forward_failed(exc: BaseException) -> str:
    """One line for a forward that failed on the example; a value read in Python (.item(), .tolist()), which
    a trace without values cannot answer, is named where the model reads it, with what measures it instead."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    if isinstance(exc, DataDependentOutputException):
        import traceback

        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if "/torch/" not in f.filename and "/memfit/" not in f.filename]  # the model's own code
        where = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""
        return (f"the model's forward reads a tensor's value in Python{where}, which memfit's estimate (a trace "
                "without values) cannot answer; measure a real step instead: memfit.track(model, optimizer) "
                "around one training step on the device")
    return f"the model's forward failed on the example: {type(exc).__name__}: {_one_line(exc)}"


def fake_like(obj: Any, device: torch.device) -> Any:
    """The example with every tensor replaced by an empty one of the same shape and dtype."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device=device)
    if isinstance(obj, Mapping):
        return {k: fake_like(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(fake_like(v, device) for v in obj)
    return obj


def real_like(obj: Any, device: torch.device) -> Any:
    """The example's own values on `device`, a fresh copy per step (as a data loader hands out batches)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_meta:
            raise ConfigError("a measured step needs example values, not meta tensors: pass real tensors or a "
                              "function device -> batch")
        return obj.to(device, copy=True)
    if isinstance(obj, Mapping):
        return {k: real_like(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(real_like(v, device) for v in obj)
    return obj


def check_example(example: Any) -> None:
    if callable(example) and not isinstance(example, torch.Tensor):
        return  # a function device -> batch (random tokens, images: valid values for a real step too)
    if example is None:
        raise ConfigError("an nn.Module needs an example micro-batch: a dict of keyword arguments "
                          "(e.g. {'input_ids': x, 'labels': x}), a tuple of positional arguments or a tensor")
    if not isinstance(example, (Mapping, tuple, list, torch.Tensor)):
        raise ConfigError(f"example must be a dict, a tuple or a tensor, got {type(example).__name__}")


def call(model: nn.Module, example: Any) -> Any:
    if isinstance(example, Mapping):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*example)
    return model(example)


def extract_loss(output: Any, example: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(output, example)
    else:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None and isinstance(output, (tuple, list)) and len(output) > 1:
            loss = output[1]
        if loss is None and isinstance(output, torch.Tensor) and output.numel() == 1:
            loss = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(f"cannot find a scalar loss in the model's output ({type(output).__name__}); "
                          "expected output.loss, output[1] or a single number: pass loss_fn=fn(output, example)")
    return loss


def example_step(example: Any, loss_fn: Callable | None, real: bool = False) -> Step:
    """One training step on (a fake copy of) the example, in its own frame as in a training loop.
    `example` may be a function device -> batch, called each step; `real` copies the example's values."""

    def step(model: nn.Module, opt: Any) -> None:
        dev = next(iter(model.parameters())).device
        if callable(example) and not isinstance(example, torch.Tensor):
            batch = example(dev)
        else:
            batch = real_like(example, dev) if real else fake_like(example, dev)
        with opt.autocast():
            try:
                out = call(model, batch)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(_forward_failed(exc)) from None
            loss = extract_loss(out, batch, loss_fn)
        del out  # a user's loop drops the output (logits) before backward too
        opt.backward(loss)
        opt.step()

    return step


@dataclass
class RunResult:
    tracker: MemoryTracker
    model: nn.Module


QUICK_WARMUP = os.environ.get("MEMFIT_FULL_WARMUP", "") != "1"
"""A step that says how to make its state alone (step.warmup) warms up with that (tests compare both)."""
UNTRACKED_WARMUP = os.environ.get("MEMFIT_TRACKED_WARMUP", "") != "1"
"""That state-only warm-up runs before the tracker is entered (only the fake mode sees its ops): the tracker
counts the optimizer state that exists at `__enter__`, and nothing else of the warm-up outlives it, so its
ops need not pass the tracker's dispatch (tests/test_plan_speed_shortcuts.py compares both)."""


def run_steps(build: Callable[[], nn.Module], step: Step, precision: str, optimizer: str, checkpoint: Any,
              device: str, steps: int = 2, tracker: Callable[..., MemoryTracker] | None = None,
              prepare: Callable[[nn.Module], None] | None = None, window: Any = None,
              offload: str | None = None, step_in_backward: bool = False, update: bool = True) -> RunResult:
    """Build the model, apply the policy and optimizer, run `steps` steps inside a tracker; the tracker's
    peak window is the last step. Call inside FakeTensorMode to predict, outside to measure.
    `offload`: the optimizer's state on the host ("cpu"), as TrainingOptimizer(offload=...);
    `step_in_backward` as TrainingOptimizer(step_in_backward=...). update=False: the measured step's
    optimizer step only drops the gradients (for traces that read the blocks' stretches alone)."""
    from memfit.apply.checkpoint import checkpoint as apply_checkpoint
    from memfit.apply.optimizer import TrainingOptimizer

    dev = torch.device(device)
    with torch.device(dev):
        model = build()
    if prepare is not None:
        prepare(model)
    model.train()
    if not (isinstance(checkpoint, str) and checkpoint == "none"):
        apply_checkpoint(model, checkpoint)
    opt = TrainingOptimizer(model, optimizer, precision=precision, offload=offload, step_in_backward=step_in_backward)
    try:
        warm = getattr(step, "warmup", None) if QUICK_WARMUP and steps > 1 else None
        warmed = UNTRACKED_WARMUP and warm is not None and warm(model, opt)
        tr = (tracker or MemoryTracker)(model, opt, dev)
        with tr:
            for i in range(steps):
                if i < steps - 1:
                    if i == 0 and warmed:
                        continue
                    if i != 0 or warm is None or UNTRACKED_WARMUP or not warm(model, opt):
                        step(model, opt)
                    continue
                tr.reset_peak()
                if not update:
                    opt.step = lambda closure=None: opt.zero_grad()  # (this instance, this last step only)
                with window if window is not None else contextlib.nullcontext():
                    step(model, opt)
    finally:
        opt.close()
    from memfit.core.progress import tick

    tick()  # a bar on stderr when a planner asked for one (memfit.core.progress)
    return RunResult(tr, model)
