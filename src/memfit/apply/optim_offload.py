"""Master weights and optimizer state kept apart from the model: on the device, in CPU memory, or on disk.

`StreamedOptimizer` holds a master copy of every parameter (fp32 in the *-master modes, the
parameter's own dtype otherwise) and runs a torch optimizer over the masters, chunk by chunk
(memfit.apply.chunk_layout):

    where="device"  masters and state beside the model (the in-memory *-master modes)
    where="cpu"     masters and state in host memory; the update runs on the CPU
    where="disk"    masters and state in private files under a spill folder (memfit.apply.chunk_files);
                    per chunk the step reads [master | state] in one read, updates, writes it back

With "cpu" and "disk" the gradients are ephemeral on the device (memfit.apply.grad_intake). On the
last micro-batch (`begin_backward(final=True)`) a chunk whose gradients are complete is also
*updated* on a worker thread during backward.

Per-element math is torch's own optimizer on the same fp32 values, so an offloaded fp32 run is
bit-identical to an in-memory one.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from memfit.apply import chunk_layout as layout
from memfit.apply.chunk_files import ChunkFiles
from memfit.apply.chunk_layout import Chunk, plan_chunks
from memfit.apply.grad_intake import GradIntake
from memfit.apply.host_io import BufferPool, IOStats
from memfit.apply.loss_scale import all_finite
from memfit.apply.optim_state import load_streamed_state, streamed_state_dict
from memfit.core.errors import ConfigError
from memfit.core.tracker import host_allocations, mark_host  # host copies are not device bytes

WHERE = ("device", "cpu", "disk")
__all__ = ["StreamedOptimizer", "IOStats", "WHERE", "mark_host"]


def _mark_state_host(opt: torch.optim.Optimizer, *_: object) -> None:
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                mark_host(v)


class StreamedOptimizer:
    def __init__(
        self,
        params: list[nn.Parameter],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        master_dtype: torch.dtype,
        where: str = "cpu",
        spill_dir: str | os.PathLike | None = None,
        chunk_bytes: int | None = None,
        check_finite: bool = False,
        keep_grad_files: bool = False,
    ) -> None:
        """chunk_bytes: master bytes per chunk; None = 16 MiB for cpu/disk (large sequential I/O) and one
        tensor per chunk on the device (so only one fp32 gradient copy exists at a time).
        check_finite: look for inf/NaN in each gradient as it leaves the device (fp16 loss scaling).
        keep_grad_files: disk only; keep the gradient files between steps (their content is still
        dropped: nothing written in one step is read in the next) instead of deleting them after
        each step. Rewriting a file's existing pages is faster than allocating new ones."""
        if where not in WHERE:
            raise ConfigError(f"unknown optimizer offload {where!r}; accepted: none, cpu, disk")
        if chunk_bytes is None:
            chunk_bytes = 1 if where == "device" else 16 << 20
        if chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes={chunk_bytes} must be positive")
        self.params, self.where, self.master_dtype = params, where, master_dtype
        self.keep_grad_files = keep_grad_files
        self.io = IOStats()
        self.buffers = BufferPool(like=params[0])
        self.files: ChunkFiles | None = None
        self.intake: GradIntake | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._early = False              # updating chunks during this backward (begin_backward)
        self._updated: set[int] = set()  # chunks already updated this step
        self.early_updates = 0           # chunk updates that ran overlapped with a backward
        self.chunk_updates = 0           # chunk updates begun: a failed step that began none changed nothing
        self._closed = False
        self._shared: set[int] = set()   # cpu: parameters that are their own master
        self.make_optimizer = make_optimizer
        self.masters = self._make_masters()
        itemsize = torch.empty((), dtype=master_dtype).element_size()
        self.chunks = [Chunk(idx, make_optimizer([self.masters[i] for i in idx]))
                       for idx in plan_chunks([p.numel() for p in params], itemsize, chunk_bytes)]
        self.chunk_index = {i: k for k, c in enumerate(self.chunks) for i in c.idx}
        """Parameter index -> the chunk (and so the torch optimizer) that updates it."""
        if where == "device":
            return
        # Instance post-hooks run before global ones, so state an optimizer step creates is
        # flagged as host before a memory tracker's global step hook rescans the optimizer.
        for c in self.chunks:
            c.optimizer.register_step_post_hook(_mark_state_host)
        if where == "disk":
            # masters + fp32 state (up to 2 per parameter for Adam) + one gradient per parameter
            need = 0 if is_fake(params[0]) else sum(p.numel() for p in params) * itemsize * 4
            self.files = ChunkFiles(spill_dir, need, self.io, self.buffers)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="memfit-offload")
            self._write_initial_chunks()
        for i, m in enumerate(self.masters):
            if i not in self._shared:
                mark_host(m)
        self.intake = GradIntake(params, self.chunks, master_dtype, self.files, self.buffers,
                                 self._executor, self._chunk_complete, check_finite)

    @property
    def folder(self) -> str | None:
        """disk: the private spill folder holding this optimizer's files."""
        return self.files.folder if self.files is not None else None

    def _make_masters(self) -> list[nn.Parameter]:
        store = self.params[0].device if self.where == "device" else torch.device("cpu")
        masters = []
        for i, p in enumerate(self.params):
            # With where="cpu", a CPU parameter already in the master dtype *is* its own master:
            # sharing the storage avoids a second copy (the update then writes the parameter in place).
            if self.where == "cpu" and p.device.type == "cpu" and p.dtype == self.master_dtype:
                m = nn.Parameter(p.detach())
                self._shared.add(i)
            elif self.where == "disk":  # filled chunk by chunk, so RAM never holds all masters
                m = nn.Parameter(torch.empty(0, dtype=self.master_dtype))
            else:
                m = nn.Parameter(p.detach().to(store, self.master_dtype, copy=True))
            masters.append(m)
        return masters

    def _write_initial_chunks(self) -> None:
        for k, c in enumerate(self.chunks):
            for i in c.idx:
                self.masters[i].data = self.params[i].detach().to("cpu", self.master_dtype, copy=True)
            c.masters_only(self.masters)
            self.files.save_state(k, layout.pack(c, self.masters))
            for i in c.idx:
                self.masters[i].data = torch.empty(0, dtype=self.master_dtype)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="memfit-offload")
        return self._pool

    def _drain(self) -> None:
        if self.intake is not None:
            self.intake.drain()

    # ---------------------------------------------------------------- the step
    def grads_finite(self) -> tuple[bool, list[int]]:
        """(all gradients finite, indices of parameters whose gradient is not)."""
        if self.intake is None:
            bad = [i for i, p in enumerate(self.params) if p.grad is not None and not all_finite(p.grad)]
            return not bad, bad
        self.intake.drain()
        return not self.intake.found_inf, sorted(self.intake.bad_grads)

    def _grad(self, i: int, gbuf: torch.Tensor | None, c: Chunk) -> torch.Tensor | None:
        return self.params[i].grad if self.intake is None else self.intake.grad(i, gbuf, c)

    def _load_grads(self, k: int) -> torch.Tensor | None:
        return self.intake.load(k) if self.files is not None else None

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of all gradients, computed as torch.nn.utils.clip_grad_norm_ does (per tensor, then
        the norm of the norms) so that clipping stays bit-identical to an in-memory fp32 run."""
        self._drain()
        norms = []
        for k, c in enumerate(self.chunks):
            gbuf = self._load_grads(k)
            for i in c.idx:
                g = self._grad(i, gbuf, c)
                if g is not None:
                    kw = {} if g.dtype == torch.float32 else {"dtype": torch.float32}
                    norms.append(torch.linalg.vector_norm(g, 2.0, **kw).to(self.masters[i].device))
            if gbuf is not None:
                self.buffers.release(gbuf)
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def step(self, grad_scale: float | torch.Tensor | None = None) -> None:
        """Update every parameter that has a gradient: grad -> master dtype, times grad_scale (unscaling
        and clipping folded into one factor), torch optimizer step on the master, copy back.
        Chunks already updated during the final backward (see begin_backward) are not updated again."""
        self._drain()
        for k in range(len(self.chunks)):
            if k not in self._updated:
                self._update_chunk(k, grad_scale)
        self._updated.clear()
        self.discard_grads()

    def _set_master_grads(self, c: Chunk, gbuf: torch.Tensor | None,
                          grad_scale: float | torch.Tensor | None) -> list[int]:
        have = []
        for i in c.idx:
            g = self._grad(i, gbuf, c)
            if g is None:
                continue
            m = self.masters[i]
            if self.where == "device":
                g = g.to(m.device, m.dtype, copy=True)
                self.params[i].grad = None  # the 16-bit grad is not needed once converted
            elif g.dtype != m.dtype:
                g = g.to(m.device, m.dtype)
            if grad_scale is not None:
                g.mul_(grad_scale)
            m.grad = g
            have.append(i)
        return have

    def _update_chunk(self, k: int, grad_scale: float | torch.Tensor | None) -> None:
        self.chunk_updates += 1
        c = self.chunks[k]
        gbuf = self._load_grads(k)
        state = self.files.load_state(k, c.nbytes) if self.files is not None else None
        if state is not None:
            layout.attach(c, self.masters, state)
        have = self._set_master_grads(c, gbuf, grad_scale)
        if have:
            if self.where == "device":
                c.optimizer.step()
            else:
                # The update runs on host memory: its new state and temporaries are host
                # copies to memory trackers (on CPU training they would look like device bytes).
                with host_allocations():
                    if state is not None:
                        self._initial_state(c)
                    c.optimizer.step()
        for i in have:
            m = self.masters[i]
            m.grad = None
            if i not in self._shared:
                self.params[i].data.copy_(m.detach())
            if self.intake is None:
                self.params[i].grad = None
            else:
                self.intake.host_grads.pop(i, None)
        if state is not None:
            out = layout.detach(c, self.masters, state)
            self.files.save_state(k, out)
            self.buffers.release(out)
            if out is not state:
                self.buffers.release(state)
        if gbuf is not None:
            self.buffers.release(gbuf)

    def _initial_state(self, c: Chunk) -> None:
        """disk, before a chunk's first update: the state its optimizer sets up in __init__ (built on
        the empty placeholder masters, then dropped by attach), rebuilt on the loaded masters.
        torch before 2.13's Adagrad reads state["sum"] in step() without creating it; optimizers that
        create their state in step() have none here, and 2.13's Adagrad creates the same values."""
        masters = [self.masters[i] for i in c.idx]
        if any(c.optimizer.state.get(m) for m in masters):
            return
        for m, st in self.make_optimizer(masters).state.items():
            c.optimizer.state[m] = st

    # ---------------------------------------------------------------- updates overlapped with backward
    def begin_backward(self, final: bool) -> None:
        """Called before each backward. With final=True (the last micro-batch before step(), and
        no clipping or loss scaling, which need every gradient first) a chunk whose gradients are
        all in is updated on the worker thread while backward goes on: a leaf's gradient is final
        once its accumulation hook ran, and every op that read the parameter has run by then."""
        self._early = final and self.intake is not None
        if self.intake is not None:
            self.intake.arrived = {}
            self.intake.watch_complete = self._early

    def end_backward(self) -> None:
        self._early = False
        if self.intake is not None:
            self.intake.watch_complete = False

    def _chunk_complete(self, k: int) -> None:
        if self._early and k not in self._updated:
            self._updated.add(k)
            self.early_updates += 1
            self.intake.submit(self._update_chunk, k, None)

    def discard_grads(self) -> None:
        """Drop this step's gradients wherever they are (skipped steps, zero_grad)."""
        if self.intake is not None:
            self.intake.discard(self.keep_grad_files)
        for p in self.params:
            p.grad = None

    # ---------------------------------------------------------------- state
    @property
    def param_groups(self) -> list[dict]:
        return [g for c in self.chunks for g in c.optimizer.param_groups]

    def state_tensors(self) -> list[torch.Tensor]:
        """Masters and optimizer state held in memory between steps (none for disk, beyond scalars).
        A master that shares the parameter's storage is the parameter, not optimizer state."""
        out: list[torch.Tensor] = []
        for c in self.chunks:
            for i in c.idx:
                m = self.masters[i]
                if m.numel() and i not in self._shared:
                    # The master itself, not m.data: .data dispatches through every active mode
                    # (a fake step's tracker calls this after each chunk's update).
                    out.append(m)
                for v in list(c.optimizer.state.get(m, {}).values()) + list(c.small.get(i, {}).values()):
                    if torch.is_tensor(v):
                        out.append(v)
        return out

    def state_dict(self) -> dict:
        """Masters and every chunk's optimizer state, materialised in CPU memory (plain containers)."""
        return streamed_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        load_streamed_state(self, state)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.intake is not None:
                self.intake.close()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self.files is not None:
                self.files.close()  # removes the spill folder
