"""The model of a training run, built from its config and checked against the byte-level data."""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.train import data as data_mod
from memfit.train.config import TrainConfig


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model of `cfg.model`, checked to take byte tokens and `cfg.seq` positions.

    `cfg.dropout` None keeps the spec's own dropout; a number replaces it (memfit's GPT only)."""
    from memfit.models.spec import parse_model

    spec = parse_model(cfg.model)
    spec.check_shape(cfg.batch, cfg.seq)
    if spec.config is not None:
        if spec.config.vocab < data_mod.VOCAB:
            raise ConfigError(f"model {cfg.model!r} has vocab={spec.config.vocab}; byte-level data needs vocab >= 256")
        if cfg.dropout is not None:
            spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, dropout=cfg.dropout))
        return spec.build(seq=cfg.seq)
    if cfg.dropout:
        raise ConfigError("--dropout applies to memfit's GPT models; set dropout in the Hugging Face config.json")
    model = spec.build()
    hf = model.config
    if getattr(hf, "vocab_size", 0) < data_mod.VOCAB:
        raise ConfigError(f"model {cfg.model!r} has vocab_size={hf.vocab_size}; byte-level data needs >= 256")
    return model
