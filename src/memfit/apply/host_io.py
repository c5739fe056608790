"""Host buffers and whole-buffer file I/O for optimizer offload.

Host staging buffers are host copies to a memory tracker from birth (memfit.core.host), so it
does not count them as device bytes (on CPU training host and device are the same RAM). They are
made like a tensor of the run, so under FakeTensorMode (the estimate traces offload too) they are
fake and reads and writes move no data. Reads and writes move a tensor's bytes with pread/pwrite,
no copy, and are timed in `IOStats`.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake

from memfit.core import host


@dataclass
class IOStats:
    """Bytes moved to and from the spill folder and the seconds spent inside read/write calls."""
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, read: int = 0, written: int = 0, read_s: float = 0.0, write_s: float = 0.0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written
            self.read_s += read_s
            self.write_s += write_s

    @property
    def throughput(self) -> float:
        """Bytes per second while doing I/O (reads and writes together)."""
        t = self.read_s + self.write_s
        return (self.bytes_read + self.bytes_written) / t if t > 0 else 0.0


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (any dtype, no copy)."""
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_at(fd: int, t: torch.Tensor, offset: int) -> int:
    if is_fake(t):  # memory prediction: no data to move
        return t.numel() * t.element_size()
    view, done = as_bytes(t), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def read_at(fd: int, t: torch.Tensor, offset: int) -> int:
    if is_fake(t):
        return t.numel() * t.element_size()
    view, done = as_bytes(t), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"spill file ended early at byte {offset + done}")
        done += n
    return done


def timed_write(io: IOStats, fd: int, buf: torch.Tensor) -> None:
    t0 = time.perf_counter()
    n = write_at(fd, buf, 0)
    io.add(written=n, write_s=time.perf_counter() - t0)


def timed_read(io: IOStats, fd: int, buf: torch.Tensor) -> None:
    t0 = time.perf_counter()
    n = read_at(fd, buf, 0)
    io.add(read=n, read_s=time.perf_counter() - t0)


def host_empty(n: int, dtype: torch.dtype = torch.uint8, like: torch.Tensor | None = None) -> torch.Tensor:
    """A host staging buffer of n elements, a host copy for the memory tracker from birth; a fake
    tensor when `like` (a tensor of the run) is one, on any thread."""
    return host.host_empty(n, dtype, like)


class BufferPool:
    """Reused host byte buffers: a fresh buffer's pages fault in on first touch, which costs as much
    as the copy itself, so a few chunk-sized buffers are kept (taken and given back from the
    training thread and the spill thread, hence the lock)."""

    def __init__(self, size: int = 4, like: torch.Tensor | None = None) -> None:
        self.size, self.like = size, like
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, n: int) -> torch.Tensor:
        with self._lock:
            fits = [j for j, b in enumerate(self._free) if b.numel() >= n]
            if fits:
                best = self._free.pop(min(fits, key=lambda j: self._free[j].numel()))
                return best[:n]
        return host_empty(n, like=self.like)

    def release(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        with self._lock:
            if any(b is base for b in self._free):
                return
            self._free.append(base)
            if len(self._free) > self.size:  # drop the smallest (tensors compare by value: use indices)
                self._free.pop(min(range(len(self._free)), key=lambda j: self._free[j].numel()))
