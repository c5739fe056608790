"""What the cluster planner reads of a model's shape, for memfit's GPT and a Hugging Face causal LM alike.

    s = shape_of(spec)     # s.layers, s.hidden, s.heads, s.kv_heads, s.vocab, s.tied_embeddings, s.tp, s.pp
    unit_model(spec, seq, tp, layers)   # the model cut to `layers` blocks with one TP rank's shapes

memfit's GPT is its own config (every layout). A Hugging Face config.json is read once from its model on
the meta device: tensor layouts where its family ships a tensor plan (memfit.distributed.hf_tensor),
pipeline layouts where memfit cuts its family at decoder layers (memfit.distributed.hf_stages).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from memfit.core.errors import ConfigError


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    tp: bool = True
    """Whether tensor-parallel layouts can run (a GPT, or a family with a tensor plan)."""
    pp: bool = True
    """Whether pipeline layouts can run."""
    key: str = ""
    """What identifies the model in caches and plan digests."""
    why_not: str = ""
    """The families' limits, said in the plan's notes."""


_MEMO: dict[tuple, Shape] = {}


def shape_of(spec) -> Shape:
    """The model's Shape (memoised: a Hugging Face one is read from a meta build)."""
    memo = (spec.name, str(spec.hf_config), repr(spec.config), spec.task)
    if memo not in _MEMO:
        _MEMO[memo] = _shape(spec)
    return _MEMO[memo]


def _shape(spec) -> Shape:
    cfg = spec.config
    if cfg is not None:
        return Shape(cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads or cfg.heads, cfg.vocab,
                     bool(cfg.tied_embeddings), key=repr(cfg))
    if spec.task not in (None, "causal-lm"):
        raise ConfigError(f"a cluster plan lays out a causal LM; {spec.hf_config} is a {spec.task} model: plan it "
                          "on one device (memfit plan without --gpus)")
    from memfit.distributed.hf_stages import check_hf_pipeline, hf_tied
    from memfit.distributed.hf_tensor import heads_of, hf_layers, hf_tp_plan

    model = spec.on_meta()
    c = model.config.get_text_config()
    heads, kv = heads_of(c)
    why = []
    try:
        hf_tp_plan(model)
        tp = True
    except ConfigError as exc:
        tp = False
        why.append(f"no tensor layouts: {exc}")
    try:
        check_hf_pipeline(model.config)
        pp = True
    except ConfigError as exc:
        pp = False
        why.append(f"no pipeline layouts: {exc}")
    return Shape(len(hf_layers(model)[1]), int(c.hidden_size), heads, kv, int(c.vocab_size), hf_tied(model), tp, pp,
                 key=f"{spec.hf_config}:{spec.hf_config.read_text() if spec.hf_config else ''}",
                 why_not="; ".join(why))


def unit_model(spec, seq: int, tp: int, layers: int) -> nn.Module:
    """The model cut to `layers` blocks with the shapes one TP rank holds (in the current device / fake mode)."""
    import dataclasses

    from memfit.measure.parallel_estimate import local_tp_gpt

    if spec.config is not None:
        return local_tp_gpt(dataclasses.replace(spec, config=dataclasses.replace(spec.config, layers=layers)), seq, tp)
    from memfit.distributed.hf_tensor import localize_hf
    from memfit.measure.blocks import truncate

    model = truncate(spec.build(seq=seq), layers)
    return localize_hf(model, tp) if tp > 1 else model


def names_of(model: nn.Module) -> tuple[str, list[str]]:
    """(the first block's module name, the embeddings' module names) as the tracker names them."""
    if getattr(model, "blocks", None) is not None and getattr(model, "tok", None) is not None:
        return "blocks.0", ["tok", "pos"]
    from memfit.distributed.hf_tensor import hf_layers

    stack, _ = hf_layers(model)
    names = {id(m): n for n, m in model.named_modules()}
    embeds = [names[id(model.get_input_embeddings())]]
    return f"{stack}.0", embeds
