"""Planner benchmark (issue 9, section 6): at budgets from the smallest feasible to the no-checkpoint
peak, the measured peak (memfit's tracker on a real step) and step time of
  - memfit's plan (memfit.fit with this machine's `memfit profile` costs and memfit's lossless set minus
    offload, then the plan's policy and head applied in place);
  - every uniform policy (none, every:4, every:2, sqrt, selective, full), so the best that fits each
    budget can be picked;
  - torch.compile with activation_memory_budget bisected to the budget (bench/planner_contenders.py);
  - PyTorch's SAC ILP where it runs (on a CPU-only machine it does not: the exact error is recorded).
Timing (bench/planner_contenders.py::timed_rounds): each round runs every contender in a shuffled order,
each for several warm steps in a row (their median is the round's figure); targets are evaluated on
paired ratios (two contenders' figures of the same round), median over rounds with their spread.
Every contender memfit can price also gets its predicted step time (the planner's own time model).

Offload (activations to CPU or disk, optimizer state to CPU) is left out of the allowed set: on this
CPU-only machine host memory is device memory, so moving bytes there saves nothing physical.

    python bench/planner.py --quick     # small GPT and small HF Llama (a few minutes)
    python bench/planner.py --threads 2 # GPT-2-small shape (12 x 768, vocab 50257) and an HF Llama, seq 1024

Full-mode shapes: batch 1 x seq 1024 (GPT-2's context). With fewer tokens the step's peak on GPT-2 small
is not in the blocks at all: with AdamW it is the optimizer step (weights, gradients, two states and the
step's temporaries); with SGD it is the embedding's backward (every gradient live). Then the smallest
feasible budget equals the no-checkpoint peak (seq 256 to 768 alike) and there is nothing to plan.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import RESULTS, ROOT, paired_ratio, save  # noqa: E402
from planner_contenders import Bench, CompileTuner, sac_ilp_attempt, timed_rounds  # noqa: E402
from planner_render import plot, render, snippets  # noqa: E402,F401  (render/snippets: bench/render.py)

UNIFORM = ["none", "every:4", "every:2", "sqrt", "selective", "full"]
ALLOW = ("recompute", "selective", "chunked-head", "accumulate")
"""memfit's default lossless set without offload (host memory is device memory on a CPU-only machine)."""
OVERHEAD_SHARE = 1 / 3  # target: overhead at the 50% budget at most a third of full checkpointing's
NOISE = 0.03  # target: no slower than the best uniform policy, with this allowance


def llama_config(quick: bool) -> Path:
    """A Hugging Face Llama config.json (random weights are built from it; nothing is downloaded)."""
    from transformers import LlamaConfig

    shape = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048) if quick else
             dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000))
    folder = Path(tempfile.mkdtemp(prefix="memfit-bench-")) / "hf-llama"
    folder.mkdir()
    # use_cache off: a training loop has no use for a KV cache, and memfit.checkpoint switches it off anyway.
    LlamaConfig(max_position_embeddings=1024, use_cache=False, **shape).to_json_file(folder / "config.json")
    return folder / "config.json"


def cases(quick: bool) -> list[dict]:
    """Each model with its warm steps per contender per round (fewer where a step takes seconds)."""
    # steps: warm steps per contender per round; profile: memfit.profile's timed rounds; bisect: halvings of
    # torch.compile's ratio after 0 and 1 (one: ratios 0, 0.5, 1). GPT-2 small at 1024 tokens takes about
    # 8 s a step on 2 cores: one step per round keeps the whole run near 20 minutes. A noisy profile
    # misprices the plan, so the profile keeps 3 rounds.
    if quick:
        return [dict(key="gpt", name="gpt:layers=12,hidden=64,heads=4,vocab=2048,seq=256", batch=2, seq=256,
                     steps=3, profile=3, bisect=2),
                dict(key="hf-llama", name=str(llama_config(True)), batch=4, seq=128, hf=True, steps=3, profile=3,
                     bisect=2)]
    return [dict(key="gpt2", name="gpt2", batch=1, seq=1024, steps=1, profile=3, bisect=1),
            dict(key="hf-llama", name=str(llama_config(False)), batch=1, seq=1024, hf=True, steps=2, profile=3,
                 bisect=1)]


def _budgets(src, optimizer: str = "adamw") -> tuple[int, int, object]:
    """Smallest feasible budget (bisected on the composed estimate of the source fit() will plan from,
    with the plain head and with the head in the most chunks) and the predicted no-checkpoint peak."""
    from memfit.apply.policy import resolve_policy
    from memfit.measure.blocks import chain_profile
    from memfit.measure.compose import BASE_ACTIONS
    from memfit.plan.solve import solve

    from memfit.plan.head import head_counts, head_profile

    prof = chain_profile(src, "32-true", optimizer)
    n = src.n_blocks
    none_peak = prof.peak_of(resolve_policy("none", n))

    def smallest(p) -> int:
        lo, hi = 0, none_peak
        while hi - lo > 4096:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if solve(p, mid, BASE_ACTIONS, lambda b, k: 0.0, n_blocks=n) is None else (lo, mid)
        return hi

    # ALLOW has the chunked head: with the most chunks it can lower the smallest feasible budget
    low = smallest(prof)
    counts = head_counts(src) if "chunked-head" in ALLOW else []
    if counts:
        low = min(low, smallest(head_profile(src, prof, max(counts), "32-true", optimizer)))
    return low, none_peak, prof


def _fit_floor(fits, lo: int, step: int = 4096) -> int:
    """The smallest budget fit() itself plans for, from the bisected composed floor `lo` up: its
    cost-aware search can need a few KiB more than the feasibility-only bisection (seen: 5.6 KiB
    over 2.14 GiB for gpt2 on one machine), and a bench budget fit() refuses ends the run."""
    from memfit.plan.costs import PlanError

    def ok(b: int) -> bool:
        try:
            fits(b)
            return True
        except PlanError:
            return False

    if ok(lo):
        return lo
    hi = lo + step
    while not ok(hi):
        lo, hi = hi, hi + 2 * (hi - lo)
    while hi - lo > step:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _fits(case: dict, src, eager: Bench, budgets: list[int], costs) -> dict:
    from memfit.plan.fit import fit

    plans = {}
    for b in budgets:
        if case.get("hf"):  # the user's path for a Hugging Face module: fit(model, example, ...)
            plans[b] = fit(eager.model, {"input_ids": eager.x, "labels": eager.x}, budget=b, allow=ALLOW, costs=costs)
        else:
            plans[b] = fit(case["name"], budget=b, batch=case["batch"], seq=case["seq"], allow=ALLOW, costs=costs)
    return plans


def _predictor(src, prof, prof_costs, tokens: int):
    """Predicted step seconds of (actions, head chunks) under memfit's time model: the profile's measured
    no-checkpoint step plus the planner's extra seconds (memfit.plan.costs, plan/head.py)."""
    from memfit.plan.costs import _block_seconds, _cost, head_cost, measured, predict_extra
    from memfit.plan.head import head_seconds, sums_weight_grad

    costs = prof_costs.blocks
    flop_fwd = _block_seconds(prof, tokens)
    t_fwd, t_sel, seg = measured(costs, 1.0, flop_fwd)
    cost = _cost(t_fwd, t_sel, prof, costs.bandwidth, seg)
    speed = t_fwd / max(flop_fwd, 1e-12)

    def predict(actions, chunks: int | None) -> float:
        head = head_cost(costs, 1.0, chunks, lambda k: head_seconds(src, tokens, k, speed),
                         sums_weight_grad(src, tokens)) if chunks else 0.0
        return prof_costs.step_s["none"] + predict_extra(list(actions), cost) + head

    return predict


def _rows(budgets, half, plans, plan_key, measured, ratio, timing) -> list[dict]:
    """One row per budget: the plan, the best uniform policy that fits (by median step) with the paired ratio
    of the plan's step to it, and the torch.compile ratio tuned to the budget."""
    from memfit.apply.policy import to_string

    med = {k: v["median"] for k, v in timing["wall"].items()}
    rows = []
    for b in budgets:
        fits = [p for p in UNIFORM if measured[p]["peak"] <= b]
        best = min(fits, key=lambda p: med[p]) if fits else None
        ck = f"compile@{ratio[b]:.4f}" if ratio[b] is not None else None
        rows.append({"budget": b, "half": b == half, "plan": plan_key[b], "plan_actions": to_string(plans[b].actions),
                     "head_chunks": plans[b].head_chunks,
                     "plan_predicted": plans[b].predicted_peak, "plan_notes": plans[b].notes,
                     "micro_batch": plans[b].micro_batch, "accumulation": plans[b].accumulation,
                     "uniform": best, "compile": ck, "compile_ratio": ratio[b],
                     "vs_uniform": paired_ratio(timing, plan_key[b], best) if best else None})
    return rows


def run_case(case: dict, quick: bool, rounds: int) -> dict:
    from memfit.apply.checkpoint import find_blocks
    from memfit.apply.policy import resolve_policy, to_string
    from memfit.measure.blocks import module_source, spec_source
    from memfit.models.spec import parse_model, read_hf_config
    from memfit.profile.measure import profile

    t_start = time.perf_counter()
    spec, batch, seq = parse_model(case["name"]), case["batch"], case["seq"]
    vocab = spec.config.vocab if spec.config is not None else read_hf_config(spec.hf_config)["vocab_size"]
    print(f"== {case['key']}: {spec.name}, batch {batch} x seq {seq}", flush=True)
    t0 = time.perf_counter()
    prof_costs = profile(case["name"], batch=batch, seq=seq, optimizer="adamw", rounds=case["profile"],
                         use_cache=False)
    profile_s = time.perf_counter() - t0
    costs = prof_costs.blocks  # this machine's block costs
    print(f"    profile ({profile_s:.0f} s): {prof_costs.step_s}", flush=True)
    eager = Bench(lambda: spec.build(seq=seq), batch, seq, vocab)
    example = {"input_ids": eager.x, "labels": eager.x}
    src = module_source(eager.model, example, None) if case.get("hf") else spec_source(spec, batch, seq)
    lo, none_pred, prof = _budgets(src)
    lo = _fit_floor(lambda b: _fits(case, src, eager, [b], costs), lo)
    n = len(find_blocks(eager.model))
    predict = _predictor(src, prof, prof_costs, batch * seq)
    measured = {}
    eager.step()  # AdamW creates its state on the first step: peaks are of a steady step, not that one
    for p in UNIFORM:  # the tracked step doubles as the contender's first warm step
        eager.policy(p)
        measured[p] = eager.peak()
    act_none = measured["none"]["breakdown"]["activations"]
    half = max(lo, measured["none"]["peak"] - act_none // 2)  # leaves 50% of the no-checkpoint activations
    budgets = sorted({round(lo + (none_pred - lo) * i / 4) for i in range(5)} | {half})
    eager.policy("none")  # fit() reads the module as the user hands it over: no wrappers installed
    t0 = time.perf_counter()
    plans = _fits(case, src, eager, budgets, costs)
    fit_s = (time.perf_counter() - t0) / len(budgets)
    # Contenders, one per distinct (action list, head): a plan equal to a uniform policy is that policy's run.
    uniform_key = {to_string(resolve_policy(p, n)): p for p in UNIFORM}

    def key_of(plan) -> str:
        acts = to_string(plan.actions)
        return f"plan:{acts}|head={plan.head_chunks}" if plan.head_chunks else uniform_key.get(acts, f"plan:{acts}")

    plan_key = {b: key_of(p) for b, p in plans.items()}
    setting = {p: (p, None) for p in UNIFORM} | {plan_key[b]: (plans[b].actions, plans[b].head_chunks) for b in budgets}
    for k, (acts, chunks) in setting.items():
        if k not in measured:
            eager.policy(acts, chunks)
            measured[k] = eager.peak()
    predicted = {k: predict(resolve_policy(a, n) if isinstance(a, str) else a, c) for k, (a, c) in setting.items()}
    print("    tuning torch.compile's activation_memory_budget", flush=True)
    compiled = Bench(lambda: spec.build(seq=seq), batch, seq, vocab)
    tuner = CompileTuner(compiled, steps=case["bisect"])
    ratio = {b: tuner.tune(b) for b in budgets}
    for r in set(ratio.values()) - {None}:
        measured[f"compile@{r:.4f}"] = {k: tuner.at(r)[k] for k in ("peak", "breakdown")}

    def setup(name: str) -> None:
        if name in setting:
            eager.policy(*setting[name])
        else:
            tuner.use(float(name.split("@")[1]))

    contenders = {k: eager.step for k in setting} | {f"compile@{r:.4f}": compiled.step
                                                      for r in set(ratio.values()) - {None}}
    print(f"    timing {len(contenders)} contenders, {rounds} rounds of {case['steps']} steps", flush=True)
    timing = timed_rounds(contenders, rounds=rounds, steps=case["steps"], setup=setup)
    rows = _rows(budgets, half, plans, plan_key, measured, ratio, timing)
    sac = sac_ilp_attempt(lambda: spec.build(seq=seq), batch, seq, vocab, budgets[0] / 2**30)
    print(f"    SAC ILP: {sac}", flush=True)
    return {"key": case["key"], "model": spec.name, "hf": bool(case.get("hf")), "batch": batch, "seq": seq,
            "n_blocks": n, "budgets": budgets, "smallest_feasible": lo, "none_predicted": none_pred,
            "half_budget": half, "activations_none": act_none, "rows": rows, "allow": list(ALLOW),
            "peaks": {k: v["peak"] for k, v in measured.items()},
            "breakdowns": {k: v["breakdown"] for k, v in measured.items()},
            "predicted_s": predicted, "timing": timing, "fit_seconds_each": fit_s,
            "compile_tried": tuner.summary(), "sac_ilp": sac,
            "profile": {"seconds": profile_s, "step_s": prof_costs.step_s,
                        "blocks": {k: getattr(costs, k) for k in ("recompute_s", "selective_s", "segment_s", "head_s")}},
            "wall_s": time.perf_counter() - t_start}


def _share(timing: dict, name: str) -> dict:
    """Per round: (name - none) / (full - none), the overhead as a share of full checkpointing's."""
    w = timing["wall"]
    vals = [(t - z) / (f - z) if f > z else float("inf")
            for t, z, f in zip(w[name]["times"], w["none"]["times"], w["full"]["times"])]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def targets(case: dict) -> dict:
    """issue 9's targets, on paired ratios (figures of the same round): median over rounds, with the spread."""
    med = {k: v["median"] for k, v in case["timing"]["wall"].items()}
    peaks, rows = case["peaks"], case["rows"]
    within = all(peaks[r["plan"]] <= r["budget"] for r in rows)
    half = next(r for r in rows if r["half"])
    share = _share(case["timing"], half["plan"])
    vs = [r["vs_uniform"]["median"] for r in rows if r["vs_uniform"]]
    return {"plan_within_budget": within,
            "half_budget_overhead_s": med[half["plan"]] - med["none"], "full_overhead_s": med["full"] - med["none"],
            "half_budget_overhead_share": share, "half_budget_ok": share["median"] <= OVERHEAD_SHARE,
            "worst_vs_best_uniform": max(vs) if vs else None,
            "no_slower_than_uniform": all(v <= 1 + NOISE for v in vs)}


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
    ap.add_argument("--only", help="run one model (its key), e.g. hf-llama")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (2 on a quiet 2-core machine halves the run)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"quick": args.quick, "threads": args.threads, "models": []}
    for case in cases(args.quick):
        if args.only and case["key"] != args.only:
            continue
        result = run_case(case, args.quick, args.rounds)
        result["targets"] = targets(result)
        result["solve_100_blocks_s"] = solve_100_blocks(case)
        print(f"    {case['key']}: {result['wall_s']:.0f} s", flush=True)
        out["models"].append(result)
    import json

    if args.only:  # one model rerun: the other models' entries of the last full run stay as they were
        old = RESULTS / "planner.json"
        kept = json.loads(old.read_text()).get("models", []) if old.exists() else []
        order = [c["key"] for c in cases(args.quick)]
        out["models"] = sorted([m for m in kept if m["key"] != args.only] + out["models"],
                               key=lambda m: order.index(m["key"]) if m["key"] in order else len(order))
        out["rerun"] = {"only": args.only, "date": time.strftime("%Y-%m-%d")}
        next(m for m in out["models"] if m["key"] == args.only)["rerun"] = out["rerun"]
    path = save("planner", out)
    saved = json.loads(path.read_text())
    plot(saved, ROOT / "docs" / "planner_frontier.png")
    print(render(saved))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
