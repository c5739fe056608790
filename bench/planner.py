"""Planner benchmark (issue 9, section 6): at budgets from the smallest feasible to the no-checkpoint
peak, the measured peak (memfit's tracker on a real step) and step time of
  - memfit's plan (memfit.fit with this machine's `memfit profile` costs, then plan.apply's policy);
  - every uniform policy (none, every:4, every:3, every:2, sqrt, selective, full), so the best that fits
    each budget can be picked;
  - torch.compile with activation_memory_budget bisected to the budget (bench/planner_contenders.py);
  - PyTorch's SAC ILP where it runs (on a CPU-only machine it does not: the exact error is recorded).
All contenders of a model run interleaved in shuffled order in one harness call (bench/common.py).

    python bench/planner.py --quick     # small GPT and small HF Llama (a few minutes)
    python bench/planner.py             # GPT-2-small shape (12 x 768, vocab 50257) and an HF Llama, seq 1024

Full-mode shapes: batch 1 x seq 1024 (GPT-2's context). With fewer tokens the step's peak on GPT-2 small
is not in the blocks at all: with AdamW it is the optimizer step (weights, gradients, two states and the
step's temporaries); with SGD it is still at a point no checkpoint policy changes. Then the smallest
feasible budget equals the no-checkpoint peak (seq 256 and 512 alike) and there is nothing to plan.
A step at 1024 tokens takes several seconds on one core: the full run is long (5 rounds of about 17
contenders per model, plus the compiles of the ratio bisection).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import ROOT, interleaved, save  # noqa: E402
from planner_contenders import Bench, CompileTuner, sac_ilp_attempt  # noqa: E402
from planner_render import plot, render, snippets  # noqa: E402,F401  (render/snippets: bench/render.py)

UNIFORM = ["none", "every:4", "every:3", "every:2", "sqrt", "selective", "full"]
ALLOW = ("recompute", "selective")
OVERHEAD_SHARE = 1 / 3  # target: overhead at the 50% budget at most a third of full checkpointing's
NOISE = 0.03  # target: no slower than the best uniform policy, with this allowance


def llama_config(quick: bool) -> Path:
    """A Hugging Face Llama config.json (random weights are built from it; nothing is downloaded)."""
    from transformers import LlamaConfig

    shape = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256) if quick else
             dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000))
    folder = Path(tempfile.mkdtemp(prefix="memfit-bench-")) / "hf-llama"
    folder.mkdir()
    # use_cache off: a training loop has no use for a KV cache, and memfit.checkpoint switches it off anyway.
    LlamaConfig(max_position_embeddings=1024, use_cache=False, **shape).to_json_file(folder / "config.json")
    return folder / "config.json"


def cases(quick: bool) -> list[dict]:
    if quick:
        return [dict(key="gpt", name="gpt:layers=12,hidden=64,heads=4,vocab=256,seq=128", batch=4, seq=128),
                dict(key="hf-llama", name=str(llama_config(True)), batch=4, seq=128, hf=True)]
    return [dict(key="gpt2", name="gpt2", batch=1, seq=1024),
            dict(key="hf-llama", name=str(llama_config(False)), batch=1, seq=1024, hf=True)]


def _budgets(src, optimizer: str = "adamw") -> tuple[int, int, object]:
    """Smallest feasible budget (bisected on the composed estimate of the source fit() will plan from)
    and the predicted no-checkpoint peak."""
    from memfit.apply.policy import resolve_policy
    from memfit.measure.blocks import chain_profile
    from memfit.measure.compose import BASE_ACTIONS
    from memfit.plan.solve import solve

    prof = chain_profile(src, "32-true", optimizer)
    n = src.n_blocks
    none_peak = prof.peak_of(resolve_policy("none", n))
    lo, hi = 0, none_peak
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if solve(prof, mid, BASE_ACTIONS, lambda b, k: 0.0, n_blocks=n) is None else (lo, mid)
    return hi, none_peak, prof


def run_case(case: dict, quick: bool, rounds: int) -> dict:
    from memfit.apply.policy import resolve_policy, to_string
    from memfit.measure.blocks import module_source, spec_source
    from memfit.models.spec import parse_model, read_hf_config
    from memfit.plan.fit import fit
    from memfit.profile.measure import profile

    t_start = time.perf_counter()
    spec, batch, seq = parse_model(case["name"]), case["batch"], case["seq"]
    vocab = spec.config.vocab if spec.config is not None else read_hf_config(spec.hf_config)["vocab_size"]
    print(f"== {case['key']}: {spec.name}, batch {batch} x seq {seq}", flush=True)
    costs = profile(case["name"], batch=batch, seq=seq, use_cache=False).blocks  # this machine's block costs
    eager = Bench(lambda: spec.build(seq=seq), batch, seq, vocab)
    example = {"input_ids": eager.x, "labels": eager.x}
    src = module_source(eager.model, example, None) if case.get("hf") else spec_source(spec, batch, seq)
    lo, none_pred, prof = _budgets(src)
    from memfit.apply.checkpoint import find_blocks

    n = len(find_blocks(eager.model))
    measured = {}
    for p in UNIFORM:
        eager.policy(p)
        eager.step()  # warm
        measured[p] = eager.peak()
    act_none = measured["none"]["breakdown"]["activations"]
    half = max(lo, measured["none"]["peak"] - act_none // 2)  # leaves 50% of the no-checkpoint activations
    budgets = sorted({round(lo + (none_pred - lo) * i / 5) for i in range(6)} | {half})
    plans, fit_s = {}, []
    eager.policy("none")  # fit() reads the module as the user hands it over: no wrappers installed
    for b in budgets:
        s0 = time.perf_counter()
        if case.get("hf"):  # the user's path for a Hugging Face module: fit(model, example, ...)
            plans[b] = fit(eager.model, example, budget=b, allow=ALLOW, costs=costs)
        else:
            plans[b] = fit(case["name"], budget=b, batch=batch, seq=seq, allow=ALLOW, costs=costs)
        fit_s.append(time.perf_counter() - s0)
    # Contenders, one per distinct action list: a plan equal to a uniform policy is that policy's run.
    uniform_key = {to_string(resolve_policy(p, n)): p for p in UNIFORM}
    plan_key = {b: uniform_key.get(to_string(p.actions), f"plan:{to_string(p.actions)}") for b, p in plans.items()}
    for b, k in plan_key.items():
        if k not in measured:
            eager.policy(plans[b].actions)
            eager.step()
            measured[k] = eager.peak()
    print("    tuning torch.compile's activation_memory_budget", flush=True)
    compiled = Bench(lambda: spec.build(seq=seq), batch, seq, vocab)
    tuner = CompileTuner(compiled, steps=2 if quick else 3)
    ratio = {b: tuner.tune(b) for b in budgets}
    for r in set(ratio.values()) - {None}:
        measured[f"compile@{r:.4f}"] = {k: tuner.at(r)[k] for k in ("peak", "breakdown")}
    policy_of = {p: p for p in UNIFORM} | {plan_key[b]: plans[b].actions for b in budgets}

    def setup(name: str) -> None:
        if name in policy_of:
            eager.policy(policy_of[name])
        else:
            tuner.use(float(name.split("@")[1]))

    contenders = {k: (lambda k=k: eager.step()) for k in policy_of}
    contenders |= {f"compile@{r:.4f}": compiled.step for r in set(ratio.values()) - {None}}
    print(f"    timing {len(contenders)} contenders, {rounds} rounds", flush=True)
    timing = interleaved(contenders, rounds=rounds, setup=setup)
    med = {k: v["median"] for k, v in timing["wall"].items()}
    rows = []
    for b in budgets:
        fits = [p for p in UNIFORM if measured[p]["peak"] <= b]
        best = min(fits, key=lambda p: med[p]) if fits else None
        ck = f"compile@{ratio[b]:.4f}" if ratio[b] is not None else None
        rows.append({"budget": b, "half": b == half, "plan": plan_key[b], "plan_actions": to_string(plans[b].actions),
                     "plan_predicted": plans[b].predicted_peak, "plan_notes": plans[b].notes,
                     "micro_batch": plans[b].micro_batch, "accumulation": plans[b].accumulation,
                     "uniform": best, "compile": ck, "compile_ratio": ratio[b]})
    sac = sac_ilp_attempt(lambda: spec.build(seq=seq), batch, seq, vocab, budgets[0] / 2**30)
    print(f"    SAC ILP: {sac}", flush=True)
    return {"key": case["key"], "model": spec.name, "hf": bool(case.get("hf")), "batch": batch, "seq": seq,
            "n_blocks": n, "budgets": budgets, "smallest_feasible": lo, "none_predicted": none_pred,
            "half_budget": half, "activations_none": act_none, "rows": rows,
            "peaks": {k: v["peak"] for k, v in measured.items()},
            "breakdowns": {k: v["breakdown"] for k, v in measured.items()},
            "timing": timing, "fit_seconds": fit_s, "compile_tried": tuner.summary(), "sac_ilp": sac,
            "costs": {"recompute_s": costs.recompute_s, "selective_s": costs.selective_s},
            "wall_s": time.perf_counter() - t_start}


def targets(case: dict) -> dict:
    """issue 9's targets, computed from one model's measurements."""
    med = {k: v["median"] for k, v in case["timing"]["wall"].items()}
    peaks, rows = case["peaks"], case["rows"]
    within = all(peaks[r["plan"]] <= r["budget"] for r in rows)
    half = next(r for r in rows if r["half"])
    over = med[half["plan"]] - med["none"]
    full_over = med["full"] - med["none"]
    vs_uniform = [med[r["plan"]] / med[r["uniform"]] for r in rows if r["uniform"]]
    return {"plan_within_budget": within,
            "half_budget_overhead_s": over, "full_overhead_s": full_over,
            "half_budget_overhead_share": over / full_over if full_over > 0 else None,
            "half_budget_ok": over <= OVERHEAD_SHARE * full_over,
            "worst_vs_best_uniform": max(vs_uniform) if vs_uniform else None,
            "no_slower_than_uniform": all(v <= 1 + NOISE for v in vs_uniform)}


def solve_100_blocks(case: dict) -> float:
    """Seconds for one exact solve over a 100-block chain of this model's blocks, mid-way between full and none."""
    from memfit.apply.policy import resolve_policy
    from memfit.measure.blocks import chain_profile, spec_source
    from memfit.measure.compose import BASE_ACTIONS
    from memfit.models.spec import parse_model
    from memfit.plan.solve import solve

    spec = parse_model(case["name"])
    prof = chain_profile(spec_source(spec, case["batch"], case["seq"]), "32-true", "adamw")
    budget = (prof.peak_of(resolve_policy("none", 100)) + prof.peak_of(resolve_policy("full", 100))) // 2
    cost = lambda b, k: {"keep": 0.0, "selective": 0.2, "recompute": 1.0}[b.mode]  # noqa: E731
    t0 = time.perf_counter()
    solve(prof, budget, BASE_ACTIONS, cost, n_blocks=100)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (2 on a quiet 2-core machine halves the run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"quick": args.quick, "threads": args.threads, "models": []}
    for case in cases(args.quick):
        result = run_case(case, args.quick, args.rounds)
        result["targets"] = targets(result)
        result["solve_100_blocks_s"] = solve_100_blocks(case)
        out["models"].append(result)
    path = save("planner", out)
    import json

    saved = json.loads(path.read_text())
    plot(saved, ROOT / "docs" / "planner_frontier.png")
    print(render(saved))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
