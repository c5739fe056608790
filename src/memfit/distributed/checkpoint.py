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

from memfit.core.errors import ConfigError


def _slots(opt, create: dict[str, torch.dtype] | None = None) -> list[dict[str, torch.Tensor]]:
    """Per shard slice, its live tensors: weights, master (master modes) and optimizer state.
    `create`: state names and dtypes to create where the optimizer has none yet (before loading)."""
    inner = opt.inner
    streamed = inner.streamed
    if streamed is not None and streamed.where == "disk":
        raise ConfigError("sharded checkpoints of disk-offloaded optimizer state are not supported; "
                          "use --offload-optimizer cpu or none")
    out = []
    for i, s in enumerate(opt.engine.shards):
        slot = {"weights": s.data}
        if streamed is not None:
            m = streamed.masters[i]
            slot["master"] = m.data
            state = streamed.chunks[streamed.chunk_index[i]].optimizer.state[m]
        else:
            m, state = s, inner.optimizer.state[s]
        for name, dtype in (create or {}).items():
            if name not in state:
                state[name] = torch.zeros(m.shape, dtype=dtype, device=m.device)
        if create is not None:
            state.setdefault("step", torch.tensor(0.0))
        slot.update({k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1})
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


def _step_of(opt) -> float:
    for slot_state in _opt_states(opt):
        step = slot_state.get("step")
        if step is not None:
            return float(step)
    return 0.0


def _opt_states(opt) -> list[dict]:
    inner, st = opt.inner, opt.inner.streamed
    if st is not None:
        return [st.chunks[st.chunk_index[i]].optimizer.state[st.masters[i]] for i in range(len(st.masters))]
    return [inner.optimizer.state[s] for s in opt.engine.shards]


def save_sharded(opt, path: str | Path) -> None:
    """Write this rank's slices of a ShardedOptimizer (zero1-3) under `path` (all ranks call it)."""
    state = _dtensors(opt, _slots(opt))
    state["step"] = torch.tensor(_step_of(opt))
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
    names.pop("master", None)
    state = _dtensors(opt, _slots(opt, create=names))
    state["step"] = torch.tensor(0.0)
    if "loss_scale" in meta and opt.scaler is not None:
        state["loss_scale"] = torch.tensor(0.0, dtype=torch.float64)
    missing = set(state) - set(meta)
    if missing:
        raise ConfigError(f"{path} lacks {sorted(missing)[:3]}: it was written for another model, optimizer "
                          "or precision")
    dcp.load(state, checkpoint_id=str(path))
    for s in _opt_states(opt):
        s["step"] = state["step"].clone()
    if "loss_scale" in state:
        opt.scaler.scale = float(state["loss_scale"])
    with torch.no_grad():  # master modes: the weights follow the masters
        st = opt.inner.streamed
        if st is not None:
            for p, m in zip(opt.engine.shards, st.masters):
                p.data.copy_(m.detach())
    opt.engine.after_step()
    dist.barrier()
