"""8-bit quantization, QSGD-style: int8 codes with one fp32 absmax scale per chunk of elements.

Code = round(x / scale) with scale = absmax / 127 over the chunk, so |x - decoded| <= scale / 2.
Stochastic rounding (floor(x / scale + u), u ~ U[0, 1)) makes the decoded value unbiased,
E[decoded] = x, at twice the worst-case error. Chunks never straddle two tensors of a bucket
(layout.py). Wire: 1 byte per element + 4 bytes per chunk.
"""
from __future__ import annotations

import torch

from memfit.distributed.compression.layout import group_ids, sizes_or_whole

LEVELS = 127


def encode_int8(x: torch.Tensor, chunk: int, generator: torch.Generator | None = None, sizes=None) -> list[torch.Tensor]:
    """[int8 codes (numel), fp32 scales (one per chunk)]. generator: stochastic rounding."""
    x = x.float()
    ids, counts = group_ids(sizes_or_whole(sizes, x.numel()), chunk, x.device)
    scales = torch.zeros(counts.numel(), device=x.device).scatter_reduce_(0, ids, x.abs(), "amax") / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = x / safe[ids]
    if generator is None:
        codes = torch.round(scaled)
    else:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device)
        codes = torch.floor(scaled + noise)
    return [codes.clamp_(-LEVELS, LEVELS).to(torch.int8), scales]


def decode_int8(parts: list[torch.Tensor], numel: int, chunk: int, sizes=None) -> torch.Tensor:
    codes, scales = parts
    ids, _ = group_ids(sizes_or_whole(sizes, numel), chunk, codes.device)
    return codes.float() * scales[ids]


class Int8:
    name = "int8"
    exchange = "gather"

    def __init__(self, chunk: int = 1024, stochastic: bool = False, seed: int = 0) -> None:
        self.chunk, self.stochastic, self.seed = chunk, stochastic, seed
        self.generator: torch.Generator | None = None

    def encode(self, x: torch.Tensor, step: int, sizes=None) -> list[torch.Tensor]:
        if self.stochastic and (self.generator is None or self.generator.device != x.device):
            self.generator = torch.Generator(device=x.device)  # on x's device: CUDA noise needs a CUDA generator
            self.generator.manual_seed(self.seed)
        return encode_int8(x, self.chunk, self.generator, sizes)

    def decode(self, parts: list[torch.Tensor], numel: int, sizes=None) -> torch.Tensor:
        return decode_int8(parts, numel, self.chunk, sizes)
