"""The optimizer step in backward against the plain step: peak memory measured and estimated, losses,
step time.

    .venv/bin/python bench/step_in_backward.py

For each configuration (a GPT of 6 blocks, batch 4 x 64 tokens, every block checkpointed, as
low-memory recipes run it, on the CPU; precision, optimizer, LoRA adapters) and each of plain /
step in backward:
1. memory: the tracker's peak of the second of two real steps (memfit.measure.trace.measure_step)
   and the estimate of the same step under FakeTensorMode (trace_step), with the categories;
2. losses: STEPS steps from the same weights on the same batches, the per-step losses compared
   bit for bit (the update is the same torch optimizer's arithmetic per parameter);
3. step time: both contenders side by side (bench/common.interleaved: a warm-up, then ROUNDS rounds
   in a shuffled order; median and range), one intra-op thread.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt_bytes, fmt_spread, interleaved, load_line, run_line, save  # noqa: E402

MODEL = "gpt:layers=6,hidden=256,heads=4,vocab=4096"
BATCH, SEQ, STEPS, ROUNDS = 4, 64, 4, 5
CHECKPOINT = "full"  # without it this shape's peak is in the forward (activations), which the step in backward leaves
CONFIGS = [("32-true", "adamw", None), ("bf16-true", "adamw", None), ("32-true", "adamw8bit", None),
           ("bf16-mixed", "adamw", "r=8,targets=qkv,proj")]


def _spec(lora: str | None):
    from memfit.models.lora import parse_lora
    from memfit.models.spec import parse_model

    spec = parse_model(MODEL)
    return replace(spec, lora=parse_lora(lora)) if lora else spec


def _trainer(spec, precision: str, optimizer: str, sib: bool):
    """A model and optimizer from seed 0, and a function running its next step on seeded batches."""
    from memfit.apply.checkpoint import checkpoint
    from memfit.apply.optimizer import TrainingOptimizer

    torch.manual_seed(0)
    model = checkpoint(spec.build(seq=SEQ), CHECKPOINT)
    opt = TrainingOptimizer(model, optimizer, lr=1e-3, precision=precision, step_in_backward=sib)
    gen = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab

    def step() -> float:
        x = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        with opt.autocast():
            _, loss_sum, n = model(x, x)
        loss = loss_sum / n
        opt.backward(loss)
        opt.step()
        return loss.item()

    return step


def one(precision: str, optimizer: str, lora: str | None) -> dict:
    from memfit.measure.trace import measure_step, trace_step

    spec = _spec(lora)
    row: dict = {"precision": precision, "optimizer": optimizer, "lora": lora}
    for sib, key in ((False, "plain"), (True, "in_backward")):
        kw = dict(batch=BATCH, seq=SEQ, precision=precision, optimizer=optimizer, checkpoint=CHECKPOINT,
                  step_in_backward=sib)
        est = trace_step(spec, **kw)
        real = measure_step(spec, allocator=False, **kw)
        row[key] = {"estimate": est.breakdown(), "measured": real.breakdown()}
        print(f"  {precision} {optimizer} lora={lora} {key}: estimate {est.peak}, measured {real.peak}", flush=True)
    runs = {k: _trainer(spec, precision, optimizer, sib) for k, sib in (("plain", False), ("in_backward", True))}
    losses = {k: [run() for _ in range(STEPS)] for k, run in runs.items()}
    row["losses"] = losses
    row["losses_equal"] = losses["plain"] == losses["in_backward"]
    row["timing"] = interleaved(runs, rounds=ROUNDS)
    return row


def main() -> None:
    torch.set_num_threads(1)
    rows = [one(*c) for c in CONFIGS]
    path = save("step_in_backward", {"model": MODEL, "batch": BATCH, "seq": SEQ, "checkpoint": CHECKPOINT,
                                     "steps": STEPS, "rows": rows})
    print(f"wrote {path}")


def _table(result: dict) -> str:
    lines = ["| precision, optimizer | peak, plain step | peak, step in backward | saved | estimate = measured "
             "| losses bit-identical | step time plain | step time in backward |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p, b = r["plain"], r["in_backward"]
        exact = all(r[k]["estimate"] == r[k]["measured"] for k in ("plain", "in_backward"))
        mp, mb = p["measured"]["total"], b["measured"]["total"]
        name = f"{r['precision']}, {r['optimizer']}" + (f", LoRA {r['lora']}" if r["lora"] else "")
        t = r["timing"]["wall"]
        lines.append(f"| {name} | {fmt_bytes(mp)} | {fmt_bytes(mb)} | {100 * (mp - mb) / mp:.0f}% | "
                     f"{'yes, every category' if exact else 'NO'} | {'yes' if r['losses_equal'] else 'NO'} | "
                     f"{fmt_spread(t['plain'], 1e3, 'ms', 0)} | {fmt_spread(t['in_backward'], 1e3, 'ms', 0)} |")
    return "\n".join(lines)


def snippets(result: dict) -> dict[str, str]:
    note = (f"`python bench/step_in_backward.py`: {result['model']}, batch {result['batch']} x {result['seq']} "
            f"tokens, checkpoint {result['checkpoint']}, CPU; peaks are the tracker's (the second of two steps), "
            f"losses over {result['steps']} steps. "
            + load_line(result["rows"][0]["timing"]))
    return {"step_in_backward": _table(result) + "\n\n" + note}


def render(result: dict) -> str:
    m = result["machine"]
    return "\n".join(["## step_in_backward", "", "The optimizer step in backward against the plain step "
                      "(bench/step_in_backward.py).", "", snippets(result)["step_in_backward"], "", run_line(result),
                      f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; run {result['date']}."])


if __name__ == "__main__":
    main()
