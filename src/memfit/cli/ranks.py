"""`memfit estimate ... --strategy S --world N`: each rank's figures under a data-parallel strategy."""
from __future__ import annotations

import json
from typing import Any

from memfit.cli.options import model_of
from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes

COLUMNS = ("params", "gathered", "grads", "in_flight", "optimizer", "activations", "temporaries", "total")


def per_rank(args: Any, est: Any) -> list[dict]:
    """Rows for every rank: model states from the strategy's shard layout, activations and
    temporaries from the one-device trace of the per-rank micro-batch (`est`)."""
    from memfit.distributed.rank_memory import rank_model_state, rank_totals
    from memfit.models.spec import parse_model

    if not est.traced:
        raise ConfigError("--strategy needs a model to trace (not --params): give a model name or spec")
    spec = parse_model(model_of(args))
    if args.strategy in ("pipeline", "tensor"):  # model parallel: memfit.measure.parallel_estimate
        from memfit.measure.parallel_estimate import pipeline_ranks, tensor_ranks

        if spec.config is None:
            raise ConfigError(f"--strategy {args.strategy} cuts memfit's GPT; give a gpt:/llama: spec or a known "
                              "name, not a Hugging Face config")

        common = dict(precision=args.precision, optimizer=args.optimizer, checkpoint=args.checkpoint)
        if args.strategy == "pipeline":
            return pipeline_ranks(spec, est.batch, est.seq, args.world, args.microbatches, args.schedule, **common)
        return tensor_ranks(spec, est.batch, est.seq, args.world, args.tp, **common)
    rows = rank_model_state(spec.on_meta(est.seq), args.strategy, args.world, args.precision, args.optimizer)
    return rank_totals(rows, est.per_device, est.module_activations, est.batch * est.seq)


def print_per_rank(args: Any, est: Any) -> int:
    rows = per_rank(args, est)
    budget = est.device_memory
    if budget is not None:
        for r in rows:
            r["fits"] = r["total"] <= budget
    if args.json:
        print(json.dumps({"estimate": est.to_json(), "ranks": rows}, indent=1))
        return 0
    print(f"{est.model}: --strategy {args.strategy} on {args.world} ranks, batch {est.batch} x seq {est.seq} per "
          f"rank, {est.precision}, {est.optimizer}")
    print("  " + f"{'rank':<6}" + "".join(f"{c:>13}" for c in COLUMNS))
    shown = rows if len({r['total'] for r in rows}) > 1 else rows[:1]  # ranks that differ are listed apart
    for r in shown:
        label = str(r["rank"]) if len(shown) > 1 else "each"
        print("  " + f"{label:<6}" + "".join(f"{format_bytes(r[c]):>13}" for c in COLUMNS))
    if args.strategy == "pipeline":
        print("\n  " + "; ".join(f"rank {r['rank']}: {r['blocks']} blocks, {r['microbatches_in_flight']} micro-batches "
                                 f"of {r['microbatch_rows']} rows in flight" for r in rows))
    elif args.strategy == "tensor":
        print(f"\n  tp {rows[0]['tp']} x dp {rows[0]['dp']}: weights, gradients and optimizer state of the attention and "
              "MLP projections sharded over tp")
    else:
        print("\n  gathered: ZeRO-3's rest + running + prefetched block; in_flight: ZeRO's flat gradient bucket for a reduce-scatter")
    if budget is not None:
        worst = max(r["total"] for r in rows)
        verdict = "fits" if worst <= budget else "does not fit"
        print(f"  each rank {verdict} in {format_bytes(budget)} (largest rank: {format_bytes(worst)})")
    return 0
