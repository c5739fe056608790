"""16-bit casts (fp16, bf16) and the uncompressed fp32 pass-through ("none").

These are linear, so they are all-reduced directly in the wire dtype after dividing by the world
size (as torch's fp16_compress_hook does, keeping partial sums in range). torch's own
bf16_compress_hook refuses anything but NCCL >= 2.10; gloo all-reduces bf16 fine, so this works
on both backends. fp16 saturates at +-65504 instead of overflowing to inf.
"""
from __future__ import annotations

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": torch.float32}
_FP16_MAX = torch.finfo(torch.float16).max


def encode_cast(x: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    if dtype == torch.float16:
        x = x.clamp(-_FP16_MAX, _FP16_MAX)
    return [x.to(dtype)]


def decode_cast(parts: list[torch.Tensor], numel: int) -> torch.Tensor:
    return parts[0].float()


class Cast:
    exchange = "allreduce"

    def __init__(self, name: str) -> None:
        self.name, self.dtype = name, DTYPES[name]

    def encode(self, x: torch.Tensor, step: int, sizes=None) -> list[torch.Tensor]:
        return encode_cast(x, self.dtype)

    def decode(self, parts: list[torch.Tensor], numel: int, sizes=None) -> torch.Tensor:
        return decode_cast(parts, numel)
