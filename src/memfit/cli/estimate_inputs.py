"""`memfit estimate my_pkg.models:build --input "pixel_values=float32[8,3,224,224]"`: a Python factory and
its example batch from the command line. Nothing is allocated: the inputs are meta tensors (shapes and
dtypes only) and the factory is called under FakeTensorMode by the estimate."""
from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any, Callable

import torch

from memfit.core.errors import ConfigError

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_INPUT = re.compile(r"^(?:([A-Za-z_]\w*)=)?([A-Za-z]\w*)\[([^\]]*)\]$")
INPUT_HELP = "NAME=DTYPE[D0,D1,...], e.g. pixel_values=float32[8,3,224,224] (NAME= left out: a positional argument)"


def is_factory(text: str | None) -> bool:
    """MODULE:FUNCTION (dotted names only); `gpt:layers=...` specs carry '=' and never match."""
    return text is not None and bool(_FACTORY.match(text)) and text.split(":")[0] not in ("gpt", "llama")


def load_factory(text: str) -> Callable[[], Any]:
    """The zero-argument callable named by MODULE:FUNCTION, imported from the current folder or PYTHONPATH."""
    module_name, _, attr = text.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `memfit` script, unlike `python -m`, omits it
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"cannot import the model factory {text}: {exc}; give MODULE:FUNCTION with MODULE "
                          "importable from the current folder or PYTHONPATH") from None
    except Exception as exc:  # the user's module itself failed while importing
        raise ConfigError(f"importing {module_name} (for the model factory {text}) failed: "
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{module_name} has no attribute {attr!r} (the model factory {text})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{text} is a {type(obj).__name__}, not a callable that builds the model")
    return obj


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def parse_input(text: str) -> tuple[str | None, torch.Tensor]:
    """`NAME=DTYPE[D0,...]` -> (NAME or None, a meta tensor of that shape and dtype)."""
    m = _INPUT.match(text.replace(" ", ""))
    if m is None:
        raise ConfigError(f"malformed --input {text!r}; expected {INPUT_HELP}")
    name, dtype_name, dims = m.groups()
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"--input {text!r}: unknown dtype {dtype_name!r}; use a torch dtype such as float32, "
                          "bfloat16, float16 or int64")
    try:
        shape = [int(d) for d in dims.split(",") if d != ""]
    except ValueError:
        raise ConfigError(f"--input {text!r}: dimensions must be integers; expected {INPUT_HELP}") from None
    if any(d < 1 for d in shape):
        raise ConfigError(f"--input {text!r}: every dimension must be positive")
    return name, torch.empty(shape, dtype=dtype, device="meta")


def parse_inputs(texts: list[str]) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
    """All --input options: keyword arguments (all named) or positional ones (none named)."""
    parsed = [parse_input(t) for t in texts]
    names = [n for n, _ in parsed]
    if all(n is None for n in names):
        return tuple(t for _, t in parsed)
    if any(n is None for n in names):
        raise ConfigError("--input: name all inputs (keyword arguments) or none (positional arguments), not a mix")
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"--input names {', '.join(twice)} more than once")
    return {n: t for n, t in parsed}


def auto_engine(args: Any, model: str | None) -> str:
    """`memfit estimate --engine auto`: the engine `memfit train` would run the strategy on (FSDP2 for
    zero2/zero3, memfit.distributed.strategy.engine_for), where FSDP2's estimate covers the request;
    memfit's otherwise, the reason on stderr in one line."""
    import sys

    from memfit.distributed.strategy import engine_for, engine_line

    strategy = args.strategy or (f"zero{args.zero}" if args.zero and args.world > 1 else None)
    if args.torchtitan or args.deepspeed or strategy not in ("zero2", "zero3"):
        return "memfit"
    if args.strategy and args.zero and args.strategy != f"zero{args.zero}" or args.sequence_parallel \
            or args.vocab_parallel:
        return "memfit"  # a request the estimate refuses in its own words
    offload = None if args.offload_optimizer in (None, "none") else args.offload_optimizer
    engine, reason = engine_for(strategy, precision=args.precision, optimizer=args.optimizer, offload=offload,
                                cuda=args.device not in (None, "cpu"))
    if engine == "fsdp2":
        reason = _fsdp2_gap(args, model)
    if reason:
        print(engine_line("memfit", reason), file=sys.stderr, flush=True)
        return "memfit"
    return engine


def _fsdp2_gap(args: Any, model: str | None) -> str | None:
    """What of the request FSDP2's estimate (memfit.measure.fsdp2_estimate) does not cover, in words."""
    if model is None or is_factory(model):
        return f"{'a model factory' if model else '--params'} is estimated on it"
    gaps = [f for f, on in (("--accum", args.accum != 1), ("--lora/--qlora", args.lora or args.qlora),
                            ("--offload-optimizer", args.offload_optimizer not in (None, "none")),
                            ("--step-in-backward", args.step_in_backward), ("--params", args.params),
                            ("--tp", args.tp), ("--microbatches", args.microbatches)) if on]
    if args.precision not in (None, "32-true", "bf16-mixed", "bf16-master", "bf16-true"):
        gaps.append(f"--precision {args.precision}")
    return f"{gaps[0]} is estimated on it" if gaps else None
