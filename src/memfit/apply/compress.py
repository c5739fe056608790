"""Lossy codecs for saved activations: int8 (absmax scales), fp8 (e4m3) and a 16-bit downcast.

`encode` turns one floating tensor into a `Packed` (a few smaller tensors plus metadata) and
`decode` restores a tensor of the original dtype, shape and stride order. Tensors a codec cannot
shrink (integers, bools, or already at most the codec's width) pass through unchanged.

- ``int8``: absmax scale per block of 64 consecutive elements (fp32 scales): 3.76x smaller than
  fp32, robust to outlier tokens *and* outlier channels because blocks are small.
- ``int8-channel``: one absmax scale per channel of the last dimension: ~4x smaller; cheaper, but
  an outlier token inflates its channels' scales for every other token.
- ``fp8``: float8_e4m3fn with one per-tensor scale mapping absmax to e4m3's largest value (448).
- ``bf16`` / ``fp16``: plain downcast (fp16 saturates beyond 65504, so values are clamped).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.core.errors import ConfigError

INT8_BLOCK = 64
_FP8 = getattr(torch, "float8_e4m3fn", None)
_WIDTH = {"int8": 1, "int8-channel": 1, "fp8": 1, "bf16": 2, "fp16": 2}


@dataclass
class Packed:
    codec: str
    tensors: list[torch.Tensor]
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def check_codec(codec: str) -> None:
    if codec not in _WIDTH:
        raise ConfigError(f"unknown compression {codec!r}; accepted: {', '.join(_WIDTH)}")
    if codec == "fp8" and _FP8 is None:
        raise ConfigError(f"compress:fp8 needs torch.float8_e4m3fn (torch {torch.__version__} has none); use int8")


def compressible(t: torch.Tensor, codec: str) -> bool:
    return t.is_floating_point() and t.element_size() > _WIDTH[codec] and t.numel() > 0


def is_dense(t: torch.Tensor) -> bool:
    """No gaps and no overlap: the elements fill numel() consecutive slots (in some dim order)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def dense(t: torch.Tensor) -> torch.Tensor:
    """t itself if dense, else a dense copy whose memory order follows t's stride order."""
    return t if is_dense(t) else torch.empty_like(t).copy_(t)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The elements of a dense tensor in memory order, as a 1-D view."""
    return t.as_strided((t.numel(),), (1,))


def encode(t: torch.Tensor, codec: str) -> Packed | torch.Tensor:
    if not compressible(t, codec):
        return t
    d = dense(t)
    flat = _flat(d)
    if codec == "int8":
        n = flat.numel()
        pad = (-n) % INT8_BLOCK
        x = flat.float()
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        x = x.view(-1, INT8_BLOCK)
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        tensors = [q, scale]
    elif codec == "int8-channel":
        c = d.shape[-1] if d.dim() else 1
        x = d.float().reshape(-1, c)
        scale = x.abs().amax(dim=0, keepdim=True).clamp_min(1e-30) / 127.0
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        tensors = [q, scale]
    elif codec == "fp8":
        x = flat.float()
        scale = x.abs().amax().clamp_min(1e-30) / 448.0
        tensors = [(x / scale).to(_FP8), scale]
    elif codec == "bf16":
        tensors = [flat.to(torch.bfloat16)]
    else:  # fp16
        tensors = [flat.float().clamp(-65504.0, 65504.0).to(torch.float16)]
    return Packed(codec, tensors, d.shape, d.stride(), t.dtype)


def decode(p: Packed | torch.Tensor) -> torch.Tensor:
    if isinstance(p, torch.Tensor):
        return p
    if p.codec == "int8":
        q, scale = p.tensors
        flat = (q.float() * scale).view(-1)[: p.shape.numel()]
    elif p.codec == "int8-channel":
        q, scale = p.tensors
        flat = (q.float() * scale).reshape(-1)  # logical order (q may carry a permuted layout)
    elif p.codec == "fp8":
        q, scale = p.tensors
        flat = q.float() * scale
    else:
        flat = p.tensors[0]
    if p.codec == "int8-channel":
        # reshape(-1, C) took the elements in logical order: rebuild logically, then restore strides.
        logical = flat.to(p.dtype).reshape(p.shape)
        if tuple(p.stride) == _contiguous_stride(p.shape):
            return logical
        return torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=flat.device).copy_(logical)
    return _restride(flat.to(p.dtype), p)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _restride(flat: torch.Tensor, p: Packed) -> torch.Tensor:
    out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=flat.device)
    _flat(out).copy_(flat)
    return out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a dense tensor in memory order (for writing it to a file)."""
    return _flat(dense(t.detach())).view(torch.uint8)
