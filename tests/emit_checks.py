"""Load an emitted config with the framework's own config classes, in the framework's venv, and print
what they read as one JSON line (tests/test_emit_validate.py runs this under bench's venvs).

    /work/dsvenv/bin/python tests/emit_checks.py deepspeed ds_config.json
    /work/ttvenv/bin/python tests/emit_checks.py torchtitan job.toml
"""
from __future__ import annotations

import dataclasses
import json
import sys
import typing


def deepspeed(path: str) -> dict:
    from deepspeed.runtime.config import DeepSpeedConfig

    c = DeepSpeedConfig(path)  # parses and validates (pydantic ZeRO, offload, TP configs); world 1 here
    off = c.zero_config.offload_optimizer
    return {"stage": c.zero_optimization_stage, "bf16": c.bfloat16_config.enabled, "fp16": c.float16_config.enabled,
            "autocast": c.torch_autocast_enabled, "offload": getattr(off.device, "value", off.device) if off else None,
            "micro": c.train_micro_batch_size_per_gpu, "accum": c.gradient_accumulation_steps,
            "autotp": c.tensor_parallel_config.autotp_size, "stages": c.pipeline["stages"],
            "checkpoints": c.activation_checkpointing_config.number_checkpoints}


def _literals(obj, where: str) -> None:
    """tyro takes a TOML's values as the defaults unchecked: check each Literal field as its CLI would."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            _literals(value, f"{where}.{f.name}")
        elif typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            raise ValueError(f"{where}.{f.name} = {value!r} is not one of {typing.get_args(hint)}")


def _titan_config_alone() -> None:
    """torchtitan/__init__ imports its MoE kernels (triton); torchtitan.config needs only tyro."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("torchtitan")
    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchtitan"] = pkg


def probe(module: str) -> dict:
    """Whether this venv imports the framework (tests skip, saying why, when it does not)."""
    import importlib

    import torch

    if module.startswith("torchtitan"):
        _titan_config_alone()
    importlib.import_module(module)
    return {"torch": torch.__version__, "module": module}


def torchtitan(path: str) -> dict:
    _titan_config_alone()
    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(["--job.config_file", path])  # unknown keys raise here
    _literals(job, "job")
    return {"parallelism": dataclasses.asdict(job.parallelism), "training": {
        k: v for k, v in dataclasses.asdict(job.training).items() if not isinstance(v, dict)},
        "activation_checkpoint": dataclasses.asdict(job.activation_checkpoint),
        "model": [job.model.name, job.model.flavor], "optimizer": job.optimizer.name}


if __name__ == "__main__":
    print(json.dumps({"deepspeed": deepspeed, "torchtitan": torchtitan, "--probe": probe}[sys.argv[1]](sys.argv[2])))
