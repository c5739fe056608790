"""Checkpoints of `pipeline` and `tensor` with torch.distributed.checkpoint, in one layout that loads
into any number of stages, any TP degree and any dp x tp mesh (and from one strategy into the other).

    opt.save_sharded("run/sharded-20")   # every rank writes what it holds; nothing is gathered
    opt.load_sharded("run/sharded-20")   # every rank reads what it needs, whoever wrote it

Keys follow the plain GPT's state dict: `model.<name>` for the weights, `optim.<name>.<state>` for
each optimizer state tensor of the parameter's shape (Adam's moments, a momentum buffer, ...) and
`optim.<name>.master` for master weights, plus `optim.step` and the loss scaler's `scaler.*`.
The fused column-parallel matrices (qkv = [q; k; v], SwiGLU's [gate; up]) are saved as their parts
(`<key>.part0` ...), because a TP rank holds a slice of *each* part. A pipeline stage saves its own
parameters as plain tensors (the tied matrix, on the first and the last stage, once as tok.weight);
a TP rank saves its shards as DTensors sharded like the parameter, so DCP reshards them for any
degree. A checkpoint of master weights also loads into a run without them and back.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from memfit.apply.param_state import (masters_follow_weights, param_states, set_step, step_of,
                                     weights_follow_masters)
from memfit.core.errors import ConfigError

_SCALER = ("scale", "clean_steps", "overflows_in_a_row", "hysteresis_left", "skipped_steps")


def _entries(opt, slots) -> dict[str, torch.Tensor]:
    entries: dict[str, torch.Tensor] = {}
    for i, (q, slot) in enumerate(zip(opt.local_params.items, slots)):
        name = opt.checkpoint_name(i)
        master = slot.master if slot.master is not None and not slot.shared else None
        tensors = {"": q.data, **({"master": master.data} if master is not None else {})}
        for k, v in slot.state.items():
            if not torch.is_tensor(v) or v.dim() == 0:
                continue
            if v.shape != q.shape:
                raise ConfigError("pipeline/tensor checkpoints hold optimizer states of the parameters' shape; "
                                  f"this optimizer keeps {k!r} of another shape: use adamw, adam, sgd, momentum, "
                                  "lion, adagrad or rmsprop")
            tensors[k] = v
        for k, t in tensors.items():
            key = f"model.{name}" if k == "" else f"optim.{name}.{k}"
            for suffix, part in opt.checkpoint_parts(i, t).items():
                entries[key + suffix] = part
    return entries


def save_parallel(opt, path: str | Path) -> None:
    """Write this rank's weights and optimizer state under `path` (all ranks call it); disk-offloaded
    state is read into memory for the save and written back after."""
    with param_states(opt.inner) as slots:
        entries = _entries(opt, slots)
        entries["optim.step"] = step_of(slots)
        if opt.scaler is not None:
            for k, v in opt.scaler.state_dict().items():
                entries[f"scaler.{k}"] = torch.tensor(float(v), dtype=torch.float64)
        dcp.save(entries, checkpoint_id=str(path))


def load_parallel(opt, path: str | Path) -> None:
    """Read a save_parallel checkpoint written with any stage count, TP degree or dp x tp mesh."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{path} is not a readable pipeline/tensor checkpoint ({type(exc).__name__})") from None
    first = f"optim.{opt.checkpoint_name(0)}."
    names = {k[len(first):].split(".part")[0]: v.properties.dtype for k, v in meta.items() if k.startswith(first)}
    has_master = names.pop("master", None) is not None
    with param_states(opt.inner, create=names) as slots:
        entries = _entries(opt, slots)
        if not has_master:  # written without master weights: the masters follow the weights below
            entries = {k: v for k, v in entries.items() if ".master" not in k}
        entries["optim.step"] = torch.tensor(0.0)
        if opt.scaler is not None and "scaler.scale" in meta:
            entries.update({f"scaler.{k}": torch.tensor(0.0, dtype=torch.float64) for k in _SCALER})
        missing = sorted(set(entries) - set(meta))
        if missing:
            raise ConfigError(f"{path} lacks {', '.join(missing[:2])}: it was written for another model, "
                              "optimizer or precision; resume with the settings it was written with")
        dcp.load(entries, checkpoint_id=str(path))
        set_step(slots, entries["optim.step"])
        (weights_follow_masters if has_master else masters_follow_weights)(slots)
    if "scaler.scale" in entries:
        opt.scaler.load_state_dict({k: float(entries[f"scaler.{k}"]) for k in _SCALER})
    dist.barrier(group=opt.group)
