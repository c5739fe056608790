"""Each parameter's optimizer state as live tensors, wherever a TrainingOptimizer keeps it.

    with param_states(opt) as slots:          # opt: a memfit TrainingOptimizer
        for s in slots:                        # in opt.params order
            s.param, s.master, s.state         # state: the torch optimizer's dict for the tensor it updates

Checkpoints read and write through these tensors in place, whatever the precision or offload:
in memory (plain, or master weights on the device or in host memory) or on disk, where each
chunk's [masters | state] file is read into memory on entry and written back on exit (so a
checkpoint of disk-offloaded state holds one rank's state in memory only while it is saved or
loaded). `create` makes the named state (zeros) where the optimizer has none yet, as a load
needs before its first step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from memfit.apply import chunk_layout as layout


@dataclass
class ParamSlot:
    param: torch.Tensor
    """The model's parameter (what the forward reads)."""
    master: torch.Tensor | None
    """The tensor the optimizer updates when it is not `param` (master weights, offloaded copies)."""
    state: dict[str, Any]
    """The torch optimizer's state for the tensor it updates (Adam: exp_avg, exp_avg_sq, step)."""
    shared: bool = False
    """The master shares the parameter's storage (cpu offload of a CPU parameter in its own dtype)."""

    @property
    def updated(self) -> torch.Tensor:
        return self.master if self.master is not None else self.param


def _create(state: dict, like: torch.Tensor, create: dict[str, torch.dtype] | None) -> None:
    if create is None:
        return
    for name, dtype in create.items():
        if not torch.is_tensor(state.get(name)):
            state[name] = torch.zeros(like.shape, dtype=dtype, device=like.device)
    state.setdefault("step", torch.tensor(0.0))


@contextlib.contextmanager
def param_states(opt: Any, create: dict[str, torch.dtype] | None = None) -> Iterator[list[ParamSlot]]:
    """The ParamSlots of TrainingOptimizer `opt`; on exit disk-offloaded chunks are written back."""
    st = opt.streamed
    if st is None:
        slots = [ParamSlot(p, None, opt.optimizer.state[p]) for p in opt.params]
        for s in slots:
            _create(s.state, s.param, create)
        yield slots
        return
    bufs: dict[int, torch.Tensor] = {}
    try:
        if st.files is not None:
            for k, c in enumerate(st.chunks):
                bufs[k] = st.files.load_state(k, c.nbytes)
                layout.attach(c, st.masters, bufs[k])
        slots = []
        for i, p in enumerate(st.params):
            m = st.masters[i]
            state = st.chunks[st.chunk_index[i]].optimizer.state[m]
            _create(state, m, create)
            slots.append(ParamSlot(p, m, state, shared=i in st._shared))
        yield slots
    finally:
        for k, buf in bufs.items():  # fold state (new state grows the layout) back into the chunk's file
            out = layout.detach(st.chunks[k], st.masters, buf)
            st.files.save_state(k, out)
            st.buffers.release(out)
            if out is not buf:
                st.buffers.release(buf)


@torch.no_grad()
def weights_follow_masters(slots: list[ParamSlot]) -> None:
    """After a load: the model's weights are the loaded masters (cast to the weights' dtype)."""
    for s in slots:
        if s.master is not None and not s.shared:
            s.param.data.copy_(s.master.detach())


@torch.no_grad()
def masters_follow_weights(slots: list[ParamSlot]) -> None:
    """After a load without master weights: the masters are the loaded weights."""
    for s in slots:
        if s.master is not None and not s.shared:
            s.master.data.copy_(s.param.detach())


def step_of(slots: list[ParamSlot]) -> torch.Tensor:
    """The optimizer's step counter (the same for every parameter), as a float tensor (0: none yet)."""
    for s in slots:
        if torch.is_tensor(s.state.get("step")):
            return s.state["step"].detach().clone().float()
        if isinstance(s.state.get("step"), (int, float)):
            return torch.tensor(float(s.state["step"]))
    return torch.tensor(0.0)


def set_step(slots: list[ParamSlot], step: torch.Tensor) -> None:
    """Every parameter's step counter, in the type the optimizer keeps (a tensor unless it keeps a number)."""
    for s in slots:
        old = s.state.get("step")
        if isinstance(old, (int, float)) and not isinstance(old, bool):
            s.state["step"] = type(old)(float(step))
        else:
            dtype = old.dtype if torch.is_tensor(old) else torch.float32
            s.state["step"] = step.detach().clone().to(dtype)
