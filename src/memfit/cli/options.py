"""The options that estimate, track and train share, each defined once: flag, type, help.

    g = parser.add_argument_group("memory")
    add(g, "precision", default="32-true")        # a real default, shown in the help
    add(g, "batch", shown=16)                     # no default (train: only what the user gave), help shows 16

Each subcommand picks the options it takes and their defaults; the meaning and the checks of an
option are the same everywhere.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from memfit.cli.args import MAX_COUNT, integer
from memfit.core.errors import ConfigError
from memfit.apply.optimizers import NAMES as OPTIMIZERS
from memfit.measure.formulas import PRECISIONS

MODEL_HELP = ("a known architecture (gpt2, llama-2-7b, ...), a spec like gpt:layers=12,hidden=768,heads=12,vocab=50257 "
              "or a Hugging Face config.json path")


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)


OPTIONS: dict[str, Option] = {
    "model": Option("--model", MODEL_HELP, dict(metavar="SPEC")),
    "batch": Option("--batch", "sequences per micro-batch (per device)", dict(metavar="N", type=integer(1))),
    "seq": Option("--seq", "tokens per sequence", dict(metavar="N", type=integer(1))),
    "precision": Option("--precision", f"one of {', '.join(PRECISIONS)}", dict(metavar="MODE")),
    "optimizer": Option("--optimizer", f"one of {', '.join(OPTIMIZERS)}", dict(metavar="NAME", choices=OPTIMIZERS)),
    "checkpoint": Option("--checkpoint", "activation checkpoint policy: none, full, every:K, sqrt, selective, "
                         "wrapper (torch's checkpoint_wrapper per block), "
                         "with +offload:cpu|disk or +compress:CODEC, ...", dict(metavar="POLICY")),
    "offload_optimizer": Option("--offload-optimizer", "keep optimizer state off the device",
                                dict(choices=("none", "cpu", "disk"))),
    "step_in_backward": Option("--step-in-backward", "update each parameter and free its gradient as soon as "
                               "backward produced it: no gradient buffer; no global clipping, accumulation, fp16 "
                               "loss scaling, master weights or optimizer offload (docs/optimizers.md)",
                               dict(action="store_true")),
    "spill_dir": Option("--spill-dir", "folder for every disk offload: activations (+offload:disk) and optimizer "
                        "state (--offload-optimizer disk); default: the system temp folder", dict(metavar="DIR")),
    "device": Option("--device", "cpu, cuda or cuda:N", dict(metavar="DEVICE")),
    "steps": Option("--steps", "optimizer steps to run", dict(metavar="N", type=integer(1))),
    "seed": Option("--seed", "seed for weights, data order and dropout", dict(metavar="N", type=integer(0, 2**64 - 1))),
    "json": Option("--json", "print one JSON object instead of a table", dict(action="store_true")),
    "modules": Option("--modules", "show the N modules with the highest peak",
                      dict(metavar="N", type=integer(0, MAX_COUNT))),
}

_UNSET = object()


def add(group: Any, name: str, default: Any = _UNSET, shown: Any = _UNSET, help: str | None = None,
        **overrides: Any) -> argparse.Action:
    """Add option `name` to `group`. `default` is the value when absent (omitted: the parser's own,
    e.g. SUPPRESS); `shown` is the default the help names when it differs from `default`."""
    opt = OPTIONS[name]
    kwargs = {**opt.kwargs, **overrides}
    text = help or opt.help
    if default is not _UNSET:
        kwargs["default"] = default
        shown = default if shown is _UNSET else shown
    if shown is not _UNSET and shown is not None and kwargs.get("action") != "store_true":
        text += f" (default {shown})"
    return group.add_argument(opt.flag, help=text, **kwargs)


def add_model(parser: argparse.ArgumentParser, positional: bool = True, shown: Any = _UNSET) -> None:
    """The model, as --model SPEC and (optionally) as the first positional argument too."""
    if positional:
        parser.add_argument("model_arg", nargs="?", metavar="MODEL", default=None, help=MODEL_HELP + " (or --model)")
        add(parser, "model", default=None, help="the same as the positional MODEL")
    else:
        add(parser, "model", shown=shown)


def model_of(args: argparse.Namespace, required: bool = True) -> str | None:
    """The model given positionally or by --model (both: they must agree)."""
    positional, option = getattr(args, "model_arg", None), getattr(args, "model", None)
    if positional is not None and option is not None and positional != option:
        raise ConfigError(f"two models given: {positional!r} and --model {option!r}; give one")
    model = option if option is not None else positional
    if model is None and required:
        raise ConfigError("give a model: a name (e.g. gpt2), a gpt:/llama: spec or a config.json, "
                          "as MODEL or --model MODEL")
    return model
