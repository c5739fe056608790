"""Markdown, a docs snippet and the frontier plot for bench/planner.py's JSON (kept apart: files under 400 lines)."""
from __future__ import annotations

from pathlib import Path

from common import fmt_bytes, run_line

NOISE, SHARE = 0.03, 1 / 3


def _t(timing: dict, key: str | None) -> str:
    if not key:
        return "-"
    s = timing["wall"][key]
    scale, unit = (1e3, "ms") if s["median"] < 1 else (1, "s")
    d = 0 if unit == "ms" else 2
    return f"{s['median'] * scale:.{d}f} ({s['min'] * scale:.{d}f}–{s['max'] * scale:.{d}f}) {unit}"


def _p(case: dict, key: str | None, budget: int) -> str:
    if not key:
        return "-"
    p = case["peaks"][key]
    return fmt_bytes(p) + ("" if p <= budget else " **over**")


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def _name(key: str | None) -> str:
    if not key:
        return "none fits"
    if key.startswith("plan:"):
        return "plan (its own)" + (", head in " + key.split("|head=")[1] + " chunks" if "|head=" in key else "")
    return f"= `{key}`"


def _pred(case: dict, key: str | None) -> str:
    v = case.get("predicted_s", {}).get(key) if key else None
    if v is None:
        return "-"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def _ratio(r: dict | float | None) -> str:
    if isinstance(r, (int, float)):  # (results of the earlier bench: a ratio of medians)
        return f"{r:.3f}"
    return "-" if not r else f"{r['median']:.3f} ({r['min']:.3f}–{r['max']:.3f})"


def _case(case: dict) -> list[str]:
    tm, t = case["timing"], case["targets"]
    none = case["peaks"]["none"]
    shape = "Hugging Face LlamaForCausalLM from a LlamaConfig, random weights" if case["hf"] else "memfit GPT"
    lines = [f"### {case['key']}: {case['model']} ({shape}), batch {case['batch']} x seq {case['seq']}, "
             f"{case['n_blocks']} blocks", "",
             f"No checkpointing: peak {fmt_bytes(none)} (activations {fmt_bytes(case['activations_none'])} of it), "
             f"step {_t(tm, 'none')}; full checkpointing: {fmt_bytes(case['peaks']['full'])}, {_t(tm, 'full')}. "
             f"Budgets: five evenly from the smallest feasible ({fmt_bytes(case['smallest_feasible'])}) to the "
             f"predicted no-checkpoint peak, and the one leaving 50% of the no-checkpoint activations "
             f"({fmt_bytes(case['half_budget'])}, marked ½). {tm['rounds']} rounds of {len(tm['wall'])} distinct "
             f"contenders in a shuffled order, each timed over {_steps(tm.get('steps', 1))} per round; "
             f"1-minute load {tm['load_before'][0]:.1f} before, "
             + (f"{', '.join(f'{x:.1f}' for x in tm['load_each_round'])} after each round, " if "load_each_round" in tm else "")
             + f"{tm['load_after'][0]:.1f} after the timed rounds.", "",
             "| budget | memfit plan | its peak | its step | predicted | best uniform that fits | its peak | its step "
             "| predicted | plan / uniform, paired | torch.compile ratio | its peak | its step |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in case["rows"]:
        b = r["budget"]
        ratio = "cannot reach" if r["compile_ratio"] is None else f"{r['compile_ratio']:.3f}"
        lines.append(f"| {fmt_bytes(b)}{' ½' if r['half'] else ''} | {_name(r['plan'])} | {_p(case, r['plan'], b)} | "
                     f"{_t(tm, r['plan'])} | {_pred(case, r['plan'])} | {r['uniform'] or 'none fits'} | "
                     f"{_p(case, r['uniform'], b)} | {_t(tm, r['uniform'])} | {_pred(case, r['uniform'])} | "
                     f"{_ratio(r.get('vs_uniform'))} | {ratio} | {_p(case, r['compile'], b)} | {_t(tm, r['compile'])} |")
    share = t["half_budget_overhead_share"]
    worst = t["worst_vs_best_uniform"]
    allow = ", ".join(f"`{a}`" for a in case.get("allow", ("recompute", "selective")))
    lines += ["", f"Plans (per-block actions, `memfit.fit` with allow = {allow}):", ""]
    for r in case["rows"]:
        head = f", LM head in {r['head_chunks']} chunks" if r.get("head_chunks") else ""
        lines.append(f"- {fmt_bytes(r['budget'])}: `{r['plan_actions']}`{head} (predicted {fmt_bytes(r['plan_predicted'])}"
                     f"{', micro-batch %d x %d' % (r['micro_batch'], r['accumulation']) if r['accumulation'] > 1 else ''})")
    lines += ["", "Every contender memfit's time model can price: measured step against predicted (the profile's "
              "measured no-checkpoint step plus the planner's extra seconds for recompute, segments, selective and "
              "the chunked head):", "", "| contender | measured peak | step | predicted | error |", "|---|---:|---:|---:|---:|"]
    for k, v in sorted(case.get("predicted_s", {}).items(), key=lambda kv: kv[1]):
        err = v / tm["wall"][k]["median"] - 1
        lines.append(f"| `{k}` | {fmt_bytes(case['peaks'][k])} | {_t(tm, k)} | {_pred(case, k)} | {err:+.1%} |")
    prof = case.get("profile", {})
    if prof:
        b = prof["blocks"]
        lines += ["", f"Profile (`memfit.profile`, {prof['seconds']:.0f} s): steps "
                  + ", ".join(f"{k} {_secs(v)}" for k, v in prof["step_s"].items())
                  + f"; per block: recompute {_secs(b['recompute_s'])}, selective {_secs(b['selective_s'])}, "
                  + "in a segment " + (", ".join(f"of {k}: {_secs(v)}" for k, v in (b.get("segment_s") or {}).items()) or "-")
                  + "; chunked head " + (", ".join(f"in {k}: {_secs(v)}" for k, v in (b.get("head_s") or {}).items()) or "-")
                  + "."]
    lines += ["", "Targets (on paired ratios: each round's figures of the two contenders; median over rounds, "
              "min–max):", "",
              f"- memfit's measured peak within the budget at every budget: {_mark(t['plan_within_budget'])}.",
              f"- at the ½ budget, overhead over no checkpointing as a share of full checkpointing's: "
              f"{_ratio(share)} (target at most {SHARE:.2f}; medians {t['half_budget_overhead_s'] * 1e3:.0f} ms "
              f"against {t['full_overhead_s'] * 1e3:.0f} ms): {_mark(t['half_budget_ok'])}.",
              f"- no slower than the best uniform policy that fits (3% allowance, on the median paired ratio): "
              f"{_mark(t['no_slower_than_uniform'])}" + (f"; worst {worst:.3f}." if worst else "."),
              f"- one solve over 100 of these blocks: {case['solve_100_blocks_s']:.2f} s (target under 1 s): "
              f"{_mark(case['solve_100_blocks_s'] < 1)}."]
    tried = ", ".join(f"{r}: {fmt_bytes(v['peak'])}" for r, v in case["compile_tried"].items())
    lines += ["", f"torch.compile ratios tried (activation_memory_budget: measured peak): {tried}."]
    sac = case["sac_ilp"]
    if sac.get("ran"):
        lines.append(f"SAC ILP ran: decisions {sac['decisions']} (not applied by this bench).")
    else:
        lines.append(f"PyTorch's SAC ILP did not run here: it stopped at {sac['stage']} with `{sac['error']}`.")
    return lines


def _steps(k: int) -> str:
    return "one warm step" if k == 1 else f"{k} warm steps in a row (their median)"


def _secs(v: float) -> str:
    return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"


def render(result: dict) -> str:
    m = result.get("machine", {})
    quick = (" --quick" if result.get("quick") else "") + (f" --threads {result['threads']}" if result.get("threads", 1) != 1 else "")
    lines = ["## planner: memfit's plan against uniform checkpointing, torch.compile's memory budget and SAC ILP", "",
             f"`python bench/planner.py{quick}`", "",
             f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}, "
             f"{m.get('device', 'cpu')}; run {result.get('date', '?')}; {result.get('threads', 1)} intra-op thread(s). "
             + run_line(result), "",
             "Peaks are memfit's tracker on one real step (AdamW, fp32, the batch and the optimizer state included). "
             "Step times are the median (fastest–slowest) over the shuffled rounds of each round's median warm step. "
             "A plan identical to a uniform policy is that policy's run (`= name`). memfit plans with its lossless "
             "techniques except offload: on this CPU-only machine host memory is device memory, so moving "
             "activations or optimizer state to the host would save nothing physical and is not counted. torch.compile runs with the aot_eager backend and the min-cut "
             "partitioner, which reads `activation_memory_budget` (a ratio of the saved activations) at compile "
             "time; each block is compiled on its own (as torchtitan does), and the ratio is bisected for the largest one whose measured peak fits. Inductor would use the same "
             "partition, but its kernels allocate outside the dispatcher, where the tracker cannot see them. "
             "aot_eager does not fuse, so its step times are eager-speed.", ""]
    reruns = [c["rerun"] for c in result["models"] if c.get("rerun")] or ([result["rerun"]] if result.get("rerun") else [])
    if reruns:
        said = "; ".join(f"{r['only']} on {r['date']} (`python bench/planner.py{quick} --only {r['only']}`)" for r in reruns)
        lines += [f"Rerun alone, after planner changes: {said}. The script's wall time above is the last rerun's "
                  f"({result['rerun']['only']}); a model not named here is from the last full run.", ""]
    loaded = [c["key"] for c in result["models"] if max(c["timing"]["load_before"][0], c["timing"]["load_after"][0])
              > m.get("cores", 1)]
    if loaded:
        lines += [f"The machine was busy during the timed rounds of {', '.join(loaded)} (1-minute load above its "
                  f"{m.get('cores')} cores): step-time differences of a few percent there are within the noise; the "
                  "peaks are not affected.", ""]
    for case in result["models"]:
        lines += _case(case) + [""]
    lines += ["![peak against step time per contender](planner_frontier.png)"]
    return "\n".join(lines)


def snippets(result: dict) -> dict[str, str]:
    """docs/planner.md's benchmark summary, between <!-- bench:planner --> markers."""
    out = []
    for c in result["models"]:
        t = c["targets"]
        share = t["half_budget_overhead_share"]
        out.append(f"- {c['model']} (batch {c['batch']} x seq {c['seq']}): peak within budget at all "
                   f"{len(c['rows'])} budgets: {_mark(t['plan_within_budget'])}; overhead at the ½ budget "
                   + f"{_ratio(share)} of full checkpointing's" + (" (paired per round)" if isinstance(share, dict) else "")
                   + ("; worst median paired time ratio" if isinstance(share, dict) else "; worst time ratio")
                   + " against the best uniform policy that fits "
                   + (f"{t['worst_vs_best_uniform']:.3f}" if t["worst_vs_best_uniform"] else "n/a")
                   + f"; 100-block solve {c['solve_100_blocks_s']:.2f} s.")
    r = result.get("run", {})
    load = f" (1-minute load {r['load_start'][0]:.1f} at the start, {r['load_end'][0]:.1f} at the end)" if r else ""
    head = f"From `python bench/planner.py{' --quick' if result.get('quick') else ''}`, run {result.get('date')}{load}:"
    return {"planner": "\n".join([head, ""] + out)}


def plot(result: dict, path: Path) -> None:
    """Step time against measured peak for every contender, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, c in zip(axes[0], models):
        med = {k: v["median"] for k, v in c["timing"]["wall"].items()}
        groups = {"uniform": [k for k in med if not k.startswith(("plan:", "compile@"))],
                  "memfit plan": sorted({r["plan"] for r in c["rows"]}),
                  "torch.compile budget": [k for k in med if k.startswith("compile@")]}
        for (label, keys), style in zip(groups.items(), ("s", "o", "^")):
            pts = sorted((c["peaks"][k] / 2**20, med[k] * 1e3, k) for k in keys)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style + ("-" if label != "uniform" else ""), label=label,
                    alpha=0.8)
            if label == "uniform":
                for x, y, k in pts:
                    ax.annotate(k, (x, y), fontsize=7)
        for b in c["budgets"]:
            ax.axvline(b / 2**20, color="lightgray", lw=0.6, zorder=0)
        ax.set_xlabel("measured peak (MiB); gray lines: budgets")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"{c['key']}: batch {c['batch']} x seq {c['seq']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
