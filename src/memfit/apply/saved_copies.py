"""One saved tensor moved off the device: to CPU memory (`HostCopy`) or to a spill file (`DiskCopy`),
possibly compressed first (`Offloaded` holds the parts), and views of one packed storage (`View`).

Under FakeTensorMode (memfit's no-allocation trace) nothing is copied or written: host copies are
fake tensors marked host-resident, and a disk copy only models its read-ahead buffer.
`store` is the memfit.apply.offload.ActivationStore packing the tensor (its streams, pinned-memory
check, spill threads and stats); typed Any because that module imports this one.
"""
from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import Any

import torch

from memfit.apply import compress as codecs
from memfit.apply.disk_spill import DiskSpill, SpillError, discard


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def to_pinned(store: Any, t: torch.Tensor) -> tuple[torch.Tensor, tuple, Any]:
    """t's elements, copied on the side stream as one flat range into pinned memory: (the flat
    host tensor, the dense layout (shape, stride) they came in, the copy's event).

    A copy into a host tensor with t's own permuted strides, or from a view with gaps, makes torch
    stage it through a pageable temporary: synchronous and several times slower (seen on an H100:
    48 of 240 saved tensors per step, 75% of the copy time). So a view with gaps is made dense on
    the device first (the layout empty_like gives it), and its memory range is copied as is."""
    src = codecs.dense(t.detach())
    flat = src.as_strided((src.numel(),), (1,), src.storage_offset())
    host = torch.empty(flat.shape, dtype=t.dtype, device="cpu", pin_memory=store.can_pin())
    stream = store.side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully computed
    with torch.cuda.stream(stream):
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    src.record_stream(stream)  # the allocator must not reuse its memory before the copy ran
    return host, (src.shape, src.stride()), ready


def to_device(host: torch.Tensor, layout: tuple, device: torch.device) -> torch.Tensor:
    """A flat host range back on the device, in its dense layout (backward runs the same kernels)."""
    shape, stride = layout
    flat = host.as_strided((host.numel(),), (1,), host.storage_offset())
    return flat.to(device, non_blocking=True).as_strided(shape, stride, 0)


class HostCopy:
    """One tensor copied to CPU memory (pinned, on a side stream, when it comes from CUDA)."""

    def __init__(self, store: Any, t: torch.Tensor) -> None:
        self.store, self.device = store, t.device
        self.prefetched: tuple[torch.Tensor, Any] | None = None
        self.ready = None
        if is_fake(t):
            self.host = torch.empty_like(t, device="cpu")
        elif t.is_cuda:
            self.host, self.layout, self.ready = to_pinned(store, t)
        else:
            self.host = torch.empty_like(t).copy_(t)
        store.mark_host(self.host)
        store.stats.host_bytes += t.numel() * t.element_size()

    def prefetch(self) -> None:
        if self.ready is None or self.prefetched is not None:
            return
        stream = self.store.side_stream(self.device, "in")
        with torch.cuda.stream(stream):
            stream.wait_event(self.ready)
            dev = to_device(self.host, self.layout, self.device)
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
            return to_device(self.host, self.layout, self.device)
        # CPU device (or fake): a fresh device tensor, so device accounting in backward is honest.
        return self.host.to(self.device, copy=True)


class DiskCopy:
    """One tensor written to a spill file by a background thread, read back (ahead) in backward."""

    def __init__(self, store: Any, t: torch.Tensor) -> None:
        self.store, self.device = store, t.device
        self.read_future: Future | None = None
        self.consumed = False
        if is_fake(t):  # tracing: no I/O and nothing held; the bytes are simply off the device
            self.fake, self.meta = True, (t.shape, t.stride(), t.dtype)
            return
        self.fake = False
        spill = store.disk()
        if spill.error is not None:
            raise SpillError(spill.error)
        ready = None
        if t.is_cuda:
            host, (shape, stride), ready = to_pinned(store, t)
            src = host.as_strided(shape, stride, 0)
        else:
            src = codecs.dense(t.detach())
        self.meta = (src.shape, src.stride(), src.dtype)
        self.path = spill.new_path()
        self.write_future = spill.pool.submit(spill.write, self.path, [src], ready)
        del src  # the write holds the only reference now, and drops it when the bytes are in the file
        # Removes the file if this saved tensor is dropped without being unpacked (exception, no backward).
        self._finalizer = weakref.finalize(self, discard, self.write_future, self.path)

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
        return to_device(t, (t.shape, t.stride()), self.device) if self.device.type != "cpu" else t


class Offloaded:
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


class View:
    """What a pack hook returns: a view of a whole storage that was packed once.

    Autograd often saves several views of one storage (an attention output and the same bytes
    reshaped as the next matmul's input); packing the storage once avoids compressing, copying or
    writing the same bytes twice, and restores each view with its exact original strides.
    """

    __slots__ = ("base", "shape", "stride", "offset", "__weakref__")

    def __init__(self, base: Offloaded, t: torch.Tensor) -> None:
        self.base, self.shape, self.stride, self.offset = base, t.shape, t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        return self.base.get_cached().as_strided(self.shape, self.stride, self.offset)


def whole_storage(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view over t's entire storage when t's elements are exactly the storage's, else None."""
    try:
        n = t.untyped_storage().nbytes() // t.element_size()
    except (RuntimeError, NotImplementedError):
        return None
    if t.numel() != n or not codecs.is_dense(t):
        return None
    return t.detach().as_strided((n,), (1,), 0)
