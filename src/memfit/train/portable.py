"""A run's checkpoint without its layout: full weights and, per parameter, full optimizer state.

Four layouts write checkpoints, each read here into one `Portable`:

    pt     one process, ddp, ps     checkpoint.pt: the model and the (whole) TrainingOptimizer state
    zero   zero1, zero2, zero3      sharded-<step>/: per bucket a flat run of its parameters (DCP)
    fsdp2  zero2, zero3 on FSDP2    sharded-<step>/: torch's get_state_dict, model.* and optim.state.* (DCP)
    mp     pipeline, tensor         sharded-<step>/: per parameter name, fused matrices in parts (DCP)

A DCP folder is read as one process would hold it: torch.distributed.checkpoint reshards the
ranks' slices into full tensors (no process group needed). `write_folder` writes a Portable in
the zero or mp layout, so the layout's own loader (memfit.distributed.checkpoint,
memfit.distributed.parallel_checkpoint) reshards it onto any world size; `load_into_pt` puts it
into a one-process, ddp or ps optimizer. Optimizer states must have their parameter's shape
(Adam's moments, momentum, ...); the low-bit optimizers' states do not, and are refused.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from memfit.core.errors import ConfigError

from memfit.train.checkpoint_kind import check_checkpointable, kind, kind_of  # noqa: F401 (re-exported)


@dataclasses.dataclass
class Portable:
    model: dict[str, torch.Tensor]
    """The plain model's state dict (full tensors, the run's dtypes)."""
    optim: dict[str, dict[str, torch.Tensor]]
    """Per parameter name (named_parameters of the plain model): state tensors of its shape, and
    "master" where the run kept master weights."""
    step: torch.Tensor
    scaler: dict[str, float] | None


def plain_model(config: dict) -> nn.Module:
    """The run's model on the meta device (names, shapes, buckets; no memory)."""
    from memfit.train.config import TrainConfig
    from memfit.train.model_build import build_model

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    with torch.device("meta"):
        return build_model(TrainConfig(**{k: v for k, v in config.items() if k in known}))


def _names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _scaler(state: dict | None) -> dict[str, float] | None:
    if state is None:
        return None
    from memfit.apply.loss_scale import LossScaler

    return {**LossScaler().state_dict(), **{k: float(v) for k, v in state.items()}}


def read_portable(checkpoint: dict[str, Any], folder: Path | None) -> Portable:
    """The Portable of a checkpoint.pt dict (and its sharded-<step> `folder` for zero and mp)."""
    source = kind_of(checkpoint["config"])
    model = plain_model(checkpoint["config"])
    if source == "pt":
        optim, step, scaler = _from_pt(checkpoint["optimizer"], _names(model))
    else:
        if folder is None:
            raise ConfigError(f"the checkpoint of step {checkpoint['step']} has no sharded folder beside it; "
                              "resume from a complete run folder")
        from memfit.train.state import check_shards

        check_shards(folder, checkpoint, alone=True)  # this process reads the whole folder
        full = _read_folder(folder)
        optim, step, scaler = {"zero": _from_zero, "mp": _from_mp, "fsdp2": _from_fsdp2}[source](full, model)
    return Portable(dict(checkpoint["model"]), optim, step, _scaler(scaler))


def _from_pt(state: dict, names: list[str]) -> tuple[dict, torch.Tensor, dict | None]:
    """TrainingOptimizer.state_dict(): torch's optimizer state, or the streamed masters and chunks."""
    optim: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    if "streamed" in state:
        s = state["streamed"]
        per_param = [st for sd in s["chunks"] for st in _ordered(sd)]
        for n, m in zip(names, s["masters"]):
            optim[n]["master"] = m
    elif "optimizer" in state:
        per_param = _ordered(state["optimizer"])
    else:
        raise ConfigError("this checkpoint's optimizer state is not a TrainingOptimizer's; it cannot change layout")
    step = torch.tensor(0.0)
    for n, st in zip(names, per_param):
        for k, v in st.items():
            if k == "step":
                step = torch.as_tensor(v).detach().clone().float()
            elif torch.is_tensor(v) and v.dim() > 0:
                optim[n][k] = v
    return optim, step, state.get("scaler")


def _ordered(sd: dict) -> list[dict]:
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    return [sd["state"].get(i, {}) for i in ids]


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every entry of a DCP folder as a full tensor (DCP gathers each one's slices)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
            if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(full, checkpoint_id=str(folder), no_dist=True)
    return full


def _from_zero(full: dict, model: nn.Module) -> tuple[dict, torch.Tensor, dict | None]:
    from memfit.distributed.layout import FlatLayout

    names = {id(p): n for n, p in model.named_parameters()}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for b in FlatLayout(model, 1).buckets:
        keys = [k.split(".", 1)[1] for k in full if k.startswith(f"bucket{b.index}.")]
        for p, off in zip(b.params, b.offsets):
            optim[names[id(p)]] = {k: full[f"bucket{b.index}.{k}"][off:off + p.numel()].view(p.shape).clone()
                                   for k in keys if k != "weights"}
    scaler = {"scale": float(full["loss_scale"])} if "loss_scale" in full else None
    return optim, full["step"].float(), scaler


def _from_fsdp2(full: dict, model: nn.Module) -> tuple[dict, torch.Tensor, dict | None]:
    """torch's optimizer state dict, flattened by DCP: optim.state.<fqn>.<state> (FSDP2 keeps no masters)."""
    optim: dict[str, dict[str, torch.Tensor]] = {n: {} for n in _names(model)}
    step = torch.tensor(0.0)
    for k, v in full.items():
        if not k.startswith("optim.state."):
            continue
        name, _, state = k[len("optim.state."):].rpartition(".")
        if state == "step":
            step = v.detach().clone().float()
        elif name in optim and v.dim() > 0:
            optim[name][state] = v
    return optim, step, None


def _from_mp(full: dict, model: nn.Module) -> tuple[dict, torch.Tensor, dict | None]:
    joined: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for k, v in full.items():
        base, _, part = k.partition(".part")
        joined.setdefault(base, []).append((int(part or 0), v))
    whole = {k: parts[0][1] if len(parts) == 1 else torch.cat([v for _, v in sorted(parts, key=lambda t: t[0])])
             for k, parts in joined.items()}
    optim: dict[str, dict[str, torch.Tensor]] = {n: {} for n in _names(model)}
    for k, v in whole.items():
        if k.startswith("optim.") and k != "optim.step":
            name, _, state = k[len("optim."):].rpartition(".")
            if name in optim:
                optim[name][state] = v
    scaler = {k[len("scaler."):]: float(v) for k, v in whole.items() if k.startswith("scaler.")} or None
    return optim, whole["optim.step"].float(), scaler
