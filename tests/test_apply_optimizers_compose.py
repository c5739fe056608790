"""Every optimizer with the rest of TrainingOptimizer: precision modes (fp32 master copy), clipping,
gradient accumulation, CPU/disk offload in chunks, and checkpoint/resume, bit for bit."""
from __future__ import annotations

import io

import pytest
import torch

from memfit.apply import lowbit, optimizers
from memfit.apply.optimizer import TrainingOptimizer
from memfit.models.gpt import GPT, GPTConfig

# Every matrix has >= 4096 elements, so the 8-/4-bit formats quantize them; norms stay fp32.
CFG = GPTConfig(layers=1, hidden=64, heads=2, vocab=64, seq=16)
LR = {"sgd": 0.1, "momentum": 0.05, "adagrad": 0.05, "lion": 1e-3, "adafactor": 0.01}
needs_torchao = pytest.mark.skipif(not lowbit.available(), reason="torchao (memfit[lowbit]) is not installed")
ALL = [pytest.param(n, marks=[needs_torchao] if optimizers.info(n).extra else []) for n in optimizers.NAMES]


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def batches(step: int, accum: int = 2):
    g = torch.Generator().manual_seed(step)
    return [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(accum)]


def train(model, opt, steps: range) -> None:
    for s in steps:
        micro = batches(s)
        total = sum(int(y.numel()) for _, y in micro)
        for i, (x, y) in enumerate(micro):
            with opt.autocast():
                _, loss, _ = model(x, y)
            opt.backward(loss / total, final=i == len(micro) - 1)
        assert opt.step().stepped


def make(model, name, precision, offload, tmp_path):
    return TrainingOptimizer(model, name, lr=LR.get(name, 1e-3), weight_decay=0.01, precision=precision, clip=0.5,
                             offload=offload, spill_dir=str(tmp_path) if offload == "disk" else None,
                             chunk_bytes=24 << 10)


def params(model):
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
@pytest.mark.parametrize("name", ALL)
def test_offload_is_bit_identical_with_clipping_and_accumulation(name, precision, tmp_path):
    """CPU and disk offload update chunk by chunk (whole parameters per chunk, so Adafactor's
    factored rows and columns and the 8-/4-bit blocks see whole tensors) on the same fp32 values:
    the trained parameters are equal to the bit. In fp32 also to the in-memory run; in bf16-master
    the host accumulates micro-batch gradients in fp32 where the device accumulates them in bf16,
    so the in-memory run is compared with cpu and disk only to a tolerance."""
    results = {}
    for offload in ("none", "cpu", "disk"):
        model = tiny_gpt()
        with make(model, name, precision, offload, tmp_path) as opt:
            train(model, opt, range(3))
            if offload != "none" or precision != "32-true":
                assert len(opt.streamed.chunks) > 1
            if precision == "bf16-master":
                assert all(p.dtype == torch.bfloat16 for p in model.parameters())
                assert all(m.dtype == torch.float32 for m in opt.streamed.masters)
                # The model's weights are the fp32 masters rounded to bf16, wherever the masters
                # live: each update copies them back, and that copy is one rounding, so bit for bit.
                masters = opt.state_dict()["streamed"]["masters"]
                for p, m in zip(model.parameters(), masters):
                    assert torch.equal(p.detach(), m.to(torch.bfloat16)), (name, offload)
        results[offload] = params(model)
    start = params(tiny_gpt())
    assert any(not torch.equal(a, b) for a, b in zip(results["none"], start))  # it trained
    for a, b in zip(results["cpu"], results["disk"]):
        assert torch.equal(a, b), (name, precision)
    moved = max((a - s).abs().max() for a, s in zip(results["none"], start))
    for a, b in zip(results["none"], results["cpu"]):
        if precision == "32-true":
            assert torch.equal(a, b), (name, precision)
        else:
            # The runs differ only in how the micro-batch gradients are summed (bf16 on the device,
            # fp32 on the host): one rounding of each gradient. Where a gradient is near 0 that can
            # flip the sign of an adaptive update (Adam, Lion, RMSprop take about lr per step
            # whatever the gradient's size), so a weight may move the other way: the two runs then
            # differ by up to what the three steps moved it, never more (seen: at most 0.53 of it).
            assert (a - b).abs().max() <= moved, (name, float((a - b).abs().max()), float(moved))


def test_disk_offload_gives_state_made_in_init_to_its_first_step(monkeypatch, tmp_path):
    """Adagrad builds its state in __init__; before torch 2.13 its step() reads state["sum"] without
    creating it. Disk offload builds each chunk's optimizer on empty placeholder masters, so the
    first update gets that state rebuilt on the loaded masters: simulated here, equal to the bit."""
    real = torch.optim.Adagrad._init_group

    def without_lazy_state(self, group, *args):
        for p in group["params"]:
            if p.grad is not None and "sum" not in self.state[p]:
                raise KeyError("sum")
        return real(self, group, *args)

    monkeypatch.setattr(torch.optim.Adagrad, "_init_group", without_lazy_state)
    results = {}
    for offload in ("none", "disk"):
        model = tiny_gpt()
        with make(model, "adagrad", "32-true", offload, tmp_path) as opt:
            train(model, opt, range(2))
        results[offload] = params(model)
    assert all(torch.equal(a, b) for a, b in zip(results["none"], results["disk"]))


@pytest.mark.parametrize("setup", [("32-true", "none"), ("bf16-master", "disk")])
@pytest.mark.parametrize("name", ALL)
def test_resume_is_bit_identical(name, setup, tmp_path):
    """2 steps, a weights-only checkpoint of model and optimizer, 2 more steps in a fresh process'
    objects: the same parameters as 4 uninterrupted steps."""
    precision, offload = setup
    model = tiny_gpt()
    with make(model, name, precision, offload, tmp_path / "a") as opt:
        train(model, opt, range(2))
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        train(model, opt, range(2, 4))
    straight = params(model)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = tiny_gpt()
    with make(resumed, name, precision, offload, tmp_path / "b") as opt:
        resumed.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train(resumed, opt, range(2, 4))
    for a, b in zip(straight, params(resumed)):
        assert torch.equal(a, b), name


@needs_torchao
@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_lowbit_state_stays_quantized_through_disk_offload(name, tmp_path):
    """The spill files hold codes and scales (not dequantized fp32), and they come back as such."""
    model = tiny_gpt()
    with make(model, name, "bf16-master", "disk", tmp_path) as opt:
        train(model, opt, range(2))
        keys = {(key, dtype) for c in opt.streamed.chunks for _, key, dtype, _, _ in c.layout if key}
        assert ("exp_avg_codes", torch.uint8) in keys and ("exp_avg_sq_scale", torch.float32) in keys
        sd = opt.state_dict()
    codes = [s["exp_avg_codes"] for c in sd["streamed"]["chunks"] for s in c["state"].values() if "exp_avg_codes" in s]
    assert codes and all(c.dtype == torch.uint8 for c in codes)
