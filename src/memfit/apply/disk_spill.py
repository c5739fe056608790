"""Disk spill of saved activations: a private spill folder (memfit.core.spill) plus the threads that
write each spilled tensor to its own file and read it back.

Files are created 0600 and deleted when read, or when their tensor is no longer needed (also after
an exception, see `discard`); the folder is removed on close, at exit, or after kill -9 by the
next run that spills under the same root. A failed write (a full disk) is kept as a message and
raised as SpillError in the training thread; it also removes every spill file at once (`_fail`).
"""
from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from memfit.apply import compress as codecs
from memfit.core.errors import MemfitError
from memfit.core.spill import LOCK_NAME, SpillFolder


class SpillError(MemfitError):
    """Writing or reading a spill file failed (for example: the disk filled up during a step)."""


@dataclass
class OffloadStats:
    """Bytes moved and time spent, for benchmarks (disk throughput reached)."""

    host_bytes: int = 0
    spilled_bytes: int = 0
    write_seconds: float = 0.0
    read_bytes: int = 0
    read_seconds: float = 0.0
    files: int = 0
    pinned: bool | None = None
    """None until a CUDA tensor was offloaded; then whether pinned buffers were available."""


class DiskSpill:
    """A private folder of spill files plus the threads that write and read them."""

    def __init__(self, root: str | os.PathLike | None, stats: OffloadStats, threads: int = 2) -> None:
        self.folder = SpillFolder(root, "act", purpose="activation offload")
        self.dir = self.folder.path
        self.stats = stats
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="memfit-spill")
        self.error: str | None = None
        """The first write failure; a message, not an exception object, so no traceback keeps tensors alive."""
        self._n = 0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, DiskSpill._cleanup, self.pool, self.folder)

    @staticmethod
    def _cleanup(pool: ThreadPoolExecutor, folder: SpillFolder) -> None:
        pool.shutdown(wait=True, cancel_futures=True)
        folder.close()

    def close(self) -> None:
        self._finalizer()

    def new_path(self) -> str:
        with self._lock:
            self._n += 1
            return str(self.dir / f"{self._n:08d}.bin")

    def write(self, path: str, box: list[torch.Tensor], ready: Any) -> None:
        """Write the tensor in `box` (a one-element list, emptied here) to `path`.

        The tensor comes in a box so that this call drops the last reference to it before the
        write's future is done: the pool's work item keeps its arguments until its thread next
        runs (after the future is set), and on a loaded machine that thread can wait for the
        interpreter long after, holding the saved bytes in RAM with every write reported done."""
        t = box.pop()
        if self.error is not None:  # an earlier write failed: the step is lost, its reads will raise
            return
        if ready is not None:
            ready.synchronize()  # the device-to-host copy into `t` has finished
        data = memoryview(codecs.flat_bytes(t).numpy())
        nbytes = t.numel() * t.element_size()
        t0 = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb", buffering=0) as f:
                while data:
                    data = data[f.write(data):]
        except OSError as exc:
            _remove(path)
            self._fail(spill_error_message(exc, str(self.dir.parent), path))
            raise SpillError(self.error) from None
        finally:
            t = data = None  # also on a failure: the exception's frame would keep the bytes alive
        if self.error is not None:  # another write failed while this one ran: _fail may have listed
            _remove(path)           # the folder before this file was created
            return
        with self._lock:
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.spilled_bytes += nbytes
            self.stats.files += 1

    def _fail(self, message: str) -> None:
        """The first failed write: keep its message and remove every spill file now.

        A failed write loses the step: its backward cannot run. The saved tensors already written
        stay referenced by the step's autograd graph for as long as the caller keeps its loss (a
        local variable in the training loop, the exception's traceback), so waiting for them to be
        dropped would leave their files on a full disk. Reads of them raise the same message; writes
        still queued or running remove their own file (`write` checks `error` after creating it)."""
        with self._lock:
            if self.error is None:
                self.error = message
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            if name != LOCK_NAME:
                _remove(str(self.dir / name))

    def read(self, path: str, meta: tuple, buf: torch.Tensor) -> torch.Tensor:
        shape, stride, dtype = meta
        nbytes = buf.numel()
        t0 = time.perf_counter()
        if self.error is not None:
            _remove(path)
            raise SpillError(self.error)
        try:
            with open(path, "rb", buffering=0) as f:
                view, got = memoryview(buf.numpy()), 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise SpillError(f"spill file {path!r} is truncated")
                    got += n
        except OSError as exc:
            if self.error is not None:  # _fail removed the file while it was being read
                raise SpillError(self.error) from None
            raise SpillError(f"reading spill file {path!r} failed: {exc.strerror}") from None
        finally:
            _remove(path)
        with self._lock:
            self.stats.read_seconds += time.perf_counter() - t0
            self.stats.read_bytes += nbytes
        return buf.view(dtype).as_strided(shape, stride)


def spill_error_message(exc: OSError, root: str, path: str) -> str:
    """What a failed spill write means for the user: a full disk (free space, or another spill
    folder), or the error itself."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"spill folder {root!r} is full; free space or pass another spill_dir"
    return f"writing spill file {path!r} failed: {exc.strerror or exc}"


def discard(write: Future, path: str) -> None:
    """Drop a spill file that will never be read, also if its write is still queued or running."""
    if not write.cancel():
        write.add_done_callback(lambda _: _remove(path))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
