"""Scaled-dot-product attention traced as a GPU runs it, from a CPU machine.

On the CPU, `F.scaled_dot_product_attention` in training runs torch's math path: it materialises
the s x s scores, keeps the softmax (upcast to fp32 for 16-bit inputs) and the dropout mask for
backward, about 12 bytes per score element. A CUDA GPU picks a fused kernel instead (torch's
sdp_utils.cpp, `select_sdp_backend`): cuDNN (sm90/sm100 first), FlashAttention-2, memory-efficient
attention, each of which saves only its output and a per-row logsumexp (plus the dropout RNG's seed
and offset), never an s x s tensor, dropout included. `choose_backend` applies torch's filters for
dtype, head size, mask, dropout, grouped-query heads and layout; `GpuAttention` then runs that
backend's own aten op, whose meta kernel gives the shapes and dtypes CUDA would allocate (e.g. the
efficient kernel's logsumexp padded to 32 rows), and adds the scratch the kernel's backward takes
from the caching allocator and never returns as a tensor (FlashAttention-2's mha_bwd: an fp32 dQ
accumulator and the softmax row sums; the efficient kernel's the same for 16-bit inputs).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from memfit.core.gpus import GpuSpec

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def _cudnn_layout(t: torch.Tensor) -> bool:
    """cuDNN's SDPA takes (b, h, s, d) views of a (b, s, h, d) tensor (or of packed qkv): stride(1) == d."""
    b, h, s, d = t.shape
    return t.stride(3) == 1 and t.stride(1) == d and t.stride(2) in (h * d, 3 * h * d)


def _enabled(backend: str) -> bool:
    """torch's runtime switches (torch.backends.cuda.enable_*_sdp, torch.nn.attention.sdpa_kernel): the
    flags live in the global context, so they are set and read on a CPU-only build too."""
    b = torch.backends.cuda
    return {"cudnn": b.cudnn_sdp_enabled, "flash": b.flash_sdp_enabled,
            "efficient": b.mem_efficient_sdp_enabled, "math": b.math_sdp_enabled}[backend]()


def choose_backend(gpu: GpuSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False,
                   training: bool = True) -> str:
    """The backend torch's CUDA dispatcher picks for these inputs on `gpu`: cudnn, flash, efficient or math."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.is_nested:
        return "math"
    dtype, d, dv = q.dtype, q.shape[-1], v.shape[-1]
    same_heads = q.shape[1] == k.shape[1] == v.shape[1]
    gqa_ok = same_heads or (enable_gqa and q.shape[1] % k.shape[1] == 0)
    for backend in gpu.attention_backends:
        if not _enabled(backend):
            continue
        if backend == "cudnn" and dtype in HALF and d == k.shape[-1] and d % 8 == 0 and dv % 8 == 0 \
                and max(d, dv) <= (256 if gpu.capability == (9, 0) else 128) and k.shape[2] > 1 and gqa_ok \
                and all(_cudnn_layout(t) for t in (q, k, v)):
            return "cudnn"
        if backend == "flash" and dtype in HALF and attn_mask is None and d == k.shape[-1] == dv and d <= 256 \
                and gqa_ok and not (is_causal and q.shape[2] != k.shape[2]) \
                and not (training and gpu.capability in ((8, 6), (8, 9), (12, 0), (12, 1))
                         and (192 < d <= 224 or (d > 224 and dropout_p > 0))):
            return "flash"
        if backend == "efficient":
            align = 8 if dtype in HALF else 4  # sm80+: tensor-core alignment, 128 bits
            dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if gpu.capability >= (8, 0) else ())
            if dtype in dtypes and same_heads and d == k.shape[-1] and d % align == 0 and dv % align == 0:
                return "efficient"
    return "math"


def backward_scratch(backend: str, q: torch.Tensor, k: torch.Tensor) -> int:
    """Bytes a fused backward takes from the allocator for its own use (freed when it returns)."""
    b, a, s, d = q.shape
    if backend in ("flash", "cudnn"):  # FlashAttention-2 mha_bwd: dq_accum fp32, softmax_d fp32, rounded
        d_round = _round(d, 32 if d <= 128 else 64)
        extra = 2 * b * k.shape[2] * a * d * q.element_size() if k.shape[1] != a else 0  # dk, dv per q head
        return 4 * b * _round(s, 128) * a * d_round + 4 * b * a * _round(s, 128) + extra
    if backend == "efficient":  # delta per row; an fp32 dQ accumulator unless dQ itself is fp32
        return 4 * b * a * _round(s, 32) + (4 * q.numel() if q.dtype != torch.float32 else 0)
    return 0


class _Fused(torch.autograd.Function):
    """One fused attention call: the backend's forward op, what it saves, its backward op and scratch."""

    @staticmethod
    def forward(ctx, backend: str, q, k, v, bias, dropout_p: float, is_causal: bool, scale):
        with torch.autocast("cpu", enabled=False):
            if backend == "flash":
                out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                    q, k, v, dropout_p, is_causal, False, scale=scale)
                ctx.extra = (cq, ck, mq, mk)
            elif backend == "cudnn":
                out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
                    q, k, v, bias, True, dropout_p, is_causal, False, scale=scale)
                ctx.extra = (cq, ck, mq, mk)
            else:
                out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                    q, k, v, bias, True, dropout_p, is_causal, scale=scale)
        ctx.backend, ctx.dropout_p, ctx.is_causal, ctx.scale = backend, dropout_p, is_causal, scale
        ctx.has_bias = bias is not None
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, *((bias,) if bias is not None else ()))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seed, offset, *bias = ctx.saved_tensors
        bias = bias[0] if bias else None
        scratch = torch.empty(backward_scratch(ctx.backend, q, k), dtype=torch.uint8, device=q.device)
        with torch.autocast("cpu", enabled=False):
            grad = grad.contiguous() if grad.stride(-1) != 1 else grad
            if ctx.backend == "flash":
                cq, ck, mq, mk = ctx.extra
                dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                    grad, q, k, v, out, lse, cq, ck, mq, mk, ctx.dropout_p, ctx.is_causal, seed, offset, scale=ctx.scale)
            elif ctx.backend == "cudnn":
                cq, ck, mq, mk = ctx.extra
                dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                    grad, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, ctx.dropout_p, ctx.is_causal,
                    scale=ctx.scale)
            else:
                dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                    grad, q, k, v, bias, out, lse, seed, offset, ctx.dropout_p, [True, True, True, False],
                    ctx.is_causal, scale=ctx.scale)
        del scratch
        return None, dq, dk, dv, None, None, None, None


def math_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's math attention (_scaled_dot_product_attention_math) as CUDA runs it: 16-bit inputs upcast to
    fp32 (unless torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp), both sides scaled by sqrt(scale),
    the s x s softmax kept in fp32, and dropout the fused kernel with a 1-byte mask (the CPU's keeps an
    fp32 one)."""
    dtype = q.dtype
    if dtype in HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = q.float(), k.float(), v.float()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    root = math.sqrt(scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    attn = (q * root) @ (k * root).transpose(-2, -1)
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        attn = attn.masked_fill(~keep, -math.inf)
    elif attn_mask is not None:
        attn = attn.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else attn + attn_mask
    attn = torch.softmax(attn, dim=-1)
    if dropout_p > 0:
        attn = aten.native_dropout(attn, dropout_p, True)[0]
    return (attn @ v).to(dtype)


def _bias(mask: Any, q: torch.Tensor) -> Any:
    """The additive bias the fused kernels take for a mask (torch converts a boolean one)."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
    return mask.to(q.dtype)


def gpu_sdpa(gpu: GpuSpec, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False, _fallback=None, _record=None):
    """F.scaled_dot_product_attention as `gpu` runs it (math falls back to torch's own composite)."""
    if torch.is_autocast_enabled("cpu"):  # CUDA autocast runs SDPA in the autocast dtype
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    backend = choose_backend(gpu, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, training=grad)
    if _record is not None:
        _record.append(backend)
    if not grad:  # no backward to save for: the forward's transient bytes only
        return _fallback(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    if backend == "math":  # below CUDA autocast, as the fused kernels: the inputs were cast above
        with torch.autocast("cpu", enabled=False):
            return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if backend == "efficient" and key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return _Fused.apply(backend, query, key, value, _bias(attn_mask, query), float(dropout_p), bool(is_causal), scale)


class GpuAttentionMode:
    """While entered, F.scaled_dot_product_attention (memfit's GPT, Hugging Face's sdpa attention, a user's
    module) runs through `gpu_sdpa` and F.dropout through CUDA's fused kernel; `backends` records each
    attention call's choice. The functions are replaced in torch.nn.functional itself, not by a
    TorchFunctionMode: a mode is per thread, and checkpointed blocks recompute on autograd's thread."""

    last: "GpuAttentionMode | None" = None
    """The mode entered most recently (what `counts()` reads)."""

    def __init__(self, gpu: GpuSpec) -> None:
        self.gpu = gpu
        self.backends: list[str] = []
        self._saved: tuple = ()

    def __enter__(self) -> "GpuAttentionMode":
        GpuAttentionMode.last = self
        sdpa, dropout = F.scaled_dot_product_attention, F.dropout
        self._saved = (sdpa, dropout)

        def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
            return gpu_sdpa(self.gpu, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            _fallback=sdpa, _record=self.backends)

        F.scaled_dot_product_attention = attention
        F.dropout = lambda *args, **kwargs: _dropout(dropout, *args, **kwargs)
        return self

    def __exit__(self, *exc: object) -> None:
        F.scaled_dot_product_attention, F.dropout = self._saved

    @classmethod
    def counts(cls) -> dict[str, int]:
        """Attention calls per backend in the most recent mode."""
        from collections import Counter

        return dict(Counter(cls.last.backends)) if cls.last is not None else {}


def _dropout(func, input, p=0.5, training=True, inplace=False):
    """CUDA's dropout is the fused native_dropout, which keeps a 1-byte boolean mask for backward; the CPU
    multiplies by a mask in the input's dtype and keeps that (2 or 4 bytes per element)."""
    if not training or p <= 0 or inplace or not isinstance(input, torch.Tensor) or not input.is_floating_point():
        return func(input, p, training, inplace)
    if p >= 1:
        return func(input, p, training, inplace)
    return aten.native_dropout(input, p, True)[0]
