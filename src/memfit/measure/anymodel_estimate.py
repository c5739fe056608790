"""memfit.estimate(module_or_factory, example, ...): the Estimate of any nn.Module, nothing allocated."""
from __future__ import annotations

import time
from typing import Any, Callable

from memfit.measure.anymodel import check_example, example_step, fake_mode, module_builder, run_steps
from memfit.measure.formulas import model_state_bytes


def estimate_module(model: Any, example: Any, *, optimizer: str = "adamw", precision: str = "32-true",
                    checkpoint: Any = "none", loss_fn: Callable | None = None, zero: int = 0, world: int = 1,
                    offload_optimizer: str | None = None, device_memory: int | None = None):
    """The fields of an Estimate: trace two training steps of a fake copy of `model` on `example`; frozen parameters
    (requires_grad=False) get no gradients and no optimizer state, as in the real step."""
    check_example(example)
    t0 = time.perf_counter()
    with fake_mode():
        r = run_steps(module_builder(model), example_step(example, loss_fn), precision, optimizer, checkpoint, "cpu")
    tr = r.tracker
    b = tr.breakdown
    params = list(r.model.parameters())
    n = sum(p.numel() for p in params)
    trainable = [p for p in params if p.requires_grad]
    n_train = sum(p.numel() for p in trainable) or 1
    single = model_state_bytes(n_train, precision=precision, optimizer=optimizer, n_tensors=len(trainable))
    sharded = model_state_bytes(n_train, precision=precision, optimizer=optimizer, zero=zero, world=world,
                                offload_optimizer=offload_optimizer, n_tensors=len(trainable))
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
                module_activations=dict(tr.module_activations))
