"""distributed: strategies on torch.distributed: data parallel (ps, ddp, zero1-3), pipeline, tensor.

    init(device)                          join the process group torchrun describes (timeouts set)
    distribute(model, strategy, ...)      an optimizer with TrainingOptimizer's interface for it
    TRAFFIC                               bytes this rank sent, per collective (memfit.distributed.comm)
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "init": "memfit.distributed.env:init",
    "shutdown": "memfit.distributed.env:shutdown",
    "distribute": "memfit.distributed.strategy:distribute",
    "global_count": "memfit.distributed.strategy:global_count",
    "rank_slice": "memfit.distributed.strategy:rank_slice",
    "STRATEGIES": "memfit.distributed.strategy:STRATEGIES",
    "TRAFFIC": "memfit.distributed.comm:TRAFFIC",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'memfit.distributed' has no attribute {name!r}")
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)
