"""4-bit NormalFloat (NF4) base weights under LoRA: QLoRA on torchao's NF4Tensor.

    model = apply_lora(model, parse_lora("r=16,targets=qkv,proj,base=nf4"))   # or --lora ... --qlora

QLoRA (Dettmers et al., 2023) stores the frozen base in 4 bits and trains 16-bit adapters on top. Every
frozen `nn.Linear` weight except the output head (which QLoRA, like peft and bitsandbytes' defaults,
keeps in 16 bits) becomes a torchao `NF4Tensor` with double quantization: blocks of 64 weights share an
absmax scale, and the scales, less their mean, are quantized to int8 in blocks of 256 with one factor
per block. `nn.Linear` then runs through torchao's `F.linear` override: the weight is dequantized to the
input's dtype for the product, freed after it, and dequantized again in backward (torchao's
`LinearNF4` saves the NF4 weight itself, not a dequantized copy).

What one NF4 weight of N elements holds, as torchao stores it (`nf4_bytes`; s: bytes of its dtype):

    N / 2            packed 4-bit codes (uint8, two per byte)
    N / 64           int8 scales, one per block of 64
    s * N / 16384    one factor per block of 256 scales (s * 256 when N == 16384: torchao keeps a
                     1-element view of its 256-element temporary, whose whole storage stays alive)
    s                the scales' mean (a 0-d tensor)
    16 * s           the 16 NF4 levels (each NF4Tensor holds its own lookup table)

Under FakeTensorMode or on the meta device (estimates, plans) the same layout is built empty
(`empty_nf4`): torchao's quantization runs a Python loop per million elements, seconds for an 8B model
that an estimate does not need. tests/test_qlora.py checks the layout against torchao's own tensors.
"""
from __future__ import annotations

import logging
import sys

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError

BLOCK = 64
"""Weights per absmax scale (QLoRA's and torchao's default)."""
SCALER_BLOCK = 256
"""Scales per int8 factor in the double quantization (QLoRA's and torchao's default)."""
_MULTIPLE = BLOCK * SCALER_BLOCK  # torchao needs whole scale blocks: N a multiple of 16384


def nf4_module():
    """torchao's NF4 module; ConfigError naming the package when it is not installed."""
    # torchao logs each CUDA-only kernel it skips on import, and torch a deprecation note on its enums.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        try:  # torchao before the quantize_ workflows layout
            from torchao.dtypes import nf4tensor as nf4_tensor
        except ImportError as e:
            raise ConfigError(f"4-bit base weights (--qlora, base=nf4) need torchao's NF4Tensor "
                              f"(pip install torchao): {e}") from None
    return nf4_tensor


def is_nf4(t: object) -> bool:
    """True for a torchao NF4Tensor (without importing torchao)."""
    return isinstance(t, torch.Tensor) and type(t).__name__ == "NF4Tensor" and hasattr(t, "quantized_data")


def nf4_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of one NF4 weight of `numel` elements in `dtype`, as torchao stores it (see the module doc)."""
    check_size(numel, "weight")
    s = dtype.itemsize
    scaler_blocks = numel // _MULTIPLE
    factors = SCALER_BLOCK if scaler_blocks == 1 else scaler_blocks
    return numel // 2 + numel // BLOCK + s * factors + s + 16 * s


def check_size(numel: int, name: str) -> None:
    if numel % _MULTIPLE:
        raise ConfigError(f"{name} has {numel} elements; NF4 double quantization needs a multiple of "
                          f"{_MULTIPLE} ({BLOCK} x {SCALER_BLOCK}); drop --qlora (base=nf4) for this model")


def _holds_no_data(t: torch.Tensor) -> bool:
    if t.is_meta:
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and fake.is_fake(t)


def empty_nf4(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An NF4Tensor with torchao's layout and no values: for fake and meta weights."""
    mod = nf4_module()
    numel = shape.numel()
    scaler_blocks = numel // _MULTIPLE
    if scaler_blocks == 1:  # torchao's factor is then a view of a (1, 256) temporary
        factor = torch.empty(1, SCALER_BLOCK, dtype=dtype, device=device)[:, 0]
    else:
        factor = torch.empty(scaler_blocks, dtype=dtype, device=device)
    meta = mod.SubclassTensorArgs(shape, torch.empty(shape, device="meta").stride(), 0, dtype, device, False)
    return mod.NF4Tensor(meta, BLOCK, numel // BLOCK, SCALER_BLOCK,
                         torch.empty(numel // BLOCK, dtype=torch.int8, device=device), factor,
                         torch.empty((), dtype=dtype, device=device),
                         torch.empty(numel // 2, dtype=torch.uint8, device=device),
                         torch.empty(16, dtype=dtype, device=device))


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in NF4 (torchao's quantization for real values; the empty layout for fake or meta ones)."""
    weight = weight.detach()
    if _holds_no_data(weight):
        return empty_nf4(weight.shape, weight.dtype, weight.device)
    return nf4_module().to_nf4(weight.contiguous(), BLOCK, SCALER_BLOCK)


def _head(model: nn.Module) -> nn.Module | None:
    """The output head QLoRA keeps in 16 bits: memfit GPT's `head`, a Hugging Face model's output embeddings."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        return get()
    return getattr(model, "head", None)


def quantize_base(model: nn.Module) -> list[str]:
    """Every frozen nn.Linear weight but the output head becomes NF4, in place; returns their names."""
    head = _head(model)
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and m is not head and not m.weight.requires_grad]
    for name, m in chosen:
        check_size(m.weight.numel(), f"layer {name} ({m.out_features} x {m.in_features})")
    for name, m in chosen:
        m.weight = nn.Parameter(to_nf4(m.weight), requires_grad=False)
    if not chosen:
        raise ConfigError(f"{type(model).__name__} has no frozen nn.Linear layer to hold in NF4 (QLoRA quantizes "
                          "nn.Linear weights; transformers' GPT-2 uses Conv1D)")
    return [name for name, _ in chosen]


def recast_nf4(model: nn.Module, dtype: torch.dtype) -> None:
    """NF4 weights of another dtype re-quantized in `dtype` (their scales, factors and levels are in the
    weight's dtype): what a precision mode's cast does to them, as casting would dequantize them."""
    for m in model.modules():
        w = getattr(m, "weight", None)
        if is_nf4(w) and w.dtype != dtype:
            if _holds_no_data(w.quantized_data):
                new = empty_nf4(w.shape, dtype, w.device)
            else:
                new = to_nf4(w.get_original_weight().to(dtype))
            m.weight = nn.Parameter(new, requires_grad=False)
