"""Planner benchmark: memfit's plan against the best uniform checkpoint policy, at budgets from the
smallest feasible to the no-checkpoint peak. Measured peak (memfit's tracker on real steps) and step
time (median of shuffled, interleaved rounds).

    python bench/planner.py --quick        # small 12-block GPT (minutes)
    python bench/planner.py                # GPT-2-small shape (12 blocks, hidden 768) at seq 128

torch.compile's activation_memory_budget and torch.distributed._tools.sac_ilp are not run here:
see docs/planner.md for why.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import fmt_bytes, save  # noqa: E402

UNIFORM = ["none", "every:4", "every:3", "every:2", "sqrt", "selective", "full"]


def _step(model, opt, x):
    # The step the planner plans (memfit.measure.trace): logits are dropped before backward.
    from memfit.measure.trace import _loss

    with opt.autocast():
        loss = _loss(model, x)
    opt.backward(loss)
    opt.step()


class Runner:
    """One model per policy, warmed up; step() times one step; peak() measures one with the tracker."""

    def __init__(self, spec, policy, batch: int, seq: int) -> None:
        import memfit
        from memfit.apply.optimizer import TrainingOptimizer

        torch.manual_seed(0)
        self.model = spec.build(seq=seq)
        memfit.checkpoint(self.model, policy)
        self.opt = TrainingOptimizer(self.model, "adamw", lr=1e-4)
        self.x = torch.randint(0, spec.config.vocab, (batch, seq))
        _step(self.model, self.opt, self.x)

    def step(self) -> float:
        t0 = time.perf_counter()
        _step(self.model, self.opt, self.x.clone())
        return time.perf_counter() - t0

    def peak(self) -> int:
        import memfit

        with memfit.track(self.model, self.opt) as t:
            x = self.x.clone()
            _step(self.model, self.opt, x)
        return t.peak_bytes


def run(quick: bool, rounds: int) -> dict:
    from memfit.measure.blocks import chain_profile, spec_source
    from memfit.models.spec import parse_model
    from memfit.apply.policy import resolve_policy
    from memfit.plan.fit import fit
    from memfit.plan.solve import solve
    from memfit.measure.compose import BASE_ACTIONS

    name = "gpt:layers=12,hidden=64,heads=4,vocab=256,seq=128" if quick else "gpt2"
    batch, seq = (4, 128) if quick else (1, 128)
    spec = parse_model(name)
    t0 = time.perf_counter()
    prof = chain_profile(spec_source(spec, batch, seq), "32-true", "adamw")
    n = spec.config.layers
    none_peak = prof.peak_of(resolve_policy("none", n))
    lo, hi = 0, none_peak
    cost = lambda b, k: 0.0  # noqa: E731
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if solve(prof, mid, BASE_ACTIONS, cost, n_blocks=n) is None else (lo, mid)
    budgets = [round(hi + (none_peak - hi) * i / 5) for i in range(6)]
    uniform_peaks = {p: prof.peak_of(resolve_policy(p, n)) for p in UNIFORM}
    from memfit.profile.measure import profile

    costs = profile(name, batch=batch, seq=seq, use_cache=False).blocks  # this machine's block costs
    plans, solve_s = {}, []
    for b in budgets:
        s0 = time.perf_counter()
        plans[b] = fit(name, budget=b, batch=batch, seq=seq, allow=("recompute", "selective"), verify=False,
                       costs=costs)
        solve_s.append(time.perf_counter() - s0)
    policies = {p: p for p in UNIFORM}
    for b, plan in plans.items():
        policies[f"plan@{b}"] = plan.actions
    runners = {k: Runner(spec, v, batch, seq) for k, v in policies.items()}
    peaks = {k: r.peak() for k, r in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in runners}
    loads = []
    for _ in range(rounds):
        order = list(runners)
        random.shuffle(order)
        loads.append(os.getloadavg()[0])
        for k in order:
            times[k].append(runners[k].step())
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    rows = []
    for b in budgets:
        fits = [p for p in UNIFORM if peaks[p] <= b]
        best = min(fits, key=lambda p: med[p]) if fits else None
        k = f"plan@{b}"
        rows.append({"budget": b, "plan": str(plans[b].actions and ",".join(map(str, plans[b].actions))),
                     "plan_peak": peaks[k], "plan_predicted": plans[b].predicted_peak, "plan_time": med[k],
                     "plan_spread": spread[k], "uniform": best, "uniform_peak": peaks.get(best),
                     "uniform_time": med.get(best), "uniform_spread": spread.get(best)})
    s100 = _solve_100(prof)
    return {"model": name, "batch": batch, "seq": seq, "rounds": rounds, "rows": rows, "none_peak": none_peak,
            "uniform_peaks": uniform_peaks, "uniform_times": {p: med[p] for p in UNIFORM},
            "full_time": med["full"], "none_time": med["none"], "load": loads, "solve_100_blocks_s": s100,
            "fit_seconds": solve_s, "costs": {"recompute_s": costs.recompute_s, "selective_s": costs.selective_s},
            "wall_s": time.perf_counter() - t0}


def _solve_100(prof) -> float:
    from memfit.measure.compose import BASE_ACTIONS
    from memfit.apply.policy import resolve_policy
    from memfit.plan.solve import solve

    budget = (prof.peak_of(resolve_policy("none", 100)) + prof.peak_of(resolve_policy("full", 100))) // 2
    t0 = time.perf_counter()
    solve(prof, budget, BASE_ACTIONS, lambda b, k: {"keep": 0, "selective": 0.2, "recompute": 1}[b.mode],
          n_blocks=100)
    return time.perf_counter() - t0


def render(result: dict) -> str:
    load = result.get("load") or [0]
    m = result.get("machine", {})
    lines = ["## planner: memfit's plan against the best uniform policy at each budget", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}; "
             f"run {result.get('date', '?')}.", "",
             f"Command: `python bench/planner.py{' --quick' if result.get('quick') else ''}`. "
             f"Machine load (1-min average) during the rounds: {min(load):.1f}-{max(load):.1f}. "
             f"Planner on {result['model']} (batch {result['batch']}, seq {result['seq']}), {result['rounds']} "
             f"shuffled rounds, CPU; peaks by memfit's tracker on real steps. No checkpointing: "
             f"{fmt_bytes(result['none_peak'])}, {result['none_time'] * 1000:.0f} ms; full: "
             f"{result['full_time'] * 1000:.0f} ms. One 100-block solve: {result['solve_100_blocks_s']:.2f} s.", "",
             "| budget | memfit plan peak | memfit time (ms) | best uniform that fits | its peak | its time (ms) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        u = r["uniform"] or "none fits"
        ut = f"{r['uniform_time'] * 1000:.0f}" if r["uniform_time"] else "-"
        up = fmt_bytes(r["uniform_peak"]) if r["uniform_peak"] else "-"
        lines.append(f"| {fmt_bytes(r['budget'])} | {fmt_bytes(r['plan_peak'])} | {r['plan_time'] * 1000:.0f} "
                     f"[{r['plan_spread'][0] * 1000:.0f}-{r['plan_spread'][1] * 1000:.0f}] | {u} | {up} | {ut} |")
    lines += ["", "![frontier](planner_frontier.png)"]
    return "\n".join(lines)


ROOT = Path(__file__).resolve().parent.parent


def plot(result: dict, path: Path) -> None:
    """Step time against measured peak: memfit's plans and the uniform policies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["rows"]
    ax.plot([r["plan_peak"] / 2**20 for r in rows], [r["plan_time"] * 1000 for r in rows], "o-", label="memfit plan")
    up, ut = result["uniform_peaks"], result["uniform_times"]
    for name in ut:
        ax.plot(up[name] / 2**20, ut[name] * 1000, "s", color="gray")
        ax.annotate(name, (up[name] / 2**20, ut[name] * 1000), fontsize=7)
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{result['model']}, batch {result['batch']} x seq {result['seq']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = run(args.quick, args.rounds)
    path = save("planner", {**result, "quick": args.quick})
    plot(result, ROOT / "docs" / "planner_frontier.png")
    print(render(result))
    print(f"\nwrote {path} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
