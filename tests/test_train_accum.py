"""Gradient accumulation equals the large-batch step, with padding making micro-batches unequal."""
from __future__ import annotations

import copy

import pytest
import torch

from memfit.apply.optimizer import TrainingOptimizer
from memfit.train.loop import accumulate_grads, accumulate_step, lr_at
from memfit.models.gpt import GPT, GPTConfig


def _tiny() -> GPT:
    return GPT(GPTConfig(layers=2, hidden=32, heads=2, vocab=256, seq=16))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (6, 16))
    y = torch.randint(0, 256, (6, 16))
    # Padding (-1) in unequal amounts: the micro-batches below hold 1+4, 14+11 and 0+16 target
    # tokens, so a mean per micro-batch would weight a token by which micro-batch it fell in.
    y[0, 1:] = -1
    y[1, 4:] = -1
    y[2, 14:] = -1
    y[3, 11:] = -1
    y[4, :] = -1          # an all-padding row
    return x, y


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulated_grads_equal_the_large_batch():
    x, y = _batch()
    big = _tiny()
    acc = copy.deepcopy(big)
    opt_big, opt_acc = TrainingOptimizer(big, "sgd", lr=0.1), TrainingOptimizer(acc, "sgd", lr=0.1)

    loss_big, n_big = accumulate_grads(big, opt_big, [(x, y)])
    micro = [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])]
    loss_acc, n_acc = accumulate_grads(acc, opt_acc, micro)

    assert n_big == n_acc == int((y != -1).sum())
    assert loss_acc == pytest.approx(loss_big, rel=1e-6)
    g_big, g_acc = _grads(big), _grads(acc)
    assert g_big.keys() == g_acc.keys() and len(g_big) > 0
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-5, atol=1e-7, msg=name)

    # The mistake this guards against: averaging per-micro-batch means gives different grads.
    wrong = copy.deepcopy(big)
    wrong.zero_grad(set_to_none=True)
    for xm, ym in micro:
        _, loss, n = wrong(xm, ym)
        (loss / max(int(n), 1) / len(micro)).backward()
    diff = max((wrong.get_parameter(n).grad - g_big[n]).abs().max().item() for n in g_big)
    assert diff > 1e-4


def test_accumulate_step_updates_like_the_large_batch_step():
    x, y = _batch()
    big = _tiny()
    acc = copy.deepcopy(big)
    # Momentum SGD, not Adam: Adam divides by sqrt(v), which turns fp32 rounding noise in grads
    # that are zero in exact arithmetic (the key bias: softmax ignores it) into full-size steps.
    opt_big = TrainingOptimizer(big, "momentum", lr=0.5, clip=1.0)
    opt_acc = TrainingOptimizer(acc, "momentum", lr=0.5, clip=1.0)
    for _ in range(2):
        out_big = accumulate_step(big, opt_big, [(x, y)])
        out_acc = accumulate_step(acc, opt_acc, [(x[:3], y[:3]), (x[3:], y[3:])])
        assert out_acc.ntokens == out_big.ntokens
        assert out_acc.result.grad_norm == pytest.approx(out_big.result.grad_norm, rel=1e-5)
    for (name, p), q in zip(big.named_parameters(), acc.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
        assert q.grad is None  # the step zeroed the grads for the next accumulation


def test_all_padding_step_is_zero_not_nan():
    model = _tiny()
    opt = TrainingOptimizer(model, "sgd", lr=0.1)
    x = torch.randint(0, 256, (2, 16))
    loss, n = accumulate_grads(model, opt, [(x, torch.full_like(x, -1))])
    assert n == 0 and loss == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_lr_schedule_warms_up_then_decays_by_cosine():
    base = 1e-3
    assert lr_at(0, base, warmup=10, horizon=100) == pytest.approx(base / 10)
    assert lr_at(9, base, warmup=10, horizon=100) == pytest.approx(base)
    assert lr_at(55, base, warmup=10, horizon=100) == pytest.approx(base * (0.1 + 0.9 * 0.5))
    assert lr_at(100, base, warmup=10, horizon=100) == pytest.approx(base * 0.1)
    after = [lr_at(s, base, 10, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert lr_at(50, base, warmup=10, horizon=None) == base  # horizon not yet fitted: hold the peak
    assert lr_at(0, base, warmup=10, horizon=20) == pytest.approx(base / 4)  # warm-up capped at 20 // 5 steps


def test_accumulation_lowers_the_tracked_peak():
    from memfit.core.tracker import track
    x, y = torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))
    base = GPT(GPTConfig(layers=2, hidden=64, heads=2, vocab=256, seq=16))
    peaks, acts = {}, {}
    for micro in (8, 2):
        model = copy.deepcopy(base)
        opt = TrainingOptimizer(model, "adamw", lr=1e-3)
        batches = [(x[i:i + micro], y[i:i + micro]) for i in range(0, 8, micro)]
        accumulate_step(model, opt, batches)  # the optimizer state exists from here on
        with track(model, opt) as t:
            accumulate_step(model, opt, batches)
        peaks[micro], acts[micro] = t.peak_bytes, t.breakdown["activations"]
    # Activations held at the peak scale with the micro-batch: 4x smaller micro-batches, ~4x fewer.
    assert acts[2] < 0.4 * acts[8]
    assert peaks[2] < peaks[8]
