"""Adam-mode top-k's choice of elements (spec select=, onebit.agreement): the ranking, the
error-feedback invariant under it, the state's wiring (one rank, its gather stubbed), and spec
refusals. The multi-rank runs are in test_distributed_compression_adam.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.distributed.compression import CompressionState, parse_compression
from memfit.distributed.compression import state as state_module
from memfit.distributed.compression.onebit import WIRE_SCALE, agreement
from memfit.distributed.compression.topk import decode_topk, encode_topk_per_segment, k_for


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.01, 0.1, 0.5]))
def test_weighted_topk_keeps_the_largest_scores_and_sends_x(seed, ratio):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(300, generator=g), torch.randn(300, generator=g)
    sizes = (100, 200)
    weight = agreement(x, y)
    sent = decode_topk(encode_topk_per_segment(x, ratio, sizes, torch.float32, weight), 300)
    score = (x * y).clamp(min=0)
    assert torch.equal(score, x.abs() * weight)  # the score is max(0, x y)
    for lo, n in ((0, 100), (100, 200)):  # per tensor: the k best scores, and x itself at them
        kept = sent[lo:lo + n] != 0
        assert int(kept.sum()) == k_for(n, ratio)
        assert float(score[lo:lo + n][kept].min()) >= float(score[lo:lo + n][~kept].max())
        assert torch.equal(sent[lo:lo + n][kept], x[lo:lo + n][kept])


def test_agreement_holds_back_the_residual_where_the_direction_turned():
    x = torch.tensor([5.0, -5.0, 1.0, -0.5])
    y = torch.tensor([1.0, 1.0, 0.25, -1.0])  # element 1: owed -5 but Adam now points +1
    assert agreement(x, y).tolist() == [1.0, 0.0, 0.25, 1.0]
    sent = decode_topk(encode_topk_per_segment(x, 0.5, None, torch.float32, agreement(x, y)), 4)
    assert sent.tolist() == [5.0, 0.0, 0.0, -0.5]  # |x| alone would send 5 and -5


def _one_rank(monkeypatch, spec: str) -> CompressionState:
    """A state whose collectives are those of a single rank: the gather returns its own payload."""
    monkeypatch.setattr(CompressionState, "world", property(lambda self: 1))
    monkeypatch.setattr(state_module, "gather_parts", lambda parts, group, traffic: [parts])
    return CompressionState(spec)


@pytest.mark.parametrize("select", ["agree", "gain", "x"])
def test_adam_mode_sends_the_selected_elements_with_exact_error_feedback(monkeypatch, select):
    spec = f"topk:0.05,adam=0,select={select}"
    state, twin = _one_rank(monkeypatch, spec), CompressionState("topk:0.05,adam=0")  # twin: the moments
    g = torch.Generator().manual_seed(3)
    residual = torch.zeros(400)
    for step in range(6):
        grad = torch.randn(400, generator=g) * torch.linspace(0.1, 2.0, 400)
        y = twin.local_adam.direction(0, grad)
        x = y + residual
        out = state.exchange(grad, key=0, sizes=[150, 250]) / WIRE_SCALE  # one rank: the mean is what it sent
        new_residual = state.feedback.residual[0]
        assert torch.equal(out + new_residual, x)  # error feedback exact under either choice
        m = twin.local_adam.m[0]  # gain: the first moment, so x m is the first-order loss decrease
        score = {"agree": (x * y).clamp(min=0), "gain": (x * m).clamp(min=0), "x": x.abs()}[select]
        for lo, n in ((0, 150), (150, 250)):
            kept = out[lo:lo + n] != 0
            assert int(kept.sum()) == k_for(n, 0.05)
            assert float(score[lo:lo + n][kept].min()) >= float(score[lo:lo + n][~kept].max())
        residual = new_residual
        state.end_step()
    assert state.update_phase


@pytest.mark.parametrize("other", ["select=x", "select=gain"])
def test_the_choices_send_different_elements(monkeypatch, other):
    agree = _one_rank(monkeypatch, "topk:0.05,adam=0,select=agree")
    plain = CompressionState(f"topk:0.05,adam=0,{other}")
    g = torch.Generator().manual_seed(4)
    differ = False
    for _ in range(6):
        grad = torch.randn(400, generator=g) * torch.linspace(0.1, 3.0, 400)  # unequal scales: m differs from y
        a, b = agree.exchange(grad, key=0), plain.exchange(grad.clone(), key=0)
        differ |= not torch.equal(a != 0, b != 0)
        agree.end_step(), plain.end_step()
    assert differ


def test_select_defaults_and_spec_round_trip():
    assert parse_compression("topk:0.01,adam=5").selection == "gain"
    spec = parse_compression("topk:0.01,adam=5,select=x")
    assert spec.selection == "x" and str(spec) == "topk:0.01,adam=5,select=x"
    assert parse_compression(str(spec)) == spec
