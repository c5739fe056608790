"""How long `memfit.fit` takes on a mid-size model: a 676M memfit GPT (16 layers, hidden 1792, 14 heads,
vocab 32000), batch 4 x 1024, budget 4 GiB, every `allow` name, 32-true asked, device cpu.

    .venv/bin/python bench/fit_speed.py [--rounds 5]     # bench/results/fit_speed.json

Each round plans in a fresh process (in-process profile caches would make later rounds free), timing
memfit.fit alone (wall and the process's CPU seconds, imports excluded) and recording the plan, which
must be the same in every round. One contender, so there is nothing to interleave.
"""
from __future__ import annotations

import argparse
import itertools
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load, run_fresh, save, spread  # noqa: E402

SPEC = "gpt:layers=16,hidden=1792,heads=14,vocab=32000,seq=1024"
ALLOW = "recompute,selective,offload-cpu,offload-disk,accumulate,chunked-head,optimizer-offload,precision"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one(out: str) -> None:
    """One plan in this process; writes its seconds and the plan to `out`."""
    import torch

    import memfit
    from memfit.models.spec import parse_model

    with torch.device("meta"):
        model = parse_model(SPEC).build()
    x = torch.zeros(4, 1024, dtype=torch.long)
    t0, c0 = time.perf_counter(), _cpu()
    plan = memfit.fit(model, (x, x), budget=4 * 2**30, optimizer="adamw", precision="32-true", allow=ALLOW,
                      device="cpu")
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    got = {"wall": wall, "cpu": cpu, "actions": [str(a) for a in plan.actions], "precision": plan.precision,
           "micro_batch": plan.micro_batch, "offload_optimizer": plan.offload_optimizer,
           "head_chunks": plan.head_chunks, "predicted_peak": plan.predicted_peak}
    Path(out).write_text(json.dumps(got))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.out:
        one(args.out)
        return
    runs = []
    for i in range(args.rounds):
        before = load()
        r = run_fresh(Path(__file__), [])
        if "error" in r:
            raise SystemExit(r["error"])
        runs.append({**r, "load_before": before, "load_after": load()})
        print(f"round {i + 1}: {r['wall']:.1f} s wall, {r['cpu']:.1f} s CPU, load {before[0]:.2f}", flush=True)
    plans = {json.dumps({k: v for k, v in r.items() if k not in ("wall", "cpu", "load_before", "load_after")})
             for r in runs}
    assert len(plans) == 1, "the plan changed between rounds"
    wall, cpu = spread([r["wall"] for r in runs]), spread([r["cpu"] for r in runs])
    path = save("fit_speed", {"spec": SPEC, "allow": ALLOW, "wall": wall, "cpu": cpu, "plan": json.loads(plans.pop()),
                              "runs": runs})
    print(f"memfit.fit: {wall['median']:.1f} ({wall['min']:.1f}-{wall['max']:.1f}) s wall, "
          f"{cpu['median']:.1f} ({cpu['min']:.1f}-{cpu['max']:.1f}) s CPU; {path}")


def render(result: dict) -> str:
    """docs/BENCHMARKS.md section."""
    m, w, c, plan = result["machine"], result["wall"], result["cpu"], result["plan"]
    actions = plan.get("actions", [])
    runs = [f"{a}*{sum(1 for _ in g)}" for a, g in itertools.groupby(actions)]
    return "\n".join([
        "## fit_speed: how long memfit.fit plans a 676M GPT", "",
        "`.venv/bin/python bench/fit_speed.py --rounds 5`", "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}; run {result.get('date')}. "
        f"`{result['spec']}`, batch 4 x 1024, budget 4 GiB, allow `{result['allow']}`; each round in a fresh "
        f"process, memfit.fit alone timed; load {result['run']['load_start'][0]:.1f} at the start.", "",
        "| rounds | wall s, median (min-max) | CPU s, median (min-max) | plan (same every round) |",
        "|---:|---:|---:|---|",
        f"| {len(w['times'])} | {w['median']:.1f} ({w['min']:.1f}-{w['max']:.1f}) | "
        f"{c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f}) | {plan.get('precision')}, optimizer offload "
        f"{plan.get('offload_optimizer')}, `{','.join(runs)}` |", ""])


if __name__ == "__main__":
    main()
