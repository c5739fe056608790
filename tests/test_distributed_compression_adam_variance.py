"""Adam mode's byte-free corrections (onebit.py): the batch second moment (var=batch) and the
local gradient clip taken from the optimizer; their spec options and refusals."""
from __future__ import annotations

import math

import pytest
import torch

from memfit.distributed.compression import CompressionState, parse_compression
from memfit.distributed.compression.onebit import LocalAdam, attach, batch_second_moment


def test_batch_second_moment_is_v_for_one_rank_and_lies_between_m2_and_v():
    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(1000, generator=g), torch.rand(1000, generator=g) * 4
    assert torch.equal(batch_second_moment(m, v, 1, 0.9), v)
    assert torch.equal(batch_second_moment(m, v, 2, 0.0), v)  # no momentum: m says nothing about mu
    out = batch_second_moment(m, v, 2, 0.9)
    lo, hi = torch.minimum(m * m, v), torch.maximum(m * m, v)
    assert bool(((out >= lo * (1 - 1e-6)) & (out <= hi * (1 + 1e-6))).all())


@pytest.mark.parametrize("world", [2, 4])
def test_batch_second_moment_estimates_adams_v_on_the_mean_gradient(world):
    """Noise-dominated coordinates: each rank's gradient is mu + N(0, 1) noise. Adam on the mean
    over `world` ranks sees E[g^2] = mu^2 + 1 / world; a rank's own v sees mu^2 + 1. The estimate
    from one rank's moments (bias-corrected, after 400 steps) lands on the former, not the latter."""
    b1, b2, n = 0.9, 0.99, 20000
    mu = torch.full((n,), 0.3)
    local = LocalAdam((b1, b2), 1e-12, batch_variance=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        local.direction("k", mu + torch.randn(n, generator=g), world)
    t = local.t["k"]
    m_hat, v_hat = local.m["k"] / (1 - b1 ** t), local.v["k"] / (1 - b2 ** t)
    est = float(batch_second_moment(m_hat, v_hat, world, b1).mean())
    target = 0.09 + 1 / world
    assert abs(est - target) < 0.1 * target
    assert float(v_hat.mean()) > 1.5 * target  # what var=rank uses: the noise counted `world` times


def test_batch_variance_direction_is_larger_in_noisy_coordinates_only():
    """var=batch divides by the smaller estimate where noise dominates; where the gradient is
    steady (v = m^2) both choices give the same direction."""
    rank, batch = LocalAdam((0.9, 0.95), 1e-8, False), LocalAdam((0.9, 0.95), 1e-8, True)
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        grad = torch.cat([torch.full((100,), 0.5), torch.randn(100, generator=g)])
        y_rank, y_batch = rank.direction("k", grad, 2), batch.direction("k", grad, 2)
    assert torch.allclose(y_rank[:100], y_batch[:100], rtol=1e-4)
    ratio = y_batch[100:].abs() / y_rank[100:].abs()
    c = 0.1 / 1.9  # (1 - b1) / (1 + b1): at most 1 / sqrt(k), k = (1/2 - c) / (1 - c), where m = 0
    assert 1.2 < float(ratio.median()) and float(ratio.max()) <= 1 / math.sqrt((0.5 - c) / (1 - c)) + 1e-4


def test_local_clip_defaults_to_the_optimizers_and_an_explicit_one_wins():
    from memfit.apply.optimizer import TrainingOptimizer

    lin = torch.nn.Linear(4, 4)
    for spec, clip, expected in [("sign:adam=2", 1.0, 1.0), ("sign:adam=2", None, None),
                                 ("sign:adam=2,clip=0.5", 1.0, 0.5), ("topk:0.01,adam=2,clip=inf", 1.0, math.inf)]:
        state = CompressionState(spec)
        attach(state, TrainingOptimizer(lin, "adamw", lr=1e-3, clip=clip))
        assert state.clip == expected, spec

    class Wrapper:  # memfit's DDPOptimizer: the clip sits on its inner TrainingOptimizer
        inner = TrainingOptimizer(lin, "adamw", lr=1e-3, clip=2.0)

    state = CompressionState("sign:adam=2")
    attach(state, Wrapper())
    assert state.clip == 2.0
    assert CompressionState("topk:0.01,clip=3").clip == 3.0  # DGC's local clip without adam mode


def test_var_defaults_and_spec_round_trip():
    assert parse_compression("topk:0.01,adam=5").variance == "batch"
    assert parse_compression("sign:adam=5").variance == "batch"
    spec = parse_compression("sign:adam=5,var=rank")
    assert spec.variance == "rank" and str(spec) == "sign,adam=5,var=rank"
    assert parse_compression(str(spec)) == spec
    assert CompressionState("sign:adam=5").local_adam.batch_variance
    assert not CompressionState("sign:adam=5,var=rank").local_adam.batch_variance
