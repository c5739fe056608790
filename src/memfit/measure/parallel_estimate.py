"""Each rank's step peak under `pipeline` and `tensor`, from one-device traces (nothing allocated).

    pipeline_ranks(spec, batch=2, seq=64, world=2, microbatches=4, schedule="1f1b")
    tensor_ranks(spec, batch=2, seq=64, world=2, tp=2)

Pipeline (global batch world x batch, split into M micro-batches of b rows). One trace of the GPT
cut to 1 block at b rows gives, per module, the bytes saved for backward: a block's (`a`), the
embeddings' and the head's (final norm, head, loss). Rank r holds its stage's weights
(embeddings on the first, final norm and head on the last; a tied matrix on both), their optimizer
state, and the activations of the micro-batches in flight at its peak:

    gpipe   all M: every forward runs before the first backward (gradients not yet there)
    1f1b    min(M, stages - r): the warm-up depth

The gradients exist from the first backward on, which frees one micro-batch: they are held with
k - 1 micro-batches, or with k where 1F1B runs a forward after a backward (M > warm-up depth).

each micro-batch's k*a, plus the stage's output held for its backward (b x seq x hidden) or, on the last stage,
the head's and the logits (b x seq x vocab; the schedule keeps each micro-batch's output). Temporaries are the trace's.

Tensor (tp ranks per replica, replica batch tp x batch): one trace of the model one TP rank runs,
built with its local shapes (the column-parallel projections' outputs and the row-parallel ones'
inputs divided by tp, heads divided by tp; embeddings, norms, row-parallel biases whole). Its
weights, gradients, optimizer state, activations (partly sharded: attention and MLP interiors)
and temporaries are the rank's. All ranks are equal.
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from memfit.distributed.pipeline import check_pipeline
from memfit.distributed.stages import cut_to_stage, mark_tied, stage_blocks
from memfit.distributed.tensor_parallel import check_tensor
from memfit.measure.trace import trace_step


def _cut(spec, layers: int):
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, layers=layers))


def _stage_numel(spec, seq: int, rank: int, stages: int) -> int:
    """Elements of rank's stage weights, from a build on the meta device."""
    gpt = spec.on_meta(seq)
    mark_tied(gpt)
    return sum(p.numel() for p in cut_to_stage(gpt, rank, stages).parameters())


def pipeline_ranks(spec, batch: int, seq: int, world: int, microbatches: int | None = None,
                   schedule: str = "1f1b", precision: str = "32-true", optimizer: str = "adamw",
                   checkpoint: str = "none") -> list[dict]:
    cfg, m = spec.config, microbatches or world
    check_pipeline(cfg.layers, world, batch * world, m, schedule)
    b = batch * world // m
    one = trace_step(_cut(spec, 1), b, seq, precision, optimizer, checkpoint)
    saved = one.module_activations
    block = saved.get("blocks.0", 0)
    embed = saved.get("tok", 0) + saved.get("pos", 0)
    head = saved.get("GPT", 0) - block - embed  # final norm, head and the loss's saved tensors
    per_param, per_opt = one.params / _cut(spec, 1).counts()[0], one.optimizer / one.params
    act_bytes = 2 if precision.startswith(("bf16", "16")) else 4
    # stages without the head: at most the highest temporaries while a block runs (the logits are the last stage's)
    block_temps = min(one.temporaries, max((c["temporaries"] for n, c in one.module_categories.items()
                                            if n.startswith("blocks.")), default=one.temporaries))
    out = []
    for r in range(world):
        params = int(_stage_numel(spec, seq, r, world) * per_param)
        last = r == world - 1
        k = len(stage_blocks(cfg.layers, world, r))
        # the stage's output waits in the schedule for its backward: hidden states, or the logits
        # (which the one-device trace frees once the loss is computed)
        per_mb = k * block + (embed if r == 0 else 0) + (
            head + b * seq * cfg.vocab * act_bytes if last else b * seq * cfg.hidden * act_bytes)
        flight = m if schedule == "gpipe" else min(m, world - r)
        # Gradients exist from the first backward on, which frees one micro-batch; 1F1B's next forward
        # (when micro-batches remain after the warm-up) brings the count back.
        after = flight if schedule == "1f1b" and m > flight else flight - 1
        # a later stage receives the next micro-batch's input while one is in flight (1F1B's steady state)
        recv = b * seq * cfg.hidden * act_bytes if r > 0 and schedule == "1f1b" and m > flight else 0
        acts, grads = max((flight * per_mb, 0), (after * per_mb + recv, params), key=lambda ag: ag[0] + ag[1])
        row = {"rank": r, "strategy": "pipeline", "world": world, "params": params, "gathered": 0, "grads": grads,
               "in_flight": 0, "optimizer": int(params * per_opt), "activations": acts,
               "temporaries": one.temporaries if last else block_temps, "blocks": k, "microbatches_in_flight": flight, "microbatch_rows": b}
        row["total"] = sum(row[c] for c in ("params", "grads", "optimizer", "activations", "temporaries"))
        out.append(row)
    return out


def local_tp_gpt(spec, seq: int, tp: int) -> nn.Module:
    """memfit's GPT with the shapes one TP rank holds and computes with (see the module docstring)."""
    gpt = spec.build(seq)
    for block in gpt.blocks:
        a, mlp = block.attn, block.mlp
        bias = a.qkv.bias is not None
        a.qkv = nn.Linear(a.qkv.in_features, a.qkv.out_features // tp, bias=bias)
        a.proj = nn.Linear(a.proj.in_features // tp, a.proj.out_features, bias=bias)
        mlp.fc = nn.Linear(mlp.fc.in_features, mlp.fc.out_features // tp, bias=bias)
        mlp.proj = nn.Linear(mlp.proj.in_features // tp, mlp.proj.out_features, bias=bias)
        a.heads //= tp
        a.kv_heads //= tp
    return gpt


def tensor_ranks(spec, batch: int, seq: int, world: int, tp: int | None = None, precision: str = "32-true",
                 optimizer: str = "adamw", checkpoint: str = "none") -> list[dict]:
    cfg, tp = spec.config, tp or world
    check_tensor(cfg.heads, cfg.kv_heads or cfg.heads, world, tp)
    t = trace_step(lambda: local_tp_gpt(spec, seq, tp), batch * tp, seq, precision, optimizer, checkpoint)
    row = {"strategy": "tensor", "world": world, "gathered": 0, "in_flight": 0, "tp": tp, "dp": world // tp,
           **{c: getattr(t, c) for c in ("params", "grads", "optimizer", "activations", "temporaries")},
           "total": t.peak}
    return [{"rank": r, **row} for r in range(world)]
