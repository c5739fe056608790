"""The files of optimizer disk offload: per chunk, state_<k>.bin ([masters | state], rewritten
each step) and grad_<k>.bin (this step's gradients), in a private spill folder (memfit.core.spill).

Files are created 0600 and written and read whole (memfit.apply.host_io). Gradient files are
deleted after each step unless kept for reuse; the folder goes on close(), on garbage collection,
at interpreter exit, or (after kill -9) when the next run uses the same spill root.
"""
from __future__ import annotations

import os

import torch

from memfit.apply.host_io import BufferPool, IOStats, timed_read, timed_write
from memfit.core.spill import SpillFolder


class ChunkFiles:
    def __init__(self, spill_dir: str | os.PathLike | None, need_bytes: int, io: IOStats,
                 buffers: BufferPool) -> None:
        self.spill = SpillFolder(spill_dir, "optim", need_bytes, purpose="optimizer offload")
        self.folder = str(self.spill.path)
        self.io, self.buffers = io, buffers
        self._grad_fds: dict[int, int] = {}

    def save_state(self, k: int, buf: torch.Tensor) -> None:
        fd = os.open(self.spill.file(f"state_{k}.bin"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            timed_write(self.io, fd, buf)
        finally:
            os.close(fd)

    def load_state(self, k: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers.acquire(nbytes)
        fd = os.open(self.spill.file(f"state_{k}.bin"), os.O_RDONLY)
        try:
            timed_read(self.io, fd, buf)
        finally:
            os.close(fd)
        return buf

    def _grad_fd(self, k: int) -> int:
        fd = self._grad_fds.get(k)
        if fd is None:
            fd = self._grad_fds[k] = os.open(self.spill.file(f"grad_{k}.bin"), os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def write_grads(self, k: int, buf: torch.Tensor) -> None:
        timed_write(self.io, self._grad_fd(k), buf)

    def read_grads(self, k: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers.acquire(nbytes)
        timed_read(self.io, self._grad_fd(k), buf)
        return buf

    def delete_grads(self) -> None:
        for k, fd in list(self._grad_fds.items()):
            os.close(fd)
            os.unlink(self.spill.file(f"grad_{k}.bin"))
        self._grad_fds.clear()

    def close_grads(self) -> None:
        for fd in self._grad_fds.values():
            os.close(fd)
        self._grad_fds.clear()

    def close(self) -> None:
        self.close_grads()
        self.spill.close()
