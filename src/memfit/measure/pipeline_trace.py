"""One pipeline stage's training step traced under FakeTensorMode, in the order torch's schedule runs it.

    trace_stage(spec, rank=1, stages=2, microbatches=2, rows=2, seq=64, schedule="1f1b")
    -> {"params": ..., "grads": ..., "optimizer": ..., "activations": ..., "temporaries": ..., "total": ...}

The stage is built and checkpointed as memfit.distributed.pipeline builds it (the GPT cut by
cut_to_stage, the policy re-applied to the stage's blocks, the step of ModelParallelOptimizer) and
its micro-batches run through the stage as torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B run them (and ScheduleInterleaved1F1B: the rank's V stages in the order torch computes
for it), holding what they hold:

* each forward's output (and its input) until that micro-batch's backward (the fwd cache); the last
  stage computes the loss right after its forward and keeps it;
* a sent tensor until its send's work is released: GPipe keeps every send's work to the end of its
  phase loop, so every forward output and every input gradient it sends lives to the step's end;
  1F1B keeps the last forward's send and the previous backward's gradient send across the next
  computation (a recomputed block's backward included), and the `output` of the last forward; the
  interleaved schedule's runtime keeps every send's work to the step's end, as GPipe;
* the receive buffers (one per micro-batch) exist before the step, as torch allocates them when the
  stage is first run; a buffer counts from the moment an op saves it, as the tracker sees it.

With checkpointing, a block's backward recomputes its forward beside everything above: that moment
(the recompute's saved tensors, the gradient arriving from the next stage, the held sends) is traced,
not assumed. Nothing is allocated; the figures are the tracker's at the last step's peak.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from memfit.measure.fake_mode import fake_mode


def trace_stage(spec, rank: int, stages: int, microbatches: int, rows: int, seq: int, schedule: str = "1f1b",
                precision: str = "32-true", optimizer: str = "adamw", checkpoint: str = "none",
                steps: int = 2, accum: int = 1, virtual_stages: int | None = None,
                aligned_targets: bool = False) -> dict[str, int]:
    """The stage of `rank` (micro-batches of `rows` sequences): its tracked categories at the step's peak.
    `accum`: schedule runs per optimizer step (PipelineOptimizer.accumulate_step: gradients add up);
    `virtual_stages`: the interleaved schedule's stages per rank (all of them are this rank's);
    `aligned_targets`: a Hugging Face model's loss as `memfit train` computes it (targets aligned with the
    inputs, ModelParallelOptimizer.aligned_targets), else transformers' labels shifted inside the loss."""
    from memfit.core.tracker import track
    from memfit.distributed.interleaved import virtual_stages_of

    virtual = virtual_stages_of(schedule, virtual_stages)
    with fake_mode():
        module, parts, opt, (hidden, vocab, hf) = _build(spec, rank, stages, virtual, seq, precision, optimizer,
                                                        checkpoint)
        n = stages * virtual
        dtype = opt.mode.param_dtype if hf else _sent_dtype(parts[0], opt, rows, seq, hidden)
        ids = [rank + k * stages for k in range(virtual)]
        runs = {sid: _Stage(part, opt, _buffers(sid > 0, microbatches, rows, seq, hidden, dtype),
                            _buffers(sid < n - 1, microbatches, rows, seq, hidden, dtype), sid == 0, sid == n - 1,
                            hf and not aligned_targets)
                for sid, part in zip(ids, parts)}
        batches = [[torch.randint(0, vocab, (rows * microbatches, seq)) for _ in range(accum)]
                   for _ in range(steps)]
        for s, xs in enumerate(batches):
            tracker = track(module, opt, device="cpu") if s == steps - 1 else None
            with tracker if tracker is not None else contextlib.nullcontext():
                for x in xs:
                    with opt.autocast():
                        _run(schedule, runs, x.tensor_split(microbatches), rank, stages, virtual)
                opt.step()
        opt.close()
        return dict(tracker.breakdown)


def _buffers(needed: bool, microbatches: int, rows: int, seq: int, hidden: int, dtype) -> list:
    """A stage's receive buffers (activations or their gradients), one per micro-batch, if it receives."""
    return [torch.empty(rows, seq, hidden, dtype=dtype) for _ in range(microbatches)] if needed else []


def _run(schedule: str, runs: dict, mbs: tuple, rank: int, stages: int, virtual: int) -> None:
    if schedule == "interleaved":
        from memfit.distributed.interleaved import rank_order

        _interleaved(runs, mbs, rank_order(stages, virtual, len(mbs), rank))
    else:
        (_gpipe if schedule == "gpipe" else _one_f_one_b)(runs[rank], mbs, stages - rank)


def _build(spec, rank: int, stages: int, virtual: int, seq: int, precision: str, optimizer: str, checkpoint: str):
    """The rank's stage module(s) and its optimizer, as PipelineOptimizer makes them (without a process
    group): (module the tracker follows, the stages, optimizer, (hidden size, vocabulary, whether a
    Hugging Face model))."""
    from memfit.apply.policy import resolve_policy
    from memfit.distributed.interleaved import StageGroup
    from memfit.distributed.mp_optimizer import ModelParallelOptimizer
    from memfit.distributed.pipeline import _blocks_of, checkpointed_stages

    model = spec.build(seq=seq)
    model.train()
    hf, layers = _blocks_of(model)
    actions = resolve_policy(checkpoint, len(layers))
    plain = all(a.is_plain for a in actions)
    parts = checkpointed_stages(model, rank, stages, virtual, hf, None if plain else actions)
    module = parts[0] if virtual == 1 else StageGroup(parts)
    opt = ModelParallelOptimizer.__new__(ModelParallelOptimizer)
    opt._make_inner(module, list(model.named_parameters()), optimizer, 1e-3, 0.0, precision, None, None, None, None,
                    {})
    opt.scaler = None  # the loss scale is a scalar: its overflow check needs the world, not memory
    if hf:
        return module, parts, opt, (model.config.hidden_size, model.config.vocab_size, True)
    return module, parts, opt, (model.cfg.hidden, model.cfg.vocab, False)


def _sent_dtype(stage: nn.Module, opt, rows: int, seq: int, hidden: int) -> torch.dtype:
    """The dtype of the hidden states between stages: what a block returns under the step's autocast
    (a Hugging Face layer: the residual stream's, the weights' dtype)."""
    block = next(iter(stage.blocks))
    with torch.no_grad(), opt.autocast():
        h = torch.empty(rows, seq, hidden, dtype=opt.mode.param_dtype)
        out = block(h)
    return (out[0] if isinstance(out, tuple) else out).dtype


class _Stage:
    """torch's PipelineStage's forward_one_chunk / backward_one_chunk and its caches, on one process."""

    def __init__(self, module, opt, recv, grad_in, first: bool, last: bool, shifted: bool = False) -> None:
        self.module, self.opt, self.recv, self.grad_in = module, opt, recv, grad_in
        self.first, self.last, self.shifted = first, last, shifted
        self.cache: dict[int, tuple] = {}
        self.losses: list[torch.Tensor] = []
        self.mbs: tuple = ()
        self.total = 1.0

    def start(self, mbs: tuple) -> None:
        """clear_runtime_states and the step's split: the input buffers' gradients are dropped."""
        self.cache, self.losses, self.mbs = {}, [], mbs
        self.total = float(sum(m[:, 1:].numel() if self.shifted else m.numel() for m in mbs))
        for b in self.recv:
            b.grad = None

    def forward(self, i: int) -> torch.Tensor:
        inp = self.mbs[i] if self.first else self.recv[i].requires_grad_(True)
        out = self.module(inp)
        self.cache[i] = (out, inp)
        if self.last:  # PipelineOptimizer._loss: the summed cross-entropy over the global token count
            if self.shifted:
                from memfit.distributed.hf_stages import hf_shifted

                loss = F.cross_entropy(*hf_shifted(out, self.mbs[i]), ignore_index=-100, reduction="sum")
            else:
                loss = F.cross_entropy(out.reshape(-1, out.size(-1)), self.mbs[i].reshape(-1), ignore_index=-1,
                                       reduction="sum")
            self.losses.append(self.opt.scaled(loss / self.total))
        return out

    def backward(self, j: int) -> torch.Tensor | None:
        """stage_backward; returns the input's gradient (sent to the previous stage), None on the first."""
        out, inp = self.cache.pop(j)
        if self.last:
            torch.autograd.backward([self.losses[j]])
        else:
            torch.autograd.backward([out], grad_tensors=[self.grad_in[j]])
        grad = None
        if not self.first:
            grad, inp.grad = inp.grad, None
        if self.last and not self.first and not out._is_view():
            out.detach_()
        return grad

    def sends(self, out: torch.Tensor | None) -> list:
        """What a send's ops (and their work) hold: the tensor's storage (a detached view)."""
        return [] if out is None else [out.detach()]


def _gpipe(st: _Stage, mbs: tuple, _warmup: int) -> None:
    st.start(mbs)
    fwd_works: list = []
    output = None
    for i in range(len(mbs)):
        output = st.forward(i)
        fwd_works += st.sends(None if st.last else output)
    bwd_works: list = []
    for i in range(len(mbs)):
        bwd_works += st.sends(st.backward(i))
    del output, fwd_works, bwd_works
    st.losses = []


def _interleaved(runs: dict[int, _Stage], mbs: tuple, order: list[tuple[str, int, int]]) -> None:
    """torch's _PipelineScheduleRuntime._step_microbatches over this rank's stages in `order`: every
    send's work is kept in one list to the step's end, so every forward output and input gradient
    sent lives until then."""
    for st in runs.values():
        st.start(mbs)
    send_ops: list = []
    for kind, sid, mb in order:
        st = runs[sid]
        if kind == "F":
            output = st.forward(mb)
            send_ops += st.sends(None if st.last else output)
            del output
        else:
            send_ops += st.sends(st.backward(mb))
    del send_ops
    for st in runs.values():
        st.losses = []


def _one_f_one_b(st: _Stage, mbs: tuple, depth: int) -> None:
    """Schedule1F1B._step_microbatches: `depth` (stages - rank) forwards of warm-up, then 1B1F, then
    the remaining backwards; the variables that hold sends live as long as torch's do."""
    st.start(mbs)
    m = len(mbs)
    warmup = min(m, depth)
    send_work: list = []
    fwd_sends: list = []
    output = None
    for i in range(warmup):
        output = st.forward(i)
        fwd_sends = st.sends(None if st.last else output)
        if i != warmup - 1:
            send_work = list(fwd_sends)
    fwd, bwd = warmup, 0
    bwd_sends: list = []
    while True:
        bwd_sends = st.sends(st.backward(bwd))
        bwd += 1
        if fwd == m:
            break
        output = st.forward(fwd)
        fwd_sends = st.sends(None if st.last else output)
        fwd += 1
    send_work = list(bwd_sends)
    while bwd < m:
        grad = st.backward(bwd)
        bwd_sends = st.sends(grad)
        send_work = list(bwd_sends)
        del grad
        bwd += 1
    del output, fwd_sends, bwd_sends, send_work
    st.losses = []
