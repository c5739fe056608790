"""Adam mode's residual units (spec owe=): with owe=step (the default) the residual holds lr-scaled
steps, so what the optimizer applies plus what is still owed is the sum of lr_t y_t whatever the
schedule; owe=direction keeps unscaled directions. One rank, its gather stubbed; the multi-rank
runs are in test_distributed_compression_adam.py."""
from __future__ import annotations

import pytest
import torch

from memfit.core.errors import ConfigError
from memfit.distributed.compression import CompressionState, parse_compression
from memfit.distributed.compression import state as state_module
from memfit.distributed.compression.onebit import LocalAdam, attach


def _one_rank(monkeypatch, spec: str, lr: float):
    """A state on one rank (the gather returns its own payload), bound to an AdamW at `lr`."""
    monkeypatch.setattr(CompressionState, "world", property(lambda self: 1))
    monkeypatch.setattr(state_module, "gather_parts", lambda parts, group, traffic: [parts])
    state = CompressionState(spec)
    w = torch.nn.Parameter(torch.zeros(400))
    opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    attach(state, opt)
    return state, w, opt


@pytest.mark.parametrize("spec", ["topk:0.05,adam=0", "sign:adam=0"])
def test_owed_steps_are_applied_at_the_lr_that_computed_them(monkeypatch, spec):
    """Under a changing lr: the weight's total movement + the residual == -sum(lr_t y_t) (rounding)."""
    state, w, opt = _one_rank(monkeypatch, spec, lr=0.01)
    twin = LocalAdam((0.9, 0.95), 1e-8)  # the rank's moments, computed again: y_t
    g = torch.Generator().manual_seed(5)
    owed = torch.zeros(400, dtype=torch.float64)
    for step, lr in enumerate([0.01, 0.03, 0.001, 0.02, 0.005, 0.04]):
        opt.param_groups[0]["lr"] = lr
        grad = torch.randn(400, generator=g) * torch.linspace(0.1, 2.0, 400)
        owed += lr * twin.direction(0, grad).double()
        w.grad = state.exchange(grad, key=0)  # what DDP's hook hands the optimizer
        opt.step()
        state.end_step()
        residual = state.feedback.residual[0].double()
        assert torch.allclose(-w.detach().double() + residual, owed, rtol=0, atol=1e-6 * float(owed.abs().max()))
    assert state.update_phase and state.spec.owed == "step"


def test_owe_direction_keeps_unscaled_directions(monkeypatch):
    """owe=direction: residual + sent == direction + old residual, in direction units, at any lr."""
    state, w, opt = _one_rank(monkeypatch, "topk:0.05,adam=0,owe=direction", lr=0.02)
    twin = LocalAdam((0.9, 0.95), 1e-8)
    g = torch.Generator().manual_seed(6)
    residual = torch.zeros(400)
    for _ in range(4):
        grad = torch.randn(400, generator=g)
        y = twin.direction(0, grad)
        before = w.detach().clone()
        w.grad = state.exchange(grad, key=0)
        opt.step()
        sent = (before - w.detach()) / 0.02
        assert torch.allclose(sent + state.feedback.residual[0], y + residual, rtol=0, atol=1e-5)
        residual = state.feedback.residual[0]
        state.end_step()


def test_a_state_without_an_optimizer_sends_directions():
    """No attach(), no lr: owe=step has nothing to scale by, and the residual is in direction units."""
    assert CompressionState("topk:0.01,adam=0")._step_lr() == 1.0


def test_owe_spec_round_trips_and_bad_values_are_refused():
    assert parse_compression("sign:adam=5").owed == "step"
    spec = parse_compression("sign:adam=5,owe=direction")
    assert spec.owed == "direction" and str(spec) == "sign,adam=5,owe=direction"
    assert parse_compression(str(spec)) == spec
    for bad, message in (("sign:adam=5,owe=lr", "accepted: step, direction"), ("topk:0.01,owe=step", "add adam=W")):
        with pytest.raises(ConfigError) as info:
            parse_compression(bad)
        assert message in str(info.value) and "\n" not in str(info.value)
