"""memfit: make PyTorch training fit in memory — explain, save, plan, prove.

The public API is small and re-exported here; names load lazily so `import memfit` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_EXPORTS = {
    "estimate": "memfit.measure.estimate:estimate",
    "Estimate": "memfit.measure.estimate:Estimate",
    "model_state_bytes": "memfit.measure.formulas:model_state_bytes",
    "track": "memfit.core.tracker:track",
    "fit": "memfit.plan.fit:fit",
    "profile": "memfit.profile.measure:profile",
    "Plan": "memfit.plan.plan:Plan",
    "AdaptivePlan": "memfit.plan.adaptive:AdaptivePlan",
    "MemoryTracker": "memfit.core.tracker:MemoryTracker",
    "checkpoint": "memfit.apply.checkpoint:checkpoint",
    "find_blocks": "memfit.apply.checkpoint:find_blocks",
    "chunk_head": "memfit.apply.head_swap:chunk_head",
    "chunked_cross_entropy": "memfit.apply.chunked_head:chunked_cross_entropy",
    "TrainingOptimizer": "memfit.apply.optimizer:TrainingOptimizer",
    "distribute": "memfit.distributed.strategy:distribute",
    "LossScaler": "memfit.apply.loss_scale:LossScaler",
    "trace_step": "memfit.measure.trace:trace_step",
    "measure_step": "memfit.measure.trace:measure_step",
    "TrainConfig": "memfit.train.loop:TrainConfig",
    "train": "memfit.train.loop:train",
    "GPT": "memfit.models.gpt:GPT",
    "GPTConfig": "memfit.models.gpt:GPTConfig",
    "MemfitError": "memfit.core.errors:MemfitError",
    "ConfigError": "memfit.core.errors:ConfigError",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    module, attr = target.split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
