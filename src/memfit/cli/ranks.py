"""`memfit estimate ... --strategy S --world N`: each distinct rank's figures under a strategy."""
from __future__ import annotations

from typing import Any

from memfit.core.units import format_bytes
from memfit.distributed.rank_memory import RANK_CATEGORIES

COLUMNS = RANK_CATEGORIES + ("total",)


def _ids(ids: list[int]) -> str:
    """Rank ids as ranges: 0-3,5."""
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def print_per_rank(args: Any, est: Any) -> int:
    """The table of est.ranks (memfit.measure.rank_estimate), one row per distinct rank."""
    rows = est.ranks
    per = "process" if est.strategy == "tensor" else "rank"  # a TP rank computes its group's rows
    print(f"{est.model}: --strategy {est.strategy} on {est.world} ranks, batch {est.batch} x seq {est.seq} per "
          f"{per}, {est.precision}, {est.optimizer}, checkpoint {est.checkpoint}")
    print("  " + f"{'ranks':<8}" + "".join(f"{c:>13}" for c in COLUMNS))
    for r in rows:
        label = "each" if len(rows) == 1 else _ids(r["rank_ids"])
        print("  " + f"{label:<8}" + "".join(f"{format_bytes(r[c]):>13}" for c in COLUMNS))
    print("\n  each row's figures are the rank's at its peak moment (they add up to its total)")
    if est.strategy == "pipeline":
        print("  " + "; ".join(f"ranks {_ids(r['rank_ids'])}: {r['blocks']} blocks"
                               + (f" in {r['virtual_stages']} stages" if r.get("virtual_stages") else "")
                               + f", {r['microbatches_in_flight']} "
                               + ("stage " if r.get("virtual_stages") else "")
                               + f"micro-batches of {r['microbatch_rows']} rows in flight" for r in rows))
    elif est.strategy == "tensor":
        r = rows[0]
        print(f"  tp {r['tp']} x dp {r['dp']}: weights, gradients and optimizer state of the attention and "
              "MLP projections sharded over tp")
        if r.get("engine") == "fsdp2":
            print(f"  FSDP2 over dp: each rank holds 1/{r['dp']} of its TP rank's weights, gradients and state, "
                  "gathering a block (gathered) around its forward and backward")
        print(f"  each rank computes its TP group's {r['rows']} rows (tp {r['tp']} x --batch {est.batch}; global batch "
              f"{est.world * est.batch}): for a TP-group micro-batch of b rows give --batch b/{r['tp']}")
        if r.get("sequence_parallel"):
            print("  sequence parallel (Megatron-LM's): every block's saved tensors sharded over tp; estimated only, "
                  "memfit train does not run it")
        if r.get("vocab_parallel"):
            print("  vocabulary parallel: embedding, head and logits split over tp; estimated only, memfit train does "
                  "not run it")
    elif getattr(args, "deepspeed", None) and est.zero == 3:
        print("  gathered: the weights DeepSpeed holds whole; grads: its gradient partition buffer; in_flight: its "
              "IPG bucket and the reduce-scatter's copy (see the note above)")
    else:
        print("  gathered: ZeRO-3's rest + running + prefetched block; in_flight: ZeRO's flat gradient bucket for a "
              "reduce-scatter")
    if est.device_memory is not None:
        verdict = "fits" if est.fits else "does not fit"
        print(f"  each rank {verdict} in {format_bytes(est.device_memory)} (largest rank: {format_bytes(est.total)})")
    return 0
