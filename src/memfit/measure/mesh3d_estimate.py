"""Each rank's step peak under FSDP2 x tensor parallel x pipeline on one ("pp", "dp", "tp") DeviceMesh
(a Hugging Face causal LM; memfit's GPT with tp=1).

    est = memfit.estimate("config.json", batch=2, seq=64, strategy="pipeline", world=8, pp=2, tp=2,
                          engine="fsdp2", microbatches=2, schedule="1f1b")
    est.ranks   # one row per stage, its rank_ids every (dp, tp) place of it

The run this estimates is memfit.distributed.mesh3d (`distribute(model, "zero3", engine="fsdp2", pp=, tp=)`);
on the command line `memfit estimate CONFIG --strategy pipeline --pp P --tp T --world N --engine fsdp2`.
`batch` is per process, as for --strategy pipeline and tensor: the global batch is world x batch rows,
a replica (pp x tp ranks) runs world x batch / dp of them in `microbatches` pieces.

Composed from the estimates memfit already has:

- the stage: memfit.measure.pipeline_trace traces the stage of the model one TP rank holds (its tensor
  plan's local shapes, memfit.measure.fsdp_tp_estimate) through the schedule, micro-batch by micro-batch,
  with the in-flight activations and sends torch's schedule holds; it is traced with a stateless optimizer,
  so its peak is the schedule's: the stage's weights and gradients whole beside the activations. Under
  pipelining FSDP2 holds exactly that: reshard_after_forward is False and torch's stage keeps the gathered
  weights and unreduced gradients from the first micro-batch to the last;
- FSDP2 over "dp" adds, at every moment of the step, each weight's shard (its first dimension padded to a
  multiple of dp, as fully_shard pads it) and the optimizer state of the shards (step counters included);
- after the last backward, torch's stage reduce-scatters group by group (each decoder layer, then the
  stage's root): one group's flat reduce-scatter input (dp padded shards) beside the whole weights and
  gradients and the gradient shards already made. The larger of the two moments is the rank's peak.
"""
from __future__ import annotations

import math
from typing import Any

from memfit.core.errors import ConfigError


def _stage_shapes(spec, rank: int, pp: int, seq: int) -> tuple[list[list[tuple]], int]:
    """(the stage's parameter shapes grouped as FSDP2 groups them: each decoder layer, then the rest;
    the bytes of one element)."""
    from memfit.distributed.pipeline import _blocks_of, cut_stage
    from memfit.measure.fake_mode import fake_mode

    with fake_mode():
        model = spec.build(seq=seq)
        hf, _ = _blocks_of(model)
        stage = cut_stage(model, rank, pp, hf)
        in_blocks = {id(p) for b in stage.blocks for p in b.parameters()}
        groups = [[tuple(p.shape) for p in b.parameters()] for b in stage.blocks]
        groups.append([tuple(p.shape) for p in stage.parameters() if id(p) not in in_blocks])
        itemsize = next(stage.parameters()).element_size()
    return groups, itemsize


def _shard(shape: tuple, dp: int) -> tuple:
    """The shape of one rank's padded shard (fully_shard splits dim 0, padded to a multiple of dp)."""
    return (math.ceil(shape[0] / dp), *shape[1:]) if shape else shape


def stage_row(spec, rank: int, pp: int, dp: int, tp: int, rows: int, seq: int, microbatches: int, schedule: str,
              optimizer: str, checkpoint: str) -> dict[str, Any]:
    """One stage's per-rank figures (see the module docstring); `rows`: sequences per micro-batch."""
    from memfit.apply.optimizers import tensor_state_bytes
    from memfit.measure.pipeline_trace import trace_stage

    cats = trace_stage(spec, rank, pp, microbatches, rows, seq, schedule, "32-true", "sgd", checkpoint)
    groups, size = _stage_shapes(spec, rank, pp, seq)
    shapes = [s for g in groups for s in g]
    shard = sum(size * math.prod(_shard(s, dp)) for s in shapes)
    state = sum(tensor_state_bytes(optimizer, _shard(s, dp), size) for s in shapes)
    whole = sum(size * math.prod(s) for s in shapes)
    buffers = cats["params"] - whole  # the rotary table: unsharded on every rank
    reduce_input = max(dp * sum(size * math.prod(_shard(s, dp)) for s in g) for g in groups)
    schedule_peak = cats["total"] + shard + state
    reduce_peak = cats["params"] + whole + shard + state + shard + reduce_input
    total = max(schedule_peak, reduce_peak)
    at_schedule = schedule_peak >= reduce_peak
    row = {"rank": rank, "stage": rank, "strategy": "pipeline", "engine": "fsdp2", "pp": pp, "dp": dp, "tp": tp,
           "params": shard + buffers, "grads": cats["grads"] if at_schedule else whole + shard,
           "optimizer": state, "activations": cats["activations"] if at_schedule else 0,
           "temporaries": cats["temporaries"] if at_schedule else reduce_input,
           "gathered": whole, "in_flight": 0, "blocks": len(groups) - 1,
           "microbatches_in_flight": microbatches if schedule == "gpipe" else min(microbatches, pp - rank),
           "microbatch_rows": rows, "peak_at": "schedule" if at_schedule else "reduce-scatter"}
    row["total"] = total
    return row


def mesh3d_ranks(spec, batch: int, seq: int | None, world: int, pp: int | None = None, tp: int | None = None,
                 microbatches: int | None = None, schedule: str = "1f1b", precision: str = "32-true",
                 optimizer: str = "adamw", checkpoint: str = "none", accum: int = 1) -> list[dict]:
    """Every rank's row of a 3-D step (see the module docstring), `rank` its global rank; `pp` defaults to
    world / tp (no dp), `tp` to 1 (FSDP2 x pipeline)."""
    from memfit.distributed.mesh3d import check_mesh3d
    from memfit.distributed.pipeline import check_pipeline
    from memfit.measure.fsdp_tp_estimate import tp_rank_spec
    from memfit.measure.parallel_estimate import blocks_of, check_tensor_spec

    tp = tp or 1
    pp = pp or world // tp
    if spec.task not in (None, "causal-lm"):
        raise ConfigError(f"FSDP2 x pipeline cuts a causal LM; this config is a {spec.task} model: use a "
                          "data-parallel strategy (ddp, zero1-3)")
    if spec.config is not None and tp > 1:
        raise ConfigError("--tp with --strategy pipeline --engine fsdp2 shards a Hugging Face config by its tensor "
                          "plan; memfit's GPT is estimated here with --tp 1 (FSDP2 x pipeline)")
    if precision != "32-true" or accum != 1:
        raise ConfigError(f"the FSDP2 x pipeline estimate is for --precision 32-true and --accum 1 (not {precision}, "
                          f"{accum}); change them, or leave out --engine fsdp2 for memfit's pipeline")
    dp = check_mesh3d(world, pp, tp)
    if tp > 1:
        check_tensor_spec(spec, tp, tp)
    m = microbatches or pp
    layers, _ = blocks_of(spec)
    global_batch = batch * world
    if global_batch % dp or (global_batch // dp) % m:
        raise ConfigError(f"a global batch of {global_batch} sequences ({batch} per process) does not split over "
                          f"{dp} replicas and {m} micro-batches; change --batch or --microbatches")
    check_pipeline(layers, pp, global_batch // dp, m, schedule)
    local = tp_rank_spec(spec, tp) if tp > 1 else spec
    stages = [stage_row(local, r, pp, dp, tp, global_batch // dp // m, seq or 128, m, schedule, optimizer,
                        checkpoint) for r in range(pp)]
    # rank = (stage x dp + replica) x tp + tp place: every (dp, tp) place of a stage holds the same
    return [dict(stages[r // (dp * tp)], rank=r, world=world, rows=global_batch // dp) for r in range(world)]
