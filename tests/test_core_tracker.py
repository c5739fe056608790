"""MemoryTracker: exact storage accounting, checked against the allocator and against byte counts."""
from __future__ import annotations

import gc

import pytest
import torch

import memfit
from memfit.apply.checkpoint import checkpoint
from memfit.apply.optimizer import TrainingOptimizer
from memfit.measure.allocator import AllocatorProfile
from memfit.core.tracker import MemoryTracker, mark_host, track
from memfit.models.gpt import GPT, GPTConfig

CFG = dict(layers=2, hidden=64, heads=4, vocab=256, seq=64)


def tiny_gpt(**kw) -> GPT:
    return GPT(GPTConfig(**{**CFG, **kw}))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def train_step(model, opt, batch=4, seq=64):
    x = torch.randint(0, model.cfg.vocab, (batch, seq))
    with opt.autocast():
        _, loss, n = model(x, x)
    opt.backward(loss / n)
    opt.step()


# ------------------------------------------------------------------ basic storage accounting
def test_views_inplace_and_frees_count_each_storage_once():
    with track(device="cpu") as t:
        x = torch.empty(1000)
        assert t.current_bytes == 4000
        y = x.view(10, 100)[2:]   # views share the storage
        x.add_(1.0)                # in-place: no new storage
        assert t.current_bytes == 4000
        z = x * 2
        assert t.current_bytes == 8000 and t.peak_bytes == 8000
        del x
        assert t.current_bytes == 8000  # the view y still holds x's storage
        del y
        assert t.current_bytes == 4000
        assert t.snapshot() == {"params": 0, "grads": 0, "optimizer": 0, "activations": 0,
                                "temporaries": 4000, "total": 4000}
    assert t.peak_bytes == 8000
    del z


def test_free_and_resize_are_tracked():
    with track(device="cpu") as t:
        a = torch.empty(256)
        b = torch.empty(512)
        assert t.current_bytes == 3 * 1024
        del a
        assert t.current_bytes == 2048
        b.resize_(1024)            # storage grows in place: re-read its size
        assert t.current_bytes == 4096
        assert t.peak_bytes == 4096
        t.reset_peak()
        assert t.peak_bytes == 4096
        del b
        assert t.current_bytes == 0 and t.peak_bytes == 4096


def test_mark_host_is_excluded_from_device_figures():
    mark_host(torch.empty(10))  # no tracker active: a no-op, must not raise
    with track(device="cpu") as t:
        dev = torch.empty(1000)
        host = torch.empty(500)
        assert t.current_bytes == 6000
        mark_host(host)
        assert t.current_bytes == 4000
        assert t.host_peak_bytes == 2000
        host2 = torch.ones(250)
        mark_host(host2)
        assert t.host_peak_bytes == 3000 and t.current_bytes == 4000
        del host, host2
        assert t._host_cur == 0
        assert t.host_peak_bytes == 3000
    del dev


# ------------------------------------------------------------ against the allocator (profiler)
@pytest.mark.parametrize("policy", ["none", "full"])
def test_peak_matches_profiler_memory_events(policy):
    """The tracker's peak of a real training step equals the allocator's, from profiler events.

    Tolerance 0.5%: the allocator also sees memory that never becomes a tensor the dispatch mode
    can see. In this fp32 step that is only the 5056-byte CPU RNG state that non-reentrant
    checkpointing stashes per block (`torch.get_rng_state()` is created outside dispatch); without
    checkpointing the two agree to the byte. (bf16 CPU GEMMs add oneDNN workspace; see the
    estimate_accuracy benchmark.)"""
    torch.manual_seed(0)
    with AllocatorProfile() as prof:  # started before the model: every block freed later is known
        model = checkpoint(tiny_gpt(), policy)
        opt = TrainingOptimizer(model, "adamw")
        with MemoryTracker(model, opt) as t:
            train_step(model, opt)
            t.reset_peak()
            start = t.current_bytes
            with prof.window("step"):
                train_step(model, opt)
    w = prof.windows["step"]
    assert w.start_bytes == start  # same baseline: params + optimizer state, nothing else live
    assert t.peak_bytes > start * 1.5  # a real step happened
    assert abs(t.peak_bytes - w.peak_bytes) <= 0.005 * w.peak_bytes
    assert t.peak_bytes <= w.peak_bytes  # the tracker never sees more than the allocator gave out
    if policy == "none":
        assert t.peak_bytes == w.peak_bytes


def test_allocator_profile_counts_known_allocations():
    with AllocatorProfile() as prof:
        keep = torch.empty(1024)               # 4 KiB live before the window
        with prof.window("w"):
            a = torch.empty(2048)              # +8 KiB
            b = torch.empty(4096)              # +16 KiB -> peak 28 KiB
            del a, b
            c = torch.empty(1024)
    assert prof.windows["w"].start_bytes == 4096
    assert prof.windows["w"].peak_bytes == 4096 + 8192 + 16384
    del keep, c


# --------------------------------------------------------------------------- categories
@pytest.mark.parametrize("name,state_per_param", [("sgd", 0), ("momentum", 1), ("adam", 2)])
def test_params_grads_optimizer_are_exact(name, state_per_param):
    model = tiny_gpt()
    params = list(model.parameters())  # tied weights appear once, as they occupy memory once
    p_bytes = nbytes(params)
    opt = TrainingOptimizer(model, name)
    with track(model, opt) as t:
        assert t.snapshot()["params"] == p_bytes
        x = torch.randint(0, 256, (4, 64))
        _, loss, n = model(x, x)
        (loss / n).backward()
        snap = t.snapshot()
        assert snap["grads"] == p_bytes  # one fp32 grad per parameter
        opt.step()
        del x, loss, n, _  # the batch, logits and loss of this step
        snap = t.snapshot()
        assert snap["grads"] == 0  # zero_grad(set_to_none) released them
        # Adam also keeps a 4-byte fp32 `step` scalar per parameter tensor.
        expected = state_per_param * p_bytes + (4 * len(params) if name == "adam" else 0)
        assert snap["optimizer"] == expected
        assert snap["params"] == p_bytes
        assert snap["activations"] == snap["temporaries"] == 0
        t.reset_peak()
        train_step(model, opt)  # steady state: state existed before the step
        b = t.breakdown
        assert b["params"] == p_bytes and b["optimizer"] == expected
        assert b["total"] == t.peak_bytes == sum(b[k] for k in ("params", "grads", "optimizer", "activations",
                                                                 "temporaries"))


def test_preexisting_state_counted_from_the_start():
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "adam")
    train_step(model, opt)  # optimizer state exists before the tracker starts
    x = torch.randint(0, 256, (2, 16))
    _, loss, n = model(x, x)
    loss.backward()         # and gradients too
    p_bytes = nbytes(model.parameters())
    with track(model, opt) as t:
        snap = t.snapshot()
    assert snap["params"] == p_bytes and snap["grads"] == p_bytes
    assert snap["optimizer"] == 2 * p_bytes + 4 * len(list(model.parameters()))
    assert t.peak_bytes == snap["total"]


def test_checkpointing_lowers_activations():
    peaks = {}
    for policy in ("none", "full"):
        torch.manual_seed(0)
        model = checkpoint(tiny_gpt(layers=4), policy)
        opt = TrainingOptimizer(model, "sgd")
        with track(model, opt) as t:
            train_step(model, opt)
            t.reset_peak()
            train_step(model, opt)
        peaks[policy] = (t.peak_bytes, t.breakdown["activations"], t.module_activations)
    (p_none, a_none, m_none), (p_full, a_full, m_full) = peaks["none"], peaks["full"]
    assert p_full < p_none
    assert a_full < 0.5 * a_none
    # Without checkpointing every block saves its own activations; with it, only block inputs remain.
    assert all(m_none[f"blocks.{i}"] > 4 * m_full.get(f"blocks.{i}", 0) for i in range(4))


def test_saved_activations_per_module_and_module_peaks():
    model = tiny_gpt()
    opt = TrainingOptimizer(model, "sgd")
    with track(model, opt) as t:
        train_step(model, opt)
    acts = t.module_activations
    assert acts["blocks.0"] > 0 and acts["blocks.1"] > 0
    assert acts["blocks.0.mlp"] + acts["blocks.0.attn"] <= acts["blocks.0"]
    assert acts["GPT"] >= acts["blocks.0"] + acts["blocks.1"]  # the model holds all of them
    assert t.module_peaks["GPT"] == t.peak_bytes
    assert 0 < t.module_peaks["blocks.1.mlp"] <= t.peak_bytes
    # Dropout(p=0) returns its input; it must not look active through the whole backward.
    assert t.module_peaks["blocks.0.mlp.drop"] < t.peak_bytes
    # Each module's categories at its own peak moment add up to that peak (ZeRO shards them).
    cats = t.module_breakdowns()
    assert set(cats) == set(t.module_peaks)
    assert all(sum(cats[name].values()) == peak for name, peak in t.module_peaks.items())
    assert cats["GPT"] == {k: v for k, v in t.breakdown.items() if k != "total"}
    assert cats["blocks.0"]["activations"] > 0 and cats["blocks.0"]["params"] == nbytes(model.parameters())


def test_autocast_bf16_tracks_and_frees():
    model = tiny_gpt()
    p_bytes = nbytes(model.parameters())
    opt = TrainingOptimizer(model, "adamw", precision="bf16-mixed")
    with track(model, opt) as t:
        train_step(model, opt)
        after_first = t.snapshot()
        train_step(model, opt)
        assert t.snapshot() == after_first  # nothing leaks between steps (autocast cache, saved hooks)
    assert after_first["params"] == p_bytes
    assert t.breakdown["activations"] > 0
    assert memfit.MemoryTracker is MemoryTracker


def test_fake_tensor_mode_counts_without_allocating():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = {}
    for fake in (False, True):
        torch.manual_seed(0)
        ctx = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device("cpu")
        with ctx:
            model = tiny_gpt()
            opt = TrainingOptimizer(model, "adam")
            with track(model, opt) as t:
                train_step(model, opt)
                t.reset_peak()
                train_step(model, opt)
        real[fake] = (t.peak_bytes, t.breakdown)
    assert real[True] == real[False]


@pytest.mark.gpu
def test_cuda_tracker_matches_memory_allocated():
    dev = torch.device("cuda")
    gc.collect()  # earlier tests' garbage must not be freed inside the measured region
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # what earlier tests in this process still hold
    model = tiny_gpt(hidden=256, vocab=1024).to(dev)
    opt = TrainingOptimizer(model, "adamw")

    def step():
        x = torch.randint(0, 1024, (8, 64), device=dev)
        _, loss, n = model(x, x)
        opt.backward(loss / n)
        opt.step()
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() - before
    with track(model, opt) as t:
        assert t.device.type == "cuda"
        assert t.current_bytes == base  # only the model lives on the device yet
        step()
        # cuBLAS keeps workspaces in the caching allocator that are not tensors (created by the first
        # GEMM of each thread, unless an earlier test made them): a constant offset.
        offset = torch.cuda.memory_allocated() - before - t.current_bytes
        assert 0 <= offset <= 64 << 20
        torch.cuda.reset_peak_memory_stats()
        t.reset_peak()
        step()
        # Storages are counted in the allocator's 512-byte blocks, so every block is accounted for.
        assert torch.cuda.memory_allocated() - before - t.current_bytes == offset
    peak = torch.cuda.max_memory_allocated() - before - offset
    # Kernel-internal scratch (never a tensor) can only add to the allocator's figure.
    assert t.peak_bytes <= peak <= 1.10 * t.peak_bytes


def test_cli_track_reports_measured_and_predicted(capsys):
    from memfit.cli import main

    rc = main(["track", "gpt:layers=2,hidden=32,heads=2,vocab=128,seq=32", "--batch", "2", "--seq", "32", "--json"])
    assert rc == 0
    import json

    data = json.loads(capsys.readouterr().out)
    m, p = data["measured"], data["predicted"]
    assert m["peak"] == p["peak"] > 0
    assert m["allocator_peak"] >= m["peak"]
    assert sum(m[k] for k in ("params", "grads", "optimizer", "activations", "temporaries")) == m["peak"]
    assert main(["track", "gpt:layers=2,hidden=32,heads=2,vocab=128", "--checkpoint", "sometimes"]) == 2
    assert "sometimes" in capsys.readouterr().err


def test_tracking_does_not_change_the_numbers():
    """The saved-tensor hooks and the dispatch mode only observe: grads are bit-identical."""
    grads = []
    for tracked in (False, True):
        torch.manual_seed(0)
        model = checkpoint(tiny_gpt(dropout=0.1), "full")
        x = torch.randint(0, 256, (2, 32))
        torch.manual_seed(1)
        with track(model) if tracked else torch.device("cpu"):
            _, loss, n = model(x, x)
            (loss / n).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
