"""A Portable checkpoint (memfit.train.portable) into another layout.

    write_folder(p, model, "zero", folder)   # then memfit.distributed.checkpoint.load_sharded(opt, folder)
    write_folder(p, model, "mp", folder)     # then opt.load_sharded(folder) (pipeline, tensor)
    load_into_pt(p, model, opt)              # one process, ddp, ps: straight into the live optimizer

The folders hold full tensors written by one process; each rank's loader then reads only its own
slices of them (torch.distributed.checkpoint reshards on load).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from memfit.apply.param_state import (masters_follow_weights, param_states, set_step, weights_follow_masters)
from memfit.core.errors import ConfigError
from memfit.train.portable import Portable


def _state_names(p: Portable) -> dict[str, torch.dtype]:
    names: dict[str, torch.dtype] = {}
    for states in p.optim.values():
        for k, v in states.items():
            names.setdefault(k, v.dtype)
    return names


def _weight(p: Portable, name: str) -> torch.Tensor:
    if name not in p.model:
        raise ConfigError(f"the checkpoint's model has no {name!r}; it was written for another model")
    return p.model[name]


def _state(p: Portable, name: str, key: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter's state `key`; zeros where that parameter has none (it never had a gradient)."""
    v = p.optim.get(name, {}).get(key)
    if v is None:
        return torch.zeros(like.shape, dtype=dtype)
    if v.shape != like.shape:
        raise ConfigError(f"optimizer state {key!r} of {name} has shape {tuple(v.shape)}, not its parameter's: "
                          "only optimizers whose state has the parameters' shape change layout (adamw, sgd, ...)")
    return v


def write_folder(p: Portable, model: nn.Module, target: str, folder: Path) -> None:
    """Write `p` in the zero or mp layout under `folder` (one process; `model`: the plain model, meta is fine)."""
    entries = _zero_entries(p, model) if target == "zero" else _mp_entries(p, model)
    dcp.save(entries, checkpoint_id=str(folder), no_dist=True)


def _zero_entries(p: Portable, model: nn.Module) -> dict[str, torch.Tensor]:
    from memfit.distributed.layout import FlatLayout

    names = {id(q): n for n, q in model.named_parameters()}
    keys = {"weights": None, **_state_names(p)}
    out: dict[str, torch.Tensor] = {}
    for b in FlatLayout(model, 1).buckets:
        for key, dtype in keys.items():
            parts = []
            for q in b.params:
                name = names[id(q)]
                w = _weight(p, name)
                parts.append((w if key == "weights" else _state(p, name, key, w, dtype)).reshape(-1))
            out[f"bucket{b.index}.{key}"] = torch.cat(parts)
    out["step"] = p.step.clone()
    if p.scaler is not None:
        out["loss_scale"] = torch.tensor(p.scaler["scale"], dtype=torch.float64)
    return out


def _mp_entries(p: Portable, model: nn.Module) -> dict[str, torch.Tensor]:
    from memfit.distributed.fused import fused_sizes

    state_names = _state_names(p)
    out: dict[str, torch.Tensor] = {}
    for name, _ in model.named_parameters():
        w = _weight(p, name)
        tensors = {f"model.{name}": w}
        tensors.update({f"optim.{name}.{k}": _state(p, name, k, w, dt) for k, dt in state_names.items()})
        sizes = fused_sizes(model, name)
        for key, t in tensors.items():
            if sizes is None:
                out[key] = t.contiguous()
            else:
                out.update({f"{key}.part{k}": part.contiguous() for k, part in enumerate(t.split(sizes))})
    out["optim.step"] = p.step.clone()
    for k, v in (p.scaler or {}).items():
        out[f"scaler.{k}"] = torch.tensor(float(v), dtype=torch.float64)
    return out


@torch.no_grad()
def load_into_pt(p: Portable, model: nn.Module, opt) -> None:
    """Weights into `model` and state into the TrainingOptimizer `opt` (a one-process run, or the
    `inner` of ddp and ps; None on a ps worker, which holds no optimizer)."""
    model.load_state_dict(p.model)
    if opt is None:
        return
    has_master = any("master" in s for s in p.optim.values())
    create = {k: v for k, v in _state_names(p).items() if k != "master"}
    with param_states(opt, create=create) as slots:
        for name, s in zip(opt.names, slots):
            for key, v in p.optim.get(name, {}).items():
                if key == "master":
                    if s.master is not None and not s.shared:
                        s.master.data.copy_(v)
                elif torch.is_tensor(s.state.get(key)):
                    s.state[key].copy_(_state(p, name, key, s.updated, v.dtype))
        set_step(slots, p.step)
        (weights_follow_masters if has_master else masters_follow_weights)(slots)
    if opt.scaler is not None and p.scaler is not None:
        opt.scaler.load_state_dict(p.scaler)
