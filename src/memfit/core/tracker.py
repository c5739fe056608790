"""MemoryTracker: exact accounting of the tensor storages a training step holds on one device.

    with memfit.track(model, optimizer) as t:
        loss = model(x, y)[1]; loss.backward(); optimizer.step()
    t.peak_bytes, t.breakdown, t.module_peaks

How it sees memory (see docs/design.md):

* A `TorchDispatchMode` sees every aten op's outputs as the op returns. Each *new* untyped storage
  is registered once (views and in-place ops share their input's storage) with a weakref callback
  that subtracts it when the storage is freed. Checking the peak right after each op is exact at
  the level of tensors: an op's outputs exist while its inputs are still alive.
* `saved_tensors_hooks` whose pack returns the tensor (via `detach()`, which shares the storage and
  avoids a grad_fn reference cycle) mark storages saved for backward as *activations*. Storages that
  are kept for backward without passing through these hooks (inputs of checkpointed blocks, packed
  or compressed copies made by an inner hook) are classified when backward starts: whatever this
  forward created and is still alive then is held for backward.
* Categories are exclusive, first match wins: params > grads > optimizer > activations >
  temporaries. Parameters and buffers of `model`, gradients (post-accumulate-grad hooks) and
  optimizer state (rescanned after every optimizer step) are recognised when they appear, and the
  ones that already exist at `__enter__` are counted from the start.
* It works under `FakeTensorMode`: fake storages report `nbytes()` without owning memory, so the
  same code predicts a step without allocating it (memfit.measure.trace).

Only storages on the tracked device count; host copies made by offload mechanisms are reported
separately through `mark_host()`. Kernel-internal workspaces that never surface as a tensor are
invisible here; `memfit.measure.allocator` measures them for comparison.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook as _register_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
PARAMS, GRADS, OPTIMIZER, ACTIVATIONS, TEMPORARIES = range(5)  # lower index wins

# The CUDA caching allocator hands out blocks in multiples of 512 bytes; counting storages the
# same way makes the tracker agree with torch.cuda.memory_allocated().
_CUDA_BLOCK = 512

_ACTIVE: list["MemoryTracker"] = []  # trackers currently entered (innermost last)


class _Entry:
    """One live storage: its size, category, whether it is a host copy, and where it was made."""

    __slots__ = ("nbytes", "cat", "host", "device", "phase", "mods", "ref", "__weakref__")

    def __init__(self, nbytes: int, cat: int, device: bool, phase: int, mods: tuple[str, ...]) -> None:
        self.nbytes, self.cat, self.device, self.phase, self.mods = nbytes, cat, device, phase, mods
        self.host = False
        self.ref: weakref.ref | None = None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's output: a tensor, or (nested) tuples/lists of them. Cheap on the hot path."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)


def _free_callback(tracker_ref: "weakref.ref[MemoryTracker]", key: int, _ref: weakref.ref) -> None:
    tracker = tracker_ref()
    if tracker is not None:
        tracker._on_free(key)


class MemoryTracker(TorchDispatchMode):
    """Tracks device-resident tensor storages by category, their peak, and per-module figures.

    Attributes (read after or during the tracked region):
        peak_bytes: max of tracked device bytes since enter / `reset_peak()`.
        current_bytes: tracked device bytes now.
        breakdown: categories at the peak moment plus "total" (they sum to peak_bytes).
        module_peaks: per module, the peak total bytes seen while its forward or backward ran.
            Keys are qualified names as in `model.named_modules()`; the model itself is listed
            under its class name (e.g. "GPT").
        module_activations: per module, bytes saved for backward by ops run inside it since
            enter / `reset_peak()` (each storage counted once, in the modules active when it was
            first saved; storages kept for backward outside the hooks count where they were made).
        host_peak_bytes: peak of bytes marked with `mark_host()` (not in the device figures).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: Any = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer
        if device is None:
            first = next(iter(model.parameters()), None) if model is not None else None
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self._dev_type, self._dev_index = self.device.type, self.device.index
        self._live: dict[int, _Entry] = {}
        self._cur = [0] * len(CATEGORIES)
        self.current_bytes = 0
        self.peak_bytes = 0
        self._peak_cats = [0] * len(CATEGORIES)
        self._at_peak = False  # the current state is the peak's (no allocation or free since)
        self._host_cur = 0
        self.host_peak_bytes = 0
        self.module_peaks: dict[str, int] = {}
        self.module_activations: dict[str, int] = {}
        self._phase = 0  # bumped whenever a backward pass starts or ends
        self._in_bw = False
        self._mods: tuple[str, ...] = ()  # modules running now (forward or backward), cached
        self._mods_dirty = True
        self._parents_obj: Any = None
        self._identity: set[str] = set()  # modules whose forward returned its input (no backward span)
        self._handles: list[Any] = []
        self._grad_hooked = WeakIdKeyDictionary()  # params whose grad hook is registered
        self._self_ref = weakref.ref(self)
        self._saved_hooks: Any = None
        self._mod_tracker: Any = None
        self._root_prefix = f"{type(model).__name__}." if model is not None else ""

    # ----------------------------------------------------------------- public
    @property
    def breakdown(self) -> dict[str, int]:
        out = dict(zip(CATEGORIES, self._peak_cats))
        out["total"] = sum(self._peak_cats)
        return out

    def snapshot(self) -> dict[str, int]:
        """Current bytes per category (and "total"), after rescanning params, grads and optimizer."""
        self._rescan()
        out = dict(zip(CATEGORIES, self._cur))
        out["total"] = self.current_bytes
        return out

    def reset_peak(self) -> None:
        """Start a new peak window at the current state (module peaks and host peak too)."""
        self._rescan()
        self.peak_bytes = self.current_bytes
        self._peak_cats = list(self._cur)
        self._at_peak = True
        self.host_peak_bytes = self._host_cur
        self.module_peaks = {}
        self.module_activations = {}

    # ------------------------------------------------------- enter / exit
    def __enter__(self) -> "MemoryTracker":
        from torch.distributed._tools.mod_tracker import ModTracker

        self._mod_tracker = ModTracker()
        self._mod_tracker.register_user_hooks(self._mods_changed, self._after_module_forward,
                                              self._mods_changed, self._mods_changed_post)
        self._mod_tracker.__enter__()
        self._handles.append(_register_step_post_hook(self._after_optimizer_step))
        if self.model is not None:
            self._handles.append(self.model.register_forward_pre_hook(lambda *_: self._rescan_params()))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()
        _ACTIVE.append(self)
        super().__enter__()
        self._rescan()
        self.peak_bytes = self.current_bytes
        self._peak_cats = list(self._cur)
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._mod_tracker.__exit__(*exc)

    # ---------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_bw = torch._C._current_graph_task_id() != -1
        if in_bw != self._in_bw:
            self._phase_change(in_bw)
        grew = False
        for t in _tensors(out):
            grew |= self._register(t, TEMPORARIES)
        if grew:
            self._check_peak()
        return out

    # ---------------------------------------------------------- internals
    def _on_device(self, t: torch.Tensor) -> bool:
        d = t.device
        return d.type == self._dev_type and (self._dev_index is None or d.index in (None, self._dev_index))

    def _register(self, t: torch.Tensor, cat: int) -> bool:
        """Count t's storage (once) in `cat` or a higher category; True if device bytes grew."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / storage-less tensors
            return False
        key = id(st)
        e = self._live.get(key)
        if e is None:
            on_device = self._on_device(t)
            if not on_device and not _is_marked_host(st):
                return False
            n = self._size(st, t)
            e = _Entry(n, cat, on_device, self._phase, self._current_mods())
            e.host = _is_marked_host(st)
            e.ref = weakref.ref(st, functools.partial(_free_callback, self._self_ref, key))
            self._live[key] = e
            self._add(e, n)
            return e.device and not e.host and n > 0
        grew = False
        n = self._size(st, t)
        if n != e.nbytes:  # resized in place (resize_, out= ops)
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
        if e.host:
            self._host_cur += n
            if self._host_cur > self.host_peak_bytes:
                self.host_peak_bytes = self._host_cur
        elif e.device:
            self._cur[e.cat] += n
            self.current_bytes += n
            self._at_peak = False

    def _recat(self, e: _Entry, cat: int) -> None:
        if e.device and not e.host:
            self._cur[e.cat] -= e.nbytes
            self._cur[cat] += e.nbytes
            if self._at_peak:
                # Nothing was allocated or freed since the peak: this is still the peak's state,
                # now better labelled (e.g. a new gradient only becomes p.grad after its op).
                self._peak_cats = list(self._cur)
        e.cat = cat

    def _on_free(self, key: int) -> None:
        e = self._live.pop(key, None)
        if e is not None:
            self._add(e, -e.nbytes)

    def _check_peak(self) -> None:
        cur = self.current_bytes
        if cur > self.peak_bytes:
            self.peak_bytes = cur
            self._peak_cats = list(self._cur)
            self._at_peak = True
        peaks = self.module_peaks
        for name in self._current_mods():
            if cur > peaks.get(name, 0):
                peaks[name] = cur

    def _mark_host(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        e = self._live.get(id(st))
        if e is None:
            self._register(t, TEMPORARIES)  # registers as host: the storage is already flagged
            return
        if not e.host:
            self._add(e, -e.nbytes)
            e.host = True
            self._add(e, e.nbytes)

    # ------------------------------------------------- activations (saved tensors)
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        e = self._live.get(id(st))
        if e is None:
            if self._register(t, ACTIVATIONS):
                self._check_peak()
            e = self._live.get(id(st))
            if e is not None and e.cat == ACTIVATIONS:
                self._attribute(e, self._current_mods())
        elif e.cat > ACTIVATIONS:
            self._recat(e, ACTIVATIONS)
            self._attribute(e, self._current_mods())
        # detach(): same storage, but no reference from the saved value back to its own grad_fn.
        return t.detach()

    def _attribute(self, e: _Entry, mods: Iterable[str]) -> None:
        if not e.device or e.host:
            return
        acts = self.module_activations
        for name in mods:
            acts[name] = acts.get(name, 0) + e.nbytes

    def _phase_change(self, in_bw: bool) -> None:
        """Backward starts: what this forward made and is still alive is held for backward."""
        self._in_bw = in_bw
        self._mods_dirty = True
        if in_bw:
            phase = self._phase
            for e in list(self._live.values()):
                if e.phase == phase and e.cat == TEMPORARIES:
                    self._recat(e, ACTIVATIONS)
                    self._attribute(e, e.mods)
        self._phase += 1

    # --------------------------------------------------- module attribution
    def _mods_changed(self, *_: Any) -> None:
        self._mods_dirty = True
        self._check_peak()  # a module that starts sees the memory already held

    def _mods_changed_post(self, *_: Any) -> None:
        # ModTracker calls user post hooks just before it removes the module from `parents`.
        self._mods_dirty = True

    def _after_module_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._mods_dirty = True
        # A module that returns its input unchanged (e.g. Dropout(p=0)) gets its backward
        # "start" hook after its "end" hook in ModTracker and would look active through the rest
        # of backward; keep it out of backward attribution.
        if isinstance(output, torch.Tensor) and any(output is i for i in _tensors(inputs)):
            name = self._mod_tracker.get_known_fqn(module)
            if name is not None:
                self._identity.add(name)

    def _current_mods(self) -> tuple[str, ...]:
        """Qualified names of the modules running now; recomputed only when the set changed."""
        mt = self._mod_tracker
        if mt is None:
            return ()
        parents = mt.parents
        if self._mods_dirty or parents is not self._parents_obj:  # the engine swaps in a new set at backward end
            self._parents_obj, self._mods_dirty = parents, False
            skip = self._identity if self._in_bw else ()
            self._mods = tuple(self._name(p) for p in parents if p != "Global" and p not in skip)
        return self._mods

    def _name(self, name: str) -> str:
        p = self._root_prefix
        return name[len(p):] if p and name.startswith(p) else name

    # ----------------------------------------- params, grads and optimizer state
    def _rescan(self) -> None:
        self._rescan_params()
        self._rescan_optimizer(self.optimizer)
        self._check_peak()

    def _rescan_params(self) -> None:
        if self.model is None:
            return
        for p in self.model.parameters():
            self._register(p, PARAMS)
            if p.grad is not None:
                self._register(p.grad, GRADS)
            if p.requires_grad and p not in self._grad_hooked:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                self._grad_hooked[p] = True
        for b in self.model.buffers():
            self._register(b, PARAMS)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None and self._register(p.grad, GRADS):
            self._check_peak()

    def _after_optimizer_step(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._rescan_optimizer(opt)
        if self.optimizer is not None and self.optimizer is not opt:
            self._rescan_optimizer(self.optimizer)
        self._rescan_params()  # e.g. master weights copied back into new 16-bit storages

    def _rescan_optimizer(self, opt: Any) -> None:
        for t in optimizer_state_tensors(opt):
            self._register(t, OPTIMIZER)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def optimizer_state_tensors(opt: Any) -> list[torch.Tensor]:
    """Tensors an optimizer holds: `state_tensors()` if it has one, a torch optimizer's `.state`,
    or the `.optimizer` it wraps."""
    if opt is None:
        return []
    if hasattr(opt, "state_tensors"):
        return list(opt.state_tensors())
    if isinstance(opt, torch.optim.Optimizer):
        out = []
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out
    inner = getattr(opt, "optimizer", None)
    return optimizer_state_tensors(inner) if inner is not None and inner is not opt else []


# Storages flagged as host copies, for trackers that meet them after mark_host() was called.
_HOST_MARKED: "weakref.WeakValueDictionary[int, torch.UntypedStorage]" = weakref.WeakValueDictionary()


def _is_marked_host(st: torch.UntypedStorage) -> bool:
    return _HOST_MARKED.get(id(st)) is st


def mark_host(t: torch.Tensor) -> None:
    """Declare `t` an offloaded host copy: counted in host_peak_bytes, never in device figures.

    Offload mechanisms call this on the copies they make; it is a no-op when no tracker is active.
    """
    if not _ACTIVE:
        return
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return
    _HOST_MARKED[id(st)] = st
    for tracker in _ACTIVE:
        tracker._mark_host(t)


def track(model: nn.Module | None = None, optimizer: Any = None,
          device: str | torch.device | None = None) -> MemoryTracker:
    """A MemoryTracker for `model` (params/grads) and `optimizer` (state); use it as a context manager."""
    return MemoryTracker(model, optimizer, device)
