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
separately (memfit.core.host: `mark_host()`, `host_allocations()`). The counts live in
memfit.core.ledger, which is safe to update from offload worker threads. Kernel-internal workspaces that never surface as a tensor are
invisible here; `memfit.measure.allocator` measures them for comparison.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook as _register_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from memfit.core.host import (ACTIVE as _ACTIVE, host_allocations, host_empty, inner_tensors, mark_host, storage,
                              wraps_tensors)
from memfit.core.ledger import (ACTIVATIONS, CATEGORIES, GRADS, OPTIMIZER, PARAMS, TEMPORARIES,
                                StorageLedger)

__all__ = ["MemoryTracker", "track", "mark_host", "host_allocations", "host_empty", "CATEGORIES",
           "optimizer_state_tensors"]


_DEVICE = torch.ops.prim.device.default
UNTRACKED_DETACH = os.environ.get("MEMFIT_TRACKED_DETACH", "") != "1"
"""A saved tensor's detach() skips this tracker's dispatch when the tracker is the innermost mode (its
records would repeat the ones around it; tests/test_plan_speed_shortcuts.py compares whole profiles)."""


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's output: a tensor, or (nested) tuples/lists of them. Cheap on the hot path."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)


class MemoryTracker(TorchDispatchMode, StorageLedger):
    """Tracks device-resident tensor storages by category, their peak, and per-module figures.

    Attributes (read after or during the tracked region):
        peak_bytes: max of tracked device bytes since enter / `reset_peak()`.
        current_bytes: tracked device bytes now.
        breakdown: categories at the peak moment plus "total" (they sum to peak_bytes).
        module_peaks: per module, the peak total bytes seen while its forward or backward ran.
            Keys are qualified names as in `model.named_modules()`; the model itself is listed
            under its class name (e.g. "GPT"). `module_breakdowns()` splits each by category.
        module_activations: per module, bytes saved for backward by ops run inside it since
            enter / `reset_peak()` (each storage counted once, in the modules active when it was
            first saved; storages kept for backward outside the hooks count where they were made).
        host_peak_bytes: peak of bytes marked as host copies (memfit.core.host; not in the
            device figures).
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
        self._init_ledger(torch.device(device))
        self.module_activations: dict[str, int] = {}
        self._in_bw = False  # _phase (ledger) is bumped whenever a backward pass starts or ends
        self._mods: tuple[str, ...] = ()  # modules running now (forward or backward), cached
        self._mods_dirty = True
        self._parents_obj: Any = None
        self._identity: set[str] = set()  # modules whose forward returned its input (no backward span)
        self._handles: list[Any] = []
        self._grad_hooked = WeakIdKeyDictionary()  # params whose grad hook is registered
        self._saved_hooks: Any = None
        self._mod_tracker: Any = None
        self._root_prefix = f"{type(model).__name__}." if model is not None else ""
        self._thread = threading.get_ident()  # the training thread (set again on __enter__)

    # ----------------------------------------------------------------- public
    def snapshot(self) -> dict[str, int]:
        """Current bytes per category (and "total"), after rescanning params, grads and optimizer."""
        with self._lock:
            self._rescan()
            out = dict(zip(CATEGORIES, self._cur))
            out["total"] = self.current_bytes
        return out

    def reset_peak(self) -> None:
        """Start a new peak window at the current state (module peaks and host peak too)."""
        with self._lock:
            self._rescan()
            self._restart_peak()
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
        self._thread = threading.get_ident()
        _ACTIVE.append(self)
        super().__enter__()
        with self._lock:
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
        if func is _DEVICE:  # the autograd engine asks every fake tensor its device: no memory, the hottest op
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        in_bw = torch._C._current_graph_task_id() != -1
        if in_bw != self._in_bw:
            self._phase_change(in_bw)
        with self._lock:
            grew = False
            for t in _tensors(out):
                grew |= self._register(t, TEMPORARIES)
            if grew:
                self._check_peak()
        return out

    # ------------------------------------------------- activations (saved tensors)
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor and wraps_tensors(t):  # e.g. an NF4 weight: its inner tensors
            for inner in inner_tensors(t):
                self._save(inner)
            return t.detach()
        # detach(): same storage, but no reference from the saved value back to its own grad_fn.
        if not self._save(t):
            return t
        if UNTRACKED_DETACH and _get_current_dispatch_mode() is self:
            # A view of a storage just registered: nothing for this tracker to count, so it goes straight to
            # the modes below (a fake step saves hundreds of tensors; this halves their dispatches).
            with _pop_mode_temporarily():
                return t.detach()
        return t.detach()

    def _save(self, t: torch.Tensor) -> bool:
        """t's storage is held for backward: an activation unless it is already a model state.
        False: t has no storage."""
        st = storage(t)
        if st is None:
            return False
        with self._lock:
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
        return True

    def _attribute(self, e, mods: Iterable[str]) -> None:
        if not e.device or e.host:
            return
        acts = self.module_activations
        for name in mods:
            acts[name] = acts.get(name, 0) + e.nbytes

    def _phase_change(self, in_bw: bool) -> None:
        """Backward starts: what this forward made and is still alive is held for backward."""
        with self._lock:
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
        with self._lock:
            self._rescan_params()
            self._rescan_optimizer(self.optimizer)
            self._check_peak()

    def _rescan_params(self) -> None:
        if self.model is None:
            return
        with self._lock:
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
        with self._lock:
            if p.grad is not None and self._register(p.grad, GRADS):
                self._check_peak()

    def _after_optimizer_step(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._rescan_optimizer(opt)
        if threading.get_ident() != self._thread:
            # An offload worker's chunk update (its state is marked host). The parameters and
            # their .grad belong to the training thread, which may be setting p.grad right now:
            # reading it from here races inside torch. The next forward rescans them.
            return
        if self.optimizer is not None and self.optimizer is not opt:
            self._rescan_optimizer(self.optimizer)
        self._rescan_params()  # e.g. master weights copied back into new 16-bit storages

    def _rescan_optimizer(self, opt: Any) -> None:
        tensors = optimizer_state_tensors(opt)
        with self._lock:
            for t in tensors:
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


def track(model: nn.Module | None = None, optimizer: Any = None,
          device: str | torch.device | None = None) -> MemoryTracker:
    """A MemoryTracker for `model` (params/grads) and `optimizer` (state); use it as a context manager."""
    return MemoryTracker(model, optimizer, device)
