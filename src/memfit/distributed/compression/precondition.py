"""Preconditioned compression: encode x / D and decode back times D, where D is the square root of
the optimizer's second moment per element (Adam's v), which is the same on every rank under DDP.

Why: Adam divides each coordinate by its own gradient scale sqrt(v), while a sign compressor sends
one magnitude per chunk and top-k ranks raw magnitudes. Coordinates with small gradients then
reach Adam as +-(the chunk's mean) flips, or not at all, and their steps shrink. Dividing by D
first makes the chunk scale and the top-k choice relative to each coordinate's own scale, as
Adam's step is. D comes from the previous step's state, so every rank computes the same D and the
decoded payloads agree bit for bit. D is floored at FLOOR x its mean over the buffer, so an
element with no gradient history (v = 0) cannot take over a chunk's scale.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

FLOOR = 1e-2


def adam_scale(optimizer) -> Callable[[Iterable[torch.Tensor]], torch.Tensor | None]:
    """params -> D over their concatenated elements, or None before the optimizer's first step
    (or when it keeps no exp_avg_sq for them: a non-Adam optimizer)."""
    def scale(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
        state = optimizer.state
        parts = []
        for p in params:
            v = state.get(p, {}).get("exp_avg_sq")
            if v is None:
                return None
            parts.append(v.detach().float().sqrt().reshape(-1))
        if not parts:
            return None
        d = torch.cat(parts)
        return d.clamp_min(max(float(d.mean()) * FLOOR, torch.finfo(torch.float32).tiny))
    return scale
