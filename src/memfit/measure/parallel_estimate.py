"""Each rank's step peak under `pipeline` and `tensor`, from one-device traces (nothing allocated).

    pipeline_ranks(spec, batch=2, seq=64, world=2, microbatches=4, schedule="1f1b")
    tensor_ranks(spec, batch=2, seq=64, world=2, tp=2)
    tensor_ranks(spec, batch=2, seq=64, world=2, tp=2, sequence_parallel=True)   # estimated only

Pipeline (global batch world x batch, split into M micro-batches of b rows): each rank's stage
(embeddings on the first, final norm and head on the last; a tied matrix on both) is traced for a
whole step, its micro-batches run in the schedule's order with what torch's schedule holds between
them (memfit.measure.pipeline_trace): GPipe runs every forward before the first backward, 1F1B
min(M, stages - r) forwards of warm-up on rank r; with checkpointing each block's recompute during
backward is traced beside the held outputs, sends and gradients. Its figures are the rank's.

Tensor (tp ranks per replica, replica batch tp x batch): one trace of the model one TP rank runs,
built with its local shapes (the column-parallel projections' outputs and the row-parallel ones'
inputs divided by tp, heads divided by tp; embeddings, norms, row-parallel biases whole). Its
weights, gradients, optimizer state, activations (partly sharded: attention and MLP interiors)
and temporaries are the rank's. All ranks are equal.

Rows: `--batch` is per process as for every strategy (the global batch is world x batch), so a TP
group of tp ranks runs tp x batch rows and every rank of it computes all of them: at a fixed TP-group
micro-batch b each block saves (R + S / tp) for its replicated part R (norm inputs, the inputs of
the column-parallel projections) and its sharded part S (q, k, v, attention output, MLP interior),
Korthikanti et al. 2022's sbh(10 + 24/t) (8 + 24/t without dropout). Each row says its `rows`.

Sequence parallelism (Megatron-LM's; memfit's runtime does not run it, so this is an estimate
only): norms, dropouts and the residual stream on s/tp tokens, and the column-parallel projections
keeping their sequence-sharded inputs (all-gathered again in backward), so every tensor a block
saves is sharded: each block saves 1/tp of what the unsharded block saves on the same rows
(Korthikanti's sbh(34/t)). The rank's activations are the TP trace's with each block's saved
bytes replaced by that; the peak drops by the difference (at the peak every block's saved tensors
are held). Embeddings, the final norm and the head stay as the TP trace has them.
"""
from __future__ import annotations

import torch.nn as nn

from memfit.distributed.pipeline import check_pipeline
from memfit.distributed.stages import stage_blocks
from memfit.distributed.tensor_parallel import check_tensor
from memfit.measure.pipeline_trace import trace_stage
from memfit.measure.trace import trace_step


def pipeline_ranks(spec, batch: int, seq: int, world: int, microbatches: int | None = None,
                   schedule: str = "1f1b", precision: str = "32-true", optimizer: str = "adamw",
                   checkpoint: str = "none", accum: int = 1) -> list[dict]:
    cfg, m = spec.config, microbatches or world
    check_pipeline(cfg.layers, world, batch * world, m, schedule)
    b = batch * world // m
    out = []
    for r in range(world):
        cats = trace_stage(spec, r, world, m, b, seq, schedule, precision, optimizer, checkpoint, accum=accum)
        row = {"rank": r, "strategy": "pipeline", "world": world, "gathered": 0, "in_flight": 0,
               **{c: cats[c] for c in ("params", "grads", "optimizer", "activations", "temporaries")},
               "blocks": len(stage_blocks(cfg.layers, world, r)),
               "microbatches_in_flight": m if schedule == "gpipe" else min(m, world - r), "microbatch_rows": b}
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
                 optimizer: str = "adamw", checkpoint: str = "none", sequence_parallel: bool = False) -> list[dict]:
    cfg, tp = spec.config, tp or world
    check_tensor(cfg.heads, cfg.kv_heads or cfg.heads, world, tp)
    rows = batch * tp  # the TP group's rows: every rank of it computes all of them
    t = trace_step(lambda: local_tp_gpt(spec, seq, tp), rows, seq, precision, optimizer, checkpoint)
    cats = {c: getattr(t, c) for c in ("params", "grads", "optimizer", "activations", "temporaries")}
    if sequence_parallel and tp > 1:
        cats["activations"] -= _sequence_parallel_saving(spec, t, rows, seq, tp, precision, optimizer, checkpoint)
    row = {"strategy": "tensor", "world": world, "gathered": 0, "in_flight": 0, "tp": tp, "dp": world // tp,
           "rows": rows, "sequence_parallel": bool(sequence_parallel), **cats, "total": sum(cats.values())}
    return [{"rank": r, **row} for r in range(world)]


def block_saved(module_activations: dict[str, int], layers: int) -> list[int]:
    """Bytes each repeated block saves for backward, from a trace's per-module figures."""
    return [module_activations.get(f"blocks.{i}", 0) for i in range(layers)]


def _sequence_parallel_saving(spec, tp_trace, rows: int, seq: int, tp: int, precision: str, optimizer: str,
                              checkpoint: str) -> int:
    """Bytes sequence parallelism takes off the TP trace's activations (see the module docstring)."""
    whole = trace_step(spec, rows, seq, precision, optimizer, checkpoint)
    layers = spec.config.layers
    local = block_saved(tp_trace.module_activations, layers)
    full = block_saved(whole.module_activations, layers)
    return sum(max(0, lo - fu // tp) for lo, fu in zip(local, full))
