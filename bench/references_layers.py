"""Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), section 4:
activation bytes a transformer layer keeps for backward, without tensor parallelism:

    sbh (34 + 5as/h)         attention computed unfused: softmax output 2as^2b, its dropout mask as^2b,
                             the dropped probabilities 2as^2b
    sbh 34                   the same with flash attention: no s x s tensor (the paper, section 4.1 and 5)
    sbh 32                   flash and no dropout: the two 1-byte masks (attention output, MLP output) gone

The paper's assumptions: 16-bit activations, 1-byte dropout masks, GELU MLP of width 4h, two
LayerNorms, and (flash rows) a logsumexp small enough to leave out (4as/h bytes per sbh: under 0.05%).
memfit's figure: the bytes saved for backward by ops inside one block of memfit's GPT of that shape
(dropout 0.1 or 0), traced with `--device h100`, in bf16 weights and activations without autocast (the
paper's 16-bit everything: `PAPER_PRECISION`); one row per shape also gives memfit's own bf16-master,
which runs under autocast: CUDA's autocast keeps LayerNorm in fp32, so each of the two norms saves an
fp32 copy of its input, 2 x 2sbh more than the paper's fused 16-bit norm (outside 3%, explained); the unfused rows trace torch's math attention
(`torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`, what a GPU runs when no fused kernel is enabled), once
kept in 16-bit as the paper assumes and once as torch runs it by default (fp32 scores: outside 3%, explained).
"""
from __future__ import annotations

from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (hidden h, heads a, seq s, micro-batch b); 22B and 175B as in the paper's Table 3
    "22B": (6144, 64, 2048, 4),
    "175B": (12288, 96, 2048, 1),
    "small": (1024, 16, 1024, 2),
}
MATH_NOTE = ("outside 3% by design: the paper's unfused figure is Megatron's 16-bit softmax kernel (2 + 1 + 2 bytes per "
             "score); torch's math attention on a GPU upcasts 16-bit inputs to fp32 and keeps the fp32 softmax, the "
             "1-byte dropout mask and the fp32 dropped probabilities (4 + 1 + 4 bytes per score) plus fp32 copies of q, k, v")


AUTOCAST_NOTE = ("sbh*34; outside 3% by design: memfit's bf16-master runs under autocast, and CUDA's autocast "
                 "keeps LayerNorm in fp32, so each of the two norms saves an fp32 copy of its bf16 input: "
                 "2 x 2sbh = 4sbh more than the paper's 16-bit norm input (Megatron's fused norm)")
VIEW_NOTE = ("; outside 3% at b = 1, explained: the batched matmul then saves v as a view of the fused qkv "
             "projection's output (no copy is needed), which keeps all 6sbh of that storage alive where the paper "
             "counts a 2sbh v, 4sbh more: the bytes a real run holds")


def paper_precision():
    """bf16 weights and activations, no autocast: every activation in 16-bit, as the paper counts."""
    import torch

    from memfit.apply.precision import PrecisionMode

    return PrecisionMode("bf16, no autocast", torch.bfloat16, None, None, False)


def saved_per_layer(h: int, a: int, s: int, b: int, dropout: float, fused: bool = True, device: str = "h100",
                    reduced: bool = False, precision=None) -> int:
    """Bytes one block of memfit's GPT of this shape saves for backward, traced on `device`. fused=False:
    torch's math attention; reduced: with torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)."""
    import contextlib

    import torch

    from memfit.measure.trace import trace_step
    from memfit.models.spec import parse_model

    spec = parse_model(f"gpt:layers=2,hidden={h},heads={a},vocab=256,seq={s},dropout={dropout}")
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
    try:
        with contextlib.nullcontext() if fused else sdpa_kernel([SDPBackend.MATH]):
            r = trace_step(spec, batch=b, seq=s, precision=precision or paper_precision(), optimizer="sgd",
                           device=device, steps=1)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)
    return r.module_activations["blocks.0"]


def layer_rows(row, tolerance: float) -> list[dict]:
    rows = []
    for shape, (h, a, s, b) in SHAPES.items():
        sbh = s * b * h
        cases = [
            ("flash, dropout 0.1", 0.1, True, 34 * sbh, "sbh*34 (section 4.1 with flash attention)"),
            ("flash, no dropout", 0.0, True, 32 * sbh, "sbh*34 less the two 1-byte dropout masks"),
            ("no flash, 16-bit math attention, dropout 0.1", 0.1, False, sbh * (34 + 5 * a * s / h),
             "sbh(34 + 5as/h) (section 4.1): torch's math attention kept in 16-bit "
             "(torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)), as the paper's kernel"
             + (VIEW_NOTE if b == 1 else "")),
            ("no flash, torch's default math attention, dropout 0.1", 0.1, False, sbh * (34 + 5 * a * s / h),
             "sbh(34 + 5as/h), " + MATH_NOTE),
        ]
        for label, dropout, fused, reference, note in cases:
            got = saved_per_layer(h, a, s, b, dropout, fused, reduced="16-bit" in label)
            rows.append(row("korthikanti", f"{shape} (h {h}, a {a}, s {s}, b {b}), {label}", reference, got,
                            tolerance, note))
        got = saved_per_layer(h, a, s, b, 0.1, precision="bf16-master")
        rows.append(row("korthikanti", f"{shape} (h {h}, a {a}, s {s}, b {b}), flash, dropout 0.1, memfit bf16-master",
                        34 * sbh, got, tolerance, AUTOCAST_NOTE))
    return rows
