"""The composed estimate (one traced block per action) against the full trace of the whole step: equal to the byte."""
from __future__ import annotations

import json

import pytest

from memfit.apply.policy import resolve_policy
from memfit.measure.blocks import chain_profile, module_source, spec_source
from memfit.measure.trace import trace_step
from memfit.models.spec import parse_model

transformers = pytest.importorskip("transformers")

POLICIES = ["none", "full", "selective", "sqrt", "every:2",
            "keep,recompute,selective,recompute+seg=0,recompute+seg=0,recompute+seg=0"]


def hf_config(tmp_path, kind: str):
    if kind == "hf-gpt2":
        cfg = dict(model_type="gpt2", n_layer=6, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                   bos_token_id=0, eos_token_id=0)
    else:
        cfg = dict(model_type="llama", num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                   bos_token_id=0, eos_token_id=0)
    path = tmp_path / kind / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return parse_model(str(path))


def spec_for(kind, tmp_path):
    if kind == "gpt":
        return parse_model("gpt:layers=6,hidden=64,heads=4,vocab=256,seq=128")
    return hf_config(tmp_path, kind)


# hf-llama with selective on every block: the composed figure is 1 KiB (0.02%) under the full trace.
# Selective blocks hold Llama's shared rotary tables differently next to each other than next to a
# kept block; the profile sees them next to kept blocks only.
# hf-llama with full recomputation in the 16-bit-weight modes (bf16-master, bf16-true): the planner's
# profile (ends measured next to kept blocks) is 8 KiB (one bf16 hidden state, 0.2-0.4%) over.
KNOWN = {("hf-llama", "selective"): 0.0005, ("hf-llama", "full"): 0.005}

GRID = [pytest.param(k, p, marks=[] if (k, p) == ("gpt", "32-true") else [pytest.mark.slow])
        for k in ("gpt", "hf-gpt2", "hf-llama") for p in ("32-true", "bf16-mixed", "bf16-master", "bf16-true")]


@pytest.mark.parametrize("kind,precision", GRID)
def test_composed_equals_full_trace(kind, precision, tmp_path):
    spec = spec_for(kind, tmp_path)
    src = spec_source(spec, batch=2, seq=32)
    prof = chain_profile(src, precision, "adamw")
    for policy in POLICIES:
        actions = resolve_policy(policy, src.n_blocks)
        full = trace_step(spec, batch=2, seq=32, precision=precision, checkpoint=policy)
        got = prof.compose(actions)
        tol = KNOWN.get((kind, policy), 0.0)
        assert abs(got.peak - full.peak) <= tol * full.peak, (kind, precision, policy, got.where)
        assert got.at_peak[:3] == (full.params, full.grads, full.optimizer), policy
        assert sum(got.at_peak) == got.peak


def test_estimate_uses_the_composed_figure_for_long_chains():
    spec = parse_model("gpt:layers=12,hidden=32,heads=2,vocab=64,seq=64")
    from memfit.measure.blocks import composed_step

    for policy in ("full", "sqrt"):
        got = composed_step(spec, 2, 16, checkpoint=policy)
        assert got is not None
        assert got.peak == trace_step(spec, batch=2, seq=16, checkpoint=policy).peak
