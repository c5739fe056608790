"""Saved-tensor hooks that keep what autograd saves for backward off the device.

`ActivationStore.hooks(group, offload, compress)` returns a `saved_tensors_hooks` context: inside it,
every tensor autograd saves is (optionally) compressed, then (optionally) moved

- to CPU memory: on CUDA into pinned buffers on a side stream, so the copy overlaps compute; in
  backward, the first unpack of block g starts copying block g-1 back (prefetch), again on the side
  stream. Where pinning is unavailable (CPU-only builds raise on `pin_memory`) pageable memory is
  used. On a CPU device the "host" copy is an ordinary tensor marked host-resident for the tracker,
  which is exactly the accounting a GPU run would see.
- to a spill folder on disk (memfit.apply.disk_spill): writes run on background threads while
  forward continues; in backward the first unpack of block g starts reading block g-1 (read-ahead).

The copies themselves are memfit.apply.saved_copies. Parameters, their autocast copies, buffers and
other leaf tensors that require grad are never moved: they stay alive anyway, so a copy would only
cost time and memory.
"""
from __future__ import annotations

import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from memfit.apply import compress as codecs
from memfit.apply.disk_spill import DiskSpill, OffloadStats, SpillError
from memfit.apply.saved_copies import DiskCopy, HostCopy, Offloaded, View, whole_storage
from memfit.core.spill import MIN_FREE_BYTES, validate_spill_dir
from memfit.core.tracker import mark_host

__all__ = ["ActivationStore", "OffloadStats", "SpillError", "validate_spill_dir", "MIN_FREE_BYTES",
           "MIN_OFFLOAD_BYTES"]

MIN_OFFLOAD_BYTES = 1024
"""Smaller saved tensors stay where they are: moving them costs more than it saves."""


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
        self._streams: dict[tuple[torch.device, str], Any] = {}
        self._pin_ok: bool | None = None
        self._groups: dict[int, list[weakref.ref]] = {}
        self._prefetched_for: int | None = None
        self._seen: dict[int, tuple[Offloaded, Any]] = {}  # storage -> its packed form, within one block
        # Model-owned tensors stay put: they are alive regardless of what we do with a saved copy.
        self._owned = weakref.WeakValueDictionary()
        if model is not None:
            for t in list(model.parameters()) + list(model.buffers()):
                self._owned[id(t)] = t
        self.mark_host = mark_host  # the tracker excludes host copies from device bytes

    # ---- resources -------------------------------------------------------------------------
    def disk(self) -> DiskSpill:
        if self._spill is None:
            self._spill = DiskSpill(self.spill_root, self.stats)
        return self._spill

    @property
    def spill_folder(self) -> Path | None:
        """The private folder holding this store's spill files (None before the first spill)."""
        return self._spill.dir if self._spill is not None else None

    def side_stream(self, device: torch.device, direction: str = "out") -> Any:
        """The stream for copies off the device ("out") or back ("in"): two, so the GPU's copy
        engines move both directions at once (the last blocks' copies out are still running when
        backward starts bringing the first ones back)."""
        key = (device, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

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
        whole = whole_storage(t) if compress != "int8-channel" else None
        if whole is None:
            return self._pack_one(t, group, offload, compress)
        st = t.untyped_storage()
        hit = self._seen.get(st._cdata)
        if hit is not None and not hit[1].expired():
            return View(hit[0], t)
        base = self._pack_one(whole, group, offload, compress)
        if isinstance(base, torch.Tensor):
            return t
        try:
            from torch.multiprocessing.reductions import StorageWeakRef

            # A weak reference: a freed storage whose address is reused must not match.
            self._seen[st._cdata] = (base, StorageWeakRef(st))
        except (RuntimeError, AttributeError, NotImplementedError):
            pass
        return View(base, t)

    def _pack_one(self, t: torch.Tensor, group: int, offload: str | None, compress: str | None) -> Any:
        packed = None
        parts: list = [t]
        if compress and codecs.compressible(t, compress):
            enc = codecs.encode(t.detach(), compress)
            if isinstance(enc, codecs.Packed):
                packed, parts = enc, list(enc.tensors)
        if offload == "cpu":
            parts = [HostCopy(self, p) for p in parts]
        elif offload == "disk":
            parts = [DiskCopy(self, p) for p in parts]
        elif packed is None:
            return t
        h = Offloaded(parts, packed, group)
        if offload:
            self._groups.setdefault(group, []).append(weakref.ref(h))
        return h

    def unpack(self, h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        root = h.base if isinstance(h, View) else h
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
        refs = self._groups.get(group)
        if refs:  # the last block is never prefetched, so nothing else drops its previous steps' references
            self._groups[group] = [r for r in refs if r() is not None]
        return _Hooks(self, group, offload, compress)
