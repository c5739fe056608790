"""memfit.estimate(module_or_factory, example, ...): the Estimate of any nn.Module, nothing allocated."""
from __future__ import annotations

import math
import time
from typing import Any, Callable

from memfit.measure.anymodel import check_example, example_step, module_builder, run_steps
from memfit.measure.fake_mode import fake_mode
from memfit.measure.formulas import model_state_bytes
from memfit.measure.workspace import WorkspaceTracker


def estimate_module(model: Any, example: Any, *, optimizer: str = "adamw", precision: str = "32-true",
                    checkpoint: Any = "none", loss_fn: Callable | None = None, zero: int = 0, world: int = 1,
                    offload_optimizer: str | None = None, device_memory: int | None = None, gpu: Any = None,
                    step_in_backward: bool = False):
    """The fields of an Estimate: trace two training steps of a fake copy of `model` on `example`; frozen parameters
    (requires_grad=False) get no gradients and no optimizer state, as in the real step.
    gpu: a named GPU (memfit.core.gpus) whose kernels and caching allocator the step runs on."""
    check_example(example)
    t0 = time.perf_counter()
    with fake_mode(gpu):
        r = run_steps(module_builder(model), example_step(example, loss_fn), precision, optimizer, checkpoint, "cpu",
                      tracker=WorkspaceTracker if gpu is None else _gpu_tracker, step_in_backward=step_in_backward)
    tr = r.tracker
    b = tr.breakdown
    params = list(r.model.parameters())
    n = sum(p.numel() for p in params)
    shapes = [tuple(p.shape) for p in params if p.requires_grad]
    states = dict(precision=precision, optimizer=optimizer, param_shapes=shapes,
                  n_trainable=sum(math.prod(s) for s in shapes))
    single = model_state_bytes(n, **states)
    sharded = model_state_bytes(n, zero=zero, world=world, offload_optimizer=offload_optimizer, **states)
    per = {}
    for cat in ("params", "grads", "optimizer"):
        full, mine = getattr(single, cat), getattr(sharded, cat)
        per[cat] = round(b[cat] * mine / full) if full else b[cat]
    per["activations"], per["temporaries"] = b["activations"], b["temporaries"]
    per["total"] = sum(per.values())
    name = type(model).__name__ if not callable(model) or hasattr(model, "parameters") else getattr(model, "__name__", "model")
    return dict(model=name, n_params=n, batch=None, seq=None, precision=precision, optimizer=optimizer, zero=zero,
                world=world, checkpoint=str(checkpoint), offload_optimizer=offload_optimizer, per_device=per,
                offloaded=sharded.offloaded, device_memory=device_memory, traced=True,
                trace_seconds=time.perf_counter() - t0,
                modules=dict(sorted(tr.module_peaks.items(), key=lambda kv: -kv[1])),
                module_activations=dict(tr.module_activations), **_reserve(gpu, tr))


def _gpu_tracker(model, opt, dev):
    """The tracker of a GPU target's trace: the storage events the caching allocator replays, no CPU workspaces."""
    from memfit.core.tracker import MemoryTracker

    t = MemoryTracker(model, opt, dev)
    t.events = []
    return t


def _reserve(gpu: Any, tr: Any) -> dict:
    """A GPU target's replay: what the allocator reserves beyond the tensors' peak (memfit.measure.estimate)."""
    if gpu is None:
        return {}
    from memfit.measure.gpu_attention import GpuAttentionMode
    from memfit.measure.gpu_kernels import replay_on

    return dict(reserve_overhead=replay_on(gpu, tr.events).peak_reserved - tr.peak_bytes,
                attention=GpuAttentionMode.counts())


def measure_module(model: Any, example: Any, *, optimizer: str = "adamw", precision: str = "32-true",
                   checkpoint: Any = "none", loss_fn: Callable | None = None, seed: int = 0) -> dict:
    """The same two steps run for real on the CPU: the tracker's figures of the last step and, independently,
    the allocator's peak replayed from profiler memory events (memfit.measure.allocator)."""
    import copy

    import torch
    import torch.nn as nn

    from memfit.measure.allocator import AllocatorProfile

    check_example(example)
    build = (lambda: copy.deepcopy(model)) if isinstance(model, nn.Module) else module_builder(model)
    torch.manual_seed(seed)
    prof = AllocatorProfile("cpu")
    with prof:  # the model is built inside the profile, so every block freed in the window is known
        r = run_steps(build, example_step(example, loss_fn, real=True), precision, optimizer, checkpoint, "cpu",
                      window=prof.window("step"))
    return dict(peak=r.tracker.peak_bytes, breakdown=dict(r.tracker.breakdown), allocator=prof.peak("step"),
                modules=dict(r.tracker.module_peaks))
