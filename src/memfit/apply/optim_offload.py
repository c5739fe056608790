"""Master weights and optimizer state kept apart from the model: on the device, in CPU memory, or on disk.

`StreamedOptimizer` holds a master copy of every parameter (fp32 in the *-master modes, the
parameter's own dtype otherwise) and runs a torch optimizer over the masters, chunk by chunk
(`chunk_bytes` of master weights per chunk, each chunk with its own torch optimizer so a step over
one chunk does not loop over all parameters):

    where="device"  masters and state beside the model (the in-memory *-master modes)
    where="cpu"     masters and state in host memory; the update runs on the CPU
    where="disk"    masters and state in private files under a spill folder; per chunk the step
                    reads [master | state] in one read, updates, writes it back in one write

With "cpu" and "disk" the gradients are ephemeral on the device: a post-accumulate-grad hook
moves each gradient to the host as soon as backward has produced it, then frees the device copy.
"cpu" accumulates them (over micro-batches) in host buffers; "disk" gathers a chunk's gradients in
a staging buffer and, once the chunk is complete, a worker thread writes it to the chunk's
gradient file in one write (adding what earlier micro-batches wrote) while backward goes on. On
the last micro-batch (`begin_backward(final=True)`) a complete chunk is also *updated* on that
worker during backward. Gradient files are deleted after each step; the whole spill folder on
`close()`, on garbage collection and at interpreter exit.

Per-element math is torch's own optimizer on the same fp32 values, so an offloaded fp32 run is
bit-identical to an in-memory one.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from memfit.apply.loss_scale import all_finite
from memfit.core.errors import ConfigError
from memfit.core.tracker import host_allocations, host_empty, mark_host  # host copies are not device bytes

WHERE = ("device", "cpu", "disk")


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


def _as_bytes(t: torch.Tensor):
    """A writable memoryview of a contiguous CPU tensor's bytes (any dtype, no copy)."""
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _write_at(fd: int, t: torch.Tensor, offset: int) -> int:
    if is_fake(t):  # memory prediction (FakeTensorMode): no data to move
        return t.numel() * t.element_size()
    view, done = _as_bytes(t), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _read_at(fd: int, t: torch.Tensor, offset: int) -> int:
    if is_fake(t):
        return t.numel() * t.element_size()
    view, done = _as_bytes(t), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"spill file ended early at byte {offset + done}")
        done += n
    return done


def _host_empty(n: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A host staging buffer of n elements, a host copy for the memory tracker from birth (and a
    fake tensor when `like`, a parameter, is one: the estimate traces offload too)."""
    return host_empty(n, dtype, like)


def open_spill_folder(spill_dir: str | os.PathLike | None, need_bytes: int) -> str:
    """Create a private (0700) folder for spill files under `spill_dir`; ConfigError if unusable."""
    root = os.fspath(spill_dir) if spill_dir is not None else tempfile.gettempdir()
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"spill folder {root!r} is a file; pass --spill-dir a writable folder")
    try:
        os.makedirs(root, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="memfit-spill-", dir=root)
    except OSError as e:
        raise ConfigError(f"spill folder {root!r} is not usable ({e.strerror}); pass a writable folder") from None
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(
            f"spill folder {root!r} has {free / 2**30:.2f} GiB free but optimizer offload needs "
            f"{need_bytes / 2**30:.2f} GiB; pass a folder on a larger disk"
        )
    return folder


def _chunks(numels: list[int], itemsize: int, chunk_bytes: int) -> list[list[int]]:
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


class _Chunk:
    """One chunk: its parameter indices, its torch optimizer, and (disk) its file layout."""

    def __init__(self, idx: list[int], optimizer: torch.optim.Optimizer) -> None:
        self.idx = idx
        self.optimizer = optimizer
        # disk only: [(param index, state key or "" for the master, dtype, shape, byte offset)]
        self.layout: list[tuple[int, str, torch.dtype, torch.Size, int]] = []
        self.nbytes = 0
        self.small: dict[int, dict] = {}  # disk only: scalar state (e.g. Adam's step) kept in RAM
        self.grad_offsets: dict[int, int] = {}
        self.grad_nbytes = 0


def _mark_state_host(opt: torch.optim.Optimizer, *_: object) -> None:
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                mark_host(v)


def _grad_hook(ref: "weakref.ref[StreamedOptimizer]", i: int, p: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._take_grad(i, p)


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
        self.params = params
        self.where = where
        self.master_dtype = master_dtype
        self.io = IOStats()
        self.folder: str | None = None
        self._host_grads: dict[int, torch.Tensor] = {}  # cpu: gradient accumulated on the host
        self._grad_written: set[int] = set()              # disk: params whose grad file slot holds this step's grad
        self._grad_fds: dict[int, int] = {}
        self._pending: list[Future] = []
        self._staging: dict[int, tuple[torch.Tensor, set[int]]] = {}  # disk: chunk -> (buffer, params in it)
        self._early = False            # updating chunks during this backward (begin_backward)
        self._arrived: dict[int, set[int]] = {}
        self._updated: set[int] = set()  # chunks already updated this step
        self.early_updates = 0           # chunk updates that ran overlapped with a backward
        self._pool: ThreadPoolExecutor | None = None
        self._free: list[torch.Tensor] = []  # reusable host staging buffers (see _acquire)
        self._pool_lock = threading.Lock()
        self._hooks = []
        self.found_inf = False                             # cpu/disk: inf/NaN seen in a grad moved to the host
        self.bad_grads: set[int] = set()
        self.check_finite = check_finite
        self.keep_grad_files = keep_grad_files
        self._closed = False

        store = params[0].device if where == "device" else torch.device("cpu")
        itemsize = self._itemsize = torch.empty((), dtype=master_dtype).element_size()
        self.masters: list[nn.Parameter] = []
        # With where="cpu", a CPU parameter already in the master dtype *is* its own master: sharing
        # the storage avoids a second copy (the update then writes the parameter in place).
        self._shared: set[int] = set()
        for i, p in enumerate(params):
            share = where == "cpu" and p.device.type == "cpu" and p.dtype == master_dtype
            if share:
                m = nn.Parameter(p.detach())
                self._shared.add(i)
            elif where == "disk":  # filled chunk by chunk below, so RAM never holds all masters
                m = nn.Parameter(torch.empty(0, dtype=master_dtype))
            else:
                m = nn.Parameter(p.detach().to(store, master_dtype, copy=True))
            self.masters.append(m)
        self.chunks = [
            _Chunk(idx, make_optimizer([self.masters[i] for i in idx]))
            for idx in _chunks([p.numel() for p in params], itemsize, chunk_bytes)
        ]
        self._chunk_index = {i: k for k, c in enumerate(self.chunks) for i in c.idx}
        if where != "device":
            # Instance post-hooks run before global ones, so state an optimizer step creates is
            # flagged as host before a memory tracker's global step hook rescans the optimizer.
            for c in self.chunks:
                c.optimizer.register_step_post_hook(_mark_state_host)
        if where == "disk":
            # masters + fp32 state (up to 2 per parameter for Adam) + one gradient per parameter
            need = 0 if is_fake(params[0]) else sum(p.numel() for p in params) * itemsize * 4
            self.folder = open_spill_folder(spill_dir, need)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, True)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="memfit-offload")
            for k, c in enumerate(self.chunks):
                off = 0
                for i in c.idx:
                    self.masters[i].data = params[i].detach().to("cpu", master_dtype, copy=True)
                    n = self.masters[i].numel() * itemsize
                    c.layout.append((i, "", master_dtype, self.masters[i].shape, off))
                    c.grad_offsets[i] = off
                    off += n
                c.nbytes = c.grad_nbytes = off
                self._save_chunk(k, self._pack(c))
                for i in c.idx:
                    self.masters[i].data = torch.empty(0, dtype=master_dtype)
        if where in ("cpu", "disk"):
            for i, m in enumerate(self.masters):
                if i not in self._shared:
                    mark_host(m)
            ref = weakref.ref(self)  # the hooks must not keep an abandoned optimizer alive
            for i, p in enumerate(params):
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref, i)))

    # ---------------------------------------------------------------- gradients leave the device
    def _take_grad(self, i: int, p: torch.Tensor) -> None:
        if p.grad is None or self._closed:  # another hook took it already
            return
        g = p.grad.detach()
        if self.where == "disk":
            # Gather the chunk's gradients in one host staging buffer; a chunk whose gradients are
            # all in goes to its file in one write on the spill thread while backward continues.
            k = self._chunk_index[i]
            c = self.chunks[k]
            stage = self._staging.get(k)
            if stage is None:
                stage = self._staging[k] = (self._acquire(c.grad_nbytes), set())
            slot = self._grad_slot(stage[0], c, i)
            # a chunk left partly filled by an earlier micro-batch may already hold this gradient
            slot.add_(g) if i in stage[1] else slot.copy_(g)
            p.grad = None  # the device gradient is ephemeral
            self._check(i, slot)
            stage[1].add(i)
            if len(stage[1]) == len(c.idx):
                del self._staging[k]
                self._pending.append(self._pool.submit(self._spill_grads, k, *stage))
                self._chunk_complete(k)
            return
        # cpu: no copy when the gradient already is a CPU tensor of the master dtype: it is handed over.
        if g.device.type != "cpu" or g.dtype != self.master_dtype:
            g = _host_empty(g.numel(), self.master_dtype, self.params[0]).view(g.shape).copy_(g)
        p.grad = None  # the device gradient is ephemeral
        mark_host(g)
        self._check(i, g)
        acc = self._host_grads.get(i)
        if acc is None:
            self._host_grads[i] = g
        else:
            acc.add_(g)
        if self._early:
            k = self._chunk_index[i]
            arrived = self._arrived.setdefault(k, set())
            arrived.add(i)
            if len(arrived) == len(self.chunks[k].idx):
                self._chunk_complete(k)

    def _check(self, i: int, g: torch.Tensor) -> None:
        if self.check_finite and not all_finite(g):
            self.found_inf = True
            self.bad_grads.add(i)

    def _grad_slot(self, buf: torch.Tensor, c: _Chunk, i: int) -> torch.Tensor:
        off = c.grad_offsets[i]
        n = self.params[i].numel() * self._itemsize
        return buf[off:off + n].view(self.master_dtype).view(self.params[i].shape)

    # Host staging buffers are reused: a fresh buffer's pages fault in on first touch, which costs
    # as much as the copy itself; a few chunk-sized buffers are kept (taken and given back from the
    # training thread and the spill thread, hence the lock).
    _POOL_SIZE = 4

    def _acquire(self, n: int) -> torch.Tensor:
        with self._pool_lock:
            fits = [j for j, b in enumerate(self._free) if b.numel() >= n]
            if fits:
                best = self._free.pop(min(fits, key=lambda j: self._free[j].numel()))
                return best[:n]
        return _host_empty(n, torch.uint8, self.params[0])

    def _release(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        with self._pool_lock:
            if any(b is base for b in self._free):
                return
            self._free.append(base)
            if len(self._free) > self._POOL_SIZE:  # drop the smallest (tensors compare by value: use indices)
                self._free.pop(min(range(len(self._free)), key=lambda j: self._free[j].numel()))

    def _grad_fd(self, k: int) -> int:
        fd = self._grad_fds.get(k)
        if fd is None:
            path = os.path.join(self.folder, f"grad_{k}.bin")
            fd = self._grad_fds[k] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def _spill_grads(self, k: int, buf: torch.Tensor, fresh: set[int]) -> None:
        """Write chunk k's staged gradients (params `fresh`) to its file in one write; over
        micro-batches, first read what earlier ones wrote and add it (or keep it, for params that
        got no gradient this time)."""
        c = self.chunks[k]
        fd = self._grad_fd(k)
        earlier = [i for i in c.idx if i in self._grad_written]
        if earlier:
            prev = self._acquire(c.grad_nbytes)
            t0 = time.perf_counter()
            n = _read_at(fd, prev, 0)
            self.io.add(read=n, read_s=time.perf_counter() - t0)
            for i in earlier:
                slot, old = self._grad_slot(buf, c, i), self._grad_slot(prev, c, i)
                slot.add_(old) if i in fresh else slot.copy_(old)
            self._release(prev)
        t0 = time.perf_counter()
        n = _write_at(fd, buf, 0)
        self.io.add(written=n, write_s=time.perf_counter() - t0)
        self._grad_written.update(fresh)
        self._release(buf)

    def _drain(self) -> None:
        """Flush partly filled chunks (parameters without a gradient) and wait for every spill write."""
        for k, stage in list(self._staging.items()):
            del self._staging[k]
            self._pending.append(self._pool.submit(self._spill_grads, k, *stage))
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()  # re-raises a failed write here, in the training thread

    # ---------------------------------------------------------------- disk layout of a chunk
    def _pack(self, c: _Chunk) -> torch.Tensor:
        buf = _host_empty(c.nbytes, torch.uint8, self.params[0])
        for i, key, dtype, shape, off in c.layout:
            src = self.masters[i] if key == "" else c.optimizer.state[self.masters[i]][key]
            n = src.numel() * src.element_size()
            buf[off:off + n].view(dtype).view(shape).copy_(src.detach())
        return buf

    def _save_chunk(self, k: int, buf: torch.Tensor) -> None:
        path = os.path.join(self.folder, f"state_{k}.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            t0 = time.perf_counter()
            n = _write_at(fd, buf, 0)
            self.io.add(written=n, write_s=time.perf_counter() - t0)
        finally:
            os.close(fd)

    def _load_chunk(self, k: int) -> torch.Tensor:
        c = self.chunks[k]
        buf = self._acquire(c.nbytes)
        fd = os.open(os.path.join(self.folder, f"state_{k}.bin"), os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            n = _read_at(fd, buf, 0)
            self.io.add(read=n, read_s=time.perf_counter() - t0)
        finally:
            os.close(fd)
        return buf

    def _attach(self, c: _Chunk, buf: torch.Tensor) -> None:
        """Point masters and optimizer state of chunk c at views of its loaded buffer."""
        for i in c.idx:
            c.optimizer.state[self.masters[i]] = dict(c.small.get(i, {}))
        for i, key, dtype, shape, off in c.layout:
            n = shape.numel() * torch.empty((), dtype=dtype).element_size()
            view = buf[off:off + n].view(dtype).view(shape)
            if key == "":
                self.masters[i].data = view
            else:
                c.optimizer.state[self.masters[i]][key] = view

    def _detach(self, c: _Chunk, buf: torch.Tensor) -> torch.Tensor:
        """After an update: fold state back into the chunk's buffer (growing the layout when the
        optimizer created new state), drop it from RAM, and return the buffer to write."""
        known = {(i, key) for i, key, *_ in c.layout}
        grew = False
        for i in c.idx:
            m = self.masters[i]
            for key, v in c.optimizer.state[m].items():
                big = torch.is_tensor(v) and v.numel() > 1
                if big and (i, key) not in known:
                    c.layout.append((i, key, v.dtype, v.shape, c.nbytes))
                    c.nbytes += v.numel() * v.element_size()
                    grew = True
                elif not big:
                    c.small.setdefault(i, {})[key] = v
        out = self._pack(c) if grew else buf
        if not grew:  # state updated in place lands in buf already; copy what an optimizer replaced
            for i, key, dtype, shape, off in c.layout:
                src = self.masters[i] if key == "" else c.optimizer.state[self.masters[i]][key]
                dst = buf[off:off + shape.numel() * src.element_size()].view(dtype).view(shape)
                if is_fake(src) or src.data_ptr() != dst.data_ptr():
                    dst.copy_(src.detach())
        for i in c.idx:
            c.optimizer.state.pop(self.masters[i], None)
            self.masters[i].data = torch.empty(0, dtype=self.master_dtype)
        return out

    # ---------------------------------------------------------------- the step
    def grads_finite(self) -> tuple[bool, list[int]]:
        """(all gradients finite, indices of parameters whose gradient is not)."""
        if self.where == "device":
            bad = [i for i, p in enumerate(self.params) if p.grad is not None and not all_finite(p.grad)]
            return not bad, bad
        self._drain()
        return not self.found_inf, sorted(self.bad_grads)

    def _grad(self, i: int, grad_buf: torch.Tensor | None, c: _Chunk) -> torch.Tensor | None:
        if self.where == "device":
            return self.params[i].grad
        if self.where == "cpu":
            return self._host_grads.get(i)
        if i not in self._grad_written:
            return None
        return self._grad_slot(grad_buf, c, i)

    def _load_grads(self, k: int) -> torch.Tensor | None:
        c = self.chunks[k]
        if not any(i in self._grad_written for i in c.idx):
            return None
        buf = self._acquire(c.grad_nbytes)
        t0 = time.perf_counter()
        n = _read_at(self._grad_fd(k), buf, 0)
        self.io.add(read=n, read_s=time.perf_counter() - t0)
        return buf

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of all gradients, computed as torch.nn.utils.clip_grad_norm_ does (per tensor, then
        the norm of the norms) so that clipping stays bit-identical to an in-memory fp32 run."""
        self._drain()
        norms = []
        for k, c in enumerate(self.chunks):
            gbuf = self._load_grads(k) if self.where == "disk" else None
            for i in c.idx:
                g = self._grad(i, gbuf, c)
                if g is not None:
                    kw = {} if g.dtype == torch.float32 else {"dtype": torch.float32}
                    norms.append(torch.linalg.vector_norm(g, 2.0, **kw).to(self.masters[i].device))
            if gbuf is not None:
                self._release(gbuf)
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

    def _update_chunk(self, k: int, grad_scale: float | torch.Tensor | None) -> None:
        c = self.chunks[k]
        gbuf = self._load_grads(k) if self.where == "disk" else None
        state = self._load_chunk(k) if self.where == "disk" else None
        if state is not None:
            self._attach(c, state)
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
        if have:
            if self.where == "device":
                c.optimizer.step()
            else:
                # The update runs on host memory: its new state and temporaries are host
                # copies to memory trackers (on CPU training they would look like device bytes).
                with host_allocations():
                    c.optimizer.step()
        for i in have:
            m = self.masters[i]
            m.grad = None
            if i not in self._shared:
                self.params[i].data.copy_(m.detach())
            if self.where == "device":
                self.params[i].grad = None
            else:
                self._host_grads.pop(i, None)
        if state is not None:
            out = self._detach(c, state)
            self._save_chunk(k, out)
            self._release(out)
            if out is not state:
                self._release(state)
        if gbuf is not None:
            self._release(gbuf)

    # ---------------------------------------------------------------- updates overlapped with backward
    def begin_backward(self, final: bool) -> None:
        """Called before each backward. With final=True (the last micro-batch before step(), and
        no clipping or loss scaling, which need every gradient first) a chunk whose gradients are
        all in is updated on the worker thread while backward goes on: a leaf's gradient is final
        once its accumulation hook ran, and every op that read the parameter has run by then."""
        self._early = final and self.where in ("cpu", "disk")
        self._arrived = {}
        if self._early and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="memfit-offload")

    def end_backward(self) -> None:
        self._early = False

    def _chunk_complete(self, k: int) -> None:
        if self._early and k not in self._updated:
            self._updated.add(k)
            self.early_updates += 1
            self._pending.append(self._pool.submit(self._update_chunk, k, None))

    def discard_grads(self) -> None:
        """Drop this step's gradients wherever they are (skipped steps, zero_grad)."""
        self._drain()
        for p in self.params:
            p.grad = None
        self._host_grads.clear()
        self._grad_written.clear()
        self.found_inf = False
        self.bad_grads.clear()
        if self.keep_grad_files:
            return
        for k, fd in list(self._grad_fds.items()):
            os.close(fd)
            os.unlink(os.path.join(self.folder, f"grad_{k}.bin"))
        self._grad_fds.clear()

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
                    out.append(m.data)
                for v in c.optimizer.state.get(m, {}).values():
                    if torch.is_tensor(v):
                        out.append(v)
                for v in c.small.get(i, {}).values():
                    if torch.is_tensor(v):
                        out.append(v)
        return out

    def state_dict(self) -> dict:
        """Masters and every chunk's optimizer state, materialised in CPU memory (plain containers)."""
        masters, chunks = [], []
        for k, c in enumerate(self.chunks):
            state = self._load_chunk(k) if self.where == "disk" else None
            if state is not None:
                self._attach(c, state)
            masters.extend(self.masters[i].detach().to("cpu", copy=True) for i in c.idx)
            sd = c.optimizer.state_dict()
            sd["state"] = {n: {key: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for key, v in s.items()}
                           for n, s in sd["state"].items()}
            chunks.append(sd)
            if state is not None:
                self._release(self._detach(c, state))
        return {"masters": masters, "chunks": chunks, "chunk_sizes": [len(c.idx) for c in self.chunks]}

    def load_state_dict(self, state: dict) -> None:
        sizes = [len(c.idx) for c in self.chunks]
        if list(state["chunk_sizes"]) != sizes or len(state["masters"]) != len(self.params):
            raise ConfigError(
                "optimizer checkpoint was written for a different model or chunking "
                f"(chunks of {list(state['chunk_sizes'])} parameters, here {sizes})"
            )
        for k, c in enumerate(self.chunks):
            if self.where == "disk":
                for i in c.idx:
                    self.masters[i].data = torch.empty(self.params[i].shape, dtype=self.master_dtype)
            for i in c.idx:
                self.masters[i].data.copy_(state["masters"][i])
                self.params[i].data.copy_(self.masters[i].detach())
            c.optimizer.load_state_dict(state["chunks"][k])
            if self.where == "disk":
                c.layout = [(i, "", self.master_dtype, self.masters[i].shape, c.grad_offsets[i]) for i in c.idx]
                c.nbytes = c.grad_nbytes
                c.small = {}
                self._save_chunk(k, self._detach(c, self._pack(c)))
        if self.where in ("cpu",):
            for t in self.state_tensors():
                mark_host(t)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        try:
            self._staging.clear()  # gradients of an unfinished step are not worth writing
            self._drain()
        finally:
            for fd in self._grad_fds.values():
                os.close(fd)
            self._grad_fds.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self.where == "disk":
                self._finalizer()  # removes the spill folder
