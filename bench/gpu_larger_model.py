"""The larger-model claim in physical bytes: under a fixed CUDA memory budget, the largest memfit GPT
that trains, for plain fp32 AdamW, for bf16-master + CPU optimizer offload + full checkpointing, and
for memfit's planner (memfit.fit with the same budget).

    PYTHONPATH=src python3 bench/gpu_larger_model.py --budget-gib 4 --out /tmp/gpu_larger_model.json
    PYTHONPATH=src python bench/gpu_larger_model.py --smoke --out /tmp/smoke.json     # tiny, CPU is fine
    # split over two commands (a device may allow 10 minutes a command; --time-limit defaults to 540 s):
    ... --contenders plain,offload --out R.json;  ... --contenders planner --resume R.json --out R.json

The budget is torch.cuda.set_per_process_memory_fraction(budget / total): the caching allocator
refuses to hold more, so what does not fit raises torch.cuda.OutOfMemoryError. A model "trains"
when `--steps` real optimizer steps finish and max_memory_allocated <= budget. Sizes come from one
fixed ladder (depth and width grow together; batch x seq fixed); each contender's search doubles its
step up the ladder from a start rung until a size fails, then bisects. Every trial runs in a fresh
subprocess with a timeout, so no OOM state or memory fraction leaks; a crash or a timeout counts as
"does not fit". On a CPU (--smoke) nothing enforces the budget: the run only checks the code paths.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, fmt_bytes, rss  # noqa: E402
from gpu_common import guarded, save_to, sync  # noqa: E402
from gpu_render import larger_model as render, larger_model_table as table  # noqa: E402,F401

import torch  # noqa: E402

NAME = "gpu_larger_model"
CONTENDERS = ("plain", "offload", "planner")
LABELS = {"plain": "plain fp32 AdamW", "offload": "bf16-master + CPU optimizer offload + full checkpointing",
          "planner": "memfit.fit (planner) at the same budget"}
# (layers, hidden): about 1.3-2x the parameters per rung, 12.6M to 51B without embeddings.
LADDER = [(4, 512), (6, 640), (8, 768), (8, 1024), (12, 1024), (12, 1280), (16, 1536), (16, 1792), (20, 2048),
          (24, 2304), (24, 2560), (28, 2816), (32, 3072), (32, 3584), (32, 4096), (40, 4608), (40, 5120),
          (48, 6144), (56, 7168), (64, 8192)]
SMOKE_LADDER = [(1, 32), (2, 64), (2, 96), (3, 128), (4, 192)]
PLANNER_ALLOW = "recompute,selective,offload-cpu,offload-disk,accumulate,chunked-head,optimizer-offload,precision"
HOST_BYTES_PER_PARAM = 16  # offload: fp32 master + two fp32 Adam moments + an fp32 gradient buffer


def spec_of(rung: tuple[int, int], vocab: int, seq: int) -> str:
    layers, hidden = rung
    return f"gpt:layers={layers},hidden={hidden},heads={max(1, hidden // 128)},vocab={vocab},seq={seq}"


def build(spec: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The GPT of `spec` created directly on `device` in `dtype` (no fp32 CPU copy of a large model)."""
    from memfit.models.gpt import GPT
    from memfit.models.spec import parse_model

    cfg = parse_model(spec).config
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return GPT(cfg)
    finally:
        torch.set_default_dtype(old)


def count_params(spec: str) -> int:
    return sum(p.numel() for p in build(spec, torch.float32, "meta").parameters())


# ---------------------------------------------------------------- one trial (in a fresh process)
def _setup_plain(spec: str, device: str, budget: int, tmp: str):
    model = build(spec, torch.float32, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))

    def step(x, y):
        _, loss, n = model(x, y)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach() / n
    return model, step, None, {}


def _setup_offload(spec: str, device: str, budget: int, tmp: str):
    import memfit
    from memfit.apply.optimizer import TrainingOptimizer

    model = build(spec, torch.bfloat16, device)  # bf16 weights straight onto the device
    memfit.checkpoint(model, "full")
    opt = TrainingOptimizer(model, "adamw", lr=1e-4, precision="bf16-master", offload="cpu")

    def step(x, y):
        with opt.autocast():
            _, loss, n = model(x, y)
        opt.backward(loss / n, final=True)
        opt.step()
        return loss.detach() / n
    return model, step, opt, {}


def _setup_planner(spec: str, device: str, budget: int, tmp: str, batch: int = 1, plan_budget: int = 0):
    import memfit
    from memfit.apply.policy import to_string
    from memfit.apply.precision import precision_mode

    seq = int(spec.rsplit("seq=", 1)[1])
    meta = build(spec, torch.float32, "meta")
    x = torch.zeros(batch, seq, dtype=torch.long, device=device)
    t0 = time.perf_counter()
    plan = memfit.fit(meta, (x, x), budget=plan_budget, optimizer="adamw", precision="32-true", allow=PLANNER_ALLOW,
                      device=device.split(":")[0])
    info = {"plan_seconds": time.perf_counter() - t0, "plan_precision": plan.precision,
            "plan_offload_optimizer": plan.offload_optimizer, "plan_micro_batch": plan.micro_batch,
            "plan_accumulation": plan.accumulation, "plan_actions": to_string(plan.actions)[:300],
            "plan_head_chunks": getattr(plan, "head_chunks", None), "plan_predicted_peak": plan.predicted_peak}
    print(plan.summary(), flush=True)
    model = build(spec, precision_mode(plan.precision).param_dtype, device)
    opt = plan.apply(model, lr=1e-4, spill_dir=tmp)
    micro, accum = plan.micro_batch, plan.accumulation

    def step(x, y):
        total = 0.0
        for k in range(accum):
            xs, ys = x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]
            with opt.autocast():
                _, loss, _ = model(xs, ys)
            opt.backward(loss / y.numel(), final=k == accum - 1)
            total += float(loss.detach())
        opt.step()
        return torch.tensor(total / y.numel())
    return model, step, opt, info


SETUPS = {"plain": _setup_plain, "offload": _setup_offload, "planner": _setup_planner}


def _host_state_bytes(opt) -> int | None:
    streamed = getattr(opt, "streamed", None)
    if streamed is None or streamed.where == "device":
        return None
    return sum(t.numel() * t.element_size() for t in streamed.state_tensors() if t.device.type == "cpu")


def run_trial(t: dict) -> dict:
    """Build, then `steps` optimizer steps of contender t["contender"] at t["spec"], under the budget."""
    device, budget = t["device"], t["budget"]
    cuda = device.startswith("cuda")
    res = {"spec": t["spec"], "fits": False}
    if cuda:
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(0).total_memory))
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    seq, vocab = int(t["spec"].rsplit("seq=", 1)[1]), int(t["spec"].split("vocab=")[1].split(",")[0])
    x = torch.randint(0, vocab, (t["batch"], seq), generator=g).to(device)
    y = torch.randint(0, vocab, (t["batch"], seq), generator=g).to(device)
    opt = None
    try:
        with tempfile.TemporaryDirectory(prefix="memfit-gpu-") as tmp:
            setup = SETUPS[t["contender"]]
            kw = {"batch": t["batch"], "plan_budget": t["plan_budget"]} if t["contender"] == "planner" else {}
            model, step, opt, info = setup(t["spec"], device, budget, tmp, **kw)
            res.update(info, params=sum(p.numel() for p in model.parameters()))
            times, losses = [], []
            for _ in range(t["steps"]):
                sync(device)
                t0 = time.perf_counter()
                losses.append(float(step(x, y)))
                sync(device)
                times.append(time.perf_counter() - t0)
            res.update(step_seconds=times, losses=losses, host_state_bytes=_host_state_bytes(opt), completed=True)
    except torch.cuda.OutOfMemoryError as exc:
        res["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0][:300]}"
    except Exception as exc:  # noqa: BLE001 - recorded as the trial's result
        res["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        if opt is not None and hasattr(opt, "close"):
            guarded(opt.close)
    res["peak_rss_bytes"] = rss()[1]
    if cuda:
        res.update(max_memory_allocated=torch.cuda.max_memory_allocated(),
                   max_memory_reserved=torch.cuda.max_memory_reserved())
        res["fits"] = bool(res.get("completed")) and res["max_memory_allocated"] <= budget
    else:
        res["fits"] = bool(res.get("completed"))
    return res


# ---------------------------------------------------------------- the search (parent process)
def trial_in_subprocess(t: dict, timeout: float) -> dict:
    fd, out = tempfile.mkstemp(suffix=".json", prefix="memfit-trial-")
    os.close(fd)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--trial", json.dumps(t), "--out", out], env=env,
                              capture_output=True, text=True, timeout=timeout)
        text = Path(out).read_text()
        if proc.returncode != 0 or not text:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[:400]
            res = {"spec": t["spec"], "fits": False, "error": f"exit {proc.returncode}: {tail}"}
        else:
            res = json.loads(text)
    except subprocess.TimeoutExpired:
        res = {"spec": t["spec"], "fits": False, "error": f"timeout after {timeout:.0f} s"}
    finally:
        os.unlink(out)
    res["trial_seconds"] = round(time.perf_counter() - t0, 1)
    return res


def host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class OutOfTime(Exception):
    """The script's --time-limit is spent: the search stops with what it has."""


def search(contender: str, args, ladder: list, start: int) -> dict:
    """Doubling from `start` up the ladder until a rung fails, then bisection; at most args.max_trials."""
    trials: dict[int, dict] = {}

    def fits(i: int) -> bool:
        if i not in trials:
            left = args.deadline - time.perf_counter()
            if left < 20:
                raise OutOfTime
            spec = spec_of(ladder[i], args.vocab, args.seq)
            params = count_params(spec)
            host = host_available()
            if contender != "plain" and host and params * HOST_BYTES_PER_PARAM > 0.85 * host:
                trials[i] = {"spec": spec, "params": params, "fits": False,
                             "error": f"skipped: ~{fmt_bytes(params * HOST_BYTES_PER_PARAM)} of host state > 85% of "
                                      f"{fmt_bytes(host)} available"}
            else:
                budget = int(args.budget * (args.planner_budget_frac if contender == "planner" else 1.0))
                t = {"contender": contender, "spec": spec, "device": args.device, "budget": args.budget,
                     "plan_budget": budget,
                     "batch": args.batch, "steps": args.steps}
                trials[i] = trial_in_subprocess(t, min(args.trial_timeout, left))
                trials[i].setdefault("params", params)
            r = trials[i]
            print(f"  {contender:8s} rung {i:2d} {spec}: {'fits' if r['fits'] else 'no'} "
                  f"({r['params'] / 1e6:,.1f}M params, {r['trial_seconds'] if 'trial_seconds' in r else 0} s)"
                  + (f"  [{r['error'][:120]}]" if r.get("error") else ""), flush=True)
        return trials[i]["fits"]

    lo, hi, step, stopped = -1, len(ladder), 1, None
    try:
        lo, hi = _double_then_bisect(fits, start, len(ladder), args.max_trials, trials)
    except OutOfTime:
        stopped = "time limit"
        ok = [i for i, t in trials.items() if t["fits"]]
        bad = [i for i, t in trials.items() if not t["fits"]]
        lo, hi = max(ok, default=-1), min(bad, default=len(ladder))
    best = trials[lo] if lo >= 0 else None
    return {"label": LABELS[contender], "start_rung": start, "best_rung": lo if lo >= 0 else None,
            "best_params": best["params"] if best else 0, "best_spec": best["spec"] if best else None,
            "bracketed": hi == lo + 1 or lo == len(ladder) - 1, "stopped": stopped,
            "trials": [dict(rung=i, **trials[i]) for i in sorted(trials)]}


def _double_then_bisect(fits, start: int, n: int, max_trials: int, trials: dict) -> tuple[int, int]:
    """(largest rung that fits or -1, smallest that fails or n)."""
    lo, hi, step = -1, n, 1
    if fits(start):
        lo = start
        while len(trials) < max_trials:
            nxt = min(lo + step, n - 1)
            if nxt == lo:
                break
            if fits(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
                break
    else:
        hi = start
    while hi - lo > 1 and len(trials) < max_trials:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


# ---------------------------------------------------------------- main, table, render
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gib", type=float, default=4.0, help="CUDA memory budget in GiB (default 4)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per trial (the first one warms up)")
    ap.add_argument("--trial-timeout", type=float, default=180.0, help="seconds per trial before it counts as failed")
    ap.add_argument("--max-trials", type=int, default=8, help="trials per contender at most")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--time-limit", type=float, default=540.0,
                    help="seconds for the whole search (the device allows 10 minutes a command); then it stops")
    ap.add_argument("--planner-budget-frac", type=float, default=1.0,
                    help="the planner is given this fraction of the budget (default 1: the same budget)")
    ap.add_argument("--start", type=int, default=0,
                    help="the first rung of the first contender searched (later ones start at the best rung so far)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--smoke", action="store_true", help="a tiny ladder, batch 2 x seq 64, vocab 256 (CPU is fine)")
    ap.add_argument("--out", default=None, help="the JSON file (default bench/results/gpu_larger_model.json)")
    ap.add_argument("--resume", default=None, help="a JSON this script wrote: keep its contenders and run only the "
                    "others named in --contenders (so the search can be split over several commands)")
    ap.add_argument("--trial", default=None, help=argparse.SUPPRESS)  # internal: run one trial, JSON to --out
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.batch, args.seq, args.vocab, args.budget_gib = 2, 64, 256, min(args.budget_gib, 1.0)
    args.budget = int(args.budget_gib * 2**30)
    args.deadline = time.perf_counter() + args.time_limit
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trial:
        Path(args.out).write_text(json.dumps(run_trial(json.loads(args.trial))))
        return
    ladder = SMOKE_LADDER if args.smoke else LADDER
    print(f"budget {fmt_bytes(args.budget)} on {args.device}; batch {args.batch} x seq {args.seq}, vocab {args.vocab}",
          flush=True)
    contenders: dict[str, dict] = {}
    if args.resume and Path(args.resume).exists():
        contenders = {k: v for k, v in json.loads(Path(args.resume).read_text())["contenders"].items() if "trials" in v}
        print(f"resumed from {args.resume}: {', '.join(contenders) or 'nothing'}", flush=True)
    start = min(args.start, len(ladder) - 1)
    for name in [c.strip() for c in args.contenders.split(",") if c.strip() and c.strip() not in contenders]:
        # a later contender starts at the best rung found so far (the planner may choose the offload setup)
        found = [c["best_rung"] for c in contenders.values() if c.get("best_rung") is not None]
        first = start if name == "plain" or not found else max(found)
        contenders[name] = guarded(lambda: search(name, args, ladder, first))
    base = contenders.get("plain", {}).get("best_params") or 0
    for c in contenders.values():
        if "best_params" in c:
            c["ratio_vs_plain"] = c["best_params"] / base if base else None
    result = {"smoke": args.smoke, "device": args.device, "budget_bytes": args.budget, "batch": args.batch,
              "planner_budget_bytes": int(args.budget * args.planner_budget_frac), "time_limit": args.time_limit,
              "seq": args.seq, "vocab": args.vocab, "steps_per_trial": args.steps, "trial_timeout": args.trial_timeout,
              "ladder": [spec_of(r, args.vocab, args.seq) for r in ladder],
              "method": "per trial: a fresh process, set_per_process_memory_fraction(budget / total memory), build the "
                        "model on the device, `steps` optimizer steps; fits = the steps finished without "
                        "OutOfMemoryError and max_memory_allocated <= budget. Search: doubling up the ladder from the "
                        "start rung (each later contender starts at the best rung found before it), then bisection.",
              "notes": ["offload: the bf16 weights are created directly on the GPU in bf16, so the fp32 masters on "
                        "the CPU start from bf16-rounded values (memory is what is measured here)",
                        "plain: torch.optim.AdamW(fused=True on CUDA), fp32 weights, no checkpointing",
                        "planner: memfit.fit(meta model, example, budget, precision='32-true', "
                        f"allow='{PLANNER_ALLOW}'),"
                        " the real model built in the planned precision's parameter dtype, then plan.apply"],
              "contenders": contenders}
    path = save_to(args.out, NAME, result)
    print(f"wrote {path}\n")
    print(table(result))


if __name__ == "__main__":
    main()
