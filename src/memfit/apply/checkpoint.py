"""Activation checkpointing by policy. (Foundation version: none / full / every:k.)

Blocks are wrapped by replacing the block's *instance* `forward`, so parameter names and
state_dict keys are unchanged and the policy can be removed again.
"""
from __future__ import annotations

import functools
import types

import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from memfit.errors import ConfigError

# Attribute paths where well-known models keep their repeated blocks.
_BLOCK_PATHS = ("blocks", "transformer.h", "model.layers", "transformer.layers", "layers", "h", "model.decoder.layers")


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: a known attribute path, else the largest ModuleList."""
    for path in _BLOCK_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ConfigError(
            f"found no nn.ModuleList of repeated blocks in {type(model).__name__}; "
            "pass blocks=<the ModuleList> explicitly"
        )
    return max(lists, key=len)


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    fwd = type(block).forward.__get__(block)
    return torch_checkpoint(fwd, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _wrap(block: nn.Module) -> None:
    block.forward = types.MethodType(functools.partial(_checkpointed_forward), block)  # type: ignore[method-assign]


def _unwrap(block: nn.Module) -> None:
    block.__dict__.pop("forward", None)


def checkpoint(model: nn.Module, policy: str = "full", blocks: nn.ModuleList | None = None) -> nn.Module:
    """Apply a checkpoint policy to `model` in place and return it.

    policy: "none", "full" (every block) or "every:k" (every k-th block).
    """
    blocks = blocks if blocks is not None else find_blocks(model)
    if policy == "none":
        chosen: set[int] = set()
    elif policy == "full":
        chosen = set(range(len(blocks)))
    elif policy.startswith("every:") and policy[6:].isdigit() and int(policy[6:]) > 0:
        k = int(policy[6:])
        chosen = set(range(0, len(blocks), k))
    else:
        raise ConfigError(f"unknown checkpoint policy {policy!r}; accepted: none, full, every:K (K >= 1)")
    for i, block in enumerate(blocks):
        (_wrap if i in chosen else _unwrap)(block)
    return model
