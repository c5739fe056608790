"""Each rank's peak under torch's FSDP2 (`fully_shard` on every repeated block, then the root), as
torchtitan, accelerate, Lightning and the HF Trainer run it.

    est = memfit.estimate(spec, batch=4, seq=128, strategy="zero3", world=8, engine="fsdp2")     # True
    est = fsdp2_estimate(memfit.estimate, spec, 4, 128, 8, precision="bf16-mixed", reshard=2)  # any
    est.per_device["total"], est.ranks

memfit's zero3 figures (memfit.measure.rank_estimate: each rank's weight, gradient and optimizer
slices, the gathered root and two gathered blocks, one block's gradients in flight, activations from
the one-device trace of the rank's micro-batch) with what FSDP2 does differently
(memfit.distributed.rank_memory, engine "fsdp2"):

- a step counter per parameter tensor (memfit's engine keeps one per flat bucket);
- between the blocks, the flat all-gather buffer of the block FSDP2 gathers next: at the head's
  backward everything the forward saved is still there, with the root's gathered weights and the last
  block gathered again for its backward;
- reshard_after_forward (`reshard`): True frees a block's gathered weights after its forward; False
  keeps them whole to its backward (Trainer's fsdp="shard_grad_op"); an int N keeps a 1/N shard of
  them (each weight's first dimension padded to a multiple of N, as FSDP2 shards it; that shard is the
  all-gather's input, freed only once the gathered copy is in place, so at the head's backward every
  block's is there). What a block keeps is counted at every moment until its backward (rank_memory's
  post_forward);
- bf16 (MixedPrecisionPolicy): the fp32 shard is the only copy kept (cast into the all-gather per
  use), where memfit's bf16-master keeps a bf16 shard beside an fp32 master (fsdp2_states).

Checked per rank against torch's MemTracker on gloo ranks (bench/fsdp2_layouts.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from memfit.core.errors import ConfigError

PRECISIONS = {"32-true": "32-true", "bf16-mixed": "bf16-master", "bf16-master": "bf16-master", "bf16-true": "bf16-true"}
"""FSDP2's precision as the user names it -> the memfit mode whose trace it runs (bf16: MixedPrecisionPolicy
gathering bf16 weights over fp32 shards, gradients reduced in fp32; bf16-true: bf16 shards, no master)."""


def check_reshard(reshard: Any, world: int) -> bool | int:
    """reshard_after_forward as FSDP2 takes it: True, False, or an int N dividing `world` (N == world is
    True, N == 1 is False, as torch reads them). Anything else: one line naming what works."""
    if isinstance(reshard, bool):
        return reshard
    if isinstance(reshard, int) and 1 <= reshard <= world and world % reshard == 0:
        return True if reshard == world else False if reshard == 1 else reshard
    raise ConfigError(f"reshard_after_forward={reshard!r} on {world} ranks: give true, false, or a divisor of "
                      f"the world size (e.g. the GPUs of one node)")


def post_forward_bytes(model: torch.nn.Module, reshard: bool | int, weight_bytes: int) -> int:
    """The bytes of the largest block's weights a rank keeps from the block's forward to its backward."""
    from memfit.apply.checkpoint import find_blocks

    if reshard is True:
        return 0
    n = 1 if reshard is False else int(reshard)
    per_block = [sum(math.ceil(p.shape[0] / n) * (p.numel() // max(p.shape[0], 1)) if p.dim() else 1
                     for p in block.parameters()) for block in find_blocks(model)]
    return weight_bytes * max(per_block, default=0)


def fsdp2_states(est: Any) -> None:
    """FSDP2's mixed precision keeps the fp32 shard only (cast into the all-gather buffer per use);
    memfit's bf16-master keeps a bf16 shard beside its fp32 master. Each rank's params become the
    fp32 master (out of optimizer), and the bf16 shard goes: the total drops by it at every moment."""
    from memfit.measure.rank_estimate import per_device

    for row in est.ranks:
        bf16 = row["params"]
        row["params"] += bf16  # the fp32 shard: twice the bf16 one's bytes
        row["optimizer"] -= 2 * bf16
        row["total"] -= bf16
    est.ranks.sort(key=lambda r: (-r["total"], r["rank_ids"][0]))
    est.per_device = per_device(est.ranks[0])


def fsdp2_estimate(estimate: Callable[..., Any], spec: Any, batch: int, seq: int | None, world: int, *,
                   precision: str = "32-true", optimizer: str = "adamw", checkpoint: str = "none", reshard: Any = True,
                   **kw: Any) -> Any:
    """memfit's Estimate of one FSDP2 rank (per_device: the largest rank; ranks: each distinct one).
    `estimate`: memfit.measure.estimate.estimate (passed in: that module calls this one); `kw` its other
    options (device, device_memory)."""
    from memfit.measure.rank_estimate import with_ranks

    if world < 2:
        raise ConfigError(f"FSDP2 over {world} process: give --world 2 or more")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} under FSDP2 is not estimated: give one of "
                          f"{', '.join(PRECISIONS)} (fp16 needs a loss scaler FSDP2 does not have)")
    mode = PRECISIONS[precision]
    reshard = check_reshard(reshard, world)
    one = estimate(spec, batch=batch, seq=seq, precision=mode, optimizer=optimizer, checkpoint=checkpoint, **kw)
    if not one.traced:
        raise ConfigError("an FSDP2 estimate traces the model; give a model, not a parameter count alone")
    kept = post_forward_bytes(spec.on_meta(one.seq), reshard, 4 if mode == "32-true" else 2)  # the gathered dtype
    est = with_ranks(one, spec, "zero3", world, engine="fsdp2", post_forward=kept, kept_whole=reshard is False)
    if mode == "bf16-master":
        fsdp2_states(est)
    if est.device is not None and est.reserve_overhead is not None:  # a GPU target: its reserve, again
        est.per_device["reserved"] = est.per_device["total"] + est.reserve_overhead
    kept_how = {True: "resharded after forward", False: "kept whole from forward to backward"}.get(
        reshard, f"kept as 1/{reshard} shards from forward to backward")
    est.note = (f"torch FSDP2 (fully_shard per block, then the root), {precision}: each block's weights "
                f"{kept_how}")
    return est
