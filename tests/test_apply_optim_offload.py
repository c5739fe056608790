"""Optimizer offload to CPU and disk: bit-identical to in-memory, gradients leave the device,
device memory goes down, private spill files that are cleaned up, clear errors."""
import gc
import os
import stat

import pytest
import torch

from memfit.apply.optimizer import TrainingOptimizer
from memfit.core import spill, tracker
from memfit.core.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=16)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(n)]


def run(model, steps=3, accum=2, **opt_kw):
    """`steps` optimizer steps of `accum` micro-batches each (sum losses / all tokens)."""
    opt = TrainingOptimizer(model, **opt_kw)
    results = []
    try:
        for s in range(steps):
            micro = batches(accum, seed=s)
            total = sum(int(y.numel()) for _, y in micro)
            for x, y in micro:
                with opt.autocast():
                    _, loss, _ = model(x, y)
                opt.backward(loss / total)
            results.append(opt.step())
        return opt, results
    finally:
        opt.close()


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("optimizer,clip", [("adamw", 1.0), ("adamw", None), ("momentum", 0.05), ("sgd", None)])
def test_offload_is_bit_identical_to_in_memory(offload, optimizer, clip, tmp_path):
    ref = tiny_gpt()
    _, ref_res = run(ref, optimizer=optimizer, lr=1e-2, weight_decay=0.1, clip=clip)
    model = tiny_gpt()
    spill = str(tmp_path) if offload == "disk" else None
    # small chunks: several streamed chunks, each with its own torch optimizer
    _, res = run(model, optimizer=optimizer, lr=1e-2, weight_decay=0.1, clip=clip,
                 offload=offload, spill_dir=spill, chunk_bytes=8192)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    assert [r.grad_norm for r in res] == [r.grad_norm for r in ref_res]


def test_master_mode_offload_matches_in_memory_master_mode(tmp_path):
    """bf16-master: in-memory masters, CPU masters and disk masters give the same bf16 weights."""
    ref = tiny_gpt()
    run(ref, optimizer="adamw", lr=1e-2, precision="bf16-master", clip=1.0, accum=1)
    for offload in ("cpu", "disk"):
        model = tiny_gpt()
        run(model, optimizer="adamw", lr=1e-2, precision="bf16-master", clip=1.0, accum=1, offload=offload,
            spill_dir=str(tmp_path) if offload == "disk" else None)
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters())), offload


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_gradients_leave_the_device_during_backward(offload, tmp_path):
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "adamw", offload=offload, spill_dir=str(tmp_path) if offload == "disk" else None)
    seen = []
    # a hook registered after the optimizer's: sees each grad once the offload hook ran
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is None))
    x, y = batches(1)[0]
    _, loss, n = model(x, y)
    opt.backward(loss / n)
    assert seen and all(seen)  # each gradient was gone from the parameter as soon as it was produced
    assert all(p.grad is None for p in model.parameters())
    if offload == "disk":
        opt.streamed._drain()
        files = sorted(os.listdir(opt.streamed.folder))
        assert any(f.startswith("grad_") for f in files)
        opt.step()
        assert not any(f.startswith("grad_") for f in os.listdir(opt.streamed.folder))  # discarded after the step
    opt.close()


def test_spill_files_are_private_and_removed_on_close(tmp_path):
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "adamw", offload="disk", spill_dir=str(tmp_path), chunk_bytes=8192)
    folder = opt.streamed.folder
    assert os.path.dirname(folder) == str(tmp_path)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    x, y = batches(1)[0]
    _, loss, n = model(x, y)
    opt.backward(loss / n)
    opt.streamed._drain()
    for f in os.listdir(folder):
        assert stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode) == 0o600, f
    opt.step()
    assert len(opt.streamed.chunks) > 1 and opt.io_stats.bytes_read > 0 and opt.io_stats.bytes_written > 0
    opt.close()
    opt.close()  # twice is fine
    assert not os.path.exists(folder)
    assert os.listdir(tmp_path) == []


def test_spill_folder_removed_after_an_exception(tmp_path):
    model = tiny_gpt()
    folder = None
    with pytest.raises(RuntimeError, match="boom"):
        with TrainingOptimizer(model, "adamw", offload="disk", spill_dir=str(tmp_path)) as opt:
            folder = opt.streamed.folder
            x, y = batches(1)[0]
            _, loss, n = model(x, y)
            opt.backward(loss / n)
            raise RuntimeError("boom")
    assert folder is not None and not os.path.exists(folder)


def test_spill_folder_removed_when_the_optimizer_is_garbage_collected(tmp_path):
    import gc

    opt = TrainingOptimizer(tiny_gpt(), "adamw", offload="disk", spill_dir=str(tmp_path))
    folder = opt.streamed.folder
    opt.streamed._pool.shutdown()
    del opt
    gc.collect()
    assert not os.path.exists(folder)


def test_unusable_spill_folder_is_a_config_error(tmp_path, monkeypatch):
    """The shared validator (memfit.core.spill; tests/test_apply_spill.py has the rest) guards
    optimizer offload too, with the optimizer's own space need."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        TrainingOptimizer(tiny_gpt(), offload="disk", spill_dir=str(a_file))
    with pytest.raises(ConfigError, match="cannot be created"):
        TrainingOptimizer(tiny_gpt(), offload="disk", spill_dir=str(a_file / "sub"))

    class Usage:
        free = 1000
    monkeypatch.setattr(spill.shutil, "disk_usage", lambda path: Usage())
    with pytest.raises(ConfigError, match="free; optimizer offload needs at least"):
        TrainingOptimizer(tiny_gpt(), offload="disk", spill_dir=str(tmp_path / "ok"))
    assert os.listdir(tmp_path / "ok") == []  # the root was made, no spill folder in it


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offload_state_dict_roundtrip(offload, tmp_path):
    """state_dict gathers masters and state from CPU or disk; loading it continues bit-exactly."""
    spill = str(tmp_path) if offload == "disk" else None
    a = tiny_gpt()
    opt = TrainingOptimizer(a, "adamw", lr=1e-2, offload=offload, spill_dir=spill, chunk_bytes=8192)
    for x, y in batches(2):
        _, loss, n = a(x, y)
        opt.backward(loss / n)
        opt.step()
    path = tmp_path / "ck.pt"
    torch.save({"model": a.state_dict(), "opt": opt.state_dict()}, path)
    x, y = batches(1, seed=5)[0]
    _, loss, n = a(x, y)
    opt.backward(loss / n)
    opt.step()
    opt.close()

    ck = torch.load(path, weights_only=True)
    b = tiny_gpt()
    b.load_state_dict(ck["model"])
    opt_b = TrainingOptimizer(b, "adamw", lr=1e-2, offload=offload, spill_dir=spill, chunk_bytes=8192)
    opt_b.load_state_dict(ck["opt"])
    _, loss, n = b(x, y)
    opt_b.backward(loss / n)
    opt_b.step()
    opt_b.close()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offload_lowers_device_memory(precision, offload, tmp_path):
    """Tracker-measured device bytes: no optimizer bytes (they are host copies) and no resident grads.
    (Training on CPU, host and device are the same memory; the tracker tells them apart through
    memfit.core.tracker.mark_host, which the offload marks its host copies with.)"""
    measured = {}
    for off in (None, offload):
        model = tiny_gpt()
        opt = TrainingOptimizer(model, "adamw", precision=precision, offload=off,
                                spill_dir=str(tmp_path) if off == "disk" else None)
        with tracker.track(model, opt) as t:
            for i, (x, y) in enumerate(batches(2)):
                if i == 1:
                    t.reset_peak()  # steady state: the first step creates the optimizer state
                with opt.autocast():
                    _, loss, n = model(x, y)
                opt.backward(loss / n)
                after_backward = t.snapshot()
                opt.step()
            measured[off] = (t.snapshot(), after_backward, t.peak_bytes, t.host_peak_bytes)
        opt.close()
    (base, base_bw, base_peak, _), (off, off_bw, off_peak, host_peak) = measured[None], measured[offload]
    n_params = tiny_gpt().num_params()
    assert base["optimizer"] >= 8 * n_params and off["optimizer"] == 0
    assert base_bw["grads"] == n_params * (4 if precision == "32-true" else 2) and off_bw["grads"] == 0
    assert off["params"] == base["params"]
    assert off_peak <= base_peak - base["optimizer"]
    if offload == "cpu":
        assert host_peak >= 8 * n_params  # the Adam state now counts as host bytes


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_updates_overlapped_with_backward_are_bit_identical(offload, tmp_path):
    """backward(loss, final=True) on the last micro-batch starts chunk updates during backward."""
    ref = tiny_gpt()
    run(ref, optimizer="adamw", lr=1e-2, weight_decay=0.1)
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "adamw", lr=1e-2, weight_decay=0.1, offload=offload, chunk_bytes=8192,
                            spill_dir=str(tmp_path) if offload == "disk" else None)
    started_during_backward = []
    model.tok.weight.register_hook(lambda g: started_during_backward.append(opt.streamed.early_updates))
    for s in range(3):
        micro = batches(2, seed=s)
        total = sum(int(y.numel()) for _, y in micro)
        for j, (x, y) in enumerate(micro):
            _, loss, _ = model(x, y)
            opt.backward(loss / total, final=j == len(micro) - 1)
        opt.step()
    # the tied embedding's grad is the last one backward finishes: chunks of later blocks were
    # already handed to the worker by then
    assert max(started_during_backward) > 0
    assert opt.streamed.early_updates >= 3
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_parameters_without_gradient_in_some_micro_batches(offload, tmp_path):
    """A branch used only by some micro-batches: accumulation and the update match in-memory exactly."""
    def make():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8), "c": torch.nn.Linear(8, 1)})

    def train(net, **kw):
        opt = TrainingOptimizer(net, "adamw", lr=1e-2, **kw)
        for s in range(3):
            for j in range(2):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + j))
                h = net["a"](x)
                if j == 1:  # "b" only sees the second micro-batch
                    h = net["b"](h)
                opt.backward(net["c"](h).pow(2).mean())
            opt.step()
        opt.close()

    ref, net = make(), make()
    train(ref)
    train(net, offload=offload, chunk_bytes=64, spill_dir=str(tmp_path) if offload == "disk" else None)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), net.parameters()))


def test_keep_grad_files_reuses_them_and_still_cleans_up(tmp_path):
    ref = tiny_gpt()
    run(ref, optimizer="adamw", lr=1e-2, offload="disk", spill_dir=str(tmp_path / "a"))
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "adamw", lr=1e-2, offload="disk", spill_dir=str(tmp_path / "b"),
                            keep_grad_files=True)
    folder = opt.streamed.folder
    for s in range(3):
        micro = batches(2, seed=s)
        total = sum(int(y.numel()) for _, y in micro)
        for x, y in micro:
            _, loss, _ = model(x, y)
            opt.backward(loss / total)
        opt.step()
        assert any(f.startswith("grad_") for f in os.listdir(folder))  # kept after the step
    opt.close()
    assert not os.path.exists(folder)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_cuda_offload_keeps_state_on_the_host(offload, tmp_path):
    """On CUDA: masters and Adam state live on the CPU, the device holds 16-bit weights only between
    steps, and the same updates as the in-memory master mode come out (to bf16 rounding)."""
    def train(off):
        torch.manual_seed(0)
        gc.collect()  # earlier runs' garbage must not be freed inside the measured region
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()  # earlier tests' and runs' blocks, cuBLAS workspaces
        model = GPT(CFG).cuda()
        opt = TrainingOptimizer(model, "adamw", lr=1e-2, precision="bf16-master", offload=off,
                                spill_dir=str(tmp_path) if off == "disk" else None)
        for x, y in batches(3):
            with opt.autocast():
                _, loss, n = model(x.cuda(), y.cuda())
            opt.backward(loss / n)
            opt.step()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        assert all(t.device.type == "cpu" for t in opt.state_tensors()) or off is None
        opt.close()
        return model, held

    train(None)  # warm-up: the cuBLAS workspaces are made once per thread, outside the compared runs
    ref, ref_bytes = train(None)
    model, off_bytes = train(offload)
    n_params = model.num_params()
    assert off_bytes <= ref_bytes - 12 * n_params  # fp32 master + 2 Adam moments left the device
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=2e-2)
