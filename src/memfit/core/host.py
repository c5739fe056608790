"""Host marks: how offload mechanisms tell the memory tracker that a storage is not device memory.

On a CPU device, an offloaded "host" copy is an ordinary CPU tensor, indistinguishable from device
memory by its device. Mechanisms therefore declare their host copies:

* `mark_host(t)` flags an existing tensor's storage as a host copy;
* `host_allocations()` flags every storage born inside it on this thread (an optimizer step that
  runs on host memory: its new state and temporaries);
* `host_empty(n, dtype, like)` makes a host staging buffer, flagged from birth. It is made with
  `like.new_empty` so that under FakeTensorMode (memory prediction) it is a fake tensor too, on
  whichever thread asks for it.

The flags are global (weak, per storage), so a tracker that meets a flagged storage later still
counts it as host. All of this is a no-op cost when no tracker is active.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch

# Trackers currently entered (innermost last); they register themselves on __enter__.
ACTIVE: list[Any] = []

# Storages flagged as host copies, for trackers that meet them after the flag was set.
_HOST_MARKED: "weakref.WeakValueDictionary[int, torch.UntypedStorage]" = weakref.WeakValueDictionary()
_local = threading.local()


def storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """t's untyped storage, or None for sparse and other storage-less tensors. A DTensor's is its
    local shard's: what this rank holds (tensor parallelism)."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def wraps_tensors(t: torch.Tensor) -> bool:
    """A traceable wrapper subclass (e.g. torchao's NF4Tensor) whose memory is its inner tensors'.
    DTensor is left to `storage()` (its local shard)."""
    return hasattr(type(t), "__tensor_flatten__") and not hasattr(t, "_local_tensor")


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass holds (`__tensor_flatten__`'s attributes)."""
    names, _ = t.__tensor_flatten__()
    return [x for x in (getattr(t, n) for n in names) if isinstance(x, torch.Tensor)]


def is_marked_host(st: torch.UntypedStorage) -> bool:
    return _HOST_MARKED.get(id(st)) is st


def flag_host(st: torch.UntypedStorage) -> None:
    # No lock of our own: a single dict store is atomic under the GIL, and a lock held here while
    # garbage collection runs a tracker's free callback could deadlock against the tracker's lock.
    _HOST_MARKED[id(st)] = st


def in_host_region() -> bool:
    """True inside `host_allocations()` on this thread."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Storages created inside this block, on this thread, are host copies to every tracker."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def mark_host(t: torch.Tensor) -> None:
    """Declare `t` an offloaded host copy: counted in host_peak_bytes, never in device figures.

    Offload mechanisms call this on the copies they make; it is a no-op when no tracker is active.
    Safe to call from any thread.
    """
    if not ACTIVE:
        return
    st = storage(t)
    if st is None:
        return
    flag_host(st)
    for tracker in list(ACTIVE):
        tracker._mark_host(t)


def host_empty(n: int, dtype: torch.dtype = torch.uint8, like: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised host buffer of n elements, a host copy for the tracker from birth.

    `like`: a tensor of the run (a parameter); the buffer is made with `like.new_empty`, so it is a
    fake tensor when `like` is one, even on a worker thread where no fake mode is active."""
    with host_allocations():
        if like is not None:
            t = like.new_empty((n,), dtype=dtype, device="cpu")
        else:
            t = torch.empty((n,), dtype=dtype, device="cpu")
    mark_host(t)  # trackers on other threads did not see it being born
    return t
