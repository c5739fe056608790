"""Selective activation checkpointing: inside a block, keep what is expensive to recompute.

Built on PyTorch's selective checkpoint contexts: during the block's forward every op's output is
either cached (MUST_SAVE) or dropped and recomputed in backward (PREFER_RECOMPUTE). The rule:

- keep the outputs of *widening* matmuls (output features > input features: the fused QKV
  projection, the MLP up/gate projection) — they are the ones the rest of the block is computed from;
- keep attention outputs (fused scaled-dot-product-attention kernels) when the sequence is longer
  than the model width (T > C); recompute them for shorter sequences;
- recompute everything else: element-wise ops, norms, activation functions, dropout (RNG-exact),
  reshapes, and the narrowing matmuls (attention output and MLP down projections).

Why not keep every matmul? A block's last matmul (the MLP down projection) is never recomputed at all:
non-reentrant recomputation stops as soon as the tensors backward needs exist, which is before that
matmul runs, so caching its output would only waste memory. The attention output projection costs
one C x C matmul per token to redo (about 1/12 of a GPT block's matmul FLOPs), and not caching it
saves one more hidden-size tensor per block.

Why attention depends on T: per element of its output, recomputing causal attention costs about 2*T
multiply-adds (QK^T and AV over T/2 keys on average, times D, per D outputs), while the C x C output
projection we already recompute costs C per element. Below T = C attention is the cheaper of the two to
redo per byte saved, so keeping it would be inconsistent; above, it is kept. For GPT-2 small at T=512
this keeps about 50% of a plain block's saved bytes (see docs/BENCHMARKS.md); from T=1024 on, with
attention kept, about 55%.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

ATTENTION_OPS = {  # overload packets: every overload of each kernel
    getattr(aten, name)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(aten, name)
}
MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _widening(op: Any, args: tuple) -> bool:
    """Output features > input features (mm(a, b): b's columns vs a's columns)."""
    if op is aten.addmm.default or op is aten.baddbmm.default:
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    return b.shape[-1] > a.shape[-1]


def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Per-op decision used in forward (and in recomputation) of a selectively checkpointed block."""
    if getattr(op, "overloadpacket", op) in ATTENTION_OPS:
        q = args[0]  # (B, H, T, D): keep when T > C = H * D (see the module docstring)
        keep = q.shape[-2] > q.shape[-3] * q.shape[-1]
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    if op in MATMUL_OPS and _widening(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def context_fn(policy: Callable[..., CheckpointPolicy] = policy_fn) -> Callable[[], tuple[Any, Any]]:
    """The `context_fn` argument for torch's non-reentrant checkpoint."""
    return functools.partial(create_selective_checkpoint_contexts, policy)


# ---------------------------------------------------------------------------- torchtitan's op list
# torchtitan's `selective_ac_option = "op"` (torchtitan/models/llama3/parallelize.py, `_save_list`):
# save the outputs of aten.mm (except every second one, counted per block, forward and recompute
# apart), of the flash / memory-efficient attention kernels, and of reduce_scatter; recompute the
# rest. Its Llama block runs seven matmuls, wq wk wv wo w1 w3 w2, and keeps wq, wv, w1 and w2. memfit's
# block fuses them into four (qkv, attention output, [gate; up], MLP output), so the same bytes are
# kept by position: the fused qkv output (holding k too: kv_heads x head_dim more per token than
# torchtitan), the attention kernel's outputs, the MLP's activation output in place of w1's output
# (the same width), and the MLP's output projection; the attention output and [gate; up] are recomputed.
_TORCHTITAN_KEEP_MM = (1, 4)  # memfit's fused block: qkv and the MLP's output projection
_ACTIVATIONS = {aten.silu.default, aten.gelu.default}


def torchtitan_context_fn() -> tuple[Any, Any]:
    """A fresh pair of selective-checkpoint contexts per block call (the matmul count restarts)."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in MATMUL_OPS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] in _TORCHTITAN_KEEP_MM
        else:
            keep = getattr(op, "overloadpacket", op) in ATTENTION_OPS or op in _ACTIVATIONS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def context_for(ops: str | None) -> Callable[[], tuple[Any, Any]]:
    """The context_fn of a selective block following `ops` (memfit.apply.policy.SELECTIVE_OPS; None: memfit's)."""
    return torchtitan_context_fn if ops == "torchtitan" else context_fn()
