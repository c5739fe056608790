"""FSDP2's checkpoints with torch's own APIs: get_state_dict / set_state_dict and dcp.save / dcp.load.

    save_fsdp2(model, optimizer, "run/sharded-20")   # every rank writes its shards; nothing is gathered
    load_fsdp2(model, optimizer, "run/sharded-20")   # every rank reads its shards, for any world size
    full_state(model)                                # the whole model on rank 0 (checkpoint.pt, export)

Atomic: the ranks write into a hidden folder beside the target (.<name>.partial), and rank 0 renames it
into place once dcp.save has returned on every rank (DCP writes .metadata last, after all data). A
kill mid-save leaves only the hidden folder, which no reader looks at (memfit.train.distributed
removes it on resume); the target name appears complete or not at all. The folder's keys are
torch's: `model.<fqn>` and `optim.state.<fqn>.<state>` / `optim.param_groups`, so torch's own tools
(torch.distributed.checkpoint.format_utils.dcp_to_torch_save) read it too.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from memfit.core.errors import ConfigError

PARTIAL = ".partial"


def partial_of(folder: Path) -> Path:
    """The hidden folder a save into `folder` writes before its rename."""
    return folder.parent / f".{folder.name}{PARTIAL}"


def _options(flat: bool):
    """`flat`: the optimizer's param_groups keyed by parameter name (torch's flatten_optimizer_state_dict).
    Ranks holding different parameters (pipeline stages) need it: DCP keeps one rank's copy of a key, and
    unflattened every rank's groups are the same keys (param_groups.0.params) with different contents."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def save_fsdp2(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path, group=None,
               flat: bool = False) -> None:
    """Write the model's and optimizer's shards into `folder` (all ranks call it; `folder` must not exist)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    tmp = partial_of(folder)
    main = dist.get_rank(group) == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier save a kill cut short
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(flat))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), process_group=group)
    dist.barrier(group=group)  # every rank's files are written (and .metadata, by the coordinator)
    if main:
        os.replace(tmp, folder)
    dist.barrier(group=group)  # every rank sees the folder under its name before anyone reads it


def load_fsdp2(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path, group=None,
               flat: bool = False) -> None:
    """Read a save_fsdp2 folder written with any number of ranks into this rank's shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{folder} is not a readable fsdp2 checkpoint ({type(exc).__name__})") from None
    # The templates: this run's shards (an optimizer without state yet gets it from torch, by a zero step).
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(flat))
    state = {"model": model_sd, "optim": optim_sd}
    missing = sorted(k for k in _flat_keys(state) if k not in meta)
    if missing:
        raise ConfigError(f"{folder} lacks {', '.join(missing[:2])}: it was written for another model or optimizer; "
                          "resume with the settings it was written with")
    dcp.load(state, checkpoint_id=str(folder), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(flat))


def _flat_keys(state: dict, prefix: str = "") -> list[str]:
    """DCP's names of the tensors in a nested state dict (dict keys joined with dots)."""
    out = []
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flat_keys(v, name + ".")
        elif isinstance(v, torch.Tensor):
            out.append(name)
    return out


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0, in CPU memory (the other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
              states: dict[str, dict[str, torch.Tensor]], step: torch.Tensor) -> None:
    """Whole tensors (every rank holds them; another layout's checkpoint, memfit.train.portable) into
    this rank's shards: `weights` by name, `states` per parameter name (a "master" replaces the weight:
    FSDP2 keeps float32 weights, no separate master), `step` the optimizer's step count."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_state_dict)

    full = StateDictOptions(full_state_dict=True)
    weights = {**weights, **{n: s["master"] for n, s in states.items() if "master" in s}}
    optim_sd = get_optimizer_state_dict(model, optimizer, options=full)  # the template, with this run's groups
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            given = step if key == "step" else states.get(name, {}).get(key)
            if given is None:
                raise ConfigError(f"the checkpoint has no {key!r} state for {name}: it was written with another "
                                  "optimizer; resume with the optimizer it was written with")
            value.copy_(given)
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim_sd, options=full)
