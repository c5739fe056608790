"""Random scalars that a model reads in Python take the top of their range while tracing.

Some models branch in Python on a random draw: LayerDrop (BART, mBART, Whisper, wav2vec2 under
transformers 5.17 and earlier) skips a layer when `torch.rand([]) < layerdrop`, even with layerdrop 0.
A fake draw has no value, so `bool()` on it fails the trace. Inside `top_of_range_draws()` a one-element
`torch.rand` / `torch.rand_like` carries a constant just below 1, the largest value rand returns. For
LayerDrop that is the worst case (no layer skipped) and, for layerdrop 0, exactly what a real run does.
Draws of more than one element stay plain fake tensors: tensor code uses them without reading them.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

from memfit.core.patching import patched

TOP = 1.0 - 2.0 ** -24  # the largest float32 torch.rand returns


def _with_top(draw: Callable[..., Any]) -> Callable[..., Any]:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    @functools.wraps(draw)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = draw(*args, **kwargs)
        if isinstance(out, FakeTensor) and out.numel() == 1 and out.dtype.is_floating_point:
            with _disable_current_modes():  # the constant is a real CPU tensor, made outside the fake mode
                out.constant = torch.full(tuple(out.shape), TOP, dtype=out.dtype)
        return out
    return wrapped


def top_of_range_draws() -> contextlib.AbstractContextManager:
    """torch.rand and torch.rand_like give one-element fake draws the value TOP inside the block."""
    return patched(torch, {name: _with_top(getattr(torch, name)) for name in ("rand", "rand_like")})
