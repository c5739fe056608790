"""The private (or undocumented) torch APIs memfit relies on, each pinned to the behaviour memfit
uses, so that a torch upgrade that changes one fails here, loudly, rather than in a run.

docs/design.md ("Private torch APIs") lists them with the memfit module that uses each.
"""
from __future__ import annotations

import inspect
import threading

import torch
import torch.nn as nn


# ------------------------------------------------------------------ apply/checkpoint.py
def test_non_reentrant_checkpoint_generator():
    """memfit opens the generator at a segment's first block and closes it after its last: one
    `next()` before the segment's forward, one after (StopIteration), with positional flags
    (preserve_rng_state, context_fn, determinism_check, debug[, early_stop]). Intermediates are
    recomputed in backward; the gradients equal the plain run's."""
    from torch.utils import checkpoint as tc

    params = list(inspect.signature(tc._checkpoint_without_reentrant_generator).parameters)
    assert params[:5] == ["fn", "preserve_rng_state", "context_fn", "determinism_check", "debug"]
    assert params[5] in ("early_stop", "args")
    from memfit.core.compat import checkpoint_generator_flags

    flags = checkpoint_generator_flags(tc.noop_context_fn)

    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    lin(x).sum().backward()
    ref = [p.grad.clone() for p in lin.parameters()] + [x.grad.clone()]
    lin.zero_grad()
    x.grad = None

    # Hooks pushed just before the generator opens receive what checkpoint itself stores (the
    # segment's input), not the intermediates: that is how memfit offloads a recomputed block's input.
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t):
        gen = tc._checkpoint_without_reentrant_generator(lin, *flags, x)
        next(gen)
        out = lin(x)
        try:
            next(gen)
            raise AssertionError("the generator must stop after the second next()")
        except StopIteration:
            pass
    out.sum().backward()
    # torch before 2.13 saves a 0-element placeholder beside the input (nothing to offload)
    assert [shape for shape in packed if shape != (0,)] == [(4, 8)] and len(packed) <= 2
    got = [p.grad for p in lin.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


# ------------------------------------------------------------------ core/tracker.py
def test_mod_tracker_parents_user_hooks_and_fqn():
    """The tracker reads `parents` (qualified names plus "Global"), names modules with
    get_known_fqn, and registers (pre_fw, post_fw, pre_bw, post_bw) user hooks; post hooks run
    while the module is still in `parents`."""
    from torch.distributed._tools.mod_tracker import ModTracker

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x).relu()

    net = Net()
    seen = {"fw": [], "post_fw": [], "bw": [], "post_bw": []}
    mt = ModTracker()

    def record(kind):
        return lambda module, *_: seen[kind].append(set(mt.parents))

    mt.register_user_hooks(record("fw"), record("post_fw"), record("bw"), record("post_bw"))
    with mt:
        out = net(torch.randn(2, 4, requires_grad=True))
        assert mt.get_known_fqn(net.inner) == "Net.inner"
        out.sum().backward()
    assert {"Global", "Net", "Net.inner"} in seen["fw"]
    assert any("Net.inner" in p for p in seen["post_fw"])   # still listed when its post hook runs
    assert any("Net.inner" in p for p in seen["bw"])
    assert any("Net.inner" in p for p in seen["post_bw"])


def test_current_graph_task_id_tells_backward_from_forward():
    """-1 outside backward, another value inside it (how the tracker sees backward start)."""
    assert torch._C._current_graph_task_id() == -1
    inside = []
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sum()
    x.register_hook(lambda g: inside.append(torch._C._current_graph_task_id()))
    y.backward()
    assert inside and inside[0] != -1
    assert torch._C._current_graph_task_id() == -1


def test_dispatch_modes_are_per_thread_and_see_outputs():
    """The tracker is a TorchDispatchMode: it sees every op's outputs on the thread that entered
    it, and nothing on other threads (offload workers report through host marks instead)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        torch.ones(3).add(1)
        t = threading.Thread(target=lambda: torch.ones(3).mul(2))
        t.start()
        t.join()
    names = [str(f) for f in mode.ops]
    assert any("add" in n for n in names)
    assert not any("mul" in n for n in names)


def test_storage_objects_are_preserved():
    """The tracker keys storages by id() and frees them through a weakref callback: the same
    storage must come back as the same Python object while it lives, and die with its tensors."""
    import gc
    import weakref

    t = torch.empty(10)
    v = t.view(2, 5)
    assert t.untyped_storage() is v.untyped_storage()
    died = []
    ref = weakref.ref(t.untyped_storage(), lambda _: died.append(True))
    del t, v
    gc.collect()
    assert died and ref() is None


def test_weak_id_key_dictionary():
    from torch.utils.weak import WeakIdKeyDictionary

    d = WeakIdKeyDictionary()
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, different tensors
    d[a] = 1
    assert a in d and b not in d
    del a
    assert len(d) == 0


def test_optimizer_instance_post_hooks_run_before_global_ones():
    """Offload marks a chunk's new state host in an instance post hook; the tracker rescans in a
    global one, which must come second."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    order = []
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.register_step_post_hook(lambda *_: order.append("instance"))
    handle = register_optimizer_step_post_hook(lambda *_: order.append("global"))
    try:
        p.grad = torch.ones(2)
        opt.step()
    finally:
        handle.remove()
    assert order == ["instance", "global"]


# ------------------------------------------------------------------ measure/trace.py, apply/*
def test_fake_tensors_have_sized_storages_and_stay_fake_on_other_threads():
    """Prediction: fake storages report nbytes() without memory; `is_fake` tells them apart;
    `new_empty` on a fake tensor is fake even on a thread where no fake mode is active (host
    staging buffers of optimizer offload are made that way on its worker)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake

    with FakeTensorMode(allow_non_fake_inputs=True):
        p = nn.Parameter(torch.empty(1000, 1000))
        out = []
        t = threading.Thread(target=lambda: out.append(p.new_empty((10,), dtype=torch.uint8, device="cpu")))
        t.start()
        t.join()
        mixed = torch.ones(3) + torch.empty(3)  # a real constant meets a fake tensor
    assert is_fake(p) and isinstance(p, FakeTensor) and isinstance(p, nn.Parameter)
    assert p.untyped_storage().nbytes() == 4_000_000
    assert p.untyped_storage() is p.untyped_storage()
    assert is_fake(out[0]) and out[0].device.type == "cpu"
    assert is_fake(mixed) and not is_fake(torch.ones(1))


def test_profiler_allocation_events():
    """memfit.measure.allocator replays `_EventType.Allocation` events (alloc_size, ptr, device;
    negative sizes for frees) and finds its windows as `_EventType.TorchOp` record_function events
    in kineto_results.experimental_event_tree()."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("memfit::window::pin"):
            t = torch.empty(12345, dtype=torch.uint8)
            del t
    allocs, marks = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            allocs.append((f.alloc_size, f.ptr, f.device.type, e.start_time_ns))
        elif e.tag == _EventType.TorchOp and e.name == "memfit::window::pin":
            marks.append((e.start_time_ns, e.end_time_ns))
    sizes = [a[0] for a in allocs]
    assert 12345 in sizes and -12345 in sizes
    ptrs = {a[1] for a in allocs if abs(a[0]) == 12345}
    assert len(ptrs) == 1 and all(a[2] == "cpu" for a in allocs)
    assert len(marks) == 1 and marks[0][0] <= marks[0][1]


# ------------------------------------------------------------------ apply/offload.py, optimizer.py
def test_storage_cdata_weakref_base_and_foreach():
    """Activation offload deduplicates saved views by `untyped_storage()._cdata` with a
    StorageWeakRef; views reach their base through `._base`; unscaling uses `torch._foreach_mul_`."""
    from torch.multiprocessing.reductions import StorageWeakRef

    base = torch.arange(6.0)
    view = base[2:]
    assert view.untyped_storage()._cdata == base.untyped_storage()._cdata
    assert view._base is base and base._base is None
    ref = StorageWeakRef(base.untyped_storage())
    assert not ref.expired()
    del base, view
    assert ref.expired()
    grads = [torch.ones(2), torch.full((3,), 2.0)]
    torch._foreach_mul_(grads, 0.5)
    assert grads[0].tolist() == [0.5, 0.5] and grads[1].tolist() == [1.0, 1.0, 1.0]


# ------------------------------------------------------------------ distributed/comm.py
def test_storage_use_count_counts_each_alias():
    """comm._released waits for gloo's worker to drop its alias of a collective's tensor: the storage's
    use count rises by one per live alias and falls back when the alias goes (the worker holds the
    alias's TensorImpl, whose Storage reference this count shows)."""
    t = torch.zeros(16)
    st = t.untyped_storage()
    held = torch._C._storage_Use_Count(st._cdata)
    alias = t.view(t.shape)
    assert torch._C._storage_Use_Count(st._cdata) == held + 1
    del alias
    assert torch._C._storage_Use_Count(st._cdata) == held
