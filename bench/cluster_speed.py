"""Cluster planner: time to answer `memfit plan MODEL --budget 80GiB --gpus auto --precision bf16-master`
for llama-2-70b and a llama-3-405b-class model, cold (a fresh cache folder: every trace made again)
and warm (the same folder again), interleaved in shuffled rounds.

    PYTHONPATH=src python bench/cluster_speed.py [--rounds 3]

Each run is a fresh process (`python -m memfit plan ... --json`): its wall seconds, its CPU seconds
(user + system, from the children's rusage) and the planner's own seconds in process (the JSON's
`cluster.seconds`, imports excluded). The answer (devices, strategy, per-rank peak predicted and
traced, predicted tokens/s) is recorded from the last run. The machine is shared: the load is
recorded before and after, and wall seconds beside CPU seconds (wall is mostly waiting for a core).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_paper import LLAMA_405B  # noqa: E402
from common import ROOT, load, machine, save  # noqa: E402

MODELS = {"llama-2-70b": "llama-2-70b", "llama-3-405b-class": LLAMA_405B}
TARGET_S = 30.0


def _run(model: str, cache: str) -> dict:
    cmd = [sys.executable, "-m", "memfit", "plan", model, "--budget", "80GiB", "--gpus", "auto", "--precision",
           "bf16-master", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MEMFIT_CACHE_DIR": cache}
    env.pop("MEMFIT_NO_CACHE", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"{model}: {proc.stderr[-2000:]}")
    c = json.loads(proc.stdout)["cluster"]
    lay = c["layout"]
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "in_process_s": c["seconds"],
            "answer": {"gpus": c["gpus"], "strategy": lay["strategy"], "dp": lay["dp"], "tp": lay["tp"],
                       "pp": lay["pp"], "micro_batch": lay["rows"], "accumulation": lay["accum"],
                       "offload_optimizer": lay["offload_optimizer"], "counts": lay["counts"], "peak": c["peak"],
                       "traced_peak": c["traced_peak"], "tokens_per_s": c["tokens_per_s"],
                       "tokens_per_s_per_device": c["tokens_per_s"] / c["gpus"], "global_batch": c["global_batch"],
                       "seq": c["seq"], "time_basis": c["time_basis"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    load_before = load()
    runs: dict[str, dict[str, list]] = {m: {"cold": [], "warm": []} for m in MODELS}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="memfit-cluster-speed-") as root:
        for i in range(args.rounds):
            order = list(MODELS)
            rng.shuffle(order)
            for name in order:
                cache = str(Path(root) / f"{name}-{i}")  # fresh: cold; then the same folder: warm
                runs[name]["cold"].append(_run(MODELS[name], cache))
                runs[name]["warm"].append(_run(MODELS[name], cache))
    out = {}
    for name, r in runs.items():
        out[name] = {"answer": r["cold"][-1]["answer"]}
        for kind in ("cold", "warm"):
            for fig in ("wall_s", "cpu_s", "in_process_s"):
                vals = [x[fig] for x in r[kind]]
                out[name][f"{kind}_{fig}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                                              "all": vals}
    save("cluster_speed", {"load_before": load_before, "load_after": load(), "rounds": args.rounds,
                           "target_s": TARGET_S, "models": out})


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def render(result: dict) -> str:
    rows = ["| model | answer | predicted tokens/s (per device) | cold: wall / CPU / in process (s) | "
            "warm: wall / CPU / in process (s) |", "|---|---|---:|---:|---:|"]
    for name, m in result["models"].items():
        a = m["answer"]
        deg = f"dp {a['dp']}" + (f" x tp {a['tp']}" if a["tp"] > 1 else "") + (f" x pp {a['pp']}" if a["pp"] > 1 else "")
        ans = (f"{a['gpus']} GPUs, {a['strategy']} ({deg}), micro-batch {a['micro_batch']} x {a['accumulation']} "
               f"(global batch {a['global_batch']} x seq {a['seq']})"
               + (", optimizer offloaded" if a["offload_optimizer"] else "")
               + f"; peak {_gib(a['peak'])} per rank (full trace {_gib(a['traced_peak'])})")
        cell = lambda k: " / ".join(f"{m[f'{k}_{f}']['median']:.1f}" for f in ("wall_s", "cpu_s", "in_process_s"))  # noqa: E731
        rows.append(f"| {name} | {ans} | {a['tokens_per_s']:,.0f} ({a['tokens_per_s_per_device']:,.0f}) | "
                    f"{cell('cold')} | {cell('warm')} |")
    wall = [m[f"{k}_wall_s"]["max"] for m in result["models"].values() for k in ("cold", "warm")]
    cpu = [m[f"{k}_cpu_s"]["max"] for m in result["models"].values() for k in ("cold", "warm")]
    return (f"`PYTHONPATH=src python bench/cluster_speed.py --rounds {result['rounds']}` — `memfit plan MODEL "
            f"--budget 80GiB --gpus auto --precision bf16-master`, each run a fresh process; cold: a fresh cache "
            f"folder, warm: the same folder again; medians of {result['rounds']} interleaved rounds (load "
            f"{result['load_before']} before, {result['load_after']} after, on 2 cores). Tokens/s by the FLOP model "
            f"(400 TFLOP/s per device assumed, not measured).\n\n" + "\n".join(rows)
            + f"\n\nSlowest run: {max(wall):.1f} s wall, {max(cpu):.1f} s CPU (target: under {result['target_s']:.0f} s "
            f"wall). With the load above 2 the wall time is mostly waiting for a core.\n")


def snippets(result: dict) -> dict[str, str]:
    return {"cluster_speed": render(result)}


if __name__ == "__main__":
    main()
