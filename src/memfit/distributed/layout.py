"""The flat view of a model's parameters that ZeRO shards evenly.

Parameters are grouped into buckets (one per repeated block, one for everything else). Each
bucket is a flat run of its parameters' elements, padded to a multiple of the world size N and
cut into N equal slices: rank r owns slice r of every bucket, so each rank holds 1/N of the
elements (plus at most N-1 padding elements per bucket), not whole parameters. Equal slices per
bucket are what a reduce-scatter and an all-gather exchange, so a bucket's gradients can leave as
soon as backward has produced them (ZeRO-2/3) and a block's weights can be gathered on their own
(ZeRO-3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from memfit.apply.checkpoint import find_blocks
from memfit.core.errors import ConfigError


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    block: nn.Module | None
    """The repeated block these parameters belong to; None for the rest (embeddings, head, norms)."""
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    """Elements of the parameters, unpadded."""
    padded: int = 0
    slice: int = 0
    """Elements per rank: padded / N."""
    shard_offset: int = 0
    """Where this bucket's slice starts in the rank's shard."""

    def flatten(self, tensors: list[torch.Tensor | None], dtype: torch.dtype, device) -> torch.Tensor:
        """One padded flat tensor of `tensors` (None counts as zeros), in this bucket's layout."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for t, off, p in zip(tensors, self.offsets, self.params):
            if t is not None:
                flat[off:off + p.numel()].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[off:off + p.numel()].view(p.shape) for off, p in zip(self.offsets, self.params)]

    def part(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat[rank * self.slice:(rank + 1) * self.slice]


class FlatLayout:
    """Buckets of `model`'s trainable parameters for a world of `world` ranks."""

    def __init__(self, model: nn.Module, world: int, blocks: nn.ModuleList | None = None) -> None:
        try:
            blocks = blocks if blocks is not None else find_blocks(model)
        except ConfigError:
            blocks = nn.ModuleList()
        seen: set[int] = set()
        groups: list[tuple[list[nn.Parameter], nn.Module | None]] = []
        for block in blocks:
            ps = [p for p in block.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in ps)
            if ps:
                groups.append((ps, block))
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
        if rest:
            groups.append((rest, None))
        if not groups:
            raise ConfigError(f"{type(model).__name__} has no trainable parameters to shard")
        self.world = world
        self.buckets: list[Bucket] = []
        shard_off = 0
        for i, (ps, block) in enumerate(groups):
            b = Bucket(i, ps, block)
            for p in ps:
                b.offsets.append(b.numel)
                b.numel += p.numel()
            b.padded = math.ceil(b.numel / world) * world
            b.slice = b.padded // world
            b.shard_offset = shard_off
            shard_off += b.slice
            self.buckets.append(b)
        self.shard_numel = shard_off
        self.numel = sum(b.numel for b in self.buckets)
        self.by_param = {id(p): b for b in self.buckets for p in b.params}
        self.block_bucket = {id(b.block): b for b in self.buckets if b.block is not None}

    @property
    def rest(self) -> Bucket | None:
        last = self.buckets[-1]
        return last if last.block is None else None
