"""Bytes sent by the collectives DTensor issues (tensor parallelism), counted where they are called.

DTensor's parallel styles redistribute in module hooks and in the backward of their autograd
functions, through torch's functional collectives (`_c10d_functional.*`). A dispatch mode active
around forward and backward sees each of those calls with its tensor and adds its volume to
memfit.distributed.comm.TRAFFIC, by the same ring formulas as memfit's own collectives:

    all_reduce              2 M (N-1)/N     M: the tensor
    all_gather_into_tensor  M (N-1)/N       M: the gathered output (input x N)
    reduce_scatter_tensor   M (N-1)/N       M: the full input
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.distributed.comm import TRAFFIC


class CountCollectives(TorchDispatchMode):
    """Count the functional collectives run while active; `n`: the group size they run over."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) == "_c10d_functional" and args and isinstance(args[0], torch.Tensor):
            m, n = args[0].numel() * args[0].element_size(), self.n
            name = func._overloadpacket.__name__
            if name.startswith("all_reduce"):
                TRAFFIC.add("all_reduce", 2 * m * (n - 1) / n)
            elif name.startswith("all_gather"):
                TRAFFIC.add("all_gather", m * (n - 1))
            elif name.startswith("reduce_scatter"):
                TRAFFIC.add("reduce_scatter", m * (n - 1) / n)
        return func(*args, **(kwargs or {}))
