"""Offload of saved activations to CPU memory and to a spill folder: files, errors, prefetch, tracing."""
import errno
import gc
import os
import stat
import sys
import threading
import time

import pytest
import torch

import memfit
from memfit.apply import disk_spill, saved_copies
from memfit.apply.checkpoint import applied, remove
from memfit.apply.offload import ActivationStore, SpillError, validate_spill_dir
from memfit.core import spill
from memfit.core.errors import ConfigError, MemfitError

sys.path.insert(0, os.path.dirname(__file__))
from test_apply_checkpoint import tiny  # noqa: E402


def files(folder):
    """Spill files in a spill folder (its owner's lock file aside)."""
    if folder is None or not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if f != spill.LOCK_NAME)


def test_spill_files_private_and_gone_after_a_step(tmp_path):
    model = tiny(dropout=0.0)
    memfit.checkpoint(model, "none+offload:disk", spill_dir=str(tmp_path))
    store = applied(model).store
    x = torch.randint(0, 64, (2, 16))
    _, loss, _ = model(x, x)
    folder = store.spill_folder
    assert folder.parent == tmp_path
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    store.disk().pool.submit(lambda: None).result()  # let queued writes land
    for f in files(folder):
        assert stat.S_IMODE(os.stat(folder / f).st_mode) == 0o600
    loss.backward()
    assert files(folder) == []
    assert store.stats.spilled_bytes > 0 and store.stats.read_bytes == store.stats.spilled_bytes
    remove(model)  # removing the policy removes the private folder
    assert not folder.exists()


def test_spill_files_gone_after_an_exception_in_forward_and_in_backward(tmp_path):
    model = tiny(dropout=0.0)
    memfit.checkpoint(model, "keep+offload:disk*3,recompute+offload:disk", spill_dir=str(tmp_path))
    folder = lambda: applied(model).store.spill_folder  # noqa: E731
    x = torch.randint(0, 64, (2, 16))

    def boom(*a):
        raise RuntimeError("boom")

    model.blocks[2].mlp.forward = boom  # forward dies after two blocks spilled
    with pytest.raises(RuntimeError, match="boom"):
        model(x, x)
    del model.blocks[2].mlp.forward
    gc.collect()
    applied(model).store.disk().pool.submit(lambda: None).result()
    assert files(folder()) == []

    def failing_hook(module, grad_in, grad_out):
        raise RuntimeError("boom in backward")

    h = model.blocks[2].register_full_backward_hook(failing_hook)

    def run():
        _, loss, _ = model(x, x)
        loss.backward()

    with pytest.raises(RuntimeError, match="boom in backward"):
        run()
    h.remove()
    gc.collect()
    applied(model).store.disk().pool.submit(lambda: None).result()
    assert files(folder()) == []


def test_spill_folder_checked_before_training(tmp_path, monkeypatch):
    model = tiny()
    memfit.checkpoint(model, "full+offload:disk", spill_dir=str(tmp_path / "new"))  # created when missing
    assert (tmp_path / "new").is_dir()
    remove(model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        memfit.checkpoint(model, "full+offload:disk", spill_dir=str(tmp_path / "file"))

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(spill.tempfile, "mkdtemp", denied)
        with pytest.raises(ConfigError, match="is not writable"):
            memfit.checkpoint(model, "full+offload:disk", spill_dir=str(tmp_path))
    with monkeypatch.context() as m:
        m.setattr(spill.shutil, "disk_usage", lambda p: type("U", (), {"free": 10 * 2**20})())
        with pytest.raises(ConfigError, match="has only 10.00 MiB free; activation offload needs at least 256.00 MiB"):
            memfit.checkpoint(model, "full+offload:disk", spill_dir=str(tmp_path))
    assert validate_spill_dir(tmp_path) == tmp_path
    assert applied(model) is None  # nothing was applied by the failed calls


@pytest.mark.parametrize("seen_in", ["forward", "backward"])
def test_disk_filling_up_mid_step_is_a_clear_error_and_leaves_no_files(tmp_path, monkeypatch, seen_in):
    """The 4th spill write finds the disk full. Seen in forward (a later pack finds the error), or,
    when the failing write lands only after forward returned, in backward (a read waits on it): then
    the step's graph, kept by `loss`, still holds the three tensors written before, and their files
    must go anyway (they did not: a flaky leftover of 3 files, issue 38)."""
    model = tiny(dropout=0.0)
    memfit.checkpoint(model, "none+offload:disk", spill_dir=str(tmp_path))
    real_open = os.open
    calls = {"n": 0}
    forward_done = threading.Event()

    def filling(path, flags, mode=0o777):
        calls["n"] += 1
        if calls["n"] > 3:
            if seen_in == "backward":
                forward_done.wait(30)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode)

    real_new_path = disk_spill.DiskSpill.new_path
    paths = {"n": 0}

    def after_the_failure(spill):  # forward: the 5th saved tensor waits for the 4th write to fail
        paths["n"] += 1
        deadline = time.monotonic() + 30
        while seen_in == "forward" and paths["n"] == 5 and spill.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_new_path(spill)

    monkeypatch.setattr(disk_spill.os, "open", filling)
    monkeypatch.setattr(disk_spill.DiskSpill, "new_path", after_the_failure)
    x = torch.randint(0, 64, (2, 16))
    loss = None
    with pytest.raises(MemfitError, match="is full"):
        _, loss, _ = model(x, x)
        forward_done.set()
        loss.backward()
    forward_done.set()
    assert (loss is not None) == (seen_in == "backward")
    monkeypatch.setattr(disk_spill.os, "open", real_open)
    # The failed write removes every spill file; writes still queued or running on a spill thread
    # remove their own file when they finish (a finalizer must not block on them): allow a moment.
    deadline = time.monotonic() + 10
    while files(applied(model).store.spill_folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert files(applied(model).store.spill_folder) == []
    assert "is full" in applied(model).store.disk().error


def test_backward_reads_ahead_the_previous_block(tmp_path, monkeypatch):
    model = tiny(dropout=0.0)
    memfit.checkpoint(model, "none+offload:disk", spill_dir=str(tmp_path))
    log = []
    real_prefetch, real_get = saved_copies.Offloaded.prefetch, saved_copies.Offloaded.get
    monkeypatch.setattr(saved_copies.Offloaded, "prefetch", lambda self: (log.append(("prefetch", self.group)), real_prefetch(self))[1])
    monkeypatch.setattr(saved_copies.Offloaded, "get", lambda self: (log.append(("get", self.group)), real_get(self))[1])
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    first_get = {g: log.index(("get", g)) for g in range(4)}
    assert sorted(first_get, key=first_get.get) == [3, 2, 1, 0]  # backward order
    for g in (2, 1, 0):  # read-ahead of block g starts as block g+1 is first unpacked, not earlier
        started = log.index(("prefetch", g))
        assert first_get.get(g + 2, -1) < started < first_get[g + 1]


def test_pinning_unavailable_falls_back_to_pageable_memory():
    store = ActivationStore()
    if torch.cuda.is_available():
        pytest.skip("pinning works on CUDA builds")
    with pytest.warns(UserWarning, match="pinned memory is unavailable"):
        host = torch.empty(16, pin_memory=store.can_pin())  # as saved_copies.to_pinned allocates
    assert not host.is_pinned() and store.stats.pinned is False


def test_parameters_and_leaves_are_never_offloaded():
    lin = torch.nn.Linear(8, 8)
    store = ActivationStore(lin)
    packed = []
    x = torch.randn(64, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(store.pack(t, 0, "cpu", None)) or packed[-1],
                                                  store.unpack):
        y = torch.tanh(lin(x))
    moved = [p for p in packed if not isinstance(p, torch.Tensor)]
    # linear saves x (a leaf requiring grad) and the weight: both stay; tanh's output is moved
    assert len(moved) == 1 and len(packed) == 3
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


def test_views_of_one_storage_are_packed_once():
    store = ActivationStore()
    base = torch.randn(4, 8, 16).exp()  # a non-leaf-like plain tensor: not owned, not requiring grad
    a, b = base.view(32, 16), base.transpose(0, 1)
    pa, pb = store.pack(a, 0, "cpu", "int8"), store.pack(b, 0, "cpu", "int8")
    assert pa.base is pb.base  # one compressed host copy serves both views
    assert store.stats.host_bytes == base.numel() + (base.numel() // 64) * 4  # int8 + fp32 scales, once
    for packed, view in ((pa, a), (pb, b)):
        out = store.unpack(packed)
        assert out.shape == view.shape and out.stride() == view.stride()
        assert (out - view).abs().max() <= view.abs().max() / 127


def test_trace_predicts_offload_without_io(tmp_path, monkeypatch):
    from memfit.measure.trace import trace_step
    from memfit.models.gpt import GPT, GPTConfig

    monkeypatch.setattr(spill.tempfile, "gettempdir", lambda: str(tmp_path))
    build = lambda: GPT(GPTConfig(layers=4, hidden=64, heads=4, vocab=128, seq=64))  # noqa: E731
    none = trace_step(build, 2, 64, checkpoint="none")
    cpu = trace_step(build, 2, 64, checkpoint="none+offload:cpu")
    disk = trace_step(build, 2, 64, checkpoint="full+offload:disk")
    assert cpu.peak < none.peak and cpu.host_peak > 0
    assert disk.peak < none.peak and disk.host_peak == 0
    spilled = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != spill.LOCK_NAME]
    assert spilled == []
