"""Model-state formulas: the ZeRO paper's published numbers, real optimizer state, and invariants."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

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
    assert parse_bytes("16G") == 16 * 2**30
    assert parse_count("7B") == 7 * 10**9 and parse_count("124M") == 124 * 10**6 and parse_count("1.5e9") == 1_500_000_000
    for bad in ("-1GiB", "lots", "12 parsecs", "0"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    assert math.isclose(parse_count("0.5k"), 500)
