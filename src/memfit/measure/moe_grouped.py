"""A grouped matmul whose forward and backward both trace under FakeTensorMode.

transformers' `grouped_mm_fallback` op has a fake forward; in releases before its backward became an
op of its own (5.17 is one), the backward reads the routing offsets in Python (`offs.tolist()`), which
fake tensors cannot answer. `grouped_mm()` here is the same computation with the same allocations
(output zeros (S, out); backward zeros like input and like weight, filled per expert) registered as
two custom ops with fake kernels, so a fake trace of such a transformers sees what a real step holds.
"""
from __future__ import annotations

import torch

_ops = None


def _forward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(input.size(0), weight.size(2), device=input.device, dtype=input.dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end != start:
            torch.mm(input[start:end], weight[i], out=out[start:end])
        start = end
    return out


def _backward(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
              grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end != start:
            torch.mm(grad_output[start:end], weight[i].T, out=grad_input[start:end])
            torch.mm(input[start:end].T, grad_output[start:end], out=grad_weight[i])
        start = end
    return grad_input, grad_weight


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _autograd(ctx, grad_output):
    input, weight = ctx.saved_tensors
    grad_input, grad_weight = torch.ops.memfit.grouped_mm_backward(input, weight, ctx.offs, grad_output)
    return grad_input, grad_weight, None


def _register():
    global _ops
    if _ops is None:
        lib = torch.library
        lib.custom_op("memfit::grouped_mm", _forward, mutates_args=(),
                      schema="(Tensor input, Tensor weight, Tensor offs) -> Tensor")
        lib.register_fake("memfit::grouped_mm",
                          lambda input, weight, offs: input.new_empty((input.size(0), weight.size(2))))
        lib.custom_op("memfit::grouped_mm_backward", _backward, mutates_args=(),
                      schema="(Tensor input, Tensor weight, Tensor offs, Tensor grad_output) -> (Tensor, Tensor)")
        lib.register_fake("memfit::grouped_mm_backward",
                          lambda input, weight, offs, grad: (torch.empty_like(input), torch.empty_like(weight)))
        lib.register_autograd("memfit::grouped_mm", _autograd, setup_context=_setup_context)
        _ops = torch.ops.memfit
    return _ops


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """input (S, in) sorted by expert, weight (E, in, out), offs (E,) cumulative counts -> (S, out)."""
    return _register().grouped_mm(input.to(weight.dtype), weight, offs)


def fakeable_fallback_backward() -> bool:
    """Whether this transformers' grouped_mm fallback has its backward as an op (with a fake kernel)."""
    return hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")
