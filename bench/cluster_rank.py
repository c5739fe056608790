"""Cluster planner: predicted step-time ranking against measured, for 7 layouts of one model on 2 gloo
processes (ddp, with and without every block recomputed; pipeline gpipe with 1 micro-batch, with and
without every block recomputed, and 1f1b with 4 and with 8; tensor tp 2), interleaved in shuffled rounds.

    PYTHONPATH=src python bench/cluster_rank.py [--rounds 5] [--measured FILE --rounds 1]

Each contender is `memfit train --nproc 2 --strategy S` (a fresh process group per run); its
figure is the median step time over the steps after the first. The prediction is what
`memfit plan MODEL --gpus 2 --device cpu` predicts for the same layout: the planner's host model
(memfit.plan.cluster_host: compute calibrated at one thread, gloo's loopback,
DTensor's cost per sharded pair and the pipeline schedules' per micro-batch measured, the ranks
sharing this machine's cores, the share other work leaves them measured), measured after the
rounds, under the same load (MEMFIT_NO_CACHE=1). The FLOP-model prediction (a GPU-style
model: no fixed costs, no core sharing, the link at LINK_GBS) is kept beside it for comparison, and
so is the host model less each of its later terms in turn (ABLATIONS: what each adds to the ranking).
The machine is shared and loaded: rounds are few (launches cost 15-40 s each) and the load is
recorded before and after. `--measured FILE` reuses a run's measured times (from its JSON) and
adds `--rounds` more (0: none), so the rounds can be split over runs of under ten minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, load, machine, save  # noqa: E402

MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=768,vocab=256"
SEQ, BATCH, STEPS, LINK_GBS = 64, 4, 6, 2.0
CONTENDERS = {
    "ddp": ["--strategy", "ddp"],
    "ddp, every block recomputed": ["--strategy", "ddp", "--checkpoint", "full"],
    "pipeline gpipe x1": ["--strategy", "pipeline", "--microbatches", "1", "--schedule", "gpipe"],
    "pipeline gpipe x1, every block recomputed": ["--strategy", "pipeline", "--microbatches", "1", "--schedule",
                                                  "gpipe", "--checkpoint", "full"],
    "pipeline 1f1b x4": ["--strategy", "pipeline", "--microbatches", "4", "--schedule", "1f1b"],
    "pipeline 1f1b x8": ["--strategy", "pipeline", "--microbatches", "8", "--schedule", "1f1b"],
    "tensor tp2": ["--strategy", "tensor", "--tp", "2"],
}


def _flops() -> float:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    return 20 * 2 * 512**3 / (time.perf_counter() - t)


def _measure(name: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "memfit", "train", "--model", MODEL, "--seq", str(SEQ), "--batch", str(BATCH),
               "--steps", str(STEPS), "--warmup", "1", "--eval-every", "0", "--eval-batches", "1", "--no-track",
               "--quiet", "--device", "cpu", "--nproc", "2", "--out", out, *CONTENDERS[name]]
        if "--batch" in CONTENDERS[name]:  # the contender's own split of the same global batch
            i = cmd.index("--batch")
            del cmd[i:i + 2]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"{name}: {proc.stderr[-2000:]}")
        steps = json.loads((Path(out) / "metrics.json").read_text())["steps"]["seconds"]
    return statistics.median(steps[1:])


def _layout(name: str):
    from memfit.plan.cluster_memory import Layout

    if name.startswith("pipeline"):  # replica rows 2 x BATCH in M micro-batches
        m, sched = int(re.search(r"x(\d+)", name).group(1)), name.split()[1]
        return Layout("pipeline", dp=1, pp=2, rows=2 * BATCH // m, accum=m, schedule=sched)
    if name.startswith("tensor"):
        return Layout("tensor", dp=1, tp=2, rows=2 * BATCH)
    if "accumulation" in name:
        return Layout("ddp", dp=2, rows=1, accum=BATCH)
    return Layout("ddp", dp=2, rows=BATCH)


ABLATIONS = {"without the pipeline schedules' cost": {"pp_gpipe_s": 0.0, "pp_1f1b_s": 0.0},
             "without the core share": {"core_share": 1.0}}
"""The host model less one of its measured terms: what each adds to the ranking."""


def _predicted(device: str, flops: float | None, link: str | None) -> tuple[dict[str, dict], str, dict]:
    """Each contender's predicted step terms and the time basis, as `memfit plan --gpus 2` on `device`;
    and, with a measured host, each ablation's predicted totals."""
    from dataclasses import replace

    from memfit.plan.cluster_fit import _basis, problem_of
    from memfit.plan.cluster_memory import stage_sizes
    from memfit.plan.cluster_search import evaluate

    p = problem_of(MODEL, "1GiB", link, None, 2 * BATCH, SEQ, "32-true", "adamw", "recompute", device, flops)
    lays = {}
    for name in CONTENDERS:
        lay, full = _layout(name), "recomputed" in name
        sizes = stage_sizes(p.spec.config.layers, lay.pp)
        lays[name] = replace(lay, counts=[(0, 0, k) if full else (k, 0, 0) for k in sizes])
    out = {name: evaluate(p, lay).time for name, lay in lays.items()}
    ablated = {}
    if p.host is not None and p.host.measured:
        for what, zeroed in ABLATIONS.items():
            q = replace(p, host=replace(p.host, **zeroed))
            ablated[what] = {name: evaluate(q, lay).time["total"] for name, lay in lays.items()}
    link_name = p.topo_of(2).intra.name
    return out, _basis(p.flops, True, p.host) + f" ({link_name})", ablated


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--measured", help="a cluster_rank JSON whose measured times to reuse")
    ap.add_argument("--passes", type=int, default=3, help="host measurements (each predicts every contender)")
    args = ap.parse_args()
    load_before = load()
    times: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    rng = random.Random(0)
    if args.measured:  # its rounds, then --rounds more (0: none)
        old = json.loads(Path(args.measured).read_text())
        times = {n: list(old["contenders"].get(n, {}).get("measured_s", [])) for n in CONTENDERS}
        load_before = old["load_before"]
        rng = random.Random(len(times["ddp"]))
    for _ in range(args.rounds):
        order = list(CONTENDERS)
        rng.shuffle(order)
        for name in order:
            times[name].append(_measure(name))
    load_measured = load()
    # the measured times first, so that a failure below costs no launches (--measured reads this too)
    (Path(tempfile.gettempdir()) / "cluster_rank_measured.json").write_text(json.dumps(
        {"load_before": load_before, "contenders": {n: {"measured_s": t} for n, t in times.items()}}))
    os.environ["MEMFIT_NO_CACHE"] = "1"  # the host measured now, under the rounds' load, --passes times
    passes = [_predicted("cpu", None, "measured") for _ in range(args.passes)]
    host = {n: {k: statistics.median(p[0][n][k] for p in passes) for k in passes[0][0][n]} for n in CONTENDERS}
    basis = passes[-1][1] + f" (the last of {args.passes} measurements; each term the median over them)"
    flop_model, flop_basis, _ = _predicted("cpu", _flops(), str(LINK_GBS))
    for t in flop_model.values():  # the GPU-style model: no fixed costs, no core sharing
        t["total"] -= t.get("cores", 0.0)
    names = list(CONTENDERS)
    measured = [statistics.median(times[n]) for n in names]
    save("cluster_rank", {
        "bench": "cluster_rank", "machine": machine(), "load_before": load_before, "load_measured": load_measured,
        "load_after": load(), "model": MODEL, "seq": SEQ, "batch_per_process": BATCH, "processes": 2,
        "steps": STEPS, "rounds": min(len(t) for t in times.values()), "time_basis": basis, "link_gbs_flop_model": LINK_GBS,
        "contenders": {n: {"measured_s": times[n], "median_s": m, "spread_s": [min(times[n]), max(times[n])],
                           "predicted": host[n], "flop_model": flop_model[n],
                           "ratio": m / host[n]["total"]} for n, m in zip(names, measured)},
        "spearman": spearman([host[n]["total"] for n in names], measured),
        "spearman_per_pass": [spearman([p[0][n]["total"] for n in names], measured) for p in passes],
        "spearman_flop_model": spearman([flop_model[n]["total"] for n in names], measured),
        "spearman_ablated": {what: spearman([statistics.median(p[2][what][n] for p in passes) for n in names], measured)
                             for what in ABLATIONS}})


def render(result: dict) -> str:
    rows = ["| layout (2 gloo processes) | predicted step (s) | of which shared cores / bubble / exposed comm (s) "
            "| measured median (s) | min-max (s) | runs | measured / predicted | FLOP model (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, c in result["contenders"].items():
        t = c["predicted"]
        rows.append(f"| {n} | {t['total']:.3f} | {t.get('cores', 0):.3f} / {t['bubble']:.3f} / "
                    f"{t['comm_exposed']:.3f} | {c['median_s']:.3f} | {c['spread_s'][0]:.3f}-{c['spread_s'][1]:.3f} "
                    f"| {len(c['measured_s'])} | {c['ratio']:.2f} | {c['flop_model']['total']:.3f} |")
    argv = " ".join(result.get("run", {}).get("argv", []))
    return (f"### Cluster planner: predicted against measured step-time ranking\n\n"
            f"`PYTHONPATH=src python bench/cluster_rank.py {argv}` — {result['model']}, seq "
            f"{result['seq']}, --batch {result['batch_per_process']} per process (the same global batch in each "
            f"layout), interleaved shuffled rounds, at least {result['rounds']} a layout (runs: a layout added later "
            f"has fewer; each is a fresh 2-process launch on a loaded machine; load {result['load_before']} before, "
            f"{result.get('load_measured')} after the rounds, {result['load_after']} at the end). Prediction: "
            f"{result['time_basis']}.\n\n" + "\n".join(rows)
            + f"\n\nSpearman rank correlation (predicted vs measured): **{result['spearman']:.2f}** with the host "
            f"model (each host measurement alone: "
            f"{', '.join(f'{x:.2f}' for x in result.get('spearman_per_pass', []))}); "
            f"{result['spearman_flop_model']:.2f} with the FLOP model alone"
            + "".join(f"; {v:.2f} {what}" for what, v in result.get("spearman_ablated", {}).items()) + ".\n")


def snippets(result: dict) -> dict[str, str]:
    return {"cluster_rank": render(result).split("\n\n", 1)[1]}  # docs/planner.md has its own heading


if __name__ == "__main__":
    main()
