"""Adaptive plans (issue 9, section 5): batches whose sequence length varies from 128 to 1024 under one
byte budget. Compared, at each length (measured peak by memfit's tracker on a real step, step time
from shuffled interleaved rounds):
  - the adaptive plan (memfit.plan.adaptive.AdaptivePlan: one plan per 128-token bucket, cached);
  - one fixed plan chosen for the shortest length;
  - one fixed plan chosen for the longest length.
Then a mixed run through AdaptivePlan.apply, as a training loop would use it, with the peak of every batch.

    python bench/planner_adaptive.py --quick     # hidden 64, vocab 256 (a few minutes)
    python bench/planner_adaptive.py             # hidden 256, vocab 8192 (a few minutes)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from common import fmt_bytes, interleaved, run_line, save  # noqa: E402
from planner_contenders import Bench  # noqa: E402

SEQS = [128, 256, 512, 1024]
MIXED = [128, 1024, 256, 768, 512, 384, 896, 640, 128, 1024]
STRATEGIES = ("adaptive", "fixed-short", "fixed-long")


def run(quick: bool, rounds: int) -> dict:
    from memfit.apply.policy import to_string
    from memfit.measure.blocks import composed_step
    from memfit.models.spec import parse_model
    from memfit.plan.adaptive import AdaptivePlan

    name = ("gpt:layers=12,hidden=64,heads=4,vocab=256,seq=1024" if quick
            else "gpt:layers=12,hidden=256,heads=4,vocab=8192,seq=1024")
    batch = 1  # seq 1024 at batch 1 already takes the longest step
    spec = parse_model(name)
    # The budget: what the middle length needs with every activation kept, so short lengths keep all
    # and the longest must recompute.
    budget = composed_step(spec, batch, SEQS[len(SEQS) // 2], checkpoint="none").peak
    ap = AdaptivePlan(name, budget, bucket=128, allow=("recompute", "selective"))
    plans = {"fixed-short": ap.for_shape(batch, SEQS[0]).actions, "fixed-long": ap.for_shape(batch, SEQS[-1]).actions}
    bench = Bench(lambda: spec.build(seq=1024), batch, SEQS[0], spec.config.vocab)
    xs = {L: torch.randint(0, spec.config.vocab, (batch, L)) for L in SEQS}

    def actions(strategy: str, L: int):
        return ap.for_shape(batch, L).actions if strategy == "adaptive" else plans[strategy]

    def setup(key: str) -> None:
        strategy, L = key.split("@")
        bench.policy(actions(strategy, int(L)))
        bench.x = xs[int(L)]

    keys = [f"{s}@{L}" for s in STRATEGIES for L in SEQS]
    peaks = {}
    for k in keys:
        setup(k)
        bench.step()
        peaks[k] = bench.peak()["peak"]
    timing = interleaved({k: bench.step for k in keys}, rounds=rounds, setup=setup)
    mixed = _mixed_run(spec, batch, budget, ap)
    return {"model": name, "batch": batch, "budget": budget, "seqs": SEQS, "peaks": peaks, "timing": timing,
            "plans": {f"adaptive@{L}": to_string(actions("adaptive", L)) for L in SEQS}
            | {k: to_string(v) for k, v in plans.items()}, "mixed": mixed, "buckets_solved": len(ap.plans)}


def _mixed_run(spec, batch: int, budget: int, ap) -> list[dict]:
    """A loop over batches of varying length through AdaptivePlan.apply on its own model: each batch's peak."""
    bench = Bench(lambda: spec.build(seq=1024), batch, MIXED[0], spec.config.vocab)
    out = []
    for L in MIXED:
        plan = ap.apply(bench.model, batch, L)
        bench.x = torch.randint(0, spec.config.vocab, (batch, L))
        out.append({"seq": L, "peak": bench.peak()["peak"], "recomputed": sum(a.mode != "keep" for a in plan.actions)})
    return out


def render(result: dict) -> str:
    tm, peaks, b = result["timing"], result["peaks"], result["budget"]
    med = {k: v["median"] for k, v in tm["wall"].items()}
    m = result.get("machine", {})

    def cell(k: str) -> str:
        over = " **over**" if peaks[k] > b else ""
        return f"{fmt_bytes(peaks[k])}{over} | {med[k] * 1e3:.0f} ms"

    lines = ["## planner_adaptive: one plan per sequence-length bucket against fixed plans", "",
             f"`python bench/planner_adaptive.py{' --quick' if result.get('quick') else ''}`", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}; run "
             f"{result.get('date', '?')}; 1 intra-op thread. " + run_line(result), "",
             f"Model `{result['model']}`, batch {result['batch']}, AdamW fp32; budget {fmt_bytes(b)} (the "
             f"no-checkpoint peak at seq {result['seqs'][len(result['seqs']) // 2]}). Peak: memfit's tracker on a real "
             f"step; time: median of {tm['rounds']} shuffled rounds, 1-minute load {tm['load_before'][0]:.1f} before "
             f"and {tm['load_after'][0]:.1f} after.", "",
             "| seq | adaptive plan | peak | step | fixed for shortest: peak | step | fixed for longest: peak | step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for L in result["seqs"]:
        lines.append(f"| {L} | `{result['plans'][f'adaptive@{L}']}` | {cell(f'adaptive@{L}')} | "
                     f"{cell(f'fixed-short@{L}')} | {cell(f'fixed-long@{L}')} |")
    seqs = result["seqs"]
    never_over = all(peaks[f"adaptive@{L}"] <= b for L in seqs)
    short_over = peaks[f"fixed-short@{seqs[-1]}"] > b
    slower = {L: med[f"fixed-long@{L}"] / med[f"adaptive@{L}"] for L in seqs[:-1]}
    mixed_max = max(r["peak"] for r in result["mixed"])
    lines += ["", f"- adaptive never over budget: {'yes' if never_over else '**no**'}; fixed-for-shortest over budget "
              f"at seq {seqs[-1]}: {'yes' if short_over else 'no'} ({fmt_bytes(peaks[f'fixed-short@{seqs[-1]}'])}); "
              "fixed-for-longest against adaptive on the shorter lengths: "
              + ", ".join(f"{L}: {r:.2f}x" for L, r in slower.items()) + ".",
              f"- mixed run through `AdaptivePlan.apply` (seq {', '.join(map(str, (r['seq'] for r in result['mixed'])))}): "
              f"highest batch peak {fmt_bytes(mixed_max)} against the {fmt_bytes(b)} budget "
              f"({'within' if mixed_max <= b else '**over**'}); {result['buckets_solved']} buckets solved, each once."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = run(args.quick, args.rounds)
    path = save("planner_adaptive", {**result, "quick": args.quick})
    import json

    print(render(json.loads(path.read_text())))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
