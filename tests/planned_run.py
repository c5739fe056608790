"""A planned model's real steps against the plain model: the check the planner's apply tests share."""
from __future__ import annotations

import torch

import memfit


def tracked_steps_match_plain(model, plain, opt, x) -> int:
    """Two tracked steps of `model` (the second holds optimizer state: the steady-state peak), whose first
    step's gradients must equal `plain`'s bit for bit; returns the tracker's peak bytes."""
    plain(x, x)[1].backward()
    with memfit.track(model, opt) as tr:
        for step in range(2):
            with opt.autocast():
                loss = model(x, x)[1]
            opt.backward(loss)
            if step == 0:
                for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                    assert torch.equal(p.grad, q.grad), name
            opt.step()
    return tr.peak_bytes
