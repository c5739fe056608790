"""The tracker's books: live storages by category, current and peak bytes, per-module peaks.

`StorageLedger` knows nothing about how storages are discovered (that is memfit.core.tracker's
dispatch mode and hooks); it keeps the counts exact and consistent:

* each storage is one `_Entry`, counted once, in one category (lower index wins) and either as
  device bytes or as a host copy (memfit.core.host);
* a weakref callback on the storage subtracts it when it is freed;
* every mutation runs under one re-entrant lock. Offload worker threads mark host copies and free
  storages (their weakref callbacks run on that thread) while the training thread allocates, and
  a free callback may also fire on the thread that holds the lock (garbage collection inside a
  mutation), hence `RLock`.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch

from memfit.core.host import in_host_region, inner_tensors, is_marked_host, flag_host, storage, wraps_tensors

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
PARAMS, GRADS, OPTIMIZER, ACTIVATIONS, TEMPORARIES = range(5)  # lower index wins

# The CUDA caching allocator hands out blocks in multiples of 512 bytes; counting storages the
# same way makes the tracker agree with torch.cuda.memory_allocated().
_CUDA_BLOCK = 512


class _Entry:
    """One live storage: its size, category, whether it is a host copy, and where it was made."""

    __slots__ = ("nbytes", "cat", "host", "device", "phase", "mods", "ref", "__weakref__")

    def __init__(self, nbytes: int, cat: int, device: bool, phase: int, mods: tuple[str, ...]) -> None:
        self.nbytes, self.cat, self.device, self.phase, self.mods = nbytes, cat, device, phase, mods
        self.host = False
        self.ref: weakref.ref | None = None


def _free_callback(ledger_ref: "weakref.ref[StorageLedger]", key: int, _ref: weakref.ref) -> None:
    ledger = ledger_ref()
    if ledger is not None:
        ledger._on_free(key)


class StorageLedger:
    """Counts of live storages on one device. Subclasses provide `_current_mods()` and `_phase`."""

    def _init_ledger(self, device: torch.device) -> None:
        self.device = device
        self._dev_type, self._dev_index = device.type, device.index
        self._lock = threading.RLock()
        self._live: dict[int, _Entry] = {}
        self._cur = [0] * len(CATEGORIES)
        self.current_bytes = 0
        self.peak_bytes = 0
        self._peak_cats = [0] * len(CATEGORIES)
        self._at_peak = False  # the current state is the peak's (no allocation or free since)
        self._host_cur = 0
        self.host_peak_bytes = 0
        self.module_peaks: dict[str, int] = {}
        self.module_peak_categories: dict[str, list[int]] = {}
        self._fresh_mods: list[str] = []  # modules whose peak is the current state
        self._clear_busiest()
        self._phase = 0
        self._self_ref = weakref.ref(self)
        self.events: list[tuple[int, int]] | None = None
        """When a list: every device allocation as (storage key, bytes) and every free as (key, 0), in
        order; what memfit.measure.caching_allocator replays to predict the CUDA allocator's reserve."""

    def _log(self, key: int, n: int) -> None:
        """n bytes allocated, or 0: freed. An empty storage logs (key, 0) twice, which a replay ignores,
        as the allocator hands out no block for it."""
        if self.events is not None:
            self.events.append((key, n))

    def _current_mods(self) -> tuple[str, ...]:
        return ()

    @property
    def breakdown(self) -> dict[str, int]:
        """Categories at the peak moment plus "total" (they sum to peak_bytes)."""
        cats = list(self._peak_cats)
        out = dict(zip(CATEGORIES, cats))
        out["total"] = sum(cats)
        return out

    def module_breakdowns(self) -> dict[str, dict[str, int]]:
        """Per module: the categories at that module's peak moment (they sum to module_peaks[name])."""
        with self._lock:
            return {name: dict(zip(CATEGORIES, cats)) for name, cats in self.module_peak_categories.items()}

    def _clear_busiest(self) -> None:
        self.busiest_categories: list[int] | None = None
        """Categories at the moment a module ran with the most activations + temporaries (the highest
        moment once every gradient is held beside them: DDP's buckets, accumulation); None before one."""
        self.busiest_mods: tuple[str, ...] = ()
        """The modules running at that moment."""
        self._busy_bytes = -1
        self._busy_fresh = False  # the current state is that moment's (no allocation or free since)
        self._busy_prev: tuple = (-1, None, ())

    def _restart_peak(self) -> None:
        with self._lock:
            self._clear_busiest()
            self.peak_bytes = self.current_bytes
            self._peak_cats = list(self._cur)
            self._at_peak = True
            self.host_peak_bytes = self._host_cur
            self.module_peaks = {}
            self.module_peak_categories = {}
            self._fresh_mods = []

    # ------------------------------------------------------------------ storages
    def _on_device(self, t: torch.Tensor) -> bool:
        d = t.device
        return d.type == self._dev_type and (self._dev_index is None or d.index in (None, self._dev_index))

    def _register(self, t: torch.Tensor, cat: int) -> bool:
        """Count t's storage (once) in `cat` or a higher category; True if device bytes grew.

        A tensor subclass that wraps others (torchao's NF4Tensor: 4-bit codes, scales, factors) counts
        its inner tensors: its own storage is a placeholder of the outer shape's full-precision size."""
        if type(t) is not torch.Tensor and wraps_tensors(t):
            grew = False
            for inner in inner_tensors(t):
                grew |= self._register(inner, cat)
            return grew
        st = storage(t)
        if st is None:
            return False
        key = id(st)
        with self._lock:
            e = self._live.get(key)
            if e is None:
                host = is_marked_host(st)
                if not host and in_host_region():
                    flag_host(st)
                    host = True
                on_device = self._on_device(t)
                if not on_device and not host:
                    return False
                n = self._size(st, t)
                e = _Entry(n, cat, on_device, self._phase, self._current_mods())
                e.host = host
                e.ref = weakref.ref(st, functools.partial(_free_callback, self._self_ref, key))
                self._live[key] = e
                self._add(e, n)
                if e.device and not e.host:
                    self._log(key, n)
                return e.device and not e.host and n > 0
            grew = False
            n = self._size(st, t)
            if n != e.nbytes:  # resized in place (resize_, out= ops)
                if e.device and not e.host:
                    self._log(key, 0)
                    self._log(key, n)
                self._add(e, -e.nbytes)
                e.nbytes = n
                self._add(e, n)
                grew = True
            if cat < e.cat:
                self._recat(e, cat)
            return grew

    def _size(self, st: torch.UntypedStorage, t: torch.Tensor) -> int:
        n = st.nbytes()
        if self._dev_type == "cuda" and t.device.type == "cuda":
            n = -(-n // _CUDA_BLOCK) * _CUDA_BLOCK
        return n

    def _add(self, e: _Entry, n: int) -> None:
        """Caller holds the lock."""
        if e.host:
            self._host_cur += n
            if self._host_cur > self.host_peak_bytes:
                self.host_peak_bytes = self._host_cur
        elif e.device:
            self._cur[e.cat] += n
            self.current_bytes += n
            self._at_peak = False
            self._busy_fresh = False
            if self._fresh_mods:
                self._fresh_mods.clear()

    def _recat(self, e: _Entry, cat: int) -> None:
        with self._lock:
            if e.device and not e.host:
                self._cur[e.cat] -= e.nbytes
                self._cur[cat] += e.nbytes
                if self._at_peak:
                    # Nothing was allocated or freed since the peak: this is still the peak's state,
                    # now better labelled (e.g. a new gradient only becomes p.grad after its op).
                    self._peak_cats = list(self._cur)
                for name in self._fresh_mods:
                    self.module_peak_categories[name] = list(self._cur)
                if self._busy_fresh:
                    self._relabel_busiest()
            e.cat = cat

    def _relabel_busiest(self) -> None:
        """The busiest moment's state relabelled (a new gradient was counted as a temporary until it
        became p.grad): the same moment with fewer activations + temporaries, which may no longer be
        the busiest; the one before it is then."""
        at = self._cur[ACTIVATIONS] + self._cur[TEMPORARIES]
        if at >= self._busy_prev[0]:
            self._busy_bytes, self.busiest_categories = at, list(self._cur)
        else:
            self._busy_bytes, self.busiest_categories, self.busiest_mods = self._busy_prev
            self._busy_fresh = False

    def _on_free(self, key: int) -> None:
        with self._lock:
            e = self._live.pop(key, None)
            if e is not None:
                if e.device and not e.host:
                    self._log(key, 0)
                self._add(e, -e.nbytes)

    def _mark_host(self, t: torch.Tensor) -> None:
        st = storage(t)
        if st is None:
            return
        with self._lock:
            e = self._live.get(id(st))
            if e is None:
                self._register(t, TEMPORARIES)  # registers as host: the storage is already flagged
                return
            if not e.host:
                if e.device:
                    self._log(id(st), 0)
                self._add(e, -e.nbytes)
                e.host = True
                self._add(e, e.nbytes)

    def _check_peak(self) -> None:
        with self._lock:
            cur = self.current_bytes
            if cur > self.peak_bytes:
                self.peak_bytes = cur
                self._peak_cats = list(self._cur)
                self._at_peak = True
            peaks, cats = self.module_peaks, self.module_peak_categories
            mods = self._current_mods()
            if mods and self._cur[ACTIVATIONS] + self._cur[TEMPORARIES] > self._busy_bytes:
                if not self._busy_fresh:
                    self._busy_prev = (self._busy_bytes, self.busiest_categories, self.busiest_mods)
                self._busy_bytes = self._cur[ACTIVATIONS] + self._cur[TEMPORARIES]
                self.busiest_categories, self.busiest_mods, self._busy_fresh = list(self._cur), mods, True
            for name in mods:
                if cur > peaks.get(name, 0):
                    peaks[name] = cur
                    cats[name] = list(self._cur)
                    self._fresh_mods.append(name)
