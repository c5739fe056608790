"""CUDA autocast's float32 list, applied to a CPU trace of a GPU's step.

Autocast keeps two op lists per device. Both run matmuls in the low dtype, but CUDA also runs
layer_norm, softmax, log_softmax, sum, cumsum, exp, log, pow, rsqrt, logsumexp and a few more in
float32 (aten/src/ATen/autocast_mode.cpp, `KERNEL_CUDA(..., fp32)` and `fp32_set_opt_dtype`), and the
CPU's list does not: traced on the CPU under bf16-mixed, a LayerNorm's output would be bf16 where an
H100 makes it fp32. `cuda_fp32_ops()` registers, while inside, a kernel under the AutocastCPU key
for each such op that casts 16-bit floating inputs to float32 and runs the op with autocast off, as
CUDA's autocast does; the registrations are removed on exit. Ops the CPU list already keeps in
float32 (the losses) are left as they are.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

FP32 = ("layer_norm", "native_layer_norm", "group_norm", "exp", "expm1", "log", "log1p", "pow.Tensor_Scalar",
        "pow.Tensor_Tensor", "pow.Scalar", "rsqrt", "reciprocal", "softplus", "logsumexp", "cosine_similarity")
FP32_UNLESS_DTYPE = ("softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "cumsum")
"""fp32_set_opt_dtype: float32 unless the call names its own dtype."""
_LOW = (torch.float16, torch.bfloat16)
_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _up(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW else x


def _kernel(op, unless_dtype: bool):
    def run(*args, **kwargs):
        named = kwargs.get("dtype") is not None or (unless_dtype and len(args) > 2 and args[2] is not None
                                                      and not isinstance(args[2], bool))
        with torch._C._ExcludeDispatchKeyGuard(_KEYS):
            if named:
                return op(*args, **kwargs)
            return op(*[_up(a) for a in args], **kwargs)
    return run


@contextlib.contextmanager
def cuda_fp32_ops() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")
    try:
        for name in FP32 + FP32_UNLESS_DTYPE:
            lib.impl(name, _kernel(_op(name), name in FP32_UNLESS_DTYPE), "AutocastCPU")
        yield
    finally:
        lib._destroy()
