"""Gradient compression on the wire for memfit's data-parallel strategies (DDP, ZeRO-1/2).

    from memfit.distributed.compression import register_compression, compressed_reduce_scatter
    state = register_compression(ddp_model, "topk:0.01")   # DDP comm hook; state.summary() for bytes

Compressors (one module each): top-k with error feedback, momentum correction and warm-up
(topk.py, feedback.py), 8-bit QSGD-style (quant8.py), 1-bit sign with error feedback (sign.py),
fp16/bf16 casts (cast.py), PowerSGD (powersgd.py). Specs: spec.py. See docs/compression.md.
"""
from memfit.distributed.compression.feedback import ErrorFeedback
from memfit.distributed.compression.hooks import register_compression
from memfit.distributed.compression.reduce_scatter import compressed_reduce_scatter
from memfit.distributed.compression.spec import (
    CompressionSpec,
    check_compression_strategy,
    parse_compression,
)
from memfit.distributed.compression.state import CompressionState

__all__ = ["CompressionSpec", "CompressionState", "ErrorFeedback", "check_compression_strategy",
           "compressed_reduce_scatter", "parse_compression", "register_compression"]
