"""ZeRO checkpoints with torch.distributed.checkpoint that load into a different world size.

    save_sharded(opt, "ckpt/")        # every rank writes its slices; nothing is gathered
    load_sharded(opt, "ckpt/")        # any world size, any ZeRO stage: each rank reads its slices

Each bucket's weights and optimizer state (master weights, Adam's moments, ...) are saved as a
DTensor of the bucket's *unpadded* length, sharded on dim 0 over the ranks. The layout's slices
are torch.chunk's (ceil(n/N) elements per rank, the last rank shorter), which is how DTensor
shards, so DCP's resharding maps any world size's slices onto any other's. Buckets are one per
block plus the rest, the same for every world size.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from memfit.apply.param_state import (masters_follow_weights, param_states, set_step, step_of,
                                     weights_follow_masters)
from memfit.core.errors import ConfigError


def _slots(opt, slots) -> list[dict[str, torch.Tensor]]:
    """Per shard slice, its live tensors: weights, master (master modes, offload) and optimizer state."""
    out = []
    for s in slots:
        slot = {"weights": s.param.data}
        if s.master is not None:
            slot["master"] = s.master.data
        slot.update({k: v for k, v in s.state.items() if torch.is_tensor(v) and v.dim() == 1})
        out.append(slot)
    return out


def _dtensors(opt, slots) -> dict[str, DTensor]:
    engine = opt.engine
    mesh = init_device_mesh(engine.device.type, (engine.world,))
    state = {}
    for b, slot in zip(engine.layout.buckets, slots):
        valid = max(0, min(b.slice, b.numel - engine.rank * b.slice))
        for name, t in slot.items():
            state[f"bucket{b.index}.{name}"] = DTensor.from_local(
                t[:valid], mesh, [Shard(0)], run_check=False, shape=torch.Size([b.numel]), stride=(1,))
    return state


def save_sharded(opt, path: str | Path) -> None:
    """Write this rank's slices of a ShardedOptimizer (zero1-3) under `path` (all ranks call it).
    Disk-offloaded state is read chunk by chunk into memory for the save and written back after."""
    with param_states(opt.inner) as slots:
        state = _dtensors(opt, _slots(opt, slots))
        state["step"] = step_of(slots)
        if opt.scaler is not None:
            state["loss_scale"] = torch.tensor(opt.scaler.scale)
        dcp.save(state, checkpoint_id=str(path))


def load_sharded(opt, path: str | Path) -> None:
    """Read a save_sharded checkpoint written with any world size into this ShardedOptimizer."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    names = {k.split(".", 1)[1]: v.properties.dtype for k, v in meta.items() if k.startswith("bucket0.")}
    if "weights" not in names:
        raise ConfigError(f"{path} is not a memfit sharded checkpoint (no bucket0.weights)")
    names.pop("weights")
    has_master = names.pop("master", None) is not None
    with param_states(opt.inner, create=names) as slots:
        state = _dtensors(opt, _slots(opt, slots))
        if not has_master:  # written without master weights: the masters follow the weights below
            state = {k: v for k, v in state.items() if not k.endswith(".master")}
        state["step"] = torch.tensor(0.0)
        if "loss_scale" in meta and opt.scaler is not None:
            state["loss_scale"] = torch.tensor(0.0, dtype=torch.float64)
        missing = set(state) - set(meta)
        if missing:
            raise ConfigError(f"{path} lacks {sorted(missing)[:3]}: it was written for another model, optimizer "
                              "or precision")
        dcp.load(state, checkpoint_id=str(path))
        set_step(slots, state["step"])
        (weights_follow_masters if has_master else masters_follow_weights)(slots)
    if "loss_scale" in state:
        opt.scaler.scale = float(state["loss_scale"])
    opt.engine.after_step()
    dist.barrier()
