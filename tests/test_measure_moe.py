"""Mixture of experts (HF Mixtral): traced under FakeTensorMode in fp32 (grouped and eager experts), balanced
routing within 3% of the allocator on a real step with the router biased to route so, and the worst case an
upper bound of the measured worst routing."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from memfit.cli import main
from memfit.measure.moe import expert_counts, force_routing, routing
from memfit.measure.trace import measure_step, trace_step

transformers = pytest.importorskip("transformers")


def config(**extra):
    return transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=256, **extra)


def builder(impl: str, how: str | None = None):
    def build():
        model = transformers.AutoModelForCausalLM.from_config(config())
        model.set_experts_implementation(impl)
        if how is not None:
            force_routing(model, how)
        return model
    return build


@given(st.integers(1, 500), st.integers(1, 4), st.integers(4, 16))
def test_expert_counts(tokens, k, experts):
    balanced, worst = expert_counts(tokens, k, experts, "balanced"), expert_counts(tokens, k, experts, "worst")
    assert sum(balanced) == sum(worst) == tokens * k
    assert max(balanced) - min(balanced) <= 1 and worst[0] == tokens and max(worst) == tokens


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_balanced_within_3pct_and_worst_never_exceeded(impl):
    measured = {}
    for how in ("balanced", "worst"):
        with routing(how):
            pred = trace_step(builder(impl), 4, 64)
        real = measure_step(builder(impl, how), 4, 64)
        measured[how] = (pred.peak, real.allocator_peak)
        assert pred.activations > 0 and any(name.endswith("mlp.experts") for name in pred.modules)
    pred, real = measured["balanced"]
    assert abs(pred - real) <= 0.03 * real
    worst_pred, worst_real = measured["worst"]
    assert worst_pred >= worst_real and worst_pred >= pred


def test_force_routing_routes_as_asked():
    import torch

    model = builder("eager", "worst")()
    seen = []
    gate = model.model.layers[0].mlp.gate
    gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
    model(input_ids=torch.randint(0, 256, (2, 16)))
    counts = torch.bincount(seen[0].flatten(), minlength=4).tolist()
    assert counts == expert_counts(32, 2, 4, "worst")


def test_cli_mixtral_config_experts_rows_and_routing(tmp_path, capsys):
    path = tmp_path / "config.json"
    config(architectures=["MixtralForCausalLM"]).to_json_file(path)
    assert main(["estimate", str(path), "--batch", "2", "--seq", "64", "--modules", "1"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.experts" in out and "model.layers.1.mlp.experts" in out
    totals = {}
    for how in ("balanced", "worst"):
        assert main(["estimate", str(path), "--batch", "2", "--seq", "64", "--routing", how, "--json"]) == 0
        totals[how] = json.loads(capsys.readouterr().out)["per_device"]["total"]
    assert totals["worst"] >= totals["balanced"] > 0


def test_worst_routing_costs_more_where_the_experts_hold_the_peak():
    def build(impl):
        def make():
            cfg = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=1024,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                             num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            model.set_experts_implementation(impl)
            return model
        return make

    peaks = {}
    for impl in ("eager", "grouped_mm"):
        for how in ("balanced", "worst"):
            with routing(how):
                peaks[impl, how] = trace_step(build(impl), 4, 64).peak
    assert peaks["eager", "worst"] > peaks["eager", "balanced"]  # the busiest expert's transients
    assert peaks["grouped_mm", "worst"] == peaks["grouped_mm", "balanced"]  # one sorted buffer either way


def test_transformers_without_a_fake_fallback_backward_traces_the_same(monkeypatch):
    """transformers 5.17's grouped_mm fallback backward reads the offsets in Python (no fake kernel):
    memfit then traces its own op of the same work (memfit.measure.moe_grouped). Forced here on a
    newer transformers, the trace is the same to the byte, and the op computes the real product."""
    import torch

    from memfit.measure import moe_grouped

    with routing("balanced"):
        reference = trace_step(builder("grouped_mm"), 4, 64)
    calls = []
    real_op = moe_grouped.grouped_mm
    monkeypatch.setattr(moe_grouped, "fakeable_fallback_backward", lambda: False)
    monkeypatch.setattr(moe_grouped, "grouped_mm", lambda *a: calls.append(1) or real_op(*a))
    with routing("balanced"):
        own = trace_step(builder("grouped_mm"), 4, 64)
    assert calls and own.peak == reference.peak and own.activations == reference.activations

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=g, requires_grad=True), torch.randn(3, 4, 5, generator=g, requires_grad=True)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    out = real_op(x, w, offs)
    expected = torch.cat([x[:2] @ w[0], x[2:] @ w[2]])
    assert torch.allclose(out, expected)
    out.sum().backward()
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cat([xr[:2] @ wr[0], xr[2:] @ wr[2]]).sum().backward()
    assert torch.allclose(x.grad, xr.grad) and torch.allclose(w.grad, wr.grad)
