"""1-bit sign compression with a scale (EF-SignSGD, 1-bit SGD): sign bits + mean |x| per chunk.

decoded = mean(|x|) * sign(x) over each chunk (zero counts as +), which keeps each chunk's L1
norm. Error feedback is what makes it converge: the residual x - decoded is added to the next
gradient. Wire: 1 bit per element (packed 8 per byte) + 4 bytes per chunk.
"""
from __future__ import annotations

import torch

from memfit.distributed.compression.layout import group_ids, sizes_or_whole

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool (n,) -> uint8 (ceil(n / 8),), most significant bit first."""
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, (-bits.numel()) % 8)).view(-1, 8)
    return (padded * _BITS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return (packed[:, None] & _BITS.to(packed.device)).ne(0).view(-1)[:numel]


def encode_sign(x: torch.Tensor, chunk: int, sizes=None) -> list[torch.Tensor]:
    """[packed sign bits (uint8), fp32 mean |x| per chunk]; chunks stay within one tensor."""
    x = x.float()
    ids, counts = group_ids(sizes_or_whole(sizes, x.numel()), chunk, x.device)
    sums = torch.zeros(counts.numel(), device=x.device).index_add_(0, ids, x.abs())
    return [pack_bits(x >= 0), sums / counts]


def decode_sign(parts: list[torch.Tensor], numel: int, chunk: int, sizes=None) -> torch.Tensor:
    packed, scales = parts
    ids, _ = group_ids(sizes_or_whole(sizes, numel), chunk, packed.device)
    signs = unpack_bits(packed, numel).float() * 2 - 1
    return signs * scales[ids]


class Sign:
    name = "sign"
    exchange = "gather"

    def __init__(self, chunk: int = 1024) -> None:
        self.chunk = chunk

    def encode(self, x: torch.Tensor, step: int, sizes=None) -> list[torch.Tensor]:
        return encode_sign(x, self.chunk, sizes)

    def decode(self, parts: list[torch.Tensor], numel: int, sizes=None) -> torch.Tensor:
        return decode_sign(parts, numel, self.chunk, sizes)
