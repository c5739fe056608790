"""The fused matrices of memfit's GPT blocks: qkv = [q; k; v] and SwiGLU's fc = [gate; up].

Tensor parallelism gives each rank a slice of *each* part (whole heads), and checkpoints store the
parts apart so that any TP degree or pipeline stage reads them back.
"""
from __future__ import annotations

import torch.nn as nn


def fused_groups(block: nn.Module) -> dict[str, list[int]]:
    """Row groups of the fused column-parallel matrices of one block (at its current head counts)."""
    a = block.attn
    out = {"attn.qkv": [a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim]}
    if block.mlp.swiglu:
        half = block.mlp.fc.out_features // 2
        out["mlp.fc"] = [half, half]
    return out


def fused_sizes(gpt: nn.Module, name: str) -> list[int] | None:
    """Full-size row groups of a fused matrix or bias named as in the GPT's state dict (None: unfused).
    A TP-sharded block remembers its full-size groups (`_memfit_fused`)."""
    if not name.startswith("blocks."):
        return None
    i, _, leaf = name[len("blocks."):].partition(".")
    block = gpt.blocks[int(i)]
    groups = getattr(block, "_memfit_fused", None) or fused_groups(block)
    return groups.get(leaf.rsplit(".", 1)[0])
