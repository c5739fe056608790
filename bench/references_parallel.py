"""Korthikanti et al. 2022's per-layer activation formulas under tensor and sequence parallelism, next
to memfit's traced figure. Rows for bench/references.py (imported; never run alone):

    from references_parallel import korthikanti_parallel_rows
    rows = korthikanti_parallel_rows()     # [{name, reference, predicted, ratio, tolerance, note}, ...]

"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), Table 2: bytes a
transformer layer saves for backward in 16-bit, s sequence, b micro-batch of the TP group, h hidden,
a heads, t the tensor-parallel degree:

    tensor parallel                 sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel      sbh/t (34 + 5as/h)
    tensor parallel, attention core not saved (flash attention; the paper's "selective")  sbh(10 + 24/t)
    tensor + sequence parallel, idem                                                     sbh(34/t)

The constant 10 is the replicated part: the two norms' inputs (4), the inputs of the column-parallel
projections (2 + 2) and the two dropout masks (1 + 1); without dropout it is 8 (32 instead of 34
with sequence parallelism). 24/t is the sharded part: q, k, v (6), the attention output (2), the MLP's
4h-wide input and output of its activation function (8 + 8).

memfit's figure: the bytes memfit's trace of one layer's forward and backward counts as saved inside
the block (`module_activations["blocks.0"]`), for the model one TP rank runs
(memfit.measure.parallel_estimate.local_tp_gpt) on the TP group's b rows in bf16-true (16-bit
activations, as the paper). With sequence parallelism memfit's rule is the unsharded block's saved
bytes divided by t (memfit.measure.parallel_estimate: estimated only, memfit's runtime does not
run it), so those rows check that rule against the formula.

Attention kernel: the trace runs torch's scaled-dot-product attention as the target GPU would when
memfit.measure.trace.trace_step accepts device="h100"; otherwise on this CPU, where without dropout
torch runs its CPU flash kernel (output and logsumexp saved: the flash rows) and with dropout its
math path (whose saved bytes per score element differ from a GPU's; the note says so).
"""
from __future__ import annotations

import contextlib
from typing import Any

FORMULA_TOLERANCE = 0.03  # the bound for formula references
DEGREES = (1, 2, 4, 8)
# (name, h, a, s, b): the paper's Table 3 shapes, at its micro-batch sizes
SHAPES = (("22B", 6144, 64, 2048, 4), ("175B", 12288, 96, 2048, 1))
PAPER = "Korthikanti et al. 2022 (arXiv 2205.05198), Table 2"


def formula(kind: str, h: int, a: int, s: int, b: int, t: int, sp: bool) -> float:
    """The paper's bytes per layer for `kind` in ("flash", "flash+dropout", "math+dropout")."""
    sbh = s * b * h
    dropout = kind != "flash"
    replicated = 10 if dropout else 8
    scores = 5 * a * s / h if kind == "math+dropout" else 0.0
    if sp:
        return sbh * (replicated + 24 + scores) / t
    return sbh * (replicated + 24 / t + scores / t)


def _kernel(kind: str) -> Any:
    """torch's math attention for the no-flash rows; the default choice otherwise."""
    if kind.startswith("math"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def layer_saved(h: int, a: int, s: int, b: int, t: int, dropout: float, kind: str) -> tuple[int, int, str]:
    """(bytes one TP rank's layer saves, bytes the unsharded layer saves, device traced on)."""
    from memfit.core.errors import ConfigError
    from memfit.measure.parallel_estimate import block_saved, local_tp_gpt
    from memfit.measure.trace import trace_step
    from memfit.models.spec import parse_model

    import torch
    from references_layers import paper_precision  # 16-bit everything, no autocast: the paper's count

    spec = parse_model(f"gpt:layers=1,hidden={h},heads={a},vocab=128,seq={s},dropout={dropout}")
    device, out = "h100", []  # the GPU's kernels where memfit models them (a ConfigError otherwise)
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)  # math rows: the paper's 16-bit softmax
    try:
        for degree in (t, 1):
            with _kernel(kind):
                try:
                    tr = trace_step(lambda d=degree: local_tp_gpt(spec, s, d), b, s, paper_precision(), "sgd",
                                    device=device)
                except ConfigError:
                    device = "cpu"
                    tr = trace_step(lambda d=degree: local_tp_gpt(spec, s, d), b, s, paper_precision(), "sgd")
            out.append(block_saved(tr.module_activations, 1)[0])
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)
    return out[0], out[1], device


def korthikanti_parallel_rows(shapes=SHAPES, degrees=DEGREES) -> list[dict]:
    """One row per shape x kernel x degree x (tensor, tensor + sequence parallel)."""
    rows = []
    for name, h, a, s, b in shapes:
        for kind, dropout in (("flash", 0.0), ("flash+dropout", 0.1), ("math+dropout", 0.1)):
            for t in degrees:
                local, whole, device = layer_saved(h, a, s, b, t, dropout, kind)
                for sp, predicted in ((False, local), (True, whole // t)):
                    ref = formula(kind, h, a, s, b, t, sp)
                    rows.append(_row(name, h, a, s, b, t, sp, kind, ref, predicted, device))
    return rows


def _row(name: str, h: int, a: int, s: int, b: int, t: int, sp: bool, kind: str, ref: float, predicted: int,
         device: str) -> dict:
    layout = f"TP {t}" + (" + SP" if sp else "")
    kernel = {"flash": "flash attention, no dropout", "flash+dropout": "flash attention, dropout",
              "math+dropout": "no flash (s x s scores saved), dropout"}[kind]
    note = (f"{PAPER}; {name}-shaped layer h {h}, a {a}, s {s}, b {b} (the TP group's rows), 16-bit; "
            f"memfit traced on {device}")
    if sp:
        note += "; sequence parallel: memfit's rule (unsharded block / t), estimated only"
    if device == "cpu" and kind != "flash":
        note += ("; dropout > 0 runs torch's CPU math attention here, not the GPU's kernel: off until the "
                 "trace follows the GPU's attention backend")
    return {"name": f"Korthikanti per layer, {name}, {layout}, {kernel}", "reference": ref, "predicted": predicted,
            "ratio": predicted / ref, "tolerance": FORMULA_TOLERANCE, "note": note}


if __name__ == "__main__":
    import json
    import sys

    rows = korthikanti_parallel_rows(SHAPES[:1] if "--quick" in sys.argv else SHAPES)
    print(json.dumps(rows, indent=1))
