"""Tensor parallelism of a Hugging Face causal LM by the model's own tensor plan.

    plan = hf_tp_plan(model)          # {"model.layers.0.self_attn.q_proj": "colwise", ...}
    grad_sum = shard_hf(model, mesh["tp"])   # parameters whose gradients are summed over the TP ranks

transformers ships a tensor plan with many families (`config.base_model_tp_plan`: Llama, Qwen2/3,
Mistral, Gemma, ...): per decoder layer the q/k/v and gate/up projections split by output columns
("colwise": each rank owns whole heads and a slice of the MLP), o_proj and down_proj by input rows
("rowwise": partial sums all-reduced in forward). memfit hands those modules to torch's
`parallelize_module` (ColwiseParallel / RowwiseParallel on the "tp" mesh dimension); the
embeddings, norms and head stay replicated, as for memfit's GPT (memfit.distributed.tensor_parallel).
The attention reshapes its projections' outputs to (-1, head_dim), so a rank's local heads need no
change to the model. "replicated_with_grad_allreduce" modules (Qwen3's per-head q/k norms) stay
whole on every rank, but each rank's gradient covers only its own heads: the step sums them over
the TP ranks. A plan with other styles (expert-parallel routers, packed projections) is refused.
"""
from __future__ import annotations

import torch.nn as nn

from memfit.core.errors import ConfigError

STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def heads_of(config) -> tuple[int, int]:
    """(attention heads, key/value heads) of a Hugging Face config."""
    c = _text_config(config)
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
    return int(heads), int(getattr(c, "num_key_value_heads", None) or heads)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor plan with its wildcards expanded: module name -> style (see the module docstring)."""
    config = getattr(model, "config", None)
    plan = getattr(_text_config(config), "base_model_tp_plan", None) if config is not None else None
    kind = getattr(config, "model_type", type(model).__name__)
    if not plan:
        raise ConfigError(f"--strategy tensor shards a Hugging Face model by the tensor plan transformers ships "
                          f"with it (config.base_model_tp_plan); model_type {kind!r} has none. Use a data-parallel "
                          f"strategy (ddp, zero1-3), or a llama/qwen2/qwen3/mistral config")
    odd = sorted({s for s in plan.values() if s not in STYLES})
    if odd:
        raise ConfigError(f"the tensor plan of model_type {kind!r} uses {', '.join(odd)}, which memfit does not "
                          f"shard (it runs {', '.join(STYLES)}); use a data-parallel strategy (ddp, zero1-3)")
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, model)
    names = dict(base.named_modules())
    out = {}
    for pattern, style in plan.items():
        head, _, tail = pattern.partition(".*.")
        if not tail:
            if pattern in names:
                out[f"{prefix}.{pattern}"] = style
            continue
        stack = names.get(head)
        for i in range(len(stack) if stack is not None else 0):
            if f"{head}.{i}.{tail}" in names:
                out[f"{prefix}.{head}.{i}.{tail}"] = style
    if not any(s == "colwise" for s in out.values()):
        raise ConfigError(f"the tensor plan of model_type {kind!r} names no module of the built model; use a "
                          f"data-parallel strategy (ddp, zero1-3)")
    return out


def shard_hf(model: nn.Module, tp_mesh) -> list[str]:
    """Put the plan's projections on the TP mesh dimension (in place); the names of the parameters
    whose gradients the step must sum over the TP ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = hf_tp_plan(model)
    styles = {n: ColwiseParallel() if s == "colwise" else RowwiseParallel() for n, s in plan.items()
              if s in ("colwise", "rowwise")}
    parallelize_module(model, tp_mesh, styles)
    summed = [n for n, s in plan.items() if s == "replicated_with_grad_allreduce"]
    return [f"{m}.{p}" for m in summed for p, _ in model.get_submodule(m).named_parameters()]


def localize_hf(model: nn.Module, tp: int) -> nn.Module:
    """The model with the shapes one TP rank holds (estimates): each column-parallel projection's
    outputs and each row-parallel one's inputs divided by tp; everything else whole (in place)."""
    for name, style in hf_tp_plan(model).items():
        if style not in ("colwise", "rowwise"):
            continue
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise ConfigError(f"{name} is a {type(lin).__name__}, not a linear layer; memfit shards linear layers")
        col = style == "colwise"
        new = nn.Linear(lin.in_features if col else lin.in_features // tp,
                        lin.out_features // tp if col else lin.out_features, bias=lin.bias is not None,
                        device=lin.weight.device, dtype=lin.weight.dtype)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    return model


def hf_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, module list) of a Hugging Face model's decoder layers: the first ModuleList
    holding as many modules as the config's layers."""
    n = getattr(_text_config(model.config), "num_hidden_layers", None)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n:
            return name, m
    raise ConfigError(f"cannot find the {n} decoder layers of {type(model).__name__}")
