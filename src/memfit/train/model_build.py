"""The model of a training run, built from its config and checked against the byte-level data.

Before anything is built, the config has been checked (memfit.models.hf_check, on parsing) and the
weights are compared with this machine's memory (memfit.models.host_fit). While the model is built,
Ctrl-C or SIGTERM stops the build at once: nothing has trained yet, so there is nothing to save, and a
large model's build would otherwise run on for minutes after the loop's handler said it would stop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from typing import Iterator

import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.train import data as data_mod
from memfit.train.config import TrainConfig


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model of `cfg.model`, checked to take byte tokens and `cfg.seq` positions.

    `cfg.dropout` None keeps the spec's own dropout; a number replaces it (memfit's GPT only)."""
    from memfit.models.host_fit import check_fits_host
    from memfit.models.spec import parse_model

    spec = parse_model(cfg.model)
    spec.check_shape(cfg.batch, cfg.seq)
    if spec.config is not None:
        if spec.config.vocab < data_mod.VOCAB:
            raise ConfigError(f"model {cfg.model!r} has vocab={spec.config.vocab}; byte-level data needs vocab >= 256")
        if cfg.dropout is not None:
            spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, dropout=cfg.dropout))
    elif cfg.dropout:
        raise ConfigError("--dropout applies to memfit's GPT models; set dropout in the Hugging Face config.json")
    if cfg.lora is not None:
        from memfit.models.lora import parse_lora

        spec = dataclasses.replace(spec, lora=parse_lora(cfg.lora))
    check_fits_host(spec, "train")
    with stoppable():
        model = spec.build(seq=cfg.seq) if spec.config is not None else spec.build()
    if spec.config is None and getattr(model.config, "vocab_size", 0) < data_mod.VOCAB:
        raise ConfigError(f"model {cfg.model!r} has vocab_size={model.config.vocab_size}; byte-level data needs >= 256")
    return model


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise memfit.train.signals.Interrupted (the CLI prints
    "memfit: interrupted" and exits 130 / 143); the handlers before it are restored after."""
    from memfit.train.signals import STOPPED, Interrupted

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOPPED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
