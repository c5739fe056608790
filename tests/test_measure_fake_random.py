"""A model that branches in Python on a random scalar (LayerDrop) is traced, not refused: the draw
takes the top of its range, so no layer is skipped, as in a real run with layerdrop 0."""
from __future__ import annotations

import torch
import torch.nn as nn

import memfit
from memfit.measure.fake_random import TOP, top_of_range_draws
from test_measure_anymodel import real_peak


class LayerDropMLP(nn.Module):
    def __init__(self, layerdrop: float):
        super().__init__()
        self.layerdrop = layerdrop
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3))
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        for b in self.blocks:
            if self.training and torch.rand([]) < self.layerdrop:  # the transformers <= 5.17 idiom
                continue
            x = x + b(x)
        return nn.functional.cross_entropy(self.head(x), y)


def test_layerdrop_model_is_estimated_exactly():
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    torch.manual_seed(0)
    model = LayerDropMLP(0.0)
    est = memfit.estimate(model, (x, y))
    peak, _ = real_peak(model, x, y)
    assert est.total == peak


def test_layerdrop_estimate_is_the_worst_case_no_layer_skipped():
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    kept = memfit.estimate(LayerDropMLP(0.0), (x, y)).total
    assert memfit.estimate(LayerDropMLP(0.9), (x, y)).total == kept


def test_only_one_element_fake_draws_get_a_value_and_torch_is_restored():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rand, rand_like = torch.rand, torch.rand_like
    with FakeTensorMode(), top_of_range_draws():
        assert torch.rand([]).item() == TOP and torch.rand_like(torch.empty(1, 1)).item() == TOP
        assert torch.rand(4).constant is None
        assert not bool(torch.rand(1) < 0.999)
    assert torch.rand is rand and torch.rand_like is rand_like
    with top_of_range_draws():
        assert torch.rand(1000).max().item() < TOP + 1e-9 and torch.rand(1000).std() > 0.1  # real draws untouched
