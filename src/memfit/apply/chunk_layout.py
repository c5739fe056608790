"""Chunks of parameters for the streamed optimizer, and where each chunk's tensors sit in its buffer.

Each chunk holds about `chunk_bytes` of master weights and has its own torch optimizer, so a step
over one chunk does not loop over all parameters. With disk offload a chunk's masters and
optimizer state live in one byte buffer (one read, one write per step):

    [master_0 | master_1 | ... | state_0["exp_avg"] | ...]      layout: (param, key, dtype, shape, offset)

and its gradients in another, one slot per parameter at `grad_offsets`. Scalar state (Adam's step)
stays in RAM (`small`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from memfit.apply.host_io import host_empty


class Chunk:
    """One chunk: its parameter indices, its torch optimizer, and (disk) its buffer layout."""

    def __init__(self, idx: list[int], optimizer: torch.optim.Optimizer) -> None:
        self.idx = idx
        self.optimizer = optimizer
        # disk only: [(param index, state key or "" for the master, dtype, shape, byte offset)]
        self.layout: list[tuple[int, str, torch.dtype, torch.Size, int]] = []
        self.nbytes = 0
        self.small: dict[int, dict] = {}  # disk only: scalar state (e.g. Adam's step) kept in RAM
        self.grad_offsets: dict[int, int] = {}
        self.grad_nbytes = 0

    def masters_only(self, masters: list[nn.Parameter]) -> None:
        """Lay out the masters alone (no optimizer state yet); gradients get the same offsets."""
        self.layout, self.grad_offsets, off = [], {}, 0
        for i in self.idx:
            m = masters[i]
            self.layout.append((i, "", m.dtype, m.shape, off))
            self.grad_offsets[i] = off
            off += m.numel() * m.element_size()
        self.nbytes = self.grad_nbytes = off
        self.small = {}


def plan_chunks(numels: list[int], itemsize: int, chunk_bytes: int) -> list[list[int]]:
    """Consecutive parameter indices grouped so each group holds about chunk_bytes of masters."""
    out: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(numels):
        if out[-1] and size + n * itemsize > chunk_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n * itemsize
    return out if out[0] else []


def slot(buf: torch.Tensor, off: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The view of `buf` (bytes) at `off` holding a tensor of this dtype and shape."""
    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return buf[off:off + n].view(dtype).view(shape)


def _source(c: Chunk, masters: list[nn.Parameter], i: int, key: str) -> torch.Tensor:
    return masters[i] if key == "" else c.optimizer.state[masters[i]][key]


def pack(c: Chunk, masters: list[nn.Parameter]) -> torch.Tensor:
    """A fresh host buffer holding chunk c's masters and state, laid out as c.layout says."""
    buf = host_empty(c.nbytes, like=masters[c.idx[0]])
    for i, key, dtype, shape, off in c.layout:
        slot(buf, off, dtype, shape).copy_(_source(c, masters, i, key).detach())
    return buf


def attach(c: Chunk, masters: list[nn.Parameter], buf: torch.Tensor) -> None:
    """Point masters and optimizer state of chunk c at views of its loaded buffer."""
    for i in c.idx:
        c.optimizer.state[masters[i]] = dict(c.small.get(i, {}))
    for i, key, dtype, shape, off in c.layout:
        view = slot(buf, off, dtype, shape)
        if key == "":
            masters[i].data = view
        else:
            c.optimizer.state[masters[i]][key] = view


def detach(c: Chunk, masters: list[nn.Parameter], buf: torch.Tensor) -> torch.Tensor:
    """After an update: fold state back into the chunk's buffer (growing the layout when the
    optimizer created new state), drop it from RAM, and return the buffer to write."""
    known = {(i, key) for i, key, *_ in c.layout}
    grew = False
    for i in c.idx:
        for key, v in c.optimizer.state[masters[i]].items():
            big = torch.is_tensor(v) and v.numel() > 1
            if big and (i, key) not in known:
                c.layout.append((i, key, v.dtype, v.shape, c.nbytes))
                c.nbytes += v.numel() * v.element_size()
                grew = True
            elif not big:
                c.small.setdefault(i, {})[key] = v
    out = pack(c, masters) if grew else buf
    if not grew:  # state updated in place lands in buf already; copy what an optimizer replaced
        for i, key, dtype, shape, off in c.layout:
            src, dst = _source(c, masters, i, key), slot(buf, off, dtype, shape)
            if is_fake(src) or src.data_ptr() != dst.data_ptr():
                dst.copy_(src.detach())
    for i in c.idx:
        m = masters[i]
        c.optimizer.state.pop(m, None)
        m.data = torch.empty(0, dtype=m.dtype)
    return out
