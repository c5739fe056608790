"""AdamW with 8-bit or 4-bit optimizer states: block-wise quantized moments (Dettmers et al. 2021,
"8-bit Optimizers via Block-wise Quantization"; Li et al. 2023, "Memory Efficient Optimizers with
4-bit States").

The quantization is torchao's (the `lowbit` extra): its dynamic quantization maps, its rounding
binary search and its block sizes (256 elements per fp32 absmax scale for 8-bit, 128 for 4-bit;
4-bit codes packed two per byte; the 4-bit second moment on a linear map without zero), and its
update math (moments dequantized to fp32, lerp, AdamW step, re-quantized). Unlike torchao's own
AdamW8bit/AdamW4bit the state is kept as plain tensors (uint8 codes, fp32 scales) instead of tensor
subclasses, and the update runs eagerly instead of through torch.compile, so that it

* streams to disk with the other optimizer state (memfit.apply.optim_offload) and checkpoints
  into a weights-only torch.save file;
* traces under FakeTensorMode and is seen by the memory tracker (memfit estimate / track);
* takes a float learning rate from a schedule, as torch's optimizers do.

Per tensor of n >= MIN_QUANTIZED elements: codes (n bytes 8-bit, ceil(n/2) 4-bit), scales (4 bytes
per block, the last block partial), a 4-byte step. Smaller tensors (biases, norms) keep fp32
moments, as bitsandbytes and torchao do. The update walks each tensor in slices of SLICE elements
so its fp32 temporaries stay small next to the tensor itself. Under FakeTensorMode (memfit
estimate) only the first and the last two slices run: the others allocate exactly as they do.
"""
from __future__ import annotations

import functools
import logging
import math

import torch
from torch._subclasses.fake_tensor import is_fake

from memfit.core.errors import ConfigError

MIN_QUANTIZED = 4096
"""Tensors with fewer elements keep fp32 moments (quantizing a bias saves nothing worth the error)."""
SLICE = 1 << 16
"""Elements per slice of the update (a multiple of both block sizes)."""
BITS = {8: 256, 4: 128}
"""Block size (elements per fp32 scale) by bits, torchao's defaults."""
EXTRA = "lowbit"


@functools.lru_cache(maxsize=None)
def _torchao():
    """torchao's quantization helpers; ConfigError naming the extra when it is not installed."""
    # torchao logs each CUDA-only kernel it skips, and torch a deprecation note on its enums.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from torchao.optim import quant_utils, subclass_4bit, subclass_8bit
    except ImportError:
        raise ConfigError(f"adamw8bit and adamw4bit need torchao: pip install 'memfit[{EXTRA}]' "
                          "(or pick another optimizer, e.g. adamw or adafactor)") from None
    return quant_utils, subclass_8bit, subclass_4bit


def available() -> bool:
    try:
        _torchao()
    except ConfigError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _qmap(bits: int, signed: bool) -> torch.Tensor:
    _, s8, s4 = _torchao()
    mod = s8 if bits == 8 else s4
    # Made outside any dispatch mode (FakeTensorMode, the tracker): a real constant shared by every
    # state, never one of them.
    with torch._C._DisableTorchDispatch():
        values = mod.get_qmap_signed() if signed else mod.get_qmap_unsigned()
        return torch.tensor(values, dtype=torch.float32)


def quantized(n: int) -> bool:
    return n >= MIN_QUANTIZED


def code_bytes(n: int, bits: int) -> int:
    return n if bits == 8 else (n + 1) // 2


def scale_count(n: int, bits: int) -> int:
    return -(-n // BITS[bits])


def state_bytes(n: int, bits: int) -> int:
    """Bytes of both moments and the step counter for one tensor of n elements."""
    if not quantized(n):
        return 2 * 4 * n + 4
    return 2 * (code_bytes(n, bits) + 4 * scale_count(n, bits)) + 4


@functools.lru_cache(maxsize=None)
def _nearest_table(bits: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for a fast nearest-code lookup of values in [-1, 1].

    The code of x is the number of midpoints between neighbouring map values that are <= x (ties
    round up, as torchao's search does). Indexed by the top 16 bits of x's fp32 pattern (its
    bfloat16 bucket), `base` holds that count for the bucket's smallest value; no bucket holds
    more than one midpoint, so one comparison with the next midpoint finishes the search."""
    with torch._C._DisableTorchDispatch():
        q = _qmap(bits, signed)
        mids = (q[1:] + q[:-1]) / 2
        top = torch.arange(1 << 16, dtype=torch.int32)
        lows = torch.where(top < (1 << 15), top << 16, (top << 16) | 0xFFFF).view(torch.float32)
        highs = torch.where(top < (1 << 15), (top << 16) | 0xFFFF, top << 16).view(torch.float32)
        finite = lows.isfinite() & highs.isfinite()
        base = torch.where(finite, torch.bucketize(lows, mids, right=True, out_int32=True), 0)
        span = torch.where(finite, torch.bucketize(highs, mids, right=True, out_int32=True), 0) - base
        assert int(span.max()) <= 1, "quantization map too fine for the bfloat16-bucket lookup"
        return base, torch.cat([mids, mids.new_full((1,), float("inf"))])


def _nearest(x: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    base, mids = _nearest_table(bits, signed)
    top = torch.bitwise_right_shift(x.view(torch.int32), 16).bitwise_and_(0xFFFF)
    codes = base.index_select(0, top.view(-1)).view(x.shape)
    return codes.add_((x >= mids.index_select(0, codes.view(-1)).view(x.shape)).int())


def _encode(x: torch.Tensor, bits: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (a multiple of the block size) -> (codes, per-block absmax scales)."""
    blocks = x.view(-1, BITS[bits])
    scale = blocks.abs().amax(-1).clip(1e-12)
    codes = _nearest((blocks / scale[:, None]).view(-1), bits, signed).to(torch.uint8)
    if bits == 4:
        pairs = codes.view(-1, 2)
        codes = (pairs[:, 0] << 4) | pairs[:, 1]
    return codes, scale


def _decode(codes: torch.Tensor, scale: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    if bits == 4:
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
    values = _qmap(bits, signed).index_select(0, codes.int())
    return (values.view(-1, BITS[bits]) * scale[:, None]).view(-1)


class AdamWLowBit(torch.optim.Optimizer):
    """AdamW whose two moments are stored in `bits` (8 or 4) bits per element plus block scales."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, bits: int = 8) -> None:
        if bits not in BITS:
            raise ConfigError(f"bits must be 8 or 4, got {bits!r}")
        _torchao()
        if not lr > 0:
            raise ConfigError(f"adamw{bits}bit: lr must be positive, got {lr!r}")
        self.bits = bits
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _init_state(self, p: torch.Tensor) -> dict:
        n = p.numel()
        state = {"step": torch.tensor(0.0)}
        if not quantized(n):
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return state
        for key in ("exp_avg", "exp_avg_sq"):
            state[key + "_codes"] = torch.zeros(code_bytes(n, self.bits), dtype=torch.uint8, device=p.device)
            state[key + "_scale"] = torch.zeros(scale_count(n, self.bits), dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                self._update(p, state, group)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        b1, b2 = group["betas"]
        step = float(state["step"])
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        bc1, bc2_sqrt = 1 - b1 ** step, math.sqrt(1 - b2 ** step)
        if not p.is_contiguous():
            raise ConfigError(f"adamw{self.bits}bit needs contiguous parameters (got strides {p.stride()})")
        flat, grad = p.view(-1), p.grad.reshape(-1)

        def adamw(lo: int, hi: int, m: torch.Tensor, v: torch.Tensor) -> None:
            # torchao's single_param_adam, on one slice in fp32.
            g = grad[lo:hi].float()
            x = flat[lo:hi].float()
            if wd:
                x.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.lerp_(g.square(), 1 - b2)
            x.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-lr / bc1)
            flat[lo:hi].copy_(x)

        if "exp_avg" in state:
            adamw(0, flat.numel(), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
            return
        bits, block = self.bits, BITS[self.bits]
        n = flat.numel()
        starts = range(0, n, SLICE)
        if is_fake(p):  # no values to compute: every full slice allocates alike, so trace two
            starts = sorted({starts[0], starts[-1], starts[max(0, len(starts) - 2)]})
        for lo in starts:
            hi = min(n, lo + SLICE)
            padded = -(-(hi - lo) // block) * block
            b_lo, b_hi = lo // block, lo // block + padded // block
            c_lo, c_hi = code_bytes(lo, bits), code_bytes(lo, bits) + code_bytes(padded, bits)
            moments = []
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                codes, scale = state[key + "_codes"], state[key + "_scale"]
                c = codes[c_lo:c_hi]
                if c.numel() < code_bytes(padded, bits):  # the last, partial block
                    c = torch.cat([c, c.new_zeros(code_bytes(padded, bits) - c.numel())])
                moments.append(_decode(c, scale[b_lo:b_hi], bits, signed)[: hi - lo])
            adamw(lo, hi, *moments)
            for (key, signed), x in zip((("exp_avg", True), ("exp_avg_sq", False)), moments):
                if x.numel() < padded:
                    x = torch.cat([x, x.new_zeros(padded - x.numel())])
                codes, scale = _encode(x, bits, signed)
                dst = state[key + "_codes"][c_lo:c_hi]
                dst.copy_(codes[: dst.numel()])
                state[key + "_scale"][b_lo:b_hi].copy_(scale)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts floating state to the parameter's dtype on load (uint8 codes too, when the
        parameter is floating): put every state tensor back in its saved dtype, so the codes stay
        one byte, the scales fp32, and a resumed run is bit-identical."""
        saved = {k: dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        by_id = {i: p for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for k, values in saved.items():
            p = by_id[k]
            for key, v in values.items():
                if torch.is_tensor(v) and key != "step":
                    self.state[p][key] = v.to(p.device, copy=True)
