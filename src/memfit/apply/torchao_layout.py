"""The optimizer state of torchao's own AdamW8bit / AdamW4bit (torchao.optim), to the byte.

memfit's `adamw8bit` / `adamw4bit` run memfit.apply.lowbit.AdamWLowBit (torchao's quantization in
plain tensors, traced by `memfit estimate`). A loop that hands torchao's classes to its model keeps
a different layout, which this module counts without running them (their state is a tensor
subclass that FakeTensorMode tracing does not see, and their step compiles):

    per parameter tensor p of n elements, block size B (256 at 8 bits, 128 at 4 bits):
      step                 a 0-dim fp32 tensor: 4 bytes
      exp_avg, exp_avg_sq  quantized when n >= 4096 and n is a multiple of B:
                             codes (n bytes at 8 bits, n // 2 at 4) + fp32 scales (4 n / B)
                             + the quantization map, one fp32 copy per moment (256 entries at 8
                               bits, 16 at 4: 1 KiB or 64 bytes)
                           otherwise plain: n elements of p's dtype (bf16 parameters: bf16 moments)
      max_exp_avg_sq       the same again with amsgrad=True
    per param group        the learning rate as a 0-dim fp32 tensor: 4 bytes

Where memfit's own format differs: it quantizes a tensor of n >= 4096 whose last block is partial
(torchao keeps those plain), its small tensors keep fp32 moments whatever the parameter dtype, and
it keeps one quantization map per process, not one per moment. tests/test_apply_torchao_layout.py
checks these figures against the state torchao's optimizers really allocate.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

BLOCK = {8: 256, 4: 128}
"""torchao's default block size (elements per fp32 scale) by bits."""
QMAP_ENTRIES = {8: 256, 4: 16}
"""fp32 entries of the quantization map each quantized moment holds."""
MIN_QUANTIZED = 4096
"""torchao (after bitsandbytes) quantizes tensors of at least this many elements."""
STEP_BYTES = 4
LR_BYTES = 4


def quantized(n: int, bits: int) -> bool:
    return n >= MIN_QUANTIZED and n % BLOCK[bits] == 0


def moment_bytes(n: int, bits: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one moment of a tensor of n elements and parameter dtype `dtype`."""
    if not quantized(n, bits):
        return n * torch.empty((), dtype=dtype).element_size()
    codes = n if bits == 8 else n // 2
    return codes + 4 * (n // BLOCK[bits]) + 4 * QMAP_ENTRIES[bits]


def tensor_state_bytes(shape: Sequence[int], bits: int, dtype: torch.dtype = torch.float32,
                       amsgrad: bool = False) -> int:
    """Bytes torchao's AdamW{bits}bit keeps for one parameter tensor (both moments, the step; amsgrad's third)."""
    n = math.prod(shape)
    return (3 if amsgrad else 2) * moment_bytes(n, bits, dtype) + STEP_BYTES


def state_bytes(params: Iterable[torch.Tensor], bits: int, amsgrad: bool = False, groups: int = 1) -> int:
    """Bytes of the whole state of torchao's AdamW{bits}bit over `params` (tensors or anything with
    .shape and .dtype, e.g. meta parameters), its `groups` learning-rate tensors included."""
    return sum(tensor_state_bytes(tuple(p.shape), bits, p.dtype, amsgrad) for p in params) + LR_BYTES * groups
