"""Mixture-of-experts layers (Hugging Face's fused experts, e.g. Mixtral) under FakeTensorMode, and routing.

Two things stop a fake trace of a real MoE step:
- transformers' default `grouped_mm` experts call torch's grouped matmul, whose fake (meta) kernel
  demands bf16 inputs, as the CUDA kernel does; the CPU kernel, and so a real fp32 step, takes fp32.
  Under fake tensors, non-bf16 weights go to transformers' own `grouped_mm_fallback` op (same output,
  same saved tensors, a fake kernel of its own) instead; with a transformers whose fallback backward
  has no fake kernel (5.17), to memfit's op of the same work (moe_grouped.py).
- the `eager` experts loop asks which tokens each expert received (`torch.where` on the routing mask):
  fake tensors have no values to answer. The trace runs the same loop with assumed counts instead:
  `balanced` (every expert gets tokens x top_k / experts, the default) or `worst` (one expert gets every
  token, the most it can receive since a token picks an expert at most once; the rest share the others).

The grouped path's memory does not depend on the routing (all token-expert pairs in one sorted buffer);
the loop's transients grow with the busiest expert. `force_routing` biases a real router so that a
measured step routes as assumed (tests, bench/estimate_accuracy.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from memfit.core.errors import ConfigError

ROUTINGS = ("balanced", "worst")
_ROUTING: contextvars.ContextVar[str] = contextvars.ContextVar("memfit_moe_routing", default="balanced")


@contextlib.contextmanager
def routing(name: str) -> Iterator[None]:
    """Trace MoE layers with this routing assumption."""
    if name not in ROUTINGS:
        raise ConfigError(f"unknown routing {name!r}; accepted: {', '.join(ROUTINGS)}")
    token = _ROUTING.set(name)
    try:
        yield
    finally:
        _ROUTING.reset(token)


def expert_counts(tokens: int, top_k: int, experts: int, how: str) -> list[int]:
    """Tokens each expert receives: balanced, or the worst case for one expert (all `tokens` of them)."""
    if how == "worst":
        first = tokens
        rest = tokens * (top_k - 1)
        others = experts - 1
        return [first] + [rest // others + (1 if i < rest % others else 0) for i in range(others)] if others else [first]
    total = tokens * top_k
    return [total // experts + (1 if i < total % experts else 0) for i in range(experts)]


def _routed_loop(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop (Mixtral) with the assumed per-expert token counts."""
    if not hasattr(self, "gate_up_proj") or getattr(self, "has_bias", False) or getattr(self, "is_transposed", False):
        raise ConfigError(f"memfit traces the eager experts loop of Mixtral-style experts only, not "
                          f"{type(self).__name__}; use experts_implementation='grouped_mm'")
    experts = self.num_experts
    counts = expert_counts(hidden_states.shape[0], top_k_index.shape[-1], experts, _ROUTING.get())
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
        torch.greater(mask.sum(dim=(-1, -2)), 0)
        torch.empty(sum(1 for n in counts if n), 1, dtype=torch.long, device=hidden_states.device)  # nonzero()
    for e, n in enumerate(counts):
        if n == 0:
            continue
        where = torch.zeros(n, 2, dtype=torch.long, device=hidden_states.device)  # torch.where(mask[e]): one buffer
        top_k_pos, token_idx = where.unbind(1)
        current = hidden_states[token_idx]
        gate, up = F.linear(current, self.gate_up_proj[e]).chunk(2, dim=-1)
        current = F.linear(self.act_fn(gate) * up, self.down_proj[e])
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


@contextlib.contextmanager
def fake_experts() -> Iterator[None]:
    """While tracing under FakeTensorMode: HF experts run as the real step would (see the module doc)."""
    moe = None
    if "transformers" in sys.modules:  # no HF model is built without importing transformers first
        try:
            import transformers.integrations.moe as moe
        except ImportError:
            pass
    if moe is None or not hasattr(moe, "_can_use_grouped_mm") or not hasattr(moe, "ALL_EXPERTS_FUNCTIONS"):
        yield
        return
    from torch._subclasses.fake_tensor import is_fake

    from memfit.measure import moe_grouped

    original = moe._can_use_grouped_mm
    original_mm = getattr(moe, "_grouped_mm", None)
    # transformers whose fallback backward reads the offsets in Python: memfit's op of the same work
    own_mm = original_mm is not None and not moe_grouped.fakeable_fallback_backward()

    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if is_fake(weight) and weight.dtype != torch.bfloat16:
            return moe_grouped.grouped_mm(input, weight, offs)
        return original_mm(input, weight, offs=offs)
    table = moe.ALL_EXPERTS_FUNCTIONS._local_mapping
    had_eager = table.get("eager")

    def can_use(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        if is_fake(weight) and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    if own_mm:
        moe._grouped_mm = grouped_mm
    table["eager"] = _routed_loop
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
        if own_mm:
            moe._grouped_mm = original_mm
        if had_eager is None:
            table.pop("eager", None)
        else:
            table["eager"] = had_eager


def force_routing(model: torch.nn.Module, how: str) -> list[Any]:
    """Bias every top-k router of a real model so its tokens route `how` (balanced or worst) as the trace
    assumes: token t's j-th choice is expert (t + j) mod E (balanced) or expert 0 then the others in turn
    (worst). Returns the hook handles (call .remove() to undo)."""
    handles = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k"):
            handles.append(module.register_forward_hook(_biased(how)))
    if not handles:
        raise ConfigError(f"{type(model).__name__} has no top-k router to bias")
    return handles


def _biased(how: str):
    def hook(router: Any, args: Any, out: Any) -> Any:
        logits = out[0]
        tokens, experts = logits.shape
        k = router.top_k
        t = torch.arange(tokens, device=logits.device)
        bias = torch.zeros_like(logits)
        for j in range(k):
            if how == "balanced":
                choice = (t + j) % experts
            else:
                choice = torch.zeros_like(t) if j == 0 else 1 + (t * (k - 1) + j - 1) % (experts - 1)
            bias[t, choice] = 100.0 - j
        biased = logits + bias
        probs = torch.softmax(biased.float(), dim=-1)
        top_value, top_index = torch.topk(probs, k, dim=-1)
        return biased, top_value / top_value.sum(dim=-1, keepdim=True), top_index

    return hook
