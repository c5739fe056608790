"""Each rank's step peak under a cluster layout, composed in closed form from the unit profile.

    rank_peaks(layout, unit, spec)  -> [{"rank": r, "params": ..., "grads": ..., "optimizer": ...,
                                        "extra": ..., "activations": ..., "temporaries": ..., "total": ...}]

Model states come from memfit.measure.formulas.model_state_bytes over the elements the rank holds
(a pipeline stage's blocks and ends, a TP rank's local shapes; ZeRO shards over dp) and sit beside
the per-rank figures of memfit.distributed.rank_memory: ZeRO-3 gathers the rest (embeddings, head,
norms) and two blocks (running, prefetched); ZeRO-2/3 copy one block's full gradients into a flat
bucket for the reduce-scatter, ZeRO-1 the largest bucket at the step; DDP keeps its gradient
buckets, which are the gradients (gradient_as_bucket_view). Without accumulation, one process and
ZeRO-1-3 make (reduce) their gradients during backward as the activations are freed: backward's
peak holds the head's and one block's, the step every one (two moments; `grad_bytes` is the rank's whole
gradient bytes). A pipeline stage holds the activations of the
micro-batches in flight (gpipe all M; 1f1b min(M, stages - r)) and its gradients: under gpipe the
last stage's peak is in its first backward, with every micro-batch's activations still held and the
gradients being made (measured: 8.17 MiB on a 2-stage run that pipeline_ranks, which leaves gpipe's
gradients out, put at 7.20 MiB; tests/test_plan_cluster_train.py).

On FSDP2 (Layout.engine "fsdp2") zero3 is the same sum (measured within a few hundred bytes of memfit's
zero3, bench/results/distributed.json); zero2 shards the weights as zero3 does and holds every
block's gathered weights from its forward to its backward.

Activations per micro-batch: rows x (per block, its action's saved bytes; the embeddings' on the
first stage; the head's and the logits on the last, or the stage's output elsewhere), plus, when
any block recomputes, one block's kept bytes (the forward rerun in backward).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memfit.measure.formulas import model_state_bytes
from memfit.plan.cluster_unit import UnitProfile

_PARAM_BYTES = {"32-true": 4, "bf16-mixed": 4, "16-mixed": 4}


@dataclass
class Layout:
    """One candidate: strategy and degrees, batch split, per-block action counts per stage."""

    strategy: str
    """none, ddp, zero1, zero2, zero3, pipeline or tensor (dp x tp), as memfit train runs them."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    rows: int = 1
    """Sequences in one rank's forward per micro-batch (tensor: the replica's, run by each TP rank)."""
    accum: int = 1
    """Micro-batches per optimizer step (pipeline: the schedule's micro-batches)."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    """Pipeline stages per rank (schedule "interleaved"; the planner itself searches gpipe and 1f1b)."""
    precision: str = "32-true"
    optimizer: str = "adamw"
    offload_optimizer: str | None = None
    head_chunks: int | None = None
    counts: list = field(default_factory=list)
    """Per stage (one entry unless pipeline): (keep, selective, recompute) block counts."""
    dp_shard: int = 0
    """A ZeRO stage over dp beside tp/pp: on paper only (3-D layouts as published; memfit's
    trainer shards over dp only under zero1-3)."""
    engine: str = "memfit"
    """Who carries out zero2/zero3 (memfit train --engine): "fsdp2" (torch's fully_shard; set by the search
    where memfit.distributed.strategy.engine_for picks it) or "memfit" (its flat engine; older plan files)."""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def zero(self) -> int:
        return int(self.strategy[-1]) if self.strategy.startswith("zero") else self.dp_shard


def stage_sizes(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def in_flight(lay: Layout, rank: int) -> int:
    if lay.strategy != "pipeline":
        return 1
    return lay.accum if lay.schedule == "gpipe" else min(lay.accum, lay.pp - rank)


def _states(lay: Layout, unit: UnitProfile, numel: int, tensors: int) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, extra) bytes; extra: ZeRO's gathered weights and flat buckets, DDP's buckets."""
    fsdp2_zero2 = lay.engine == "fsdp2" and lay.zero == 2  # weights sharded, gathered whole until backward
    s = model_state_bytes(numel, lay.precision, lay.optimizer, zero=3 if fsdp2_zero2 else lay.zero,
                          world=max(lay.dp, 1), offload_optimizer=lay.offload_optimizer, n_tensors=tensors)
    w = _PARAM_BYTES.get(lay.precision, 2)
    extra = 0
    if fsdp2_zero2:  # at backward's start every block's gathered weights (reshard_after_forward=False)
        extra += w * numel
    if lay.zero == 3:
        extra += w * (unit.rest_numel + 2 * unit.block_numel)
    if lay.zero >= 2:
        extra += w * unit.block_numel
    elif lay.zero == 1:
        extra += w * max(unit.block_numel, unit.rest_numel)
    # (DDP's buckets are the gradients themselves: memfit's DDP sets gradient_as_bucket_view)
    return s.params, s.grads, s.optimizer, extra


def _activations(lay: Layout, unit: UnitProfile, rank: int, counts: tuple[int, int, int]) -> int:
    keep, sel, rec = counts
    first, last = rank == 0, rank == lay.pp - 1
    per_row = keep * unit.saved["keep"] + sel * unit.saved["selective"] + rec * unit.saved["recompute"]
    if first:
        per_row += unit.embed_saved
    if last:
        head = unit.head_saved
        if lay.head_chunks:  # the chunked head keeps one chunk's logits, not the whole sequence's
            head = max(head - unit.logits + unit.logits // lay.head_chunks, 0)
        elif lay.strategy == "pipeline":
            head += unit.logits  # the schedule keeps each micro-batch's output until its backward
        per_row += head
    else:
        per_row += unit.boundary  # the stage's output waits for its backward
    working = unit.saved["keep"] if rec or sel else 0  # one block's forward rerun in backward
    return lay.rows * (in_flight(lay, rank) * per_row + working)


def stage_numel(lay: Layout, unit: UnitProfile, layers: int, rank: int, tied: bool) -> tuple[int, int]:
    """(elements, tensors) of the rank's weights."""
    k = stage_sizes(layers, lay.pp)[rank]
    numel, tensors = k * unit.block_numel, k * unit.block_tensors
    if rank == 0 or tied:
        numel += unit.embed_numel
    if rank == lay.pp - 1:
        numel += unit.head_numel
    return numel, tensors + unit.rest_tensors


def rank_peaks(lay: Layout, unit: UnitProfile, layers: int, tied: bool = False) -> list[dict]:
    """One row per pipeline stage (every other layout: one row, all ranks being equal)."""
    out = []
    for r in range(lay.pp):
        numel, tensors = stage_numel(lay, unit, layers, r, tied and lay.pp > 1)
        params, grads, opt, extra = _states(lay, unit, numel, tensors)
        counts = lay.counts[r] if r < len(lay.counts) else (stage_sizes(layers, lay.pp)[r], 0, 0)
        acts = _activations(lay, unit, r, counts)
        # two moments: backward (activations and its temporaries, which grow with the rows) and the
        # optimizer step (its temporaries, in proportion to the weights the rank updates)
        one_block = unit.block_numel + unit.rest_numel
        shard = numel / (lay.dp if lay.zero else 1)
        t_bwd = unit.temps[1] * lay.rows // 2
        t_step = int(unit.temps[0] * min(1.0, shard / max(one_block, 1)))
        bwd_grads = grads
        if lay.accum == 1 and lay.strategy in ("none", "zero1", "zero2", "zero3", "tensor"):
            # made (ZeRO-2/3: reduced) during backward as the activations are freed: at its peak (its
            # start), the head's and one block's; DDP's buckets and an earlier micro-batch's gradients
            # are there throughout. A TP rank's shards too (reduced over dp at the step only): its
            # traced and tracked peaks hold no gradients (tests/test_plan_cluster_hf.py)
            bwd_grads = int(grads * min(1.0, (unit.head_numel + unit.block_numel) / max(numel, 1)))
        bwd_extra = 0 if lay.zero == 1 else extra  # ZeRO-1's flat bucket: at the step only
        row = {"rank": r, "params": params, "optimizer": opt, "grad_bytes": grads,
               "backward": params + opt + bwd_extra + bwd_grads + acts + t_bwd}
        if bwd_extra + acts + t_bwd + bwd_grads >= extra + t_step + grads:  # the categories of the peak moment
            row.update(extra=bwd_extra, grads=bwd_grads, activations=acts, temporaries=t_bwd)
        else:
            row.update(extra=extra, grads=grads, activations=0, temporaries=t_step)
        row["total"] = params + opt + row["extra"] + row["grads"] + row["activations"] + row["temporaries"]
        out.append(row)
    return out


def fixed_bytes(lay: Layout, unit: UnitProfile, layers: int, rank: int, tied: bool = False) -> tuple[int, int, int]:
    """(bytes that no block action changes, bytes per kept block, per selective, per recomputed):
    the linear form rank_peaks takes in the action counts (without the recompute working set)."""
    probe = Layout(**{**lay.__dict__, "counts": [(0, 0, 0)] * lay.pp})
    base = rank_peaks(probe, unit, layers, tied)[rank]["backward"]  # (the step's moment: no counts change it)
    per = lay.rows * in_flight(lay, rank)
    return base, per * unit.saved["keep"], per * unit.saved["selective"], per * unit.saved["recompute"]
