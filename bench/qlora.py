"""QLoRA (LoRA on an NF4 base): the estimate against a real step, and what the 4-bit base saves.

    python bench/qlora.py

1. A small Llama-shaped memfit spec, LoRA r=8 on qkv and proj over an NF4 base, batch 2 x seq 32, AdamW,
   in 32-true and bf16-true: the traced estimate, the tracked peak of a real CPU step and the allocator's
   peak over the same step (profiler memory events).
2. llama-2-7b, LoRA r=16 on qkv and proj, batch 4 x seq 2048, bf16-true, full recompute (the issue's
   24 GB question): the estimate with a 16-bit base and with an NF4 base, and the NF4 base's weight
   bytes from the formula (memfit.models.qlora.nf4_bytes) beside the traced parameter bytes.
Writes bench/results/qlora.json; no timings (memory figures are deterministic).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import fmt_bytes, run_line, save  # noqa: E402

import memfit  # noqa: E402
from memfit.measure.trace import measure_step, trace_step  # noqa: E402
from memfit.models.lora import parse_lora  # noqa: E402
from memfit.models.qlora import is_nf4, nf4_bytes  # noqa: E402
from memfit.models.spec import parse_model  # noqa: E402

SMALL = "llama:layers=2,hidden=128,heads=4,vocab=512,seq=64"
BIG = "llama-2-7b"


def small_rows() -> list[dict]:
    spec = replace(parse_model(SMALL), lora=parse_lora("r=8,targets=qkv,proj,base=nf4"))
    rows = []
    for precision in ("32-true", "bf16-true"):
        pred = trace_step(spec, 2, 32, precision=precision)
        real = measure_step(spec, 2, 32, precision=precision)
        rows.append({"precision": precision, "estimate": pred.peak, "tracked": real.peak,
                     "allocator": real.allocator_peak, "breakdown": real.breakdown()})
    return rows


def big_rows() -> dict:
    import torch

    common = dict(batch=4, seq=2048, precision="bf16-true", lora="r=16,targets=qkv,proj", checkpoint="full")
    lora = memfit.estimate(BIG, **common)
    qlora = memfit.estimate(BIG, **common, qlora=True)
    model = replace(parse_model(BIG), lora=parse_lora("r=16,targets=qkv,proj,base=nf4")).on_meta()
    formula = sum(nf4_bytes(p.numel(), torch.bfloat16) if is_nf4(p) else p.numel() * 2 for p in model.parameters())
    return {"lora": lora.per_device, "qlora": qlora.per_device, "formula_params": formula}


def main() -> None:
    save("qlora", {"script": "qlora", "small": {"model": SMALL, "rows": small_rows()}, "big": big_rows()})


def snippets(r: dict) -> dict[str, str]:
    lines = [f"From `python bench/qlora.py`, run {r['date']}. `{r['small']['model']}`, LoRA r=8 on qkv and proj "
             "over an NF4 base, batch 2 x seq 32, AdamW, one CPU step:", "",
             "| precision | estimate | tracked (real step) | allocator (real step) |", "|---|---|---|---|"]
    for row in r["small"]["rows"]:
        lines.append(f"| {row['precision']} | {row['estimate']:,} B | {row['tracked']:,} B | {row['allocator']:,} B |")
    b = r["big"]
    lines += ["", f"`{BIG}`, LoRA r=16 on qkv and proj, batch 4 x seq 2048, bf16-true, full recompute (estimates):", "",
              "| base | params | activations | temporaries | total |", "|---|---|---|---|---|"]
    for name, key in (("16-bit", "lora"), ("NF4", "qlora")):
        d = b[key]
        lines.append(f"| {name} | {fmt_bytes(d['params'])} | {fmt_bytes(d['activations'])} | "
                     f"{fmt_bytes(d['temporaries'])} | {fmt_bytes(d['total'])} |")
    lines += ["", f"The NF4 base's parameter bytes by the formula: {b['formula_params']:,} B; traced: "
              f"{b['qlora']['params']:,} B."]
    return {"qlora": "\n".join(lines)}


def render(r: dict) -> str:
    return "\n".join(["## QLoRA: LoRA on an NF4 base (`bench/qlora.py`)", "", snippets(r)["qlora"], "", run_line(r)])


if __name__ == "__main__":
    main()
