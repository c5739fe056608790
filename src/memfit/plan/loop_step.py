"""The training loop a plan is made for, as a step the planner's traces run.

    for micro in step_batches:                 # all on the device when the step begins (memfit train)
        out = model(**micro)                   # keep_output: `out` lives until the next forward returns
        loss = out.loss
        loss.backward()
    opt.step()

Two things about that loop cost memory that a step which drops its output and runs one micro-batch
does not show:

* `keep_output`: Python keeps `out` (logits, a Hugging Face KV cache) alive through backward and the
  optimizer step, and until the *next* forward has returned and its result replaced it. The step
  below holds the output in a slot that outlives the step, as the loop's variable does.
* accumulation: from the second micro-batch on, the gradients of the earlier ones are held, and
  memfit train has moved every micro-batch of the step to the device up front. The plan is checked by
  a trace of two micro-batches (the third and later ones repeat the second) with the rest of the
  step's inputs on the device.

`loop_source` gives the chain source the composed estimate traces (one micro-batch, with the output
kept or dropped); `trace_plan` traces the chosen plan's whole step so.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn as nn

from memfit.measure.blocks import ChainSource

TRACED_MICRO_BATCHES = 2
"""Micro-batches a plan with accumulation is checked with: the second holds the first one's gradients,
and every later one is the second again."""


def _spec_batch(model: nn.Module, micro: int, seq: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from memfit.measure.trace import _vocab

    vocab = _vocab(model)
    return torch.randint(0, vocab, (micro, seq), device=dev), torch.randint(0, vocab, (micro, seq), device=dev)


def _spec_forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """(the output as a loop holds it, the loss) for memfit's GPT or a Hugging Face causal LM."""
    from memfit.models.gpt import GPT

    x, y = batch
    if isinstance(model, GPT):
        out = model(x, y)  # (logits, summed loss, tokens): `logits, loss, n = model(x, y)`
        return out, out[1] / out[2]
    out = model(input_ids=x, labels=y)
    return out, out.loss


def _module_batch(problem: Any, micro: int) -> Callable[[torch.device], Any]:
    from memfit.measure.anymodel import fake_like

    example = problem.example
    if callable(example) and not isinstance(example, torch.Tensor):
        return example
    sliced = problem.example_for(micro)
    return lambda dev: fake_like(sliced, dev)


def loop_step(problem: Any, micro: int, micro_batches: int = 1, keep_output: bool = True,
              on_device: int = 1) -> Callable[[nn.Module, Any], None]:
    """One optimizer step of the loop above: `micro_batches` forward/backward passes, then the update.
    `on_device`: micro-batches of the step moved to the device when it begins (at least those run)."""
    held: dict[str, Any] = {}  # the loop's `out` variable: it survives the step
    if problem.spec is not None:
        seq = problem.seq
        make = lambda model, dev: _spec_batch(model, micro, seq, dev)  # noqa: E731
        forward = _spec_forward
    else:
        from memfit.measure.anymodel import call, extract_loss

        fetch = _module_batch(problem, micro)
        make = lambda model, dev: fetch(dev)  # noqa: E731

        def forward(model: nn.Module, batch: Any) -> tuple[Any, torch.Tensor]:
            out = call(model, batch)
            return out, extract_loss(out, batch, problem.loss_fn)

    def step(model: nn.Module, opt: Any) -> None:
        dev = next(iter(model.parameters())).device
        batches = [make(model, dev) for _ in range(max(micro_batches, on_device))]
        for i in range(micro_batches):
            with opt.autocast():
                # One assignment, as `out = model(...)`: the previous output is released only now.
                held["out"], loss = forward(model, batches[i])
            if not keep_output:
                held.clear()
            opt.backward(loss, final=i == micro_batches - 1)
            del loss
        opt.step()

    if not keep_output:
        # Nothing of the step outlives it but the optimizer's state: a warm-up step may make that state alone.
        step.warmup = warmup_state  # type: ignore[attr-defined]
    return step


def warmup_state(model: nn.Module, opt: Any) -> bool:
    """Make the optimizer's state as a first training step would, without its forward and backward: zero
    gradients, one update, the gradients dropped. Only where the update sees nothing of the step but the
    gradients (a traced step on a CPU device; full precision, no loss scale, offload, update in backward or
    chunked head); False (nothing done) elsewhere. The traced step after it then begins as it would after a real first step (tests/test_plan_warmup.py
    compares whole profiles): this saves a forward and backward per trace."""
    from torch._subclasses.fake_tensor import FakeTensor

    first = next(iter(model.parameters()))
    if (not isinstance(first, FakeTensor)  # a measured step's warm-up also warms kernels and allocator up
            or getattr(opt, "precision", None) != "32-true" or opt.scaler is not None or opt.streamed is not None
            or opt.stepper is not None or first.device.type != "cpu"
            or any(getattr(m, "_memfit_head_chunks", None) for m in model.modules())):
        # (a chunked head may keep state of its own from a real step: memfit GPT's tied head does)
        return False
    for p in opt.params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    if not (STATE_ONLY_ADAM and _adam_state(opt.optimizer)):
        opt.step()
    opt.zero_grad()
    return True


STATE_ONLY_ADAM = os.environ.get("MEMFIT_WARMUP_UPDATE", "") != "1"
"""torch's Adam and AdamW warm up with their state made as their first step makes it (`_init_group`: the
step counter and the moment buffers), without the update's arithmetic, about a third of a traced step's
operations; the traced step after it sees the same tensors (tests/test_plan_speed_shortcuts.py compares
whole profiles and plans with MEMFIT_WARMUP_UPDATE=1, the full update)."""


def _adam_state(inner: Any) -> bool:
    """Make torch Adam's or AdamW's state as its first step would (False, nothing done, for any other
    optimizer). The step counter stays at 0 (counting it up is an operation on a constant, the costliest kind
    under FakeTensorMode): the traced step's update then counts it to 1, not 2, which only changes Python
    floats (the bias corrections), not which tensors the update makes."""
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    try:
        for group in inner.param_groups:
            inner._init_group(group, [], [], [], [], [], [])
    except TypeError:  # a torch whose private _init_group takes other arguments: the whole update makes it
        return False
    return True


def loop_source(problem: Any, src: ChainSource, micro: int, keep_output: bool) -> ChainSource:
    """The chain source whose step is one micro-batch of the loop, its output kept or dropped."""
    return replace(src, step=loop_step(problem, micro, 1, keep_output), key=src.key + (("loop", keep_output),))


def trace_plan(problem: Any, plan: Any) -> int:
    """The plan's traced device peak (`traced`'s first figure)."""
    return traced(problem, plan)[0]


def traced(problem: Any, plan: Any) -> tuple[int, int]:
    """The plan's step traced whole (nothing allocated): two micro-batches when it accumulates, the
    step's other micro-batches on the device, the output held as `plan.keep_output` says. On CUDA the
    figure is the caching allocator's predicted reserve (what a memory limit refuses). A model spec's
    figure is cached on disk (memfit.core.cache, kind `plan-traces`): the same plan is not traced twice."""
    device = str(getattr(problem, "device", None) or "cpu")
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    key = _trace_key(problem, plan, device) if not cuda else None
    hit = _load(key)
    if hit is not None:
        return hit
    got = _trace_plan(problem, plan, device, cuda)
    _store(key, got)
    return got


def _trace_key(problem: Any, plan: Any, device: str) -> tuple | None:
    """What a model spec's traced plan depends on (None for a module: no identity across processes)."""
    if problem.spec is None:
        return None
    from memfit.apply.policy import to_string

    src = problem.source(plan.micro_batch)
    return src.key + ("plan-trace", device, plan.precision, plan.optimizer, to_string(plan.actions), plan.micro_batch,
                      plan.accumulation, plan.keep_output, plan.head_chunks, plan.offload_optimizer) + (
                      ("step-in-backward",) if getattr(plan, "step_in_backward", False) else ())


def _load(key: tuple | None) -> tuple[int, int] | None:
    """A traced plan's peak from the disk cache (memfit.measure.chain_cache's key: the code digest included)."""
    from memfit.core import cache
    from memfit.measure.chain_cache import disk_key

    dk = disk_key(key) if key is not None else None
    hit = cache.load(dk, "plan-traces") if dk is not None else None
    return (int(hit["peak"]), int(hit["host"])) if hit is not None and "host" in hit else None


def _store(key: tuple | None, got: tuple[int, int]) -> None:
    from memfit.core import cache
    from memfit.measure.chain_cache import disk_key

    dk = disk_key(key) if key is not None else None
    try:
        if dk is not None:
            cache.store(dk, {"peak": int(got[0]), "host": int(got[1])}, "plan-traces")
    except OSError:
        pass


def _trace_plan(problem: Any, plan: Any, device: str, cuda: bool) -> tuple[int, int]:
    from memfit.apply.head_swap import chunk_head
    from memfit.core.gpus import target
    from memfit.core.tracker import MemoryTracker
    from memfit.measure.anymodel import module_builder, run_steps
    from memfit.measure.caching_allocator import replay_step
    from memfit.measure.fake_mode import fake_mode
    from memfit.measure.gpu_kernels import replay_on

    gpu = target(device)  # a named GPU (h100, ...): traced on the CPU as that GPU runs the step
    if problem.spec is not None:
        if problem.spec.hf_config is not None:
            import transformers  # noqa: F401  (imported before tracing, as trace_step does)
        spec, seq = problem.spec, problem.seq
        build = lambda: spec.build(seq=seq)  # noqa: E731
        on_device = plan.accumulation  # memfit train moves the whole step's micro-batches at once
    else:
        build = module_builder(problem.model)
        on_device = 1  # a user's loop: one micro-batch at a time
    runs = min(plan.accumulation, TRACED_MICRO_BATCHES)
    step = loop_step(problem, plan.micro_batch, runs, plan.keep_output, on_device)

    def tracker(model, opt, dev):
        t = MemoryTracker(model, opt, dev)
        t.events = [] if cuda or gpu is not None else None
        return t

    with fake_mode(gpu):
        r = run_steps(build, step, plan.precision, plan.optimizer, plan.actions, device if cuda else "cpu",
                      tracker=tracker, prepare=(lambda m: chunk_head(m, plan.head_chunks)) if plan.head_chunks else None,
                      offload=plan.offload_optimizer, step_in_backward=getattr(plan, "step_in_backward", False))
    peak, host = r.tracker.peak_bytes, r.tracker.host_peak_bytes
    if gpu is not None:
        return max(peak, replay_on(gpu, r.tracker.events).peak_reserved), host
    return (max(peak, replay_step(r.tracker.events, device).peak_reserved) if cuda else peak), host


def input_bytes(problem: Any, micro: int) -> int:
    """Bytes of one micro-batch's inputs as `loop_step` makes them."""
    if problem.spec is not None:
        return 2 * micro * problem.seq * 8  # tokens and targets, int64
    ex = problem.example
    if callable(ex) and not isinstance(ex, torch.Tensor):
        return 0  # made by the user's function: not known without calling it
    return sum(t.numel() * t.element_size() for t in tensor_leaves(problem.example_for(micro)))


def tensor_leaves(obj: Any):
    """The tensors of a nested example (tensors, dicts, tuples, lists)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensor_leaves(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from tensor_leaves(v)
