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


@pytest.mark.parametrize("precision", ["32-true", "bf16-master", "bf16-true"])
@pytest.mark.parametrize("kind", ["gpt", "hf-gpt2", "hf-llama"])
def test_composed_equals_full_trace(kind, precision, tmp_path):
    spec = spec_for(kind, tmp_path)
    src = spec_source(spec, batch=2, seq=32)
    prof = chain_profile(src, precision, "adamw")
    policies = POLICIES if precision == "32-true" else POLICIES[:2] + POLICIES[-1:]
    for policy in policies:
        actions = resolve_policy(policy, src.n_blocks)
        full = trace_step(spec, batch=2, seq=32, precision=precision, checkpoint=policy)
        got = prof.compose(actions)
        assert got.peak == full.peak, (kind, precision, policy, got.where)
        assert got.at_peak[:3] == (full.params, full.grads, full.optimizer), policy
