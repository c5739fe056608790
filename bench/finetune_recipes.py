"""Published low-memory fine-tuning recipes as the bar: each estimated as configured, then planned by
memfit on the same GPU.

    python bench/finetune_recipes.py [--only NAME_PART ...]

The recipes, their sources (repository, path, commit) and their configurations are in
bench/data/finetune_recipes.json, with what the source does not publish and the assumption made. For each:
1. the estimate as configured: `memfit.estimate(model, device=gpu, batch, seq, precision, optimizer,
   checkpoint, lora, qlora, step_in_backward)` (memfit's plain LM head), and the same step traced with the
   head and loss in the recipe's chunks (head_chunks, by memfit.chunk_head: torchtune's
   CEWithChunkedOutputLoss runs the output projection and the loss in 8; null, the plain loss, traces
   the plain head again): the allocated peak and the caching allocator's
   predicted reserve. A paged optimizer (bitsandbytes' Paged*) keeps its states in CUDA unified memory,
   outside PyTorch's allocator and its counters: the figure torch.cuda.max_memory_* can show is the
   step's less the optimizer state, reported beside it.
2. the plan: `memfit.fit` for the same model, batch, seq, precision, optimizer and adapters on the same
   GPU, within the recipe's predicted reserve (chunked head; at most the card's budget): the fastest
   plan at most as large as the recipe. Allowed: recompute, selective, offload to CPU, accumulation,
   chunked head, optimizer offload, the step in backward.
3. step times under memfit's FLOP model, relative to the step that keeps every activation: the recipe
   recomputes every layer once (1 + 1/3: a step is three forwards); its head chunks, torch.compile and
   paging are not charged, which favours the recipe. The plan's is predicted_time / baseline_time.
Writes bench/results/finetune_recipes.json; no timings (estimates and plans are deterministic).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import run_line, save  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "finetune_recipes.json"
GIB = 2**30
UNITS = {"GiB": GIB, "GB": 10**9}
TOLERANCE = 0.05  # the bound for an estimate against a published peak
ALLOW = ("recompute", "selective", "offload-cpu", "accumulate", "chunked-head", "optimizer-offload", "step-in-backward")
REQUIRED = ("name", "source", "row", "config", "published", "model", "gpu", "batch", "seq", "precision", "optimizer",
            "checkpoint", "step_in_backward", "lora", "qlora", "head_chunks", "paged_optimizer", "configured",
            "unpublished")


def load_recipes(path: Path = DATA) -> dict:
    """The data file, checked: every recipe names a known source and has every configuration field."""
    data = json.loads(path.read_text())
    for r in data["recipes"]:
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"recipe {r.get('name', '?')!r} lacks {', '.join(missing)}")
        if r["source"] not in data["sources"]:
            raise ValueError(f"recipe {r['name']!r}: unknown source {r['source']!r}")
        if not isinstance(r["published"].get("peak"), (int, float)) or r["published"].get("unit") not in UNITS:
            raise ValueError(f"recipe {r['name']!r}: published needs a numeric peak and a unit in {sorted(UNITS)}")
    return data


def published_bytes(r: dict) -> float:
    return r["published"]["peak"] * UNITS[r["published"]["unit"]]


def _lora(r: dict) -> str | None:
    return r["lora"] + (",base=nf4" if r["qlora"] else "") if r["lora"] else None


def _spec(r: dict):
    from memfit.models.lora import parse_lora
    from memfit.models.spec import parse_model

    spec = parse_model(r["model"])
    return replace(spec, lora=parse_lora(_lora(r))) if r["lora"] else spec


def estimate_recipe(r: dict) -> dict:
    """The recipe as configured: memfit.estimate with the plain head, and the step traced with the head in
    the recipe's chunks; with a paged optimizer, also the figures less its state."""
    import memfit
    from memfit.apply.head_swap import chunk_head
    from memfit.measure.trace import trace_step

    plain = memfit.estimate(r["model"], device=r["gpu"], batch=r["batch"], seq=r["seq"], precision=r["precision"],
                            optimizer=r["optimizer"], checkpoint=r["checkpoint"], lora=r["lora"], qlora=r["qlora"],
                            step_in_backward=r["step_in_backward"]).per_device
    spec = _spec(r)
    chunks = r["head_chunks"]
    traced = trace_step(lambda: chunk_head(spec.build(seq=r["seq"]), chunks), r["batch"], r["seq"],
                        precision=r["precision"], optimizer=r["optimizer"], checkpoint=r["checkpoint"],
                        device=r["gpu"], step_in_backward=r["step_in_backward"])
    cats = traced.breakdown()
    out = {"plain": {"allocated": plain["total"], "reserved": plain.get("reserved"), "categories": plain},
           "chunked": {"allocated": traced.cuda_allocated, "reserved": traced.cuda_reserved, "categories": cats}}
    paged = cats["optimizer"] if r["paged_optimizer"] else 0
    out["counted"] = {"allocated": traced.cuda_allocated - paged, "reserved": traced.cuda_reserved - paged,
                      "paged_state": paged}
    published = published_bytes(r)
    out["ratio"] = {k: out["counted"][k] / published for k in ("allocated", "reserved")}
    out["within"] = any(abs(x - 1) <= TOLERANCE for x in out["ratio"].values())
    return out


def plan_recipe(r: dict, est: dict) -> dict:
    """memfit's fastest plan for the same job on the same GPU within the recipe's predicted reserve."""
    import memfit
    from memfit.core.gpus import target

    gpu = target(r["gpu"])
    budget = min(est["chunked"]["reserved"], gpu.memory - gpu.context)
    t0 = time.process_time()
    try:
        plan = memfit.fit(r["model"], device=r["gpu"], budget=budget, batch=r["batch"], seq=r["seq"],
                          precision=r["precision"], optimizer=r["optimizer"], lora=r["lora"], qlora=r["qlora"],
                          allow=ALLOW)
    except Exception as exc:  # a PlanError is the finding: no plan within the budget
        return {"budget": budget, "error": f"{type(exc).__name__}: {exc}", "cpu_s": round(time.process_time() - t0, 1)}
    rel = plan.predicted_time / plan.baseline_time if plan.baseline_time > 0 else 1.0
    return {"budget": budget, "predicted_peak": plan.predicted_peak, "traced_peak": plan.measured_peak,
            "relative_time": rel, "predicted_time": plan.predicted_time, "baseline_time": plan.baseline_time,
            "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
            "actions": plan.to_json()["actions"], "head_chunks": plan.head_chunks,
            "offload_optimizer": plan.offload_optimizer, "step_in_backward": plan.step_in_backward,
            "notes": plan.notes, "cpu_s": round(time.process_time() - t0, 1)}


def recipe_time(r: dict) -> float:
    """The recipe's step under memfit's FLOP model, relative to keeping every activation: a step is three
    forwards, and full checkpointing runs each layer's forward once more."""
    return 1.0 + (1.0 / 3.0 if r["checkpoint"] == "full" else 0.0)


def run(recipe: dict) -> dict:
    t0 = time.process_time()
    est = estimate_recipe(recipe)
    row = {"name": recipe["name"], "source": recipe["source"], "published": recipe["published"],
           "estimate": est, "estimate_cpu_s": round(time.process_time() - t0, 1), "recipe_time": recipe_time(recipe)}
    row["plan"] = plan_recipe(recipe, est)
    p = row["plan"]
    if "error" not in p:
        row["bar"] = {"peak": p["predicted_peak"] <= est["chunked"]["allocated"]
                      and (p["traced_peak"] or 0) <= est["chunked"]["reserved"],
                      "speed": p["relative_time"] <= row["recipe_time"]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None, help="recipes whose name contains one of these")
    args = ap.parse_args()
    data = load_recipes()
    recipes = [r for r in data["recipes"] if not args.only or any(s in r["name"] for s in args.only)]
    rows = []
    for r in recipes:
        rows.append(run(r))
        print(json.dumps(rows[-1], default=str)[:400], flush=True)
    save("finetune_recipes", {"script": "finetune_recipes", "sources": data["sources"], "rows": rows,
                              "not_estimated": data["not_estimated"], "allow": list(ALLOW)})


def _g(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _estimate_table(rows: list[dict]) -> list[str]:
    lines = ["| recipe | published | memfit.estimate (plain head) alloc / reserved | head in the recipe's chunks "
             "alloc / reserved | counted by torch (alloc / reserved) | ratio to published | within 5% |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        e = row["estimate"]
        c = e["counted"]
        paged = f" (less {_g(c['paged_state'])} GiB paged state)" if c["paged_state"] else ""
        lines.append(f"| {row['name']} | {row['published']['peak']} {row['published']['unit']} | {_g(e['plain']['allocated'])} / "
                     f"{_g(e['plain']['reserved'])} GiB | {_g(e['chunked']['allocated'])} / {_g(e['chunked']['reserved'])} GiB"
                     f" | {_g(c['allocated'])} / {_g(c['reserved'])} GiB{paged} | {e['ratio']['allocated']:.3f} / "
                     f"{e['ratio']['reserved']:.3f} | {'yes' if e['within'] else 'no: see the note'} |")
    return lines


def _kinds(actions: str) -> str:
    """A plan's block actions counted by kind (segment tags dropped): 'recompute x17, keep+offload:cpu x15'."""
    counts: dict[str, int] = {}
    for item in actions.split(","):
        kind, _, n = item.partition("*")
        kind = re.sub(r"\+seg=\d+", "", kind)
        counts[kind] = counts.get(kind, 0) + (int(n) if n else 1)
    return ", ".join(f"{k} x{n}" for k, n in counts.items())


def _plan_cell(p: dict) -> str:
    if "error" in p:
        return p["error"].split(": ", 1)[-1]
    parts = [f"micro-batch {p['micro_batch']} x {p['accumulation']}", f"blocks {_kinds(p['actions'])}",
             f"head chunks {p['head_chunks'] or 'none'}"]
    if p["offload_optimizer"]:
        parts.append(f"optimizer offloaded to {p['offload_optimizer']}")
    if p["step_in_backward"]:
        parts.append("step in backward")
    return "; ".join(parts)


def _plan_table(rows: list[dict]) -> list[str]:
    lines = ["| recipe | budget (recipe's reserve) | memfit's plan | plan peak (composed / traced) | time: recipe / plan "
             "| peak <= recipe | speed >= recipe |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        p = row["plan"]
        if "error" in p:
            lines.append(f"| {row['name']} | {_g(p['budget'])} GiB | no plan: {_plan_cell(p)} | - | "
                         f"{row['recipe_time']:.2f} / - | - | - |")
            continue
        bar = row["bar"]
        lines.append(f"| {row['name']} | {_g(p['budget'])} GiB | {_plan_cell(p)} | {_g(p['predicted_peak'])} / "
                     f"{_g(p['traced_peak'])} GiB | {row['recipe_time']:.2f} / {p['relative_time']:.2f} | "
                     f"{'yes' if bar['peak'] else 'no'} | {'yes' if bar['speed'] else 'no'} |")
    return lines


def snippets(r: dict) -> dict[str, str]:
    src = "; ".join(f"{k}: {v['repo']} {v['path']} at {v['commit'][:12]} ({v['section']})" for k, v in r["sources"].items())
    lines = [f"From `python bench/finetune_recipes.py`, run {r['date']}; recipes and sources in "
             f"`bench/data/finetune_recipes.json` ({src}). Peaks in GiB; ratios are memfit's counted figure over the "
             "published one (allocated / reserved: the source does not say which counter it reports); 'within 5%' "
             "holds when either is.", ""]
    lines += _estimate_table(r["rows"])
    lines += ["", "Times are memfit's FLOP model relative to the step that keeps every activation (the recipe: every layer "
              "recomputed once; its head chunks, torch.compile and paging not charged). Plans allow "
              f"{', '.join(r['allow'])}.", ""]
    lines += _plan_table(r["rows"])
    lines += ["", "Not estimated: " + "; ".join(f"{n['name']} ({n['why']})" for n in r["not_estimated"]) + "."]
    return {"finetune_recipes": "\n".join(lines)}


def render(r: dict) -> str:
    return "\n".join(["## Published fine-tuning recipes as the bar (`bench/finetune_recipes.py`)", "",
                      snippets(r)["finetune_recipes"], "", run_line(r)])


if __name__ == "__main__":
    main()
