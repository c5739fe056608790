"""`memfit plan MODEL --budget 80GiB --gpus N|auto`: the cluster planner's flags, table and chosen plan."""
from __future__ import annotations

import argparse
import json

from memfit.cli.args import integer
from memfit.core.units import format_bytes


def _gpus(text: str) -> int | str:
    if text == "auto":
        return text
    return integer(1, 4096)(text)


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several devices (a cluster plan; docs/planner.md, 'Cluster plans')")
    g.add_argument("--gpus", type=_gpus, metavar="N|auto",
                   help="plan for N devices of --budget each, or auto: the smallest count that fits and the "
                   "fastest plan there; --batch is then the global batch (default 256)")
    g.add_argument("--interconnect", metavar="LINK", help="nvlink, pcie, ib, measured (with --device cpu: "
                   "gloo here and the compute, measured once and cached) or a bandwidth in GB/s (default nvlink)")
    g.add_argument("--cores", type=integer(1, 4096), metavar="C", help="with --device cpu: the CPU cores the "
                   "ranks share (default: this machine's)")
    g.add_argument("--nodes", type=integer(1, 4096), metavar="K", help="the devices over K nodes (default 8 a node); "
                   "groups that span nodes run at InfiniBand's speed")


def run_cluster(args: argparse.Namespace, model: str, device: str, emit=None) -> int:
    from memfit.plan.cluster_fit import plan_cluster

    cp = plan_cluster(model, args.budget, args.gpus, interconnect=args.interconnect, nodes=args.nodes,
                      batch=args.batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer,
                      allow=args.allow, device=device, verify=args.verify, cores=args.cores,
                      host_memory=args.host_memory)
    if args.json:
        print(json.dumps({"plan": cp.plan, "cluster": cp.to_json()}, indent=1))
        return 0
    if emit is not None and not args.emit_to:  # stdout is the config
        return emit({"plan": cp.plan, "cluster": cp.to_json()}, args)
    print(table(cp.ranked))
    if cp.by_count:
        print("\n  best plan by device count (" + cp.time_basis.split(":")[0] + "):")
        for c in cp.by_count:
            print(f"  {c['gpus']:>6} devices  {c['strategy']:<9}{c['degrees']:<36}{format_bytes(c['peak']):>12}"
                  f"{c['tokens_per_s']:>14,.0f} tok/s{c['tokens_per_s_per_device']:>11,.0f} per device")
    print()
    print(cp.summary())
    if emit is not None:
        print()
        return emit({"plan": cp.plan, "cluster": cp.to_json()}, args)
    return 0


def table(rows: list[dict], limit: int = 12) -> str:
    head = (f"  {'strategy':<10}{'degrees':<37}{'micro x accum':<15}{'offload':<9}{'head':>5}{'peak/rank':>12}"
            f"{'step s':>10}{'tokens/s':>13}{'comm/step':>12}  blocks (keep/sel/rec)")
    out = [head]
    for r in _with_each_kind(rows, limit):
        step = f"{r['step_s']:.3g}" if r["feasible"] else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r["feasible"] else "does not fit"
        acts = " | ".join("/".join(map(str, c)) for c in r["counts"][:2]) + (" ..." if len(r["counts"]) > 2 else "")
        out.append(f"  {r['strategy']:<10}{r['degrees']:<37}{str(r['micro_batch']) + ' x ' + str(r['accumulation']):<15}"
                   f"{r['offload_optimizer'] or '-':<9}{r['head_chunks'] or '-':>5}{format_bytes(r['peak']):>12}"
                   f"{step:>10}{tps:>13}"
                   f"{format_bytes(r['comm_bytes']):>12}  {acts}")
    return "\n".join(out)


def _with_each_kind(rows: list[dict], limit: int) -> list[dict]:
    """The first `limit` rows, then the first of each strategy (pipeline: and schedule) not among them."""
    from memfit.plan.cluster_fit import first_of_each

    return first_of_each(rows, limit, lambda r: (r["strategy"], "gpipe" in r["degrees"]))


def smallest_cluster_hint(args: argparse.Namespace, model: str, device: str) -> str:
    """For the fit report when nothing fits one device: the smallest cluster that would, or ''."""
    from memfit.core.errors import MemfitError
    from memfit.plan.cluster_fit import plan_cluster
    from memfit.plan.cluster_plan import degrees

    try:
        # memory alone decides the hint: no link probe or compute calibration on a CPU device
        cp = plan_cluster(model, args.budget, "auto", interconnect=args.interconnect or "nvlink", nodes=args.nodes,
                          batch=args.batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer,
                          allow=args.allow, device=device, verify=False, flops=1e11, host_memory=args.host_memory)
    except MemfitError:
        return ""
    lay = cp.lay
    return (f"; or several devices: the smallest cluster that fits is {cp.gpus} devices of "
            f"{format_bytes(cp.budget)}, {lay.strategy} "
            f"({degrees(lay)}), predicted peak {format_bytes(cp.peak)} per rank at a global batch of "
            f"{cp.global_batch}: memfit plan {model} --budget {args.budget} --gpus auto"
            + ("" if args.batch else f" --batch {cp.global_batch}"))
