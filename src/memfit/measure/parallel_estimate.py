"""Each rank's step peak under `pipeline` and `tensor`, from one-device traces (nothing allocated).

    pipeline_ranks(spec, batch=2, seq=64, world=2, microbatches=4, schedule="1f1b")
    tensor_ranks(spec, batch=2, seq=64, world=2, tp=2)
    tensor_ranks(spec, batch=2, seq=64, world=2, tp=2, sequence_parallel=True, vocab_parallel=True)  # estimated only

Pipeline (global batch world x batch, split into M micro-batches of b rows): each rank's stage
(embeddings on the first, final norm and head on the last; a tied matrix on both) is traced for a
whole step, its micro-batches run in the schedule's order with what torch's schedule holds between
them (memfit.measure.pipeline_trace): GPipe runs every forward before the first backward, 1F1B
min(M, stages - r) forwards of warm-up on rank r, interleaved 1F1B its V stages' forwards and
backwards in the order torch's schedule computes for the rank (`microbatches_in_flight`: the most
stage micro-batches whose backward has not run, each 1/V of the rank's blocks); with checkpointing each block's recompute during
backward is traced beside the held outputs, sends and gradients. Its figures are the rank's.

A Hugging Face causal LM is cut as memfit.distributed.hf_stages cuts it (its own pipeline plan:
embeddings, decoder layers, final norm), its loss over the shifted targets.

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

A Hugging Face causal LM is cut by its own tensor plan (memfit.distributed.hf_tensor): the plan's
column-parallel projections' outputs and row-parallel ones' inputs divided by tp, the rest whole,
as torch's parallelize_module leaves each rank's shards.

Sequence parallelism (Megatron-LM's; memfit's runtime does not run it, so this is an estimate
only): norms, dropouts and the residual stream on s/tp tokens, and the column-parallel projections
keeping their sequence-sharded inputs (all-gathered again in backward), so every tensor a block
saves is sharded: each block saves 1/tp of what the unsharded block saves on the same rows
(Korthikanti's sbh(34/t)). Each traced moment loses the share of that saving its held block
activations stand for (all of it at the end of forward, none at the optimizer step), and the
highest moment is the rank's peak. Embeddings, the final norm and the head stay as the TP trace has them.

Vocabulary parallelism (estimate only; torchtitan's and Megatron-LM's layout, not memfit's runtime):
the embedding's rows and the head's output columns divided by tp, so each rank holds and computes
its slice of the logits and of the loss over them.
"""
from __future__ import annotations

import torch.nn as nn

from memfit.distributed.pipeline import check_pipeline
from memfit.distributed.stages import stage_blocks
from memfit.distributed.tensor_parallel import check_tensor
from memfit.measure.pipeline_trace import trace_stage
from memfit.measure.trace import trace_step

CATS = ("params", "grads", "optimizer", "activations", "temporaries")


def pipeline_ranks(spec, batch: int, seq: int, world: int, microbatches: int | None = None,
                   schedule: str = "1f1b", precision: str = "32-true", optimizer: str = "adamw",
                   checkpoint: str = "none", accum: int = 1, virtual_stages: int | None = None,
                   aligned_targets: bool = True) -> list[dict]:
    """`aligned_targets`: a Hugging Face model's loss as `memfit train` computes it (the default), else
    over transformers' shifted labels, as `distribute()` computes it (docs/distributed.md)."""
    from memfit.distributed.interleaved import peak_held, rank_order, virtual_stages_of

    m = microbatches or world
    layers, _ = blocks_of(spec)
    check_pipeline(layers, world, batch * world, m, schedule, virtual_stages)
    virtual = virtual_stages_of(schedule, virtual_stages)
    b = batch * world // m
    out = []
    for r in range(world):
        cats = trace_stage(spec, r, world, m, b, seq, schedule, precision, optimizer, checkpoint, accum=accum,
                           virtual_stages=virtual, aligned_targets=aligned_targets)
        row = {"rank": r, "strategy": "pipeline", "world": world, "gathered": 0, "in_flight": 0,
               **{c: cats[c] for c in ("params", "grads", "optimizer", "activations", "temporaries")},
               "blocks": sum(len(stage_blocks(layers, world * virtual, r + k * world)) for k in range(virtual)),
               "microbatches_in_flight": m if schedule == "gpipe" else min(m, world - r), "microbatch_rows": b}
        if schedule == "interleaved":  # micro-batches held at the peak, each on one of the rank's V stages
            row.update(microbatches_in_flight=peak_held(rank_order(world, virtual, m, r)), virtual_stages=virtual)
        row["total"] = sum(row[c] for c in ("params", "grads", "optimizer", "activations", "temporaries"))
        out.append(row)
    return out


def local_tp_gpt(spec, seq: int, tp: int, vocab_parallel: bool = False) -> nn.Module:
    """memfit's GPT with the shapes one TP rank holds and computes with (see the module docstring);
    `vocab_parallel`: the embedding's rows and the head's outputs split too (estimate only)."""
    gpt = spec.build(seq)
    if vocab_parallel and tp > 1:
        vocab = -(-gpt.tok.num_embeddings // tp)
        gpt.tok = nn.Embedding(vocab, gpt.tok.embedding_dim)
        tied = gpt.head.weight is not None and gpt.cfg.tied_embeddings
        gpt.head = nn.Linear(gpt.head.in_features, vocab, bias=False)
        if tied:
            gpt.head.weight = gpt.tok.weight
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


def local_tp_hf(spec, seq: int, tp: int, aligned_targets: bool = False) -> nn.Module:
    """A Hugging Face causal LM with the shapes one TP rank of its tensor plan holds; `aligned_targets`:
    its loss as `memfit train` computes it (see aligned_loss)."""
    from memfit.distributed.hf_tensor import localize_hf

    model = localize_hf(spec.build(seq), tp)
    return aligned_loss(model) if aligned_targets else model


def aligned_loss(model: nn.Module) -> nn.Module:
    """`model` (a Hugging Face causal LM) scoring `labels` as targets aligned with the inputs, as
    TensorParallelOptimizer for `memfit train` does (its summed float cross-entropy, -1 skipped, over
    the target count), instead of transformers' labels shifted inside the loss. What that step holds
    beyond the loss's own saved tensors is held here too, until the next forward: the targets, memfit's
    data's own storage beside the inputs (saved by the loss and alive in the train loop to the step's
    end), and the summed loss (alive in accumulate_step through backward). The instance's own forward is
    replaced, so the module tree (every name the tracker reports) is the model's."""
    import types

    import torch.nn.functional as F

    def forward(self, input_ids=None, labels=None, **kw):
        self.__dict__.pop("_aligned_held", None)  # the previous step's batch is gone
        out = type(self).forward(self, input_ids=input_ids, **kw)
        if labels is not None:
            logits = out.logits
            target = labels.clone() if labels is input_ids else labels
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index=-1,
                                   reduction="sum")
            self.__dict__["_aligned_held"] = (target, loss)
            out.loss = loss / labels.numel()  # (the traced batches skip none: a count needs no data)
        return out

    model.forward = types.MethodType(forward, model)
    return model


def local_tp_model(spec, seq: int, tp: int, vocab_parallel: bool = False, aligned_targets: bool = False) -> nn.Module:
    """One TP rank's model: memfit's GPT (local_tp_gpt) or a Hugging Face causal LM (local_tp_hf)."""
    if spec.config is not None:
        return local_tp_gpt(spec, seq, tp, vocab_parallel)
    if vocab_parallel:
        from memfit.core.errors import ConfigError

        raise ConfigError("vocabulary parallelism is estimated for memfit's GPT only; drop --vocab-parallel for a "
                          "Hugging Face config (its plan keeps the embeddings and head whole)")
    return local_tp_hf(spec, seq, tp, aligned_targets)


def check_tensor_spec(spec, world: int, tp: int) -> None:
    """check_tensor for memfit's GPT or a Hugging Face config (whose family must ship a tensor plan)."""
    if spec.config is not None:
        check_tensor(spec.config.heads, spec.config.kv_heads or spec.config.heads, world, tp)
        return
    from memfit.distributed.hf_tensor import heads_of, hf_tp_plan

    model = spec.on_meta()
    check_tensor(*heads_of(model.config), world, tp)
    hf_tp_plan(model)


def blocks_of(spec, pipeline: bool = True) -> tuple[int, str]:
    """(repeated blocks, their module-name prefix): memfit's GPT's `blocks`, a Hugging Face model's layers
    (`pipeline`: of a family memfit.distributed.hf_stages cuts, refused otherwise)."""
    if spec.config is not None:
        return spec.config.layers, "blocks"
    from memfit.distributed.hf_stages import check_hf_pipeline
    from memfit.distributed.hf_tensor import hf_layers

    model = spec.on_meta()
    if pipeline:
        check_hf_pipeline(model.config)
    name, stack = hf_layers(model)
    return len(stack), name


def tensor_ranks(spec, batch: int, seq: int, world: int, tp: int | None = None, precision: str = "32-true",
                 optimizer: str = "adamw", checkpoint: str = "none", sequence_parallel: bool = False,
                 vocab_parallel: bool = False, aligned_targets: bool = True) -> list[dict]:
    """`aligned_targets`: a Hugging Face model's loss as `memfit train` computes it (the default), else
    over transformers' shifted labels, as `distribute()` computes it (docs/distributed.md)."""
    tp = tp or world
    check_tensor_spec(spec, world, tp)
    rows = batch * tp  # the TP group's rows: every rank of it computes all of them
    t = trace_step(lambda: local_tp_model(spec, seq, tp, vocab_parallel, aligned_targets), rows, seq, precision,
                   optimizer, checkpoint)
    cats = {c: getattr(t, c) for c in CATS}
    if sequence_parallel and tp > 1:
        cats = _sequence_parallel_peak(spec, t, rows, seq, tp, precision, optimizer, checkpoint)
    row = {"strategy": "tensor", "world": world, "gathered": 0, "in_flight": 0, "tp": tp, "dp": world // tp,
           "rows": rows, "sequence_parallel": bool(sequence_parallel), "vocab_parallel": bool(vocab_parallel), **cats,
           "total": sum(cats.values())}
    return [{"rank": r, **row} for r in range(world)]


def block_saved(module_activations: dict[str, int], layers: int, prefix: str = "blocks") -> list[int]:
    """Bytes each repeated block saves for backward, from a trace's per-module figures."""
    return [module_activations.get(f"{prefix}.{i}", 0) for i in range(layers)]


def _sequence_parallel_peak(spec, tp_trace, rows: int, seq: int, tp: int, precision: str, optimizer: str,
                            checkpoint: str) -> dict[str, int]:
    """The TP trace's categories at its highest moment once sequence parallelism shards what the blocks
    save (see the module docstring). Each traced moment (the step's peak and every module's) holds a
    share of the blocks' saved bytes, read from its activations beyond what the embeddings and head save
    (between 0 and all of them); that share of the saving comes off it, and the highest moment wins."""
    whole = trace_step(spec, rows, seq, precision, optimizer, checkpoint)
    layers, prefix = blocks_of(spec, pipeline=False)
    local = block_saved(tp_trace.module_activations, layers, prefix)
    full = block_saved(whole.module_activations, layers, prefix)
    saving, held = sum(max(0, lo - fu // tp) for lo, fu in zip(local, full)), sum(local)
    outside = max(tp_trace.module_activations.values(), default=0) - held  # embeddings' and head's saved bytes
    best = None
    for cats in [{c: getattr(tp_trace, c) for c in CATS}, *tp_trace.module_categories.values()]:
        share = min(1.0, max(0.0, (cats["activations"] - outside) / held)) if held else 0.0
        moment = {c: cats[c] for c in CATS}
        moment["activations"] -= round(share * saving)
        if best is None or sum(moment.values()) > sum(best.values()):
            best = moment
    return best
