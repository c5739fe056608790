"""`memfit plan`: the fastest configuration that fits a byte budget, ranked candidates and the chosen plan."""
from __future__ import annotations

import argparse
import json

from memfit.cli.options import add, add_model, model_of
from memfit.core.units import format_bytes
from memfit.plan.costs import PlanError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="find the fastest configuration that fits a memory budget",
                       description="Choose per-block activation actions (keep / selective / recompute / segments), "
                       "micro-batch x accumulation and optimizer offload so the predicted peak fits --budget; "
                       "prints the ranked configurations and the chosen plan. Exit code 2 when nothing fits.")
    add_model(p)
    p.add_argument("--budget", required=True, metavar="SIZE", help="device memory budget, e.g. 8GiB or 300MiB")
    add(p, "batch", default=None, shown="1; 256 with --gpus", help="global batch per step")
    add(p, "seq", default=None, shown="the model's, at most 4096")
    add(p, "precision", default="32-true")
    add(p, "optimizer", default="adamw")
    add(p, "device", default=None, shown="cuda when available", help="where the model will train: cpu, cuda")
    p.add_argument("--allow", metavar="LIST", help="comma list of what the plan may use (default: recompute, selective, "
                   "offload-cpu, offload-disk, accumulate, chunked-head, optimizer-offload; on a CPU device without "
                   "offload-cpu and optimizer-offload, which save no physical memory there)")
    p.add_argument("--profile", action="store_true",
                   help="time blocks on this machine (memfit profile, cached) instead of the FLOP time model")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking the chosen plan with a full trace of the step")
    add(p, "json", help="print one JSON object with a `plan` field (for memfit train --plan)")
    from memfit.cli.plan_cluster import add_flags

    add_flags(p)
    return p


def run(args: argparse.Namespace) -> int:
    from memfit.core.device import resolve_device
    from memfit.plan.fit import fit

    args.model = model_of(args)
    device = resolve_device(args.device).type
    if args.gpus is not None:  # several devices: memfit.plan.cluster_fit
        from memfit.cli.plan_cluster import run_cluster

        return run_cluster(args, args.model, "cuda" if args.device is None else device)
    batch = args.batch or 1
    costs = None
    if args.profile:
        from memfit.plan.costs import parse_budget
        from memfit.plan.plan import parse_allow
        from memfit.profile.measure import profile

        parse_budget(args.budget), parse_allow(args.allow)  # fail on bad input before measuring
        costs = profile(args.model, batch=batch, seq=args.seq, precision=args.precision,
                        optimizer=args.optimizer).blocks
    try:
        plan = fit(args.model, budget=args.budget, optimizer=args.optimizer, precision=args.precision,
                   allow=args.allow, batch=batch, seq=args.seq, verify=args.verify, costs=costs,
                   device=device)
    except PlanError as exc:  # name the smallest cluster that would fit
        from memfit.cli.plan_cluster import smallest_cluster_hint

        hint = smallest_cluster_hint(args, args.model, "cuda" if args.device is None else device)
        raise PlanError(str(exc) + hint) from None
    if args.json:
        print(json.dumps({"plan": plan.to_json()}, indent=1))
        return 0
    print(f"  {'micro x accum':<15}{'offload':<9}{'precision':<13}{'head':>6}{'peak':>14}{'time':>11}  actions")
    for c in plan.ranked:
        peak = "refused" if c.refused else format_bytes(c.peak) if c.feasible else "does not fit"
        time = f"{c.time * 1000:.1f} ms" if c.feasible else ""
        print(f"  {f'{c.micro_batch} x {c.accumulation}':<15}{c.offload_optimizer or '-':<9}{c.precision:<13}"
              f"{c.head_chunks or '-':>6}{peak:>14}{time:>11}  {c.actions}")
    print()
    print(plan.summary())
    return 0
