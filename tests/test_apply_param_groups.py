"""TrainingOptimizer parameter groups: no weight decay on biases and norm weights, equal to torch's
AdamW with the same two groups, streamed (optimizer offload) or not; schedulers see every group."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from memfit.apply.optimizer import TrainingOptimizer
from memfit.core.errors import ConfigError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _train(model, opt, steps=3, memfit_opt=True):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8)
        loss = model(x).pow(2).mean()
        if memfit_opt:
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        if not memfit_opt:
            opt.zero_grad()


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_no_decay_group_equals_torch_adamw_with_two_groups(offload):
    ref, mine = _model(), _model()
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    rest = [p for p in ref.parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.1, weight_decay=0.5)
    _train(ref, torch_opt, memfit_opt=False)
    opt = TrainingOptimizer(mine, "adamw", lr=0.1, weight_decay=0.5, offload=offload, no_decay=True)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    _train(mine, opt)
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a, b)
    single = _model()  # the negative control: one group decays the norm weights too
    _train(single, TrainingOptimizer(single, "adamw", lr=0.1, weight_decay=0.5, offload=offload))
    assert not torch.equal(single[1].weight, mine[1].weight)


def test_torch_style_groups_and_a_scheduler_per_group():
    model = _model()
    w = [p for p in model.parameters() if p.dim() >= 2]
    b = [p for p in model.parameters() if p.dim() < 2]
    opt = TrainingOptimizer(model, "adamw", lr=0.1, offload="cpu",
                            groups=[{"params": w, "lr": 0.2}, {"params": b, "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.1]
    _train(model, opt, steps=1)
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]
    state = copy.deepcopy(opt.state_dict())
    for g in opt.param_groups:
        g["lr"] = 9.0
    opt.load_state_dict(state)  # the saved hyperparameters of each group come back
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


def test_a_parameter_in_no_group_is_one_line():
    model = _model()
    with pytest.raises(ConfigError, match="in no group"):
        TrainingOptimizer(model, "adamw", groups=[{"params": list(model[0].parameters())}])
