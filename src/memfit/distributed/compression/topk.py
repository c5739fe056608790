"""Top-k sparsification (Deep Gradient Compression): send the k largest-magnitude elements.

Wire format: values (bf16 by default, or fp32), then the indices: 16-bit offsets within their tensor
for tensors of at most 65536 elements, int32 positions in the buffer for larger ones; 4 bytes
per kept element (bf16, small tensors) to 8 (fp32, large ones). Every rank knows the tensor sizes
and k per tensor (the same ratio at the same step), so the receiver can tell the two apart.
bf16 values lose precision, but with error feedback the rounding lands in the residual and is
sent later; `x - bf16(x)` is exact in fp32 (Sterbenz: both within a factor 2), so the
error-feedback invariant stays bitwise.
"""
from __future__ import annotations

import math

import torch

from memfit.distributed.compression.layout import offsets, sizes_or_whole

VALUE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WARMUP_START = 0.25
"""DGC's warm-up starts at 25% density and decays exponentially to the target ratio."""


def k_for(numel: int, ratio: float) -> int:
    return max(1, min(numel, math.ceil(ratio * numel)))


def ratio_at(step: int, ratio: float, warmup: int) -> float:
    """DGC warm-up: density decays geometrically from 25% to `ratio` over `warmup` steps."""
    if warmup <= 0 or step >= warmup or ratio >= WARMUP_START:
        return ratio
    return WARMUP_START * (ratio / WARMUP_START) ** (step / warmup)


def encode_topk_per_segment(x: torch.Tensor, ratio: float, sizes, value_dtype: torch.dtype,
                            weight: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Top-k within each segment (one per tensor: DGC's layer-wise selection), k = ceil(ratio n).

    weight: rank the elements by |x| * weight instead of |x| (what is sent is still x)."""
    sizes = sizes_or_whole(sizes, x.numel())
    score = x.abs() if weight is None else x.abs() * weight
    idx = torch.cat([torch.topk(score[o:o + n], k_for(n, ratio), sorted=False).indices + o
                     for o, n in zip(offsets(sizes), sizes)])
    return [x[idx].to(value_dtype), idx.to(torch.int32)]


def decode_topk(parts: list[torch.Tensor], numel: int) -> torch.Tensor:
    values, idx = parts
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[idx.long()] = values.float()
    return out


SHORT = 1 << 16
"""Tensors up to this many elements send 16-bit offsets (stored as int16 minus 32768)."""


def _segments(sizes: tuple[int, ...], ratio: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per kept element: the offset of its tensor in the buffer, and whether that tensor is short."""
    ks = torch.tensor([k_for(n, ratio) for n in sizes], device=device)
    starts = torch.tensor(offsets(sizes), device=device).repeat_interleave(ks)
    short = torch.tensor([n <= SHORT for n in sizes], device=device).repeat_interleave(ks)
    return starts, short


def compact(parts: list[torch.Tensor], sizes: tuple[int, ...], ratio: float) -> list[torch.Tensor]:
    """[values, global int32 indices] -> [values, int16 offsets (short tensors), int32 (long ones)]."""
    values, idx = parts
    starts, short = _segments(sizes, ratio, idx.device)
    local = (idx.long() - starts)[short] - (SHORT // 2)
    return [values, local.to(torch.int16), idx[~short]]


def expand(parts: list[torch.Tensor], sizes: tuple[int, ...], ratio: float) -> list[torch.Tensor]:
    values, idx16, idx32 = parts
    starts, short = _segments(sizes, ratio, values.device)
    idx = torch.empty(values.numel(), dtype=torch.int64, device=values.device)
    idx[short] = idx16.long() + (SHORT // 2) + starts[short]
    idx[~short] = idx32.long()
    return [values, idx]


class TopK:
    name = "topk"
    exchange = "gather"

    def __init__(self, ratio: float, value_dtype: str = "bf16", warmup: int = 0) -> None:
        self.ratio, self.value_dtype, self.warmup = ratio, VALUE_DTYPES[value_dtype], warmup
        self.current = ratio
        """The ratio of the last encode (warm-up changes it by step; decode of the same step needs it)."""

    def encode(self, x: torch.Tensor, step: int, sizes=None, weight: torch.Tensor | None = None) -> list[torch.Tensor]:
        self.current = ratio_at(step, self.ratio, self.warmup)
        parts = encode_topk_per_segment(x, self.current, sizes, self.value_dtype, weight)
        return compact(parts, sizes_or_whole(sizes, x.numel()), self.current)

    def decode(self, parts: list[torch.Tensor], numel: int, sizes=None) -> torch.Tensor:
        return decode_topk(expand(parts, sizes_or_whole(sizes, numel), self.current), numel)
