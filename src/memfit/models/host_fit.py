"""Whether a model's weights can be built in this machine's memory, asked before building them.

    check_fits_host(spec)     # ConfigError naming the parameter count and the bytes, or nothing

The parameter count comes from two builds on the meta device, of one and of two layers (nothing is
allocated, and no depth makes them slow): the whole model has p1 + (layers - 1) * (p2 - p1)
parameters, exact for a chain of blocks that are alike, as memfit's GPT and the Hugging Face causal
LMs are. Building holds every weight in float32 on the host before it moves to a device, so that is
the size compared with the host's memory.
"""
from __future__ import annotations

import copy
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes

BUILD_BYTES_PER_PARAM = 4
"""float32 weights, as `from_config` and memfit's GPT build them."""


def host_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _hf_builder(spec: Any) -> tuple[int | None, Any]:
    """(layers of the config, a function k -> the Hugging Face model of `spec` with k layers)."""
    import transformers

    from memfit.models.hf_check import build_quietly, checked, per_layer_config, text_config
    from memfit.models.hf_families import TASKS
    from memfit.models.spec import read_hf_config

    data = read_hf_config(spec.hf_config, families=spec.task is not None)
    config = checked(data, spec.hf_config, spec.image_size)
    n = getattr(text_config(config), "num_hidden_layers", None)
    auto = getattr(transformers, TASKS[spec.task or "causal-lm"][1])

    def build(k: int) -> torch.nn.Module:
        cfg = copy.deepcopy(config)
        if isinstance(n, int) and k < n:
            per_layer_config(text_config(cfg), n, k)
        return build_quietly(lambda: auto.from_config(cfg), "model", spec.hf_config)

    return (n if isinstance(n, int) else None), build


def param_count(spec: Any) -> int:
    """Parameter elements of the model `spec` builds (LoRA adapters left out), without building it.

    A mixture-of-experts model whose second layer is sparse and first dense is over-counted (every
    layer counted as the second): an upper bound, as a refusal wants."""
    from memfit.models.spec import _no_init

    with torch.device("meta"), _no_init():
        if spec.config is not None:
            layers = spec.config.layers
            p1, p2 = (_count(replace(spec, config=replace(spec.config, layers=k), lora=None).build()) for k in (1, 2))
        else:
            layers, build = _hf_builder(spec)
            if layers is None or layers < 2:
                return _count(build(layers or 1))
            p1, p2 = _count(build(1)), _count(build(2))
    return p1 + (layers - 1) * max(p2 - p1, 0)


def check_fits_host(spec: Any, action: str = "build") -> None:
    """Refuse a model whose float32 weights alone exceed this machine's memory, before building it."""
    params = param_count(spec)
    need, have = params * BUILD_BYTES_PER_PARAM, host_memory()
    if need > have:
        raise ConfigError(f"model {spec.name} has {params:.3g} parameters ({format_bytes(need)} of float32 weights), "
                          f"more than this machine's {format_bytes(have)} of memory: memfit cannot {action} it here "
                          "(memfit estimate and memfit plan size it without building it)")
