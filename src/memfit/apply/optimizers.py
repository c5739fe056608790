"""The optimizers memfit knows: one table for the estimate, TrainingOptimizer, `memfit train` and `track`.

Each entry says how to build the torch optimizer and what state it keeps per parameter tensor, so
the memory formulas (memfit.measure.formulas) and the planner read the same facts the training
run acts on:

    name        state per tensor of shape s (K = bytes per element of the state dtype)   lossless
    sgd         nothing                                                                   yes
    momentum    1 buffer: K * n                                                           yes
    adam/adamw  2 moments: 2K * n + 4-byte step                                           yes
    adagrad     sum of squares: K * n + step                                              yes
    rmsprop     square average: K * n + step                                              yes
    lion        momentum: K * n                                                           yes
    adafactor   factored second moment: K * (n / s[-1] + n / s[-2]) for matrices,
                K * n for vectors, + step                                                  yes
    adamw8bit   AdamW, moments as 8-bit codes + an fp32 scale per 256: 2(n + 4 ceil(n/256)) + step;
                tensors under 4096 elements keep fp32 moments                             no
    adamw4bit   the same at 4 bits, scale per 128: 2(ceil(n/2) + 4 ceil(n/128)) + step   no

"lossless" means the optimizer runs its algorithm in the state dtype as published; the 8-/4-bit
formats quantize AdamW's moments, which changes the trajectory, so a planner may choose them only
when the user allows "optimizer-states" (see `describe()` and docs/optimizers.md).
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from memfit.core.errors import ConfigError

STEP_BYTES = 4
"""torch's Adam-family optimizers keep a 0-dim fp32 step counter per parameter tensor."""


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    summary: str
    states: int
    """Full-size state tensors per parameter (0 for factored / quantized formats)."""
    step_counter: bool
    lossless: bool
    bits: int | None = None
    """Quantized formats: bits per moment element."""
    same_update_as: str | None = None
    """A quantized format of this optimizer's update (adamw8bit -> adamw)."""
    extra: str | None = None
    """The optional dependency set (pip install 'memfit[extra]') it needs."""


_INFO = [
    OptimizerInfo("sgd", "SGD", 0, False, True),
    OptimizerInfo("momentum", "SGD with momentum 0.9", 1, False, True),
    OptimizerInfo("adam", "Adam (torch.optim.Adam)", 2, True, True),
    OptimizerInfo("adamw", "AdamW (torch.optim.AdamW)", 2, True, True),
    OptimizerInfo("adagrad", "Adagrad (torch.optim.Adagrad)", 1, True, True),
    OptimizerInfo("rmsprop", "RMSprop (torch.optim.RMSprop)", 1, True, True),
    OptimizerInfo("lion", "Lion: sign of interpolated momentum (memfit.apply.lion)", 1, False, True),
    OptimizerInfo("adafactor", "Adafactor: factored second moment (torch.optim.Adafactor)", 0, True, True),
    OptimizerInfo("adamw8bit", "AdamW with block-wise 8-bit moments (torchao quantization)", 0, True, False,
                  bits=8, same_update_as="adamw", extra="lowbit"),
    OptimizerInfo("adamw4bit", "AdamW with block-wise 4-bit moments (torchao quantization)", 0, True, False,
                  bits=4, same_update_as="adamw", extra="lowbit"),
]
OPTIMIZERS: dict[str, OptimizerInfo] = {i.name: i for i in _INFO}
NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
ADAM_FAMILY = ("adam", "adamw")
"""Optimizers whose eps divides by sqrt(v) in the state dtype (fp16 states need a larger eps)."""


def info(name: str) -> OptimizerInfo:
    try:
        return OPTIMIZERS[name.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(f"unknown optimizer {name!r}; accepted: {', '.join(NAMES)}") from None


def optimizer_class(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The optimizer class (or class with its format bound) that runs `name`; ConfigError if unknown.
    memfit.apply.torch_optim builds it with torch's defaults for whatever the caller leaves out."""
    name = info(name).name
    if name == "adafactor":
        from memfit.apply.adafactor import Adafactor

        return Adafactor
    if name == "lion":
        from memfit.apply.lion import Lion

        return Lion
    if name in ("adamw8bit", "adamw4bit"):
        from memfit.apply.lowbit import AdamWLowBit

        return functools.partial(AdamWLowBit, bits=OPTIMIZERS[name].bits)
    return _TORCH[name]


_TORCH = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
          "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}

def check_available(name: str) -> None:
    """ConfigError (naming the extra to install) when `name` needs a dependency that is missing."""
    if info(name).extra == "lowbit":
        from memfit.apply.lowbit import _torchao

        _torchao()


def tensor_state_bytes(name: str, shape: Sequence[int], itemsize: int = 4) -> int:
    """Exact bytes of optimizer state for one parameter tensor of `shape` (states of `itemsize`
    bytes per element), step counter included."""
    spec = info(name)
    n = math.prod(shape)
    if spec.bits is not None:
        from memfit.apply.lowbit import state_bytes

        return state_bytes(n, spec.bits)
    step = STEP_BYTES if spec.step_counter else 0
    if spec.name == "adafactor":
        if len(shape) >= 2:
            return itemsize * (n // shape[-1] + n // shape[-2]) + step
        return itemsize * n + step
    return itemsize * spec.states * n + step


def state_bytes_per_param(name: str, n: int, itemsize: int = 4) -> float:
    """Bytes per parameter for one large tensor of n elements, step counter left out. Adafactor's
    depends on the shape: this is for a square matrix."""
    spec = info(name)
    if spec.name == "adafactor":
        side = max(1, math.isqrt(n))
        return tensor_state_bytes(name, (side, side), itemsize) / (side * side) - STEP_BYTES / (side * side)
    return (tensor_state_bytes(name, (n,), itemsize) - (STEP_BYTES if spec.step_counter else 0)) / n


def describe() -> dict[str, dict[str, Any]]:
    """Plain data a planner can read: per optimizer, its facts and the state bytes per parameter of
    a large fp32-state tensor (1M elements; Adafactor: a 1024 x 1024 matrix)."""
    out = {}
    for name, spec in OPTIMIZERS.items():
        row = asdict(spec)
        row["bytes_per_param"] = state_bytes_per_param(name, 1 << 20)
        row["factored"] = name == "adafactor"
        out[name] = row
    return out


def state_format_choices(name: str, allow: Iterable[str] = ()) -> list[str]:
    """Optimizers a planner may run in place of `name`: itself, plus its quantized state formats
    when "optimizer-states" is allowed (they change the numbers), smallest state last."""
    name = info(name).name
    out = [name]
    if "optimizer-states" in tuple(allow):
        subs = [n for n, s in OPTIMIZERS.items() if s.same_update_as == name]
        out += sorted(subs, key=lambda n: -state_bytes_per_param(n, 1 << 20))
    return out


def needs_shapes(name: str) -> bool:
    """True when the state bytes depend on parameter shapes, not on the parameter count alone."""
    spec = info(name)
    return spec.name == "adafactor" or spec.bits is not None

