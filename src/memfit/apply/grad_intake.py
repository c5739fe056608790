"""Gradients leaving the device during backward, for optimizer offload to CPU or disk.

A post-accumulate-grad hook takes each gradient as soon as backward has produced it and frees the
device copy. "cpu" accumulates gradients (over micro-batches) in host tensors; "disk" gathers a
chunk's gradients in a host staging buffer and, once the chunk is complete, a worker thread writes
it to the chunk's gradient file in one write (adding what earlier micro-batches wrote) while
backward goes on. When every gradient of a chunk is in, `on_complete(k)` is called (the streamed
optimizer then may update that chunk early, during backward).
"""
from __future__ import annotations

import functools
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn as nn

from memfit.apply.chunk_files import ChunkFiles
from memfit.apply.chunk_layout import Chunk, slot
from memfit.apply.host_io import BufferPool, host_empty
from memfit.apply.loss_scale import all_finite
from memfit.apply.saved_copies import is_fake
from memfit.core.tracker import mark_host


def _hook(ref: "weakref.ref[GradIntake]", i: int, p: torch.Tensor) -> None:
    intake = ref()
    if intake is not None:
        intake.take(i, p)


class GradIntake:
    def __init__(self, params: list[nn.Parameter], chunks: list[Chunk], master_dtype: torch.dtype,
                 files: ChunkFiles | None, buffers: BufferPool, pool: Callable[[], ThreadPoolExecutor],
                 on_complete: Callable[[int], None], check_finite: bool) -> None:
        self.params, self.chunks, self.master_dtype = params, chunks, master_dtype
        self.files, self.buffers, self._pool = files, buffers, pool
        self._on_complete = weakref.WeakMethod(on_complete)  # the optimizer owns this intake
        self.chunk_index = {i: k for k, c in enumerate(chunks) for i in c.idx}
        self.check_finite = check_finite
        self.host_grads: dict[int, torch.Tensor] = {}  # cpu: gradient accumulated on the host
        self.written: set[int] = set()                 # disk: params whose grad file slot holds this step's grad
        self.staging: dict[int, tuple[torch.Tensor, set[int]]] = {}  # disk: chunk -> (buffer, params in it)
        self.pending: list[Future] = []
        self.watch_complete = False  # cpu: report complete chunks (only while updating early)
        self.arrived: dict[int, set[int]] = {}
        self.found_inf = False       # inf/NaN seen in a grad moved to the host
        self.bad_grads: set[int] = set()
        self.closed = False
        ref = weakref.ref(self)  # the hooks must not keep an abandoned optimizer alive
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_hook, ref, i))
                       for i, p in enumerate(params)]

    def submit(self, fn: Callable, *args: object) -> None:
        if is_fake(self.params[0]):
            # A FakeTensorMode trace: the mode's state is shared by every thread, so a worker running
            # fake ops beside backward races it ("in_kernel_invocation must be False"). Run inline.
            done: Future = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's f.result(), as from the pool
                done.set_exception(exc)
            self.pending.append(done)
            return
        self.pending.append(self._pool().submit(fn, *args))

    def _complete(self, k: int) -> None:
        cb = self._on_complete()
        if cb is not None:
            cb(k)

    def take(self, i: int, p: torch.Tensor) -> None:
        if p.grad is None or self.closed:  # another hook took it already
            return
        g = p.grad.detach()
        p.grad = None  # the device gradient is ephemeral
        if self.files is not None:
            self._stage(i, g)
            return
        # cpu: no copy when the gradient already is a CPU tensor of the master dtype: it is handed over.
        if g.device.type != "cpu" or g.dtype != self.master_dtype:
            g = host_empty(g.numel(), self.master_dtype, like=g).view(g.shape).copy_(g)
        mark_host(g)
        self._check(i, g)
        acc = self.host_grads.get(i)
        if acc is None:
            self.host_grads[i] = g
        else:
            acc.add_(g)
        if self.watch_complete:
            k = self.chunk_index[i]
            arrived = self.arrived.setdefault(k, set())
            arrived.add(i)
            if len(arrived) == len(self.chunks[k].idx):
                self._complete(k)

    def _stage(self, i: int, g: torch.Tensor) -> None:
        """Gather the chunk's gradients in one host staging buffer; a chunk whose gradients are all
        in goes to its file in one write on the spill thread while backward continues."""
        k = self.chunk_index[i]
        c = self.chunks[k]
        stage = self.staging.get(k)
        if stage is None:
            stage = self.staging[k] = (self.buffers.acquire(c.grad_nbytes), set())
        s = self.grad_slot(stage[0], c, i)
        # a chunk left partly filled by an earlier micro-batch may already hold this gradient
        s.add_(g) if i in stage[1] else s.copy_(g)
        self._check(i, s)
        stage[1].add(i)
        if len(stage[1]) == len(c.idx):
            del self.staging[k]
            self.submit(self._spill, k, *stage)
            self._complete(k)

    def _check(self, i: int, g: torch.Tensor) -> None:
        if self.check_finite and not all_finite(g):
            self.found_inf = True
            self.bad_grads.add(i)

    def grad_slot(self, buf: torch.Tensor, c: Chunk, i: int) -> torch.Tensor:
        return slot(buf, c.grad_offsets[i], self.master_dtype, self.params[i].shape)

    def _spill(self, k: int, buf: torch.Tensor, fresh: set[int]) -> None:
        """Write chunk k's staged gradients (params `fresh`) to its file in one write; over
        micro-batches, first read what earlier ones wrote and add it (or keep it, for params that
        got no gradient this time)."""
        c = self.chunks[k]
        earlier = [i for i in c.idx if i in self.written]
        if earlier:
            prev = self.files.read_grads(k, c.grad_nbytes)
            for i in earlier:
                new, old = self.grad_slot(buf, c, i), self.grad_slot(prev, c, i)
                new.add_(old) if i in fresh else new.copy_(old)
            self.buffers.release(prev)
        self.files.write_grads(k, buf)
        self.written.update(fresh)
        self.buffers.release(buf)

    def drain(self) -> None:
        """Flush partly filled chunks (parameters without a gradient) and wait for every spill write."""
        for k, stage in list(self.staging.items()):
            del self.staging[k]
            self.submit(self._spill, k, *stage)
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()  # re-raises a failed write here, in the training thread

    def load(self, k: int) -> torch.Tensor | None:
        """disk: chunk k's gradient buffer (None when none of its parameters got a gradient)."""
        c = self.chunks[k]
        if not any(i in self.written for i in c.idx):
            return None
        return self.files.read_grads(k, c.grad_nbytes)

    def grad(self, i: int, gbuf: torch.Tensor | None, c: Chunk) -> torch.Tensor | None:
        if self.files is None:
            return self.host_grads.get(i)
        return self.grad_slot(gbuf, c, i) if i in self.written else None

    def discard(self, keep_files: bool) -> None:
        """Drop this step's gradients (their files too unless keep_files)."""
        self.drain()
        self.host_grads.clear()
        self.written.clear()
        self.found_inf = False
        self.bad_grads.clear()
        if self.files is not None and not keep_files:
            self.files.delete_grads()

    def close(self) -> None:
        """Stop taking gradients; an unfinished step's gradients are not worth writing."""
        self.closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.staging.clear()
        self.drain()
