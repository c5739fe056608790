"""The optimizer set: one registry for every entry point, Lion against its published rule, 8-/4-bit
AdamW against torchao's quantization and against AdamW, clear errors for unknown names and a
missing extra."""
from __future__ import annotations

import math

import pytest
import torch

from memfit.apply import lowbit, optimizers
from memfit.apply.optimizer import OPTIMIZERS, TrainingOptimizer, make_torch_optimizer
from memfit.cli import build_parser, main
from memfit.core.errors import ConfigError
from memfit.measure.formulas import OPTIMIZER_STATES

needs_torchao = pytest.mark.skipif(not lowbit.available(), reason="torchao (memfit[lowbit]) is not installed")
ALL = [pytest.param(n, marks=[needs_torchao] if optimizers.info(n).extra else []) for n in optimizers.NAMES]


def test_one_set_everywhere():
    expected = {"sgd", "momentum", "adam", "adamw", "adagrad", "rmsprop", "lion", "adafactor", "adamw8bit", "adamw4bit"}
    assert set(optimizers.NAMES) == expected
    assert set(OPTIMIZERS) == expected and set(OPTIMIZER_STATES) == expected
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for cmd in ("estimate", "train", "track"):
        action = next(a for a in sub.choices[cmd]._actions if a.dest == "optimizer")
        assert set(action.choices) == expected, cmd


RATIO_20_STEPS = {"sgd": 0.4057, "momentum": 0.1317, "adam": 0.2648, "adamw": 0.2648, "adagrad": 0.000427,
                  "rmsprop": 0.000495, "lion": 0.6914, "adafactor": 0.4176, "adamw8bit": 0.2651, "adamw4bit": 0.3408}


@pytest.mark.parametrize("name", ALL)
def test_every_optimizer_trains_a_step(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    x, y = torch.randn(32, 96), torch.randn(32, 4)
    lr = {"sgd": 0.05, "momentum": 0.02, "adagrad": 0.02, "lion": 3e-4, "adafactor": 0.01}.get(name, 1e-3)
    with TrainingOptimizer(model, name, lr=lr, clip=1.0) as opt:
        losses = []
        for _ in range(20):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.backward(loss)
            opt.step()
            losses.append(float(loss.detach()))
    # Seeded and deterministic on CPU: torch 2.13.0 and 2.14.1 give the same 20-step loss ratios to
    # 1e-6. Each bound is that ratio plus 10%, headroom for a BLAS that sums in another order; an
    # update rule that is slowed (a lost momentum, a wrong bias correction) lands above it.
    assert losses[-1] < 1.1 * RATIO_20_STEPS[name] * losses[0], (name, losses[-1] / losses[0])


def test_unknown_optimizer_is_a_config_error_and_exit_2(capsys):
    with pytest.raises(ConfigError, match="accepted: sgd"):
        TrainingOptimizer(torch.nn.Linear(2, 2), "adamax2")
    assert main(["estimate", "gpt2", "--optimizer", "adamax2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "adamax2" in err


def test_adafactor_without_shapes_says_what_would_work(capsys):
    assert main(["estimate", "--params", "7B", "--optimizer", "adafactor"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give a model" in err


def test_missing_extra_names_it(monkeypatch, capsys):
    import sys

    lowbit._torchao.cache_clear()
    for mod in ("torchao", "torchao.optim"):
        monkeypatch.setitem(sys.modules, mod, None)  # importing it now raises ImportError
    try:
        with pytest.raises(ConfigError, match=r"memfit\[lowbit\]"):
            TrainingOptimizer(torch.nn.Linear(2, 2), "adamw8bit")
        assert main(["estimate", "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=16", "--optimizer", "adamw4bit"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "memfit[lowbit]" in err
    finally:
        lowbit._torchao.cache_clear()


def test_lion_follows_the_published_rule():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    ref, m = p.detach().clone(), torch.zeros(50)
    lr, b1, b2, wd = 1e-2, 0.9, 0.99, 0.1
    opt = make_torch_optimizer("lion", [p], lr, wd, betas=(b1, b2))
    for _ in range(5):
        g = torch.randn(50)
        p.grad = g.clone()
        opt.step()
        c = b1 * m + (1 - b1) * g
        ref = ref - lr * (torch.sign(c) + wd * ref)
        m = b2 * m + (1 - b2) * g
        torch.testing.assert_close(p.detach(), ref)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m)


@needs_torchao
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_lowbit_codes_equal_torchaos_quantizer(bits, signed):
    quant_utils = lowbit._torchao()[0]
    x = torch.randn(20000).clamp(-1, 1)
    x[:6] = torch.tensor([1.0, -1.0, 0.0, 1e-7, 0.5, -0.25])
    if not signed:
        x = x.abs()
    qmap = lowbit._qmap(bits, signed)
    ref = (quant_utils.quantize_8bit_with_qmap if bits == 8 else quant_utils.quantize_4bit_with_qmap)(x, qmap)
    assert torch.equal(lowbit._nearest(x, bits, signed), ref.int())


@needs_torchao
@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.15)])
def test_lowbit_roundtrip_error_is_bounded(bits, tol):
    x = torch.randn(5000 * 128 // 128 * 2)  # not a multiple of the block size either way
    x = x[:9999]
    block = lowbit.BITS[bits]
    padded = torch.cat([x, x.new_zeros(-len(x) % block)])
    codes, scale = lowbit._encode(padded, bits, signed=True)
    assert codes.numel() == lowbit.code_bytes(len(padded), bits) and scale.numel() == len(padded) // block
    back = lowbit._decode(codes, scale, bits, signed=True)[: len(x)]
    rel = (back - x).abs().max(-1).values / x.abs().max()
    assert float(rel) < tol


@needs_torchao
@pytest.mark.parametrize("name,tol", [("adamw8bit", 0.08), ("adamw4bit", 0.5)])
def test_lowbit_follows_adamw(name, tol):
    """Quantized moments change the trajectory, not its direction: after 30 steps of a regression
    the parameters moved by AdamW and by its 8-bit form differ by ~4% (4-bit: ~35%)."""
    torch.manual_seed(0)
    w0 = torch.randn(64, 130)  # 8320 elements: quantized, the last block partial
    x, y = torch.randn(256, 130), torch.randn(256, 64)
    finals = {}
    for opt_name in ("adamw", name):
        w = torch.nn.Parameter(w0.clone())
        opt = make_torch_optimizer(opt_name, [w], 1e-2, 0.01, betas=(0.9, 0.999))
        for _ in range(30):
            w.grad = None
            torch.nn.functional.mse_loss(x @ w.T, y).backward()
            opt.step()
        finals[opt_name] = w.detach() - w0
    diff = (finals[name] - finals["adamw"]).norm() / finals["adamw"].norm()
    assert float(diff) < tol
    state = opt.state[w]
    assert state["exp_avg_codes"].dtype == torch.uint8 and state["exp_avg_scale"].dtype == torch.float32


def test_state_format_choices_need_permission():
    assert optimizers.state_format_choices("adamw") == ["adamw"]
    assert optimizers.state_format_choices("adamw", allow=("optimizer-states",)) == ["adamw", "adamw8bit", "adamw4bit"]
    assert optimizers.state_format_choices("sgd", allow=("optimizer-states",)) == ["sgd"]
    d = optimizers.describe()
    assert d["adamw"]["bytes_per_param"] == 8 and d["adamw"]["lossless"]
    assert d["adamw8bit"]["bytes_per_param"] == pytest.approx(2 + 8 / 256) and not d["adamw8bit"]["lossless"]
    assert d["adamw4bit"]["bytes_per_param"] == pytest.approx(1 + 8 / 128)
    assert d["adafactor"]["bytes_per_param"] == pytest.approx(8 / 1024)
    assert all(math.isfinite(r["bytes_per_param"]) for r in d.values())


@needs_torchao
@pytest.mark.slow  # torchao's optimizers compile their update (tens of seconds on 2 cores)
@pytest.mark.parametrize("bits", [8, 4])
def test_lowbit_equals_torchaos_optimizer(bits):
    """The same update as torchao's AdamW8bit / AdamW4bit (which keep their state as tensor
    subclasses and compile the step), to float rounding."""
    from torchao.optim import AdamW4bit, AdamW8bit

    torch.manual_seed(0)
    w0, x, y = torch.randn(64, 128), torch.randn(256, 128), torch.randn(256, 64)
    finals = []
    for make in (lambda p: make_torch_optimizer(f"adamw{bits}bit", p, 1e-2, 0.01, betas=(0.9, 0.999)),
                 lambda p: (AdamW8bit if bits == 8 else AdamW4bit)(p, lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999))):
        w = torch.nn.Parameter(w0.clone())
        opt = make([w])
        for _ in range(30):
            w.grad = None
            torch.nn.functional.mse_loss(x @ w.T, y).backward()
            opt.step()
        finals.append(w.detach() - w0)
    assert float((finals[0] - finals[1]).norm() / finals[1].norm()) < 1e-3


@needs_torchao
def test_lowbit_trace_equals_real_step_on_many_slices():
    """Under FakeTensorMode the 8-bit update runs only the first and last slices of a tensor (the
    rest allocate alike): the traced step still equals the real one to the byte, here with
    1M-element matrices of 16 slices."""
    from memfit.measure.trace import measure_step, trace_step

    spec = "gpt:layers=1,hidden=512,heads=2,vocab=256,seq=16"
    pred = trace_step(spec, batch=1, seq=16, optimizer="adamw8bit")
    real = measure_step(spec, batch=1, seq=16, optimizer="adamw8bit", allocator=False)
    assert pred.breakdown() == real.breakdown()
