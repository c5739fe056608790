"""Precision modes: which dtype each piece of model state has, and casting a model to it.

    mode = precision_mode("bf16-master")
    cast_model(model, mode)          # parameters become bfloat16 on the device
    with autocast(mode, "cpu"): ...  # no-op for 32-true

Per parameter, bytes on the device (weights / grads / optimizer, K = optimizer state bytes in fp32):

    32-true                  4 / 4 / K       plain fp32
    bf16-mixed, 16-mixed     4 / 4 / K       fp32 weights, autocast runs matmuls in 16-bit
    bf16-true, 16-true       2 / 2 / K/2     everything 16-bit, optimizer state too
    bf16-master, 16-master   2 / 2 / 4 + K   16-bit weights and grads; fp32 master weights and fp32
                                             state live in the optimizer (ZeRO / Megatron style)

fp16 modes use dynamic loss scaling (memfit.apply.loss_scale) because fp16's exponent range loses
small gradients; bf16 has fp32's exponent range and does not need it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.models.qlora import is_nf4, recast_nf4


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    param_dtype: torch.dtype
    """dtype of the model's floating-point parameters (and so of their gradients) on the device."""
    autocast_dtype: torch.dtype | None
    """dtype autocast runs eligible ops in; None means no autocast."""
    master_dtype: torch.dtype | None
    """dtype of master weights kept by the optimizer; None: the optimizer updates the parameters directly."""
    loss_scaling: bool
    """fp16 modes: gradients would underflow without scaling the loss up (and overflow detection)."""

    @property
    def state_dtype(self) -> torch.dtype:
        """dtype of the optimizer's moment buffers: the master's when there is one, else the parameter's."""
        return self.master_dtype or self.param_dtype



_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16

MODES: dict[str, PrecisionMode] = {
    m.name: m
    for m in (
        PrecisionMode("32-true", _F32, None, None, False),
        PrecisionMode("bf16-mixed", _F32, _BF16, None, False),
        PrecisionMode("16-mixed", _F32, _F16, None, True),
        # The 16-bit-weight modes autocast too: weights need no cast, but autocast's fp32 op list runs
        # losses and softmax reductions in fp32, so a summed token loss cannot overflow fp16.
        PrecisionMode("bf16-true", _BF16, _BF16, None, False),
        PrecisionMode("16-true", _F16, _F16, None, True),
        PrecisionMode("bf16-master", _BF16, _BF16, _F32, False),
        PrecisionMode("16-master", _F16, _F16, _F32, True),
    )
}
PRECISIONS = tuple(MODES)


def precision_mode(name: str | PrecisionMode) -> PrecisionMode:
    if isinstance(name, PrecisionMode):
        return name
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown precision {name!r}; accepted: {', '.join(PRECISIONS)}") from None


def cast_model(model: nn.Module, mode: str | PrecisionMode) -> nn.Module:
    """Cast floating-point parameters and buffers to the mode's parameter dtype, in place.

    Only floating tensors change (integer buffers such as token ids or counters keep their dtype).
    Parameters are cast through `.data` so the optimizer and any hooks keep the same Parameter objects.
    NF4 base weights (QLoRA, frozen, in no optimizer) are re-quantized in the dtype (memfit.models.qlora).
    """
    mode = precision_mode(mode)
    dtype = mode.param_dtype
    if any(is_nf4(p) for p in model.parameters()):  # casting would dequantize them: re-quantized instead
        recast_nf4(model, dtype)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and not is_nf4(p):
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)
    return model


def autocast(mode: str | PrecisionMode, device_type: str) -> contextlib.AbstractContextManager:
    mode = precision_mode(mode)
    if mode.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=mode.autocast_dtype)
