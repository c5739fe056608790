"""The planner's time target where it means something (issue 37, step 3): on a ~1B Llama in bf16 on one
GPU, the step time of memfit's plan at the budget that leaves a third of the activation memory, against
no checkpointing, full checkpointing, and torch.compile's activation_memory_budget at the same fraction.

    PYTHONPATH=src python3 bench/gpu_planner_overhead.py [--batch 8 --seq 1024 --steps 6 --rounds 1]

Each contender runs in a fresh process (the caching allocator is per process): 2 warm-up steps, then
`--steps` timed steps (median and spread, CUDA synchronized), and torch.cuda.max_memory_reserved over
them. The batch is the largest of 8, 4, 2, 1 whose plain step fits. Activation memory: the plain step's
reserved peak less full checkpointing's; the budget: full checkpointing's peak plus a third of that.
memfit plans for the budget on this machine (memfit.fit(device="cuda"), its planning seconds recorded)
and its measured reserved peak must be within it. Overhead: step time over the plain step's. Moonshot:
at most 5% (MONeT reports 9-16%, Rockmate 10-20%). Without CUDA its JSON says it was skipped.
Writes bench/results/gpu_planner_overhead.json.
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

NAME = "gpu_planner_overhead"
LLAMA_1B = "llama:layers=22,hidden=2048,heads=32,kv_heads=4,ffn=5632,vocab=32000,seq={seq}"
PRECISION = "bf16-mixed"
FRACTION = 1 / 3
WARMUP = 2
TIMEOUT_S = 240


def one(kind: str, batch: int, seq: int, steps: int, plan_file: str | None, device: str = "cuda",
        model: str = LLAMA_1B) -> dict:
    """One contender in this process: step seconds and the reserved peak (or "oom"). `device` cpu and a
    small `model`: a smoke run of this code on a machine without CUDA (no memory figures)."""
    import torch

    from memfit.apply.checkpoint import checkpoint
    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.models.spec import parse_model
    from memfit.plan.loop_step import _spec_batch, _spec_forward

    torch.manual_seed(0)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.device(device):
        model = parse_model(model.format(seq=seq)).build(seq=seq)
    model.train()
    if kind == "full":
        checkpoint(model, "full")
    if kind == "memfit":
        from memfit.plan.plan import Plan

        plan = Plan.from_json(json.loads(Path(plan_file).read_text()))
        opt = plan.apply(model, lr=1e-4)
    else:
        opt = TrainingOptimizer(model, "adamw", lr=1e-4, precision=PRECISION)
    forward = _spec_forward
    if kind == "compile":
        import torch._functorch.config as fc

        fc.activation_memory_budget = FRACTION
        compiled = torch.compile(model)

        def forward(m, b):  # memfit's GPT returns (logits, summed loss, tokens), as _spec_forward reads it
            out = compiled(*b)
            return out, out[1] / out[2]
    data = _spec_batch(model, batch, seq, torch.device(device))
    times = []
    try:
        for i in range(WARMUP + steps):
            if i == WARMUP:
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with opt.autocast():
                _, loss = forward(model, data)
            opt.backward(loss)
            opt.step()
            sync()
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {"kind": kind, "oom": True}
    if not cuda:
        return {"kind": kind, "step_s": times}
    return {"kind": kind, "step_s": times, "reserved": torch.cuda.max_memory_reserved(),
            "allocated": torch.cuda.max_memory_allocated()}


def _child(kind: str, batch: int, seq: int, steps: int, plan_file: str | None = None) -> dict:
    argv = [sys.executable, __file__, "--one", kind, "--batch", str(batch), "--seq", str(seq), "--steps", str(steps)]
    try:
        p = subprocess.run(argv + (["--plan", plan_file] if plan_file else []), capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "error": f"timed out after {TIMEOUT_S} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if p.returncode == 0 and lines else {"kind": kind, "error": p.stderr[-1500:]}


def _plan(budget: int, batch: int, seq: int, folder: str) -> tuple[str, dict]:
    import memfit

    t0, c0 = time.perf_counter(), time.process_time()
    plan = memfit.fit(LLAMA_1B.format(seq=seq), budget=f"{budget}B", batch=batch, seq=seq, precision=PRECISION,
                      device="cuda", allow="recompute,selective,chunked-head")
    path = os.path.join(folder, "plan.json")
    Path(path).write_text(json.dumps(plan.to_json()))
    return path, {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
                  "summary": plan.summary().splitlines()}


def run(batch: int, seq: int, steps: int, rounds: int, save) -> dict:
    """The contenders; `save(result)` after each one, so a round cut short by its time box keeps them."""
    import torch

    out: dict = {"model": LLAMA_1B.format(seq=seq), "precision": PRECISION, "fraction": FRACTION, "seq": seq,
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": steps, "rounds": rounds}
    plain = None
    for b in [x for x in (8, 4, 2, 1) if x <= batch]:  # the largest batch whose plain step fits
        plain = _child("none", b, seq, steps)
        if "reserved" in plain:
            batch = b
            break
    if plain is None or "reserved" not in plain:
        return save({**out, "error": "the plain step does not fit at batch 1", "plain": plain})
    full = _child("full", batch, seq, steps)
    if "reserved" not in full:
        return save({**out, "error": "full checkpointing failed", "full": full})
    budget = full["reserved"] + int((plain["reserved"] - full["reserved"]) * FRACTION)
    runs: dict = {"none": [plain], "full": [full], "memfit": [], "compile": []}
    out.update(batch=batch, budget=budget)
    with tempfile.TemporaryDirectory() as folder:
        plan_file, out["planning"] = _plan(budget, batch, seq, folder)
        for r in range(rounds):
            order = ["memfit", "compile"] + (["none", "full"] if r else [])
            random.Random(r).shuffle(order)
            for kind in order:
                runs[kind].append(_child(kind, batch, seq, steps, plan_file if kind == "memfit" else None))
                result = save({**out, "rows": _rows(runs, budget)})
    return result


def _rows(runs: dict, budget: int) -> dict:
    base = statistics.median(t for g in runs["none"] for t in g.get("step_s", []))
    rows = {}
    for kind, got in runs.items():
        ts = [t for g in got for t in g.get("step_s", [])]
        peaks = [g["reserved"] for g in got if "reserved" in g]
        rows[kind] = {"step_s_median": statistics.median(ts) if ts else None, "step_s_min": min(ts, default=None),
                      "step_s_max": max(ts, default=None), "overhead": statistics.median(ts) / base - 1 if ts else None,
                      "reserved_max": max(peaks, default=None), "within_budget": bool(peaks) and max(peaks) <= budget,
                      "errors": [g.get("error") or ("oom" if g.get("oom") else None) for g in got if "step_s" not in g]}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke run of --one
    ap.add_argument("--model", default=LLAMA_1B, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.batch, args.seq, args.steps, args.plan, args.device, args.model)))
        return
    import torch

    from common import save

    if not torch.cuda.is_available():  # the result says so, so that the manifest's every result exists
        print(save(NAME, {"skipped": "no CUDA on this machine: nothing measured", "model": LLAMA_1B.format(seq=args.seq),
                          "fraction": FRACTION}))
        return
    def keep(result: dict) -> dict:
        print(save(NAME, result), flush=True)
        return result

    run(args.batch, args.seq, args.steps, args.rounds, keep)


def render(result: dict) -> str:
    lines = ["## GPU planner overhead: memfit's plan against full checkpointing and torch.compile's budget", "",
             "`PYTHONPATH=src python3 bench/gpu_planner_overhead.py` (bench/gpu_round.sh, step 3).", ""]
    if "rows" not in result:
        return "\n".join(lines + [f"Not measured: {result.get('skipped') or result.get('error')}."]) + "\n"
    lines += [f"{result['model']}, {result['precision']}, batch {result['batch']} x {result['seq']}, budget "
              f"{result['budget'] / 2**30:.2f} GiB (a third of the activation memory left); {result['device']}, "
              f"torch {result['torch']}; memfit planned in {result['planning']['cpu_s']} CPU-s.", "",
              "| contender | step s (median, min-max) | overhead | max reserved | within budget |",
              "|---|---:|---:|---:|---|"]
    for kind, r in result["rows"].items():
        if r["step_s_median"] is None:
            lines.append(f"| {kind} | {r['errors']} | | | |")
            continue
        lines.append(f"| {kind} | {r['step_s_median']:.3f} ({r['step_s_min']:.3f}-{r['step_s_max']:.3f}) | "
                     f"{100 * r['overhead']:+.1f}% | {r['reserved_max'] / 2**30:.2f} GiB | {r['within_budget']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
