"""Optimizer offload puts masters and state in host memory even when the model is elsewhere.

On a CPU-only machine the model's device *is* host memory, so a mechanism that left its state beside
the model would pass every CPU test. Here the model lives on the meta device (under FakeTensorMode, so
a whole step runs without memory): "cpu" offload must put masters and every state tensor on the CPU,
no offload must keep them beside the model, and the model's parameters must stay where they were."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.apply.optimizer import TrainingOptimizer


def _step_on_meta(offload: str | None, precision: str, optimizer: str = "adamw"):
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = nn.Sequential(nn.Linear(8, 16, device="meta"), nn.ReLU(), nn.Linear(16, 8, device="meta"))
        opt = TrainingOptimizer(model, optimizer, lr=1e-3, precision=precision, offload=offload)
        model(torch.empty(2, 8, device="meta")).float().sum().backward()
        opt.step()
        opt.zero_grad()
        state = [t for t in opt.state_tensors() if t.numel() > 1]  # Adam's step counters are scalars
        return model, state


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cpu_offload_keeps_state_in_host_memory(precision, optimizer):
    model, state = _step_on_meta("cpu", precision, optimizer)
    assert state, "the optimizer holds no state tensors to check"
    assert {t.device.type for t in state} == {"cpu"}
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_no_offload_keeps_state_beside_the_model():
    model, state = _step_on_meta(None, "bf16-master")
    assert state and {t.device.type for t in state} == {"meta"}
