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
from typing import Sequence

from memfit.apply import optimizers
from memfit.apply.precision import PRECISIONS  # the one list of precision names
from memfit.core.errors import ConfigError

# Per-parameter full-size state tensors each optimizer keeps (memfit.apply.optimizers is the one
# table; Adafactor's factored and the 8-/4-bit quantized states are counted per tensor shape).
OPTIMIZER_STATES = {name: spec.states for name, spec in optimizers.OPTIMIZERS.items()}

# Optimizers whose implementation keeps a 0-dim fp32 `step` counter per parameter tensor.
STEP_COUNTERS = {name for name, spec in optimizers.OPTIMIZERS.items() if spec.step_counter}
STEP_BYTES = optimizers.STEP_BYTES

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
    """Full-size state tensors per parameter; ConfigError for an unknown optimizer."""
    return optimizers.info(optimizer).states


def state_itemsize(precision: str) -> int:
    """Bytes per element of optimizer state: 2 in the 16-bit -true modes, else 4 (fp32)."""
    return 2 if precision.endswith("-true") and precision != "32-true" else 4


def optimizer_state_bytes(optimizer: str, param_shapes: Sequence[Sequence[int]], precision: str = "32-true") -> int:
    """Exact optimizer state bytes (step counters included, master weights not) for parameters of
    these shapes: Adafactor's factored moments and the 8-/4-bit codes and block scales per tensor."""
    check_precision(precision)
    size = state_itemsize(precision)
    return sum(optimizers.tensor_state_bytes(optimizer, tuple(s), size) for s in param_shapes)


def param_shapes(model) -> list[tuple[int, ...]]:
    """Shapes of a module's trainable parameters, or of a ModelSpec's (built on the meta device)."""
    if hasattr(model, "on_meta") and not hasattr(model, "parameters"):
        model = model.on_meta()
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def bytes_per_param(precision: str = "32-true", optimizer: str = "adamw") -> BytesPerParam:
    """Per parameter, for the element-wise optimizers; for Adafactor and the 8-/4-bit formats the
    optimizer figure holds the master weights only (their state depends on the shapes)."""
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
    param_shapes: Sequence[Sequence[int]] | None = None,
    n_trainable: int | None = None,
) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes held on one device.

    A shard holds ceil(n_params / world) elements, as sharding pads to a multiple of the world size.
    `n_tensors` (the number of parameter tensors) adds the 4-byte step counters that torch's
    Adam-family optimizers keep per tensor; 0 leaves them out, as the ZeRO paper does.
    `param_shapes` (the trainable parameters' shapes) makes the optimizer figure exact for every
    optimizer and sets n_tensors; Adafactor needs it. Without it the 8-/4-bit formats are counted as
    one tensor of n_params elements. ZeRO shards shape-dependent state in proportion to the elements.
    `n_trainable` (default: all n_params) counts the parameters with requires_grad: frozen ones (a LoRA
    base) hold weights only, no gradient and no optimizer state; `n_tensors` and `param_shapes` then
    describe the trainable tensors.
    """
    if not isinstance(n_params, int) or n_params <= 0:
        raise ConfigError(f"number of parameters must be a positive integer, got {n_params!r}")
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size must be a positive integer, got {world!r}")
    if offload_optimizer not in OFFLOAD_TARGETS:
        raise ConfigError(f"unknown optimizer offload target {offload_optimizer!r}; accepted: none, cpu, disk")
    trainable = n_params if n_trainable is None else n_trainable
    if not isinstance(trainable, int) or not 0 <= trainable <= n_params:
        raise ConfigError(f"n_trainable must be an integer in [0, n_params={n_params}], got {n_trainable!r}")
    b = bytes_per_param(precision, optimizer)
    spec = optimizers.info(optimizer)
    if param_shapes is not None:
        param_shapes = [tuple(s) for s in param_shapes]
        if sum(math.prod(s) for s in param_shapes) != trainable:
            raise ConfigError(f"param_shapes hold {sum(math.prod(s) for s in param_shapes)} elements, "
                              f"not the {trainable} trainable parameters")
        n_tensors = len(param_shapes)
    elif spec.name == "adafactor":
        raise ConfigError("adafactor's state depends on the parameter shapes (factored per matrix): give a "
                          "model (or param_shapes), not a parameter count alone")
    shard, tshard = math.ceil(n_params / world), math.ceil(trainable / world)
    params = b.weights * (shard if zero >= 3 else n_params)
    grads = b.grads * (tshard if zero >= 2 else trainable)
    opt = b.optimizer * (tshard if zero >= 1 else trainable)
    steps = STEP_BYTES * n_tensors if spec.step_counter and trainable else 0
    if optimizers.needs_shapes(optimizer) and trainable:  # the state is not a whole number of bytes per element
        shapes = param_shapes if param_shapes is not None else [(trainable,)]
        state = optimizer_state_bytes(optimizer, shapes, precision) - STEP_BYTES * len(shapes) * spec.step_counter
        opt += state if zero < 1 else math.ceil(state * tshard / trainable)
    opt += steps
    if offload_optimizer in ("cpu", "disk"):
        return ModelStateBytes(params, 0, 0, offloaded=grads + opt)
    return ModelStateBytes(params, grads, opt)
