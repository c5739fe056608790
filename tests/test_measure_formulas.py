"""Model-state formulas: the ZeRO paper's published numbers, real optimizer state, and invariants."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from memfit.apply.torch_optim import make_torch_optimizer
from memfit.core.errors import ConfigError
from memfit.measure.formulas import PRECISIONS, bytes_per_param, model_state_bytes
from memfit.core.units import parse_bytes, parse_count

GB = 1e9

# ZeRO (Rajbhandari et al., 2020), Table 1: per-device GB for mixed-precision Adam (K = 12),
# columns P_os, P_os+g, P_os+g+p, by data-parallel degree.
ZERO_TABLE_7_5B = {
    1: (120, 120, 120),
    4: (52.5, 41.3, 30),
    16: (35.6, 21.6, 7.5),
    64: (31.4, 16.6, 1.88),
    256: (30.4, 15.4, 0.47),
    1024: (30.1, 15.1, 0.12),
}


@pytest.mark.parametrize("world,expected", ZERO_TABLE_7_5B.items())
def test_zero_paper_table_7_5b(world, expected):
    got = [model_state_bytes(7_500_000_000, "16-master", "adam", zero=z, world=world).total / GB for z in (1, 2, 3)]
    for g, e in zip(got, expected):
        # The paper rounds to 3 significant figures.
        assert g == pytest.approx(e, rel=0.006, abs=0.006), (world, got, expected)


def test_zero_paper_baseline_and_large_models():
    # Figure 1: baseline 120 GB; the 1-trillion-parameter model on 1024 devices with P_os+g+p: 15.6 GB.
    assert model_state_bytes(7_500_000_000, "16-master", "adam").total == 120 * 10**9
    assert model_state_bytes(10**12, "16-master", "adam", zero=3, world=1024).total / GB == pytest.approx(15.6, abs=0.05)
    assert model_state_bytes(128 * 10**9, "16-master", "adam").total / GB == pytest.approx(2048)


def _real_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


@pytest.mark.parametrize("name,make", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("adam", lambda p: torch.optim.Adam(p)),
    ("adamw", lambda p: torch.optim.AdamW(p)),
    ("adagrad", lambda p: torch.optim.Adagrad(p)),
    ("rmsprop", lambda p: torch.optim.RMSprop(p)),
])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "32-true"), (torch.bfloat16, "bf16-true")])
def test_formula_matches_real_optimizer_state(name, make, dtype, precision):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(dtype)
    opt = make(model.parameters())
    model(torch.randn(4, 16, dtype=dtype)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    f = model_state_bytes(n, precision, name, n_tensors=len(list(model.parameters())))
    assert f.params == sum(p.numel() * p.element_size() for p in model.parameters())
    assert f.grads == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert f.optimizer == _real_state_bytes(opt)


def test_master_modes_count_fp32_master_in_optimizer():
    b = bytes_per_param("bf16-master", "adamw")
    assert (b.weights, b.grads, b.optimizer) == (2, 2, 12)
    assert bytes_per_param("16-mixed", "adamw") == bytes_per_param("32-true", "adamw")


def test_offload_moves_optimizer_bytes_off_device():
    on = model_state_bytes(10**9, "bf16-master", "adamw", zero=1, world=8)
    off = model_state_bytes(10**9, "bf16-master", "adamw", zero=1, world=8, offload_optimizer="cpu")
    assert off.optimizer == 0 and off.grads == 0 and off.offloaded == on.optimizer + on.grads
    assert off.params == on.params


@given(
    n=st.integers(1, 10**13),
    precision=st.sampled_from(PRECISIONS),
    optimizer=st.sampled_from(["sgd", "momentum", "adam", "adamw", "lion"]),
    world=st.integers(1, 4096),
)
def test_sharding_invariants(n, precision, optimizer, world):
    stages = [model_state_bytes(n, precision, optimizer, zero=z, world=world) for z in range(4)]
    # Each stage shards more: totals never increase.
    assert all(a.total >= b.total for a, b in zip(stages, stages[1:]))
    # Shards cover the whole model: N devices hold at least the unsharded bytes, padding < N elements each.
    full, z3 = stages[0], stages[3]
    assert z3.total * world >= full.total
    assert z3.total * world - full.total < world * bytes_per_param(precision, optimizer).weights * 16
    if world == 1:
        assert all(s == full for s in stages)


@pytest.mark.parametrize("bad", [
    dict(n_params=0), dict(n_params=-5), dict(n_params=10, precision="fp8"), dict(n_params=10, optimizer="adamax2"),
    dict(n_params=10, zero=4), dict(n_params=10, world=0), dict(n_params=10, offload_optimizer="gpu"),
])
def test_bad_input_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        model_state_bytes(**bad)


def test_units():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80MB") == 80 * 10**6 and parse_bytes("80MiB") == 80 * 2**20 and parse_bytes("512") == 512
    for bare, hint in (("16G", "16GiB"), ("80M", "80MiB"), ("2t", "2TiB"), ("64k", "64KiB")):
        with pytest.raises(ConfigError, match=f"bare .*{hint}.*decimal"):  # binary or decimal: the user says which
            parse_bytes(bare)
    assert parse_count("7B") == 7 * 10**9 and parse_count("124M") == 124 * 10**6 and parse_count("1.5e9") == 1_500_000_000
    for bad in ("-1GiB", "lots", "12 parsecs", "0"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    assert math.isclose(parse_count("0.5k"), 500)


# ---------------------------------------------------------------- every optimizer, exactly
from memfit.apply import lowbit, optimizers  # noqa: E402
from memfit.measure.formulas import optimizer_state_bytes, param_shapes  # noqa: E402

_needs_torchao = pytest.mark.skipif(not lowbit.available(), reason="torchao (memfit[lowbit]) is not installed")
ALL_OPTIMIZERS = [pytest.param(n, marks=[_needs_torchao] if optimizers.info(n).extra else []) for n in optimizers.NAMES]
GRID_SPEC = "gpt:layers=1,hidden=64,heads=2,vocab=256,seq=32"  # matrices >= 4096 elements: quantized


@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "32-true"), (torch.bfloat16, "bf16-true")])
def test_shape_formula_matches_real_state(name, dtype, precision):
    """Per tensor shape: Adafactor's row and column factors, the 8-/4-bit codes and block scales
    (a 5000-element tensor ends in a partial block), fp32 moments for small tensors."""
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 3)).to(dtype)
    opt = make_torch_optimizer(name, model.parameters(), 1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    shapes = param_shapes(model)
    assert optimizer_state_bytes(name, shapes, precision) == _real_state_bytes(opt)
    n = sum(p.numel() for p in model.parameters())
    ms = model_state_bytes(n, precision, name, param_shapes=shapes)
    assert ms.optimizer == _real_state_bytes(opt)


def _offloaded_state_bytes(opt, precision: str) -> int:
    """Optimizer state held off the device, read back through state_dict (host RAM or spill files),
    plus the fp32 master copy in the -master modes."""
    sd = opt.state_dict()["streamed"]
    state = sum(t.numel() * t.element_size() for c in sd["chunks"] for s in c["state"].values()
                for t in s.values() if torch.is_tensor(t))
    masters = sum(m.numel() * m.element_size() for m in sd["masters"]) if precision.endswith("-master") else 0
    return state + masters


def _grid():
    """Every optimizer x (32-true, bf16-master) x (none, cpu, disk); the default run keeps a covering
    half (each optimizer with each offload, precisions alternating), --runslow the rest."""
    out = []
    for i, p in enumerate(ALL_OPTIMIZERS):
        for j, offload in enumerate(("none", "cpu", "disk")):
            for k, precision in enumerate(("32-true", "bf16-master")):
                marks = list(p.marks) + ([] if (i + j) % 2 == k else [pytest.mark.slow])
                out.append(pytest.param(p.values[0], precision, offload, marks=marks))
    return out


@pytest.mark.parametrize("name,precision,offload", _grid())
def test_estimate_equals_tracker_for_every_optimizer(name, precision, offload, tmp_path):
    """memfit.estimate (formulas + a FakeTensorMode trace) against real steps under the tracker.
    Without offload the whole breakdown agrees to the byte; with offload the device holds no
    optimizer state and the bytes the estimate moves off the device are the state the offloaded
    optimizer really holds."""
    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.core.tracker import MemoryTracker
    from memfit.measure.estimate import estimate
    from memfit.measure.trace import measure_step
    from memfit.models.spec import parse_model

    spec = parse_model(GRID_SPEC)
    est = estimate(spec, batch=2, seq=32, precision=precision, optimizer=name, offload_optimizer=offload)
    shapes = param_shapes(spec)
    n = sum(math.prod(s) for s in shapes)
    on_device = model_state_bytes(n, precision, name, param_shapes=shapes)
    if offload == "none":
        real = measure_step(spec, batch=2, seq=32, precision=precision, optimizer=name, allocator=False)
        assert est.per_device == real.breakdown()
        assert est.per_device["optimizer"] == on_device.optimizer
        return
    torch.manual_seed(0)
    model = spec.build(seq=32)
    with TrainingOptimizer(model, name, precision=precision, offload=offload,
                           spill_dir=str(tmp_path) if offload == "disk" else None) as opt:
        with MemoryTracker(model, opt) as tracker:
            for _ in range(2):
                x = torch.randint(0, 256, (2, 32))
                with opt.autocast():
                    _, loss, count = model(x, x)
                opt.backward(loss / count)
                opt.step()
        assert est.per_device["optimizer"] == tracker.breakdown["optimizer"] == 0
        assert est.offloaded - on_device.grads == on_device.optimizer == _offloaded_state_bytes(opt, precision)
