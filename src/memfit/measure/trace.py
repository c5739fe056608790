"""Predict a whole training step's memory without allocating it, and measure the same step for real.

    trace_step(parse_model("llama-2-7b"), batch=1, seq=4096, precision="bf16-mixed")   # seconds, ~no RAM
    trace_step(spec, batch=1, seq=512, precision="bf16-master", offload_optimizer="disk")
    measure_step(parse_model("gpt:layers=2,hidden=64,heads=4,vocab=256"), batch=4, seq=64)

Both build the model, apply the checkpoint policy, build memfit's TrainingOptimizer and run `steps`
full training steps (forward under the optimizer's autocast, loss, backward, optimizer step) inside
a MemoryTracker. `trace_step` does it under FakeTensorMode, where every tensor has a shape, dtype
and device but no data: the tracker counts the same storages a real run would hold. The reported
figures are the *last* step's (steady state: optimizer state exists, the previous step's gradients
were released by its `step()`), each step running in its own frame as in a training loop, so its
batch, logits and loss are gone before the next step begins.

Optimizer offload is traced too: memfit's StreamedOptimizer runs under FakeTensorMode (its host
buffers are fake, its spill-file I/O moves no data) and marks its host copies as the real run
does, so the prediction equals the measured step's tracker figures to the byte.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Union

import torch
import torch.nn as nn

from memfit.core.device import estimate_device, resolve_device
from memfit.core.errors import ConfigError
from memfit.core.tracker import MemoryTracker
from memfit.measure.fake_mode import fake_mode

ModelArg = Union["ModelSpec", Callable[[], nn.Module], str]  # noqa: F821 (ModelSpec imported lazily)


@dataclass
class TraceResult:
    """Bytes on the device at the steady-state peak of a training step; the five categories sum to `peak`."""

    peak: int
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    modules: dict[str, int] = field(default_factory=dict)
    """Per module (qualified name; the model under its class name): peak bytes while it ran."""
    module_activations: dict[str, int] = field(default_factory=dict)
    """Per module: bytes saved for backward by ops run inside it."""
    module_categories: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per module: the five categories at that module's peak moment (they sum to modules[name])."""
    other_moments: dict[str, dict[str, int]] = field(default_factory=dict)
    """Moments that are no module's highest but become a rank's peak once gradient buckets are held
    beside them: the one with the most activations + temporaries while the model ran (e.g. the loss's
    backward under full recomputation), named by memfit.distributed.rank_memory.busiest_name."""
    seconds: float = 0.0
    """Wall time of the trace or measurement."""
    host_peak: int = 0
    """Peak bytes of offloaded host copies (not part of `peak`)."""
    allocator_peak: int | None = None
    """measure_step only: the allocator-level peak over the same step (profiler memory events),
    which also sees workspaces that kernels allocate internally."""
    cuda_allocated: int | None = None
    """CUDA traces: the peak that torch.cuda.max_memory_allocated will report over the traced steps,
    from replaying the storages through the caching allocator's rules (memfit.measure.caching_allocator)."""
    cuda_reserved: int | None = None
    """CUDA traces: the predicted torch.cuda.max_memory_reserved (the segments the allocator holds)."""
    gpu: str | None = None
    """A named GPU target (device="h100"): the step was traced as that GPU runs it (memfit.measure.gpu_kernels)."""
    attention: dict[str, int] = field(default_factory=dict)
    """GPU targets: how many attention calls each backend ran (cudnn, flash, efficient, math)."""

    def breakdown(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "temporaries": self.temporaries, "total": self.peak}


def trace_step(model: ModelArg, batch: int, seq: int, precision: str = "32-true", optimizer: str = "adamw",
               checkpoint: "str | list" = "none", device: str = "cpu", steps: int = 2,
               offload_optimizer: str | None = None, step_in_backward: bool = False) -> TraceResult:
    """Predict the steady-state peak of one training step under FakeTensorMode (nothing is allocated).

    device: cpu, cuda (this machine's GPU), or a named GPU (h100, a100-80gb, ...: memfit.core.gpus) on
    any machine, traced with that GPU's attention and optimizer kernels; CUDA and named GPUs also get
    the caching allocator's figures (cuda_allocated, cuda_reserved).
    offload_optimizer: None / "none", "cpu" or "disk", as TrainingOptimizer(offload=...); a disk
    trace creates an empty spill folder (no data is written) and removes it.
    step_in_backward: as TrainingOptimizer(step_in_backward=...) (memfit.apply.step_in_backward)."""
    build = _builder(model, seq)
    _check(batch, seq, steps)
    device, gpu = estimate_device(device)  # ConfigError for a device memfit cannot trace on
    t0 = time.perf_counter()
    with fake_mode(gpu):
        result = _run(build, batch, seq, precision, optimizer, checkpoint, device, steps, window=None,
                      offload=offload_optimizer, gpu=gpu, step_in_backward=step_in_backward)
    result.seconds = time.perf_counter() - t0
    return result


def measure_step(model: ModelArg, batch: int, seq: int, precision: str = "32-true", optimizer: str = "adamw",
                 checkpoint: "str | list" = "none", device: str = "cpu", steps: int = 2,
                 allocator: bool = True, seed: int = 0, offload_optimizer: str | None = None,
                 step_in_backward: bool = False) -> TraceResult:
    """Run the same steps for real and measure them: the tracker's figures, plus (allocator=True)
    the allocator-level peak of the last step from profiler memory events."""
    from memfit.measure.allocator import AllocatorProfile

    build = _builder(model, seq)
    _check(batch, seq, steps)
    resolve_device(device)  # ConfigError for a device memfit cannot trace on (fake CUDA tensors need CUDA)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    # The profile starts before the model exists, so it knows every block freed inside the window.
    prof = AllocatorProfile(device) if allocator else None
    with prof if prof is not None else contextlib.nullcontext():
        result = _run(build, batch, seq, precision, optimizer, checkpoint, device, steps,
                      window=prof.window("step") if prof is not None else None, offload=offload_optimizer,
                      step_in_backward=step_in_backward)
    if prof is not None:
        result.allocator_peak = prof.peak("step")
    result.seconds = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------------- internals
def _check(batch: int, seq: int, steps: int) -> None:
    for name, value in (("batch", batch), ("seq", seq), ("steps", steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _builder(model: ModelArg, seq: int) -> Callable[[], nn.Module]:
    from memfit.models.spec import ModelSpec, parse_model

    if isinstance(model, str):
        model = parse_model(model)
    if isinstance(model, ModelSpec):
        spec = model
        if spec.hf_config is not None:
            import transformers  # noqa: F401  (imported before tracing: see hf_masks.unpacked_batches)
        return lambda: spec.build(seq=seq)
    if isinstance(model, nn.Module):
        raise ConfigError("pass a ModelSpec or a function that builds the model, not a built module: "
                          "tracing must create the parameters itself to avoid allocating them")
    if not callable(model):
        raise ConfigError(f"model must be a ModelSpec, a model name or a callable returning nn.Module, "
                          f"got {type(model).__name__}")
    return model


def _vocab(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "vocab"):
        return cfg.vocab
    config = getattr(model, "config", None)
    if config is not None:
        vocab = getattr(config, "vocab_size", None)
        if vocab is None and hasattr(config, "get_text_config"):
            vocab = config.get_text_config().vocab_size
        if vocab is not None:
            return int(vocab)
    raise ConfigError(f"cannot find the vocabulary size of {type(model).__name__}: expected model.cfg.vocab "
                      "(memfit GPT) or model.config.vocab_size (Hugging Face)")


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from memfit.models.gpt import GPT

    if isinstance(model, GPT):
        _, loss_sum, n = model(x, x)
        return loss_sum / n
    return model(input_ids=x, labels=x).loss


def _train_step(model: nn.Module, opt, batch: int, seq: int, vocab: int, device: torch.device) -> None:
    # Its own frame, as in a training loop: batch, logits and loss die before the next step.
    x = torch.randint(0, vocab, (batch, seq), device=device)
    with opt.autocast():
        loss = _loss(model, x)
    opt.backward(loss)
    opt.step()


def _busiest(tracker: MemoryTracker) -> dict[str, dict[str, int]]:
    from memfit.core.ledger import CATEGORIES
    from memfit.distributed.rank_memory import busiest_name

    cats = tracker.busiest_categories
    return {} if cats is None else {busiest_name(tracker.busiest_mods): dict(zip(CATEGORIES, cats))}


def _run(build: Callable[[], nn.Module], batch: int, seq: int, precision: str, optimizer: str,
         checkpoint: "str | list", device: str, steps: int, window, offload: str | None = None,
         gpu=None, step_in_backward: bool = False) -> TraceResult:
    from memfit.apply.checkpoint import checkpoint as apply_checkpoint
    from memfit.apply.optimizer import TrainingOptimizer

    dev = torch.device(device)
    with torch.device(dev):
        model = build()
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(model, "pos", None) is not None and seq > cfg.seq:
        raise ConfigError(f"seq={seq} exceeds the model's position table ({cfg.seq}); use seq <= {cfg.seq}")
    model.train()
    apply_checkpoint(model, checkpoint)
    opt = TrainingOptimizer(model, optimizer, precision=precision,
                            offload=None if offload in (None, "none") else offload, step_in_backward=step_in_backward)
    vocab = _vocab(model)
    tracker = MemoryTracker(model, opt, dev)
    if dev.type == "cuda" or gpu is not None:
        tracker.events = []
    try:
        with tracker:
            for i in range(steps):
                if i < steps - 1:
                    _train_step(model, opt, batch, seq, vocab, dev)
                    continue
                tracker.reset_peak()
                with window if window is not None else contextlib.nullcontext():
                    _train_step(model, opt, batch, seq, vocab, dev)
    finally:
        opt.close()
    b = tracker.breakdown
    cuda = None
    if gpu is not None:
        from memfit.measure.gpu_attention import GpuAttentionMode
        from memfit.measure.gpu_kernels import replay_on

        cuda = replay_on(gpu, tracker.events)
    elif tracker.events is not None:
        from memfit.measure.caching_allocator import replay_step

        cuda = replay_step(tracker.events, dev)
    return TraceResult(
        gpu=gpu.name if gpu is not None else None, attention=GpuAttentionMode.counts() if gpu is not None else {},
        cuda_allocated=cuda.peak_allocated if cuda else None, cuda_reserved=cuda.peak_reserved if cuda else None,
        peak=tracker.peak_bytes, params=b["params"], grads=b["grads"], optimizer=b["optimizer"],
        activations=b["activations"], temporaries=b["temporaries"],
        modules=dict(sorted(tracker.module_peaks.items(), key=lambda kv: -kv[1])),
        module_activations=dict(sorted(tracker.module_activations.items(), key=lambda kv: -kv[1])),
        module_categories=tracker.module_breakdowns(), other_moments=_busiest(tracker),
        host_peak=tracker.host_peak_bytes,
    )
