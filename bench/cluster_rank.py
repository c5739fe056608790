"""Cluster planner: predicted step-time ranking against measured, for 5 layouts of one model on 2 gloo
processes (ddp, ddp with every block recomputed, pipeline 1f1b x4 and gpipe x2, tensor tp 2),
interleaved in shuffled rounds.

    PYTHONPATH=src python bench/cluster_rank.py [--rounds 3]

Each contender is `memfit train --nproc 2 --strategy S` (a fresh process group per run); its
figure is the median step time over the steps after the first. The prediction is the cluster
planner's time model (memfit.plan.cluster_time) for the same layout, with the FLOP rate measured
here (a float32 matmul, one thread) and the link at LINK_GBS (gloo over loopback; assumed, not
measured). The machine is shared and loaded: rounds are few (launches cost ~30 s each) and the
load is recorded before and after; the rank correlation, not the seconds, is the result.
"""
from __future__ import annotations

import argparse
import json
import os
import random
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
    "pipeline 1f1b x4": ["--strategy", "pipeline", "--microbatches", "4", "--schedule", "1f1b"],
    "pipeline gpipe x2": ["--strategy", "pipeline", "--microbatches", "2", "--schedule", "gpipe"],
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
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"{name}: {proc.stderr[-2000:]}")
        steps = json.loads((Path(out) / "metrics.json").read_text())["steps"]["seconds"]
    return statistics.median(steps[1:])


def _layout(name: str):
    from memfit.plan.cluster_memory import Layout

    n = 2
    if name.startswith("pipeline"):  # replica rows 2 x BATCH in M micro-batches
        m, sched = int(name.split("x")[-1]), name.split()[1]
        return Layout("pipeline", dp=1, pp=2, rows=n * BATCH // m, accum=m, schedule=sched)
    if name.startswith("tensor"):
        return Layout("tensor", dp=1, tp=2, rows=2 * BATCH)
    return Layout("ddp", dp=n, rows=BATCH)


def _predicted(flops: float) -> dict[str, dict]:
    from dataclasses import replace

    from memfit.plan.cluster_fit import problem_of
    from memfit.plan.cluster_search import evaluate

    p = problem_of(MODEL, "1GiB", str(LINK_GBS), None, 2 * BATCH, SEQ, "32-true", "adamw", "recompute", "cpu", flops)
    layers = p.spec.config.layers
    out = {}
    for name in CONTENDERS:
        lay = _layout(name)
        full = "recomputed" in name
        lay = replace(lay, counts=[(0, 0, k) if full else (k, 0, 0) for k in _stages(layers, lay.pp)])
        out[name] = evaluate(p, lay).time
    return out


def _stages(layers: int, pp: int) -> list[int]:
    from memfit.plan.cluster_memory import stage_sizes

    return stage_sizes(layers, pp)


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
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    load_before = load()
    flops = _flops()
    predicted = _predicted(flops)
    times: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(CONTENDERS)
        rng.shuffle(order)
        for name in order:
            times[name].append(_measure(name))
    names = list(CONTENDERS)
    measured = [statistics.median(times[n]) for n in names]
    pred = [predicted[n]["total"] for n in names]
    save("cluster_rank", {
        "bench": "cluster_rank", "machine": machine(), "load_before": load_before, "load_after": load(),
        "model": MODEL, "seq": SEQ, "batch_per_process": BATCH, "processes": 2, "steps": STEPS, "rounds": args.rounds,
        "flops_measured": flops, "link_gbs_assumed": LINK_GBS,
        "contenders": {n: {"measured_s": times[n], "median_s": m, "spread_s": [min(times[n]), max(times[n])],
                           "predicted": predicted[n]} for n, m in zip(names, measured)},
        "spearman": spearman(pred, measured)})


def render(result: dict) -> str:
    rows = ["| layout (2 gloo processes) | predicted step (s) | measured median (s) | measured min-max (s) |",
            "|---|---:|---:|---:|"]
    for n, c in result["contenders"].items():
        rows.append(f"| {n} | {c['predicted']['total']:.3f} | {c['median_s']:.3f} | "
                    f"{c['spread_s'][0]:.3f}-{c['spread_s'][1]:.3f} |")
    return (f"### Cluster planner: predicted against measured step-time ranking\n\n"
            f"`PYTHONPATH=src python bench/cluster_rank.py --rounds {result['rounds']}` — {result['model']}, seq "
            f"{result['seq']}, --batch {result['batch_per_process']} per process, {result['rounds']} interleaved "
            f"shuffled rounds (few: each is a fresh 2-process launch on a loaded machine; load "
            f"{result['load_before']} before, {result['load_after']} after). FLOP rate measured "
            f"({result['flops_measured'] / 1e9:.1f} GFLOP/s, one thread), link assumed "
            f"{result['link_gbs_assumed']} GB/s.\n\n" + "\n".join(rows)
            + f"\n\nSpearman rank correlation (predicted vs measured): **{result['spearman']:.2f}**\n")


def snippets(result: dict) -> dict[str, str]:
    return {"cluster_rank": render(result).split("\n\n", 1)[1]}  # docs/planner.md has its own heading


if __name__ == "__main__":
    main()
