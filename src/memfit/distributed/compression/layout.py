"""Groups of elements that share one scale (int8, sign) or one top-k budget: per tensor, not per
bucket. A DDP bucket concatenates tensors whose gradients differ by orders of magnitude (an
embedding, a LayerNorm gain, an attention matrix); a scale or a top-k taken across them lets the
large ones drown the small ones, so groups never straddle a tensor boundary (DGC selects per
layer and PowerSGD compresses per matrix for the same reason).
"""
from __future__ import annotations

from functools import lru_cache

import torch


def sizes_or_whole(sizes: list[int] | tuple[int, ...] | None, numel: int) -> tuple[int, ...]:
    """The segment lengths, or one segment for the whole buffer when none (or wrong ones) are given."""
    if sizes and sum(sizes) == numel and all(s > 0 for s in sizes):
        return tuple(sizes)
    return (numel,)


@lru_cache(maxsize=256)
def _group_ids(sizes: tuple[int, ...], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, counts, base = [], [], 0
    for n in sizes:
        full, rest = divmod(n, chunk)
        ids.append(torch.arange(n) // chunk + base)
        counts += [chunk] * full + ([rest] if rest else [])
        base += full + (1 if rest else 0)
    return torch.cat(ids), torch.tensor(counts, dtype=torch.float32)


def group_ids(sizes: tuple[int, ...], chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(group id of each element, elements per group): chunks of `chunk` within each segment."""
    ids, counts = _group_ids(sizes, chunk)
    return ids.to(device), counts.to(device)


def offsets(sizes: tuple[int, ...]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def split_segments(sizes: tuple[int, ...], numel: int, parts: int) -> list[tuple[int, ...]]:
    """The segments of each of `parts` equal slices of the buffer (a ZeRO shard each): tensors cut
    at the slice boundaries, so every slice can be encoded on its own."""
    step, out = numel // parts, []
    bounds = [(o, o + n) for o, n in zip(offsets(sizes), sizes)]
    for j in range(parts):
        lo, hi = j * step, (j + 1) * step
        out.append(tuple(min(b, hi) - max(a, lo) for a, b in bounds if min(b, hi) > max(a, lo)))
    return out
