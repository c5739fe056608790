"""Saved-tensor hooks that keep what autograd saves for backward off the device.

`ActivationStore.hooks(group, offload, compress)` returns a `saved_tensors_hooks` context: inside it,
every tensor autograd saves is (optionally) compressed, then (optionally) moved

- to CPU memory: on CUDA into pinned buffers on a side stream, so the copy overlaps compute; in
  backward, the first unpack of block g starts copying block g-1 back (prefetch), again on the side
  stream. Where pinning is unavailable (CPU-only builds raise on `pin_memory`) pageable memory is
  used. On a CPU device the "host" copy is an ordinary tensor marked host-resident for the tracker,
  which is exactly the accounting a GPU run would see.
- to a spill folder on disk: writes run on background threads while forward continues; in backward
  the first unpack of block g starts reading block g-1 (read-ahead). Files live in a private
  (0700) per-process folder, are created 0600, deleted when read, when their tensor is no longer
  needed (also after an exception), and the folder is removed on close and at exit.

Parameters, their autocast copies, buffers and other leaf tensors that require grad are never moved:
they stay alive anyway, so a copy would only cost time and memory. Under FakeTensorMode (memfit's
no-allocation trace) nothing is copied or written: host copies are fake tensors marked host-resident.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from memfit.apply import compress as codecs
from memfit.core.errors import ConfigError, MemfitError
from memfit.core.tracker import mark_host

MIN_FREE_BYTES = 256 * 2**20
"""A spill folder with less free space than this is refused up front."""
MIN_OFFLOAD_BYTES = 1024
"""Smaller saved tensors stay where they are: moving them costs more than it saves."""


class SpillError(MemfitError):
    """Writing or reading a spill file failed (for example: the disk filled up during a step)."""


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def validate_spill_dir(path: str | os.PathLike | None, need_bytes: int = 0) -> Path:
    """Check a spill folder before training: it must exist, be a writable folder and have free space."""
    p = Path(path if path is not None else tempfile.gettempdir()).expanduser()
    if not p.exists():
        raise ConfigError(f"spill folder {str(p)!r} does not exist; create it or pass another spill_dir")
    if not p.is_dir():
        raise ConfigError(f"spill folder {str(p)!r} is not a directory; pass a folder (for example on local NVMe)")
    try:
        probe = tempfile.mkdtemp(prefix=".memfit-probe-", dir=p)
        with open(os.path.join(probe, "w"), "wb") as f:
            f.write(b"\0" * 4096)
        shutil.rmtree(probe, ignore_errors=True)
    except OSError as exc:
        raise ConfigError(f"spill folder {str(p)!r} is not writable ({exc.strerror}); pass a writable spill_dir") from None
    free = shutil.disk_usage(p).free
    need = max(MIN_FREE_BYTES, need_bytes)
    if free < need:
        raise ConfigError(
            f"spill folder {str(p)!r} has only {free / 2**20:.0f} MiB free; need at least {need / 2**20:.0f} MiB"
        )
    return p


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

    def __init__(self, root: Path, stats: OffloadStats, threads: int = 2) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"memfit-spill-{os.getpid()}-", dir=root))  # mode 0700
        self.stats = stats
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="memfit-spill")
        self.error: str | None = None
        """The first write failure; a message, not an exception object, so no traceback keeps tensors alive."""
        self._n = 0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, DiskSpill._cleanup, self.pool, str(self.dir))

    @staticmethod
    def _cleanup(pool: ThreadPoolExecutor, folder: str) -> None:
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        self._finalizer()

    def new_path(self) -> str:
        with self._lock:
            self._n += 1
            return str(self.dir / f"{self._n:08d}.bin")

    def write(self, path: str, t: torch.Tensor, ready: Any) -> None:
        if ready is not None:
            ready.synchronize()  # the device-to-host copy into `t` has finished
        data = memoryview(codecs.flat_bytes(t).numpy())
        t0 = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb", buffering=0) as f:
                while data:
                    data = data[f.write(data):]
        except OSError as exc:
            _remove(path)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self.error = (
                f"spill folder {str(self.dir.parent)!r} is full; free space or pass another spill_dir" if full
                else f"writing spill file {path!r} failed: {exc.strerror}"
            )
            raise SpillError(self.error) from None
        with self._lock:
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.spilled_bytes += t.numel() * t.element_size()
            self.stats.files += 1

    def read(self, path: str, meta: tuple, buf: torch.Tensor) -> torch.Tensor:
        shape, stride, dtype = meta
        nbytes = buf.numel()
        t0 = time.perf_counter()
        try:
            with open(path, "rb", buffering=0) as f:
                view, got = memoryview(buf.numpy()), 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise SpillError(f"spill file {path!r} is truncated")
                    got += n
        except OSError as exc:
            raise SpillError(f"reading spill file {path!r} failed: {exc.strerror}") from None
        finally:
            _remove(path)
        with self._lock:
            self.stats.read_seconds += time.perf_counter() - t0
            self.stats.read_bytes += nbytes
        return buf.view(dtype).as_strided(shape, stride)


def _discard(write: Future, path: str) -> None:
    """Drop a spill file that will never be read, also if its write is still queued or running."""
    if not write.cancel():
        write.add_done_callback(lambda _: _remove(path))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _HostCopy:
    """One tensor copied to CPU memory (pinned, on a side stream, when it comes from CUDA)."""

    def __init__(self, store: "ActivationStore", t: torch.Tensor) -> None:
        self.store, self.device = store, t.device
        self.prefetched: tuple[torch.Tensor, Any] | None = None
        self.ready = None
        if _is_fake(t):
            self.host = torch.empty_like(t, device="cpu")
        elif t.is_cuda:
            self.host = store.host_empty_like(t)
            stream = store.side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully computed
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
            t.record_stream(stream)  # the allocator must not reuse t's memory before the copy ran
        else:
            self.host = torch.empty_like(t).copy_(t)
        store.mark_host(self.host)
        store.stats.host_bytes += t.numel() * t.element_size()

    def prefetch(self) -> None:
        if self.ready is None or self.prefetched is not None:
            return
        stream = self.store.side_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.ready)
            dev = self.host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.prefetched = (dev, done)

    def get(self) -> torch.Tensor:
        if self.prefetched is not None:
            dev, done = self.prefetched
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            dev.record_stream(current)
            return dev
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            return self.host.to(self.device, non_blocking=True)
        # CPU device (or fake): a fresh device tensor, so device accounting in backward is honest.
        return self.host.to(self.device, copy=True)


class _DiskCopy:
    """One tensor written to a spill file by a background thread, read back (ahead) in backward."""

    def __init__(self, store: "ActivationStore", t: torch.Tensor) -> None:
        self.store, self.device = store, t.device
        self.read_future: Future | None = None
        self.consumed = False
        if _is_fake(t):  # tracing: no I/O and nothing held; the bytes are simply off the device
            self.fake, self.meta = True, (t.shape, t.stride(), t.dtype)
            return
        self.fake = False
        spill = store.disk()
        if spill.error is not None:
            raise SpillError(spill.error)
        ready = None
        if t.is_cuda:
            src = store.host_empty_like(t)
            stream = store.side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                src.copy_(t, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            t.record_stream(stream)
        else:
            src = codecs.dense(t.detach())
        self.meta = (src.shape, src.stride(), src.dtype)
        self.path = spill.new_path()
        self.write_future = spill.pool.submit(spill.write, self.path, src, ready)
        # Removes the file if this saved tensor is dropped without being unpacked (exception, no backward).
        self._finalizer = weakref.finalize(self, _discard, self.write_future, self.path)

    def prefetch(self) -> None:
        if self.consumed:
            return
        if self.fake and self.read_future is None:  # tracing: model the read-ahead buffer, no I/O
            shape, stride, dtype = self.meta
            done: Future = Future()
            done.set_result(torch.empty_strided(shape, stride, dtype=dtype, device=self.device))
            self.read_future = done
        elif self.read_future is None:
            spill = self.store.disk()
            shape, _, dtype = self.meta
            # Allocated here, on the training thread, so memory trackers see the read-ahead buffer.
            pin = self.device.type == "cuda" and self.store.can_pin()
            buf = torch.empty(shape.numel() * dtype.itemsize, dtype=torch.uint8, pin_memory=pin)
            self.read_future = spill.pool.submit(self._read, spill, buf)

    def _read(self, spill: DiskSpill, buf: torch.Tensor) -> torch.Tensor:
        self.write_future.result()
        return spill.read(self.path, self.meta, buf)

    def get(self) -> torch.Tensor:
        if self.consumed:
            raise SpillError("a spilled activation was unpacked twice (backward with retain_graph=True); "
                             "use offload:cpu for graphs that are backpropagated more than once")
        self.prefetch()
        self.consumed = True
        t, self.read_future = self.read_future.result(), None
        if self.fake:
            return t
        self._finalizer.detach()
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t


class _Offloaded:
    """One tensor's (compressed) parts, each possibly moved off the device."""

    __slots__ = ("parts", "packed", "group", "_cached", "__weakref__")

    def __init__(self, parts: list, packed: codecs.Packed | None, group: int) -> None:
        self.parts, self.packed, self.group = parts, packed, group
        self._cached: torch.Tensor | None = None

    @property
    def moved(self) -> bool:
        return any(not isinstance(p, torch.Tensor) for p in self.parts)

    def get_cached(self) -> torch.Tensor:
        """Restored once, shared by every saved view of it (freed with the last view)."""
        if self._cached is None:
            self._cached = self.get()
        return self._cached

    def prefetch(self) -> None:
        for p in self.parts:
            if not isinstance(p, torch.Tensor):
                p.prefetch()

    def get(self) -> torch.Tensor:
        tensors = [p if isinstance(p, torch.Tensor) else p.get() for p in self.parts]
        if self.packed is None:
            return tensors[0]
        p = self.packed
        return codecs.decode(codecs.Packed(p.codec, tensors, p.shape, p.stride, p.dtype))


class _View:
    """What a pack hook returns: a view of a whole storage that was packed once.

    Autograd often saves several views of one storage (an attention output and the same bytes
    reshaped as the next matmul's input); packing the storage once avoids compressing, copying or
    writing the same bytes twice, and restores each view with its exact original strides.
    """

    __slots__ = ("base", "shape", "stride", "offset", "__weakref__")

    def __init__(self, base: _Offloaded, t: torch.Tensor) -> None:
        self.base, self.shape, self.stride, self.offset = base, t.shape, t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        return self.base.get_cached().as_strided(self.shape, self.stride, self.offset)


def _whole_storage(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view over t's entire storage when t's elements are exactly the storage's, else None."""
    try:
        n = t.untyped_storage().nbytes() // t.element_size()
    except (RuntimeError, NotImplementedError):
        return None
    if t.numel() != n or not codecs.is_dense(t):
        return None
    return t.detach().as_strided((n,), (1,), 0)


class _Hooks:
    """saved_tensors_hooks that also forget the storages seen while they were active."""

    def __init__(self, store: "ActivationStore", group: int, offload: str | None, compress: str | None) -> None:
        self.store = store
        self.inner = torch.autograd.graph.saved_tensors_hooks(
            lambda t: store.pack(t, group, offload, compress), store.unpack
        )

    def __enter__(self) -> "_Hooks":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.store._seen.clear()


class ActivationStore:
    """Pack/unpack for saved tensors of one model: compression, CPU offload, disk spill, prefetch."""

    def __init__(self, model: nn.Module | None = None, spill_dir: str | os.PathLike | None = None,
                 min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.stats = OffloadStats()
        self.min_bytes = min_bytes
        self.spill_root = Path(spill_dir) if spill_dir is not None else None
        self._spill: DiskSpill | None = None
        self._streams: dict[torch.device, Any] = {}
        self._pin_ok: bool | None = None
        self._groups: dict[int, list[weakref.ref]] = {}
        self._prefetched_for: int | None = None
        self._seen: dict[int, tuple[_Offloaded, Any]] = {}  # storage -> its packed form, within one block
        # Model-owned tensors stay put: they are alive regardless of what we do with a saved copy.
        self._owned = weakref.WeakValueDictionary()
        if model is not None:
            for t in list(model.parameters()) + list(model.buffers()):
                self._owned[id(t)] = t
        self.mark_host = mark_host  # the tracker excludes host copies from device bytes

    # ---- resources -------------------------------------------------------------------------
    def disk(self) -> DiskSpill:
        if self._spill is None:
            root = validate_spill_dir(self.spill_root)
            self._spill = DiskSpill(root, self.stats)
        return self._spill

    @property
    def spill_folder(self) -> Path | None:
        """The private folder holding this store's spill files (None before the first spill)."""
        return self._spill.dir if self._spill is not None else None

    def side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def can_pin(self) -> bool:
        if self._pin_ok is None:
            try:
                torch.empty(1, pin_memory=True)
                self._pin_ok = True
            except RuntimeError:  # CPU-only builds, or no driver: pageable memory still works, just slower
                self._pin_ok = False
                warnings.warn("pinned memory is unavailable; activation offload uses pageable host memory")
            self.stats.pinned = self._pin_ok
        return self._pin_ok

    def host_empty_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="cpu", pin_memory=self.can_pin())

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    # ---- hooks -----------------------------------------------------------------------------
    def _stays(self, t: torch.Tensor) -> bool:
        base = t
        while base._base is not None:
            base = base._base
        if isinstance(base, nn.Parameter) or id(base) in self._owned or (base.is_leaf and base.requires_grad):
            return True
        fn = base.grad_fn  # autocast's cached low-precision copy of a parameter
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            nxt = fn.next_functions[0][0] if fn.next_functions else None
            return nxt is not None and type(nxt).__name__ == "AccumulateGrad"
        return False

    def pack(self, t: torch.Tensor, group: int, offload: str | None, compress: str | None) -> Any:
        if self._stays(t) or t.numel() * t.element_size() < self.min_bytes:
            return t
        # int8-channel needs the tensor's own last dimension, so it packs each saved tensor as is.
        whole = _whole_storage(t) if compress != "int8-channel" else None
        if whole is None:
            return self._pack_one(t, group, offload, compress)
        st = t.untyped_storage()
        hit = self._seen.get(st._cdata)
        if hit is not None and not hit[1].expired():
            return _View(hit[0], t)
        base = self._pack_one(whole, group, offload, compress)
        if isinstance(base, torch.Tensor):
            return t
        try:
            from torch.multiprocessing.reductions import StorageWeakRef

            # A weak reference: a freed storage whose address is reused must not match.
            self._seen[st._cdata] = (base, StorageWeakRef(st))
        except (RuntimeError, AttributeError, NotImplementedError):
            pass
        return _View(base, t)

    def _pack_one(self, t: torch.Tensor, group: int, offload: str | None, compress: str | None) -> Any:
        packed = None
        parts: list = [t]
        if compress and codecs.compressible(t, compress):
            enc = codecs.encode(t.detach(), compress)
            if isinstance(enc, codecs.Packed):
                packed, parts = enc, list(enc.tensors)
        if offload == "cpu":
            parts = [_HostCopy(self, p) for p in parts]
        elif offload == "disk":
            parts = [_DiskCopy(self, p) for p in parts]
        elif packed is None:
            return t
        h = _Offloaded(parts, packed, group)
        if offload:
            self._groups.setdefault(group, []).append(weakref.ref(h))
        return h

    def unpack(self, h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        root = h.base if isinstance(h, _View) else h
        if root.group != self._prefetched_for and root.moved:
            self._prefetched_for = root.group
            self._prefetch_before(root.group)
        return h.get()

    def _prefetch_before(self, group: int) -> None:
        """Backward runs blocks in reverse: start bringing back the closest earlier group."""
        for g in sorted((g for g in self._groups if g < group), reverse=True):
            live = [r() for r in self._groups[g]]
            live = [h for h in live if h is not None]
            self._groups[g] = [weakref.ref(h) for h in live]
            if live:
                for h in live:
                    h.prefetch()
                return
            del self._groups[g]

    def hooks(self, group: int, offload: str | None, compress: str | None) -> _Hooks:
        """The saved-tensor hooks context for one block (group = block index, for prefetch order)."""
        if compress:
            codecs.check_codec(compress)
        if offload == "disk":
            self.disk()  # validates the folder now, not in the middle of a step
        return _Hooks(self, group, offload, compress)
