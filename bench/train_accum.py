"""Gradient accumulation: at the same tokens per optimizer step, how much peak memory does splitting
the batch into micro-batches save, what does it cost in speed, and are the grads the same?

    .venv/bin/python bench/train_accum.py

memfit's default training model (byte-level GPT, 1.9M parameters), 32 sequences x 128 bytes per
optimizer step, AdamW, fp32 on CPU, split as 32x1, 16x2, 8x4 and 4x8 (micro-batch x accumulation).
Peak and activation bytes of one steady-state step come from memfit's tracker; step times are timed
side by side (bench/common.py: shuffled order each round, >= 5 rounds, median and spread, load
average); the grad difference is the largest absolute difference from the unsplit batch's grads on
the same data.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, fmt_spread, interleaved, load_line, run_line, save  # noqa: E402

from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.core.tracker import track  # noqa: E402
from memfit.models.spec import parse_model  # noqa: E402
from memfit.train.data import WindowSampler, load_corpus  # noqa: E402
from memfit.train.loop import DEFAULT_MODEL, accumulate_grads, accumulate_step  # noqa: E402

NAME = "train_accum"
TOTAL, SEQ, REPEATS = 32, 128, 5
SPLITS = [(32, 1), (16, 2), (8, 4), (4, 8)]


def micro_batches(x: torch.Tensor, y: torch.Tensor, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, x.shape[0], batch)]


def main() -> None:
    torch.set_num_threads(1)  # on a shared machine, OpenMP threads that lose their core stall at barriers
    torch.manual_seed(0)
    corpus = load_corpus(min_split_bytes=SEQ + 1)
    x, y = WindowSampler(corpus.train, TOTAL, SEQ, seed=0).next()
    base = parse_model(DEFAULT_MODEL).build(seq=SEQ)

    # Same weights, same data: grads of every split against the unsplit batch.
    grads = {}
    for batch, accum in SPLITS:
        model = copy.deepcopy(base)
        accumulate_grads(model, TrainingOptimizer(model, "sgd", lr=0.0), micro_batches(x, y, batch))
        grads[(batch, accum)] = [p.grad.clone() for p in model.parameters()]
    ref = grads[SPLITS[0]]

    runs = {}
    for batch, accum in SPLITS:
        model = copy.deepcopy(base)
        opt = TrainingOptimizer(model, "adamw", lr=1e-4)
        accumulate_step(model, opt, micro_batches(x, y, batch))  # warm-up; creates the optimizer state
        with track(model, opt.optimizer) as t:
            accumulate_step(model, opt, micro_batches(x, y, batch))
        runs[(batch, accum)] = {"model": model, "opt": opt, "peak": t.peak_bytes, "breakdown": t.breakdown, "times": []}
    timing = interleaved({f"{b} x {a}": (lambda r=r, b=b: accumulate_step(r["model"], r["opt"], micro_batches(x, y, b)))
                          for (b, a), r in runs.items()}, rounds=REPEATS, warmup=0)  # each ran two steps above

    rows = []
    for (batch, accum), r in runs.items():
        step = timing["wall"][f"{batch} x {accum}"]
        sec = step["median"]
        diff = max((g - g0).abs().max().item() for g, g0 in zip(grads[(batch, accum)], ref))
        rows.append({
            "micro_batch": batch, "accum": accum, "tokens_per_step": TOTAL * SEQ,
            "peak_bytes": r["peak"], "activations": r["breakdown"]["activations"],
            "temporaries": r["breakdown"]["temporaries"], "step": step, "step_seconds": sec,
            "tokens_per_s": TOTAL * SEQ / sec, "max_grad_diff": diff,
        })
        print(f"{batch:>3} x {accum}: peak {fmt_bytes(r['peak'])}, {TOTAL * SEQ / sec:,.0f} tok/s, grad diff {diff:.1e}")
    path = save(NAME, {"model": DEFAULT_MODEL, "seq": SEQ, "sequences_per_step": TOTAL, "repeats": REPEATS,
                       "threads": torch.get_num_threads(), "rows": rows,
                       "timing": {k: v for k, v in timing.items() if k not in ("wall", "cpu")}})
    print(f"wrote {path}")


def render(result: dict) -> str:
    from render import machine_line

    rows = result["rows"]
    full = rows[0]
    lines = [
        "## train_accum: gradient accumulation trades speed for activation memory",
        "",
        "`.venv/bin/python bench/train_accum.py`",
        "",
        machine_line(result) + f" {result['threads']} intra-op thread(s). " + run_line(result),
        "",
        f"Model `{result['model']}`, {result['sequences_per_step']} sequences x {result['seq']} bytes per "
        f"optimizer step, AdamW, fp32; peak = memfit tracker, one steady-state step; step time side by side: "
        + (load_line(result["timing"], result["machine"]["cores"]) if "timing" in result else ""),
        "",
        "| micro-batch x accum | peak | activations | peak vs 1 step | step time | tokens/s (median) | "
        "max abs grad diff vs unsplit |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['micro_batch']} x {r['accum']} | {fmt_bytes(r['peak_bytes'])} | {fmt_bytes(r['activations'])} | "
            f"{r['peak_bytes'] / full['peak_bytes']:.2f}x | {fmt_spread(r['step']) if 'step' in r else '–'} | "
            f"{r['tokens_per_s']:,.0f} | {r['max_grad_diff']:.1e} |"
        )
    last = rows[-1]
    lines += [
        "",
        f"Splitting the same {rows[0]['tokens_per_step']} tokens into {last['accum']} micro-batches cuts the step's "
        f"peak to {last['peak_bytes'] / full['peak_bytes']:.0%} of the unsplit step (activations scale with the "
        f"micro-batch) at {last['tokens_per_s'] / full['tokens_per_s']:.0%} of its speed (median against median), "
        f"with grads equal to "
        f"fp32 rounding (loss summed per micro-batch, divided by the whole batch's token count).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
