"""Predicted seconds of one optimizer step under a cluster layout, term by term.

    step_time(layout, unit, model, topology, flops)  -> {"compute": s, "recompute": s, "comm": s,
        "comm_exposed": s, "bubble": s, "offload": s, "total": s, "comm_bytes": bytes sent per rank}

Compute is the FLOP model: forward 2 FLOPs per weight per token plus causal attention
(2 x seq x hidden per token and block, divided over TP), the head's matmul, backward twice the
forward, at `flops` sustained per device (no profile of a cluster exists on this machine, so the
figures are a model, labelled as such). Recompute adds a recomputed block's forward, selective
SELECTIVE_SHARE of it (memfit.plan.costs). Communication is the bytes each strategy sends per rank,
by the ring formulas memfit.distributed.comm counts with, over the group's link
(memfit.plan.cluster_links), a latency per ring step:

    ddp       all-reduce of the gradients once per step (no sync on earlier micro-batches),
              overlapped with the last micro-batch's backward (DDP's buckets)
    zero1     reduce-scatter of the gradients and all-gather of the weights once per step
    zero2     reduce-scatter per micro-batch, all-gather of the weights at the step
    zero3     two all-gathers of the weights per micro-batch (forward and backward), overlapped with
              compute by the prefetch, and a reduce-scatter per micro-batch
    tensor    per block and micro-batch two all-reduces of the hidden states forward, two backward
              (two more forward for a recomputed block); not overlapped; dp all-reduce at the step
    pipeline  each stage's output forward and its gradient backward per micro-batch; the bubble:
              (stages - 1) micro-batch slots of the slowest stage; dp all-reduce at the step;
              interleaved 1F1B (V stages a rank): V times the sends, slots of one virtual stage
              (1/V of the rank's blocks), so a bubble of (stages - 1) / V slots

Optimizer offload adds the gradients' trip to the host and the weights' back at HOST_BW.

On this machine's CPU (`host`, memfit.plan.cluster_host): a fixed cost per block and micro-batch
beside the FLOPs, the pipeline schedule's per micro-batch and stage (a longer slot: the bubble's
too), and the ranks share its cores: the step is no shorter than every rank's busy time
times its threads over the cores they get (its cores times the measured share other work leaves);
the difference is the "cores" term (zero with an idle core per thread).
The optimizer step's fixed cost, measured apart, is counted once per step, for the weights a rank
updates (the fullest stage's; ZeRO's shard).
With no core to spare, no communication overlaps (gloo computes on the cores the ranks use).
"""
from __future__ import annotations

from memfit.plan.cluster_host import Host
from memfit.plan.cluster_links import Topology, ring_seconds
from memfit.plan.cluster_memory import Layout, rank_peaks, stage_sizes
from memfit.plan.cluster_unit import UnitProfile
from memfit.plan.costs import HOST_BW, SELECTIVE_SHARE

BUCKET = 25 * 2**20
"""DDP's default gradient bucket: one all-reduce (and its latency) per bucket."""


def _grad_bytes(lay: Layout, numel: int) -> int:
    return numel * (4 if lay.precision in ("32-true", "bf16-mixed", "16-mixed") else 2)


def _flops(cfg, unit: UnitProfile, seq: int, tp: int) -> tuple[float, float]:
    """(one block's forward, the head's forward) FLOPs per sequence on one TP rank."""
    block = 2 * unit.block_numel * seq + 2 * seq * seq * cfg.hidden / tp
    head = 2 * cfg.hidden * cfg.vocab * seq
    return block, head


def _dp_sync(lay: Layout, topo: Topology, numel: int, mb_backward: float) -> tuple[float, float, int]:
    """(seconds, exposed seconds, bytes sent) of the data-parallel gradient traffic per step."""
    n, g, w = lay.dp, _grad_bytes(lay, numel), _grad_bytes(lay, numel)
    if n <= 1:
        return 0.0, 0.0, 0
    link = topo.group_link(n, lay.tp * lay.pp)
    frac = (n - 1) / n
    if lay.strategy in ("ddp", "tensor", "pipeline"):
        sent = 2 * g * frac
        t = ring_seconds(link, sent, n, steps=2 * max(1, -(-g // BUCKET)))
        exposed = max(t - mb_backward, 0.0) if lay.strategy == "ddp" else t
        return t, exposed, int(sent)
    if lay.zero == 1:
        sent = (g + w) * frac
        t = ring_seconds(link, sent, n, steps=2)
        return t, t, int(sent)
    if lay.zero == 2:
        sent = g * frac * lay.accum + w * frac
        t = ring_seconds(link, sent, n, steps=lay.accum + 1)
        return t, t, int(sent)
    rs, ag = g * frac * lay.accum, 2 * w * frac * lay.accum
    t_rs = ring_seconds(link, rs, n, steps=lay.accum)
    t_ag = ring_seconds(link, ag, n, steps=2 * lay.accum)
    return t_rs + t_ag, t_rs + max(t_ag - lay.accum * 3 * mb_backward / 2, 0.0), int(rs + ag)


def step_time(lay: Layout, unit: UnitProfile, cfg, seq: int, topo: Topology, flops: float,
              host: Host | None = None) -> dict:
    block_f, head_f = _flops(cfg, unit, seq, lay.tp)
    sizes = stage_sizes(cfg.layers, lay.pp)
    act = unit.boundary  # bytes of one sequence's hidden states
    per_stage, recompute = [], 0.0
    for r, k in enumerate(sizes):
        keep, sel, rec = lay.counts[r] if r < len(lay.counts) else (k, 0, 0)
        fwd = k * block_f + (head_f if r == lay.pp - 1 else 0)
        extra = (rec + SELECTIVE_SHARE * sel) * block_f
        # fixed seconds per block, forward and backward (a forward: a third); DTensor's two pairs under TP
        fixed = (host.overhead_s + (2 * host.tp_pair_s if lay.tp > 1 else 0.0)) if host else 0.0
        per_stage.append((3 * fwd + extra) * lay.rows / flops + fixed * (k + (rec + SELECTIVE_SHARE * sel) / 3))
        recompute = max(recompute, extra * lay.rows / flops + fixed * (rec + SELECTIVE_SHARE * sel) / 3)
    mb = max(per_stage)  # one micro-batch on the slowest stage
    comm, exposed, sent = 0.0, 0.0, 0
    if lay.tp > 1:  # the hidden states all-reduced over TP, per block of the (fullest) stage
        rec = max((c[2] for c in lay.counts), default=0)
        n_ar = 4 * max(sizes) + 2 * rec
        size = 2 * lay.rows * act * (lay.tp - 1) / lay.tp
        t = ring_seconds(topo.group_link(lay.tp), size * n_ar, lay.tp, steps=2 * n_ar)
        comm, exposed, sent = comm + t * lay.accum, exposed + t * lay.accum, sent + int(size * n_ar * lay.accum)
    v = lay.virtual_stages if lay.schedule == "interleaved" else 1
    if lay.pp > 1:  # a stage's output forward and its gradient backward, per micro-batch (and virtual stage)
        size = 2 * lay.rows * act
        t = ring_seconds(topo.group_link(lay.pp, lay.tp), size, 2, steps=1) * v
        comm, exposed, sent = comm + t * lay.accum, exposed + t * lay.accum, sent + int(size * lay.accum * v)
    numel = unit.block_numel * max(sizes) + unit.rest_numel
    t, e, s = _dp_sync(lay, topo, numel, mb * 2 / 3)
    comm, exposed, sent = comm + t, exposed + e, sent + s
    # the pipeline schedule's own cost per micro-batch and stage is in every slot, the bubble's too;
    # measured as wall time with the ranks sharing the cores, so it stays out of their busy time
    # (interleaved: a 1F1B cost for each of the rank's V stages)
    schedule = v * host.microbatch_s(lay.schedule) if host and lay.strategy == "pipeline" and lay.pp > 1 else 0.0
    if lay.strategy == "pipeline":  # interleaved: a bubble slot is one virtual stage's, 1/V of the rank's
        compute, bubble = lay.accum * (mb + schedule), (lay.pp - 1) * (mb + schedule) / v
    else:
        compute, bubble = lay.accum * mb, 0.0
    opt = host.step_s_per_elem * numel / (lay.dp if lay.zero else 1) if host else 0.0  # once per step
    if host and lay.tp > 1:  # the step over DTensors: four sharded matrices a block
        opt += host.tp_param_step_s * 4 * max(sizes)
    compute += opt
    offload = 0.0
    if lay.offload_optimizer:
        row = rank_peaks(Layout(**{**lay.__dict__, "offload_optimizer": None}), unit, cfg.layers)[0]
        offload = 2 * (row["grad_bytes"] + row["params"]) / HOST_BW
    if host is not None and lay.gpus * host.threads >= host.cores:
        exposed = comm  # gloo's copies and reductions run on the cores the compute uses: nothing hides them
    cores = 0.0
    if host is not None:  # every rank's busy seconds over the cores they share
        busy = (lay.dp * lay.accum * sum(per_stage) if lay.strategy == "pipeline" else lay.gpus * lay.accum * mb) \
            + lay.gpus * opt
        waits = (lay.accum + (lay.pp - 1) / v) * schedule
        cores = max(busy * host.threads / (host.cores * host.core_share) - (compute + bubble - waits), 0.0)
    total = compute + bubble + exposed + offload + cores
    return {"compute": compute - lay.accum * recompute, "recompute": lay.accum * recompute, "comm": comm,
            "comm_exposed": exposed, "bubble": bubble, "offload": offload, "cores": cores, "total": total,
            "comm_bytes": sent}
