"""Interleaved 1F1B: each of the pp pipeline ranks runs V virtual stages, run by torch's
ScheduleInterleaved1F1B (Narayanan et al. 2021, "depth first").

    check_interleaved(layers=8, pp=2, microbatches=4, virtual=2)   # refuses what torch's schedule refuses
    virtual_stage_ids(rank=1, pp=2, virtual=2)                     # [1, 3]: stage i runs on rank i % pp
    rank_order(pp=2, virtual=2, microbatches=4, rank=0)            # [("F", 0, 0), ..., ("B", 0, 3)]

The model is cut evenly into pp x V stages of contiguous blocks; rank r holds stages r, r + pp, ...,
so the first stage (embeddings) is on rank 0 and the last (final norm, head) on rank pp - 1, as with
one stage per rank. Each rank's bubble shrinks V times, at the price of V times the P2P messages and
of holding, at its peak, more micro-batch-stages' activations than 1F1B's pp - r micro-batches
(rank_order gives the order; the estimate traces it, memfit.measure.pipeline_trace).

torch's rule (ScheduleInterleaved1F1B.__init__): rounds = max(1, M // pp) and M must be a multiple
of rounds (M = 10 on 4 ranks runs, M = 5 on 2 ranks does not). ScheduleInterleavedZeroBubble splits
each backward into an input part (autograd.grad, the graph retained) and a later weight part, so
a micro-batch-stage's saved tensors outlive its input backward; memfit does not run it (docs/distributed.md,
"Interleaved 1F1B", says why).
"""
from __future__ import annotations

import torch.nn as nn

from memfit.core.errors import ConfigError

DEFAULT_VIRTUAL = 2
"""Virtual stages per rank when the interleaved schedule is asked for without a count."""


def virtual_stages_of(schedule: str, virtual: int | None) -> int:
    """Stages per rank: `virtual` (default DEFAULT_VIRTUAL) for the interleaved schedule, 1 for the others."""
    if schedule == "interleaved":
        return DEFAULT_VIRTUAL if virtual is None else virtual
    if virtual not in (None, 1):
        raise ConfigError(f"--virtual-stages {virtual} needs --schedule interleaved (gpipe and 1f1b run one stage "
                          "per rank); add --schedule interleaved or drop --virtual-stages")
    return 1


def check_interleaved(layers: int, pp: int, microbatches: int, virtual: int) -> None:
    """What torch's interleaved schedule and memfit's even cut need (every rank, before any group)."""
    if pp < 2:
        raise ConfigError(f"the interleaved schedule passes activations between ranks: it needs at least 2 pipeline "
                          f"stages' ranks, got {pp}; use more processes (or fewer replicas), or --schedule 1f1b")
    n = pp * virtual
    if virtual < 1 or layers % n:
        raise ConfigError(f"{layers} blocks do not split evenly into {pp} ranks x {virtual} virtual stages = {n} "
                          f"stages; use --virtual-stages V with {layers} divisible by {pp} x V")
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        good = sorted({m for m in range(1, 2 * microbatches + 1) if m % max(1, m // pp) == 0} - {microbatches},
                      key=lambda m: abs(m - microbatches))[:3]
        raise ConfigError(f"torch's interleaved 1F1B runs {microbatches} micro-batches in max(1, {microbatches} // "
                          f"{pp}) = {rounds} rounds, which must divide them; use --microbatches "
                          f"{' or '.join(str(m) for m in sorted(good))}")


def virtual_stage_ids(rank: int, pp: int, virtual: int) -> list[int]:
    """The stages rank `rank` runs, in order (stage i on rank i % pp)."""
    return [rank + k * pp for k in range(virtual)]


def rank_order(pp: int, virtual: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """The forwards ("F") and full backwards ("B") rank `rank` runs, as (kind, stage, micro-batch), in
    torch's own order (ScheduleInterleaved1F1B computes every rank's list without a process group)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    plan = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    rounds = max(1, microbatches // pp)
    plan.n_local_stages, plan.pp_group_size, plan._n_microbatches = virtual, pp, microbatches
    plan.number_of_rounds, plan.microbatches_per_round = rounds, microbatches // rounds
    out = []
    for action in plan._calculate_single_rank_operations(rank):
        if action is not None:
            kind = "F" if action.computation_type == _ComputationType.FORWARD else "B"
            out.append((kind, action.stage_index, action.microbatch_index))
    return out


def peak_held(order: list[tuple[str, int, int]]) -> int:
    """The most (stage, micro-batch) forwards whose backward has not run, at any point of `order`."""
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


class StageGroup(nn.Module):
    """A rank's stages (interleaved) as one module: their parameters once, their blocks in order."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        object.__setattr__(self, "blocks", nn.ModuleList(b for p in parts for b in p.blocks))  # not an owner

    def forward(self, *args, **kwargs):
        raise RuntimeError("a rank's stages run one by one in the pipeline schedule, not as one module")
