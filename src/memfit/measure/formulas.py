"""Model-state bytes (parameters, gradients, optimizer state) per device, in closed form.

Per parameter, by precision mode (K = optimizer state bytes in the states' dtype):

    mode                    weights  grads  optimizer
    32-true                 4        4      K32
    bf16-mixed / 16-mixed   4        4      K32          (autocast: fp32 weights and grads)
    bf16-true  / 16-true    2        2      K16          (states kept in the weights' dtype)
    bf16-master/ 16-master  2        2      4 + K32      (fp32 master weights live in the optimizer)

ZeRO shards over the data-parallel world N: stage 1 the optimizer, stage 2 also gradients, stage 3
also weights. Offloading the optimizer (to CPU or disk) moves its bytes off the device, and the
gradients with them (as ZeRO-Offload does): each gradient leaves the device as backward produces
it, for the host-side update. With Adam in 16-master this is the ZeRO paper's (2 + 2 + K)Ψ, K = 12.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.apply.precision import PRECISIONS  # the one list of precision names
from memfit.core.errors import ConfigError

# Per-parameter state tensors each optimizer keeps (torch.optim's implementations).
OPTIMIZER_STATES = {
    "sgd": 0,
    "momentum": 1,  # SGD with momentum: one buffer
    "adam": 2,  # exp_avg, exp_avg_sq
    "adamw": 2,
    "adagrad": 1,  # sum of squares
    "rmsprop": 1,  # square average (no momentum, not centered)
    "lion": 1,  # exp_avg
}

# Optimizers whose torch implementation keeps a 0-dim fp32 `step` counter per parameter tensor.
STEP_COUNTERS = {"adam", "adamw", "adagrad", "rmsprop"}
STEP_BYTES = 4

OFFLOAD_TARGETS = (None, "none", "cpu", "disk")


@dataclass(frozen=True)
class BytesPerParam:
    weights: int
    grads: int
    optimizer: int
    """Includes fp32 master weights in the -master modes."""


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per device (and bytes moved off the device by offload)."""

    params: int
    grads: int
    optimizer: int
    offloaded: int = 0
    """Optimizer and gradient bytes held on the host (CPU memory or disk) instead of the device."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; accepted: {', '.join(PRECISIONS)}")
    return precision


def optimizer_states(optimizer: str) -> int:
    try:
        return OPTIMIZER_STATES[optimizer.lower()]
    except KeyError:
        raise ConfigError(f"unknown optimizer {optimizer!r}; accepted: {', '.join(OPTIMIZER_STATES)}") from None


def bytes_per_param(precision: str = "32-true", optimizer: str = "adamw") -> BytesPerParam:
    check_precision(precision)
    states = optimizer_states(optimizer)
    if precision.endswith("-true") and precision != "32-true":
        return BytesPerParam(2, 2, 2 * states)
    if precision.endswith("-master"):
        return BytesPerParam(2, 2, 4 + 4 * states)
    return BytesPerParam(4, 4, 4 * states)


def model_state_bytes(
    n_params: int,
    precision: str = "32-true",
    optimizer: str = "adamw",
    zero: int = 0,
    world: int = 1,
    offload_optimizer: str | None = None,
    n_tensors: int = 0,
) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes held on one device.

    A shard holds ceil(n_params / world) elements, as sharding pads to a multiple of the world size.
    `n_tensors` (the number of parameter tensors) adds the 4-byte step counters that torch's
    Adam-family optimizers keep per tensor; 0 leaves them out, as the ZeRO paper does.
    """
    if not isinstance(n_params, int) or n_params <= 0:
        raise ConfigError(f"number of parameters must be a positive integer, got {n_params!r}")
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size must be a positive integer, got {world!r}")
    if offload_optimizer not in OFFLOAD_TARGETS:
        raise ConfigError(f"unknown optimizer offload target {offload_optimizer!r}; accepted: none, cpu, disk")
    b = bytes_per_param(precision, optimizer)
    shard = math.ceil(n_params / world)
    params = b.weights * (shard if zero >= 3 else n_params)
    grads = b.grads * (shard if zero >= 2 else n_params)
    opt = b.optimizer * (shard if zero >= 1 else n_params)
    if optimizer.lower() in STEP_COUNTERS:
        opt += STEP_BYTES * n_tensors
    if offload_optimizer in ("cpu", "disk"):
        return ModelStateBytes(params, 0, 0, offloaded=grads + opt)
    return ModelStateBytes(params, grads, opt)
