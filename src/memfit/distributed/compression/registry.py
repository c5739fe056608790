"""Compressor name -> codec. A codec is a pure encode/decode pair on flat fp32 tensors:

    parts = codec.encode(x, step)            # list of small tensors, same shapes on every rank
                                             # (top-k also takes weight=: rank by |x| * weight)
    y = codec.decode(parts, x.numel())       # fp32, x's length
    codec.exchange                           # "gather" (payloads all-gathered) or "allreduce"

PowerSGD is not a codec: it needs collectives between its two halves (see powersgd.py).
"""
from __future__ import annotations

from memfit.distributed.compression.cast import Cast
from memfit.distributed.compression.quant8 import Int8
from memfit.distributed.compression.sign import Sign
from memfit.distributed.compression.spec import CompressionSpec
from memfit.distributed.compression.topk import TopK


def make_codec(spec: CompressionSpec, rank: int = 0):
    """The codec for `spec`; `rank` seeds stochastic rounding differently on each rank."""
    if spec.name == "topk":
        return TopK(spec.ratio, spec.values, spec.warmup)
    if spec.name == "int8":
        return Int8(spec.chunk, spec.stochastic, seed=spec.seed * 1000 + rank)
    if spec.name == "sign":
        return Sign(spec.chunk)
    if spec.name in ("bf16", "fp16", "none"):
        return Cast(spec.name)
    raise ValueError(f"{spec.name} has no codec")  # powersgd: handled by CompressionState
