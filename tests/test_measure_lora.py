"""Frozen parameters and LoRA adapters: no gradients or optimizer state for the frozen base, in the
formulas and in the trace, checked against real steps (tracker and allocator events)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.measure.anymodel_estimate import measure_module
from memfit.measure.formulas import model_state_bytes
from memfit.measure.trace import measure_step, trace_step
from memfit.models.lora import LoRALinear, apply_lora, parse_lora
from memfit.models.spec import parse_model

TINY = "llama:layers=2,hidden=64,heads=4,vocab=512,seq=128"
TARGET_PCT = 3.0


def within(pred: int, real: int, pct: float = TARGET_PCT) -> bool:
    return abs(pred - real) <= pct / 100 * real


def test_formulas_count_frozen_parameters_as_weights_only():
    full = model_state_bytes(10_000, optimizer="adamw", n_tensors=4)
    lora = model_state_bytes(10_000, optimizer="adamw", n_trainable=500, n_tensors=2)
    assert lora.params == full.params == 40_000
    assert lora.grads == 4 * 500 and lora.optimizer == 8 * 500 + 4 * 2
    master = model_state_bytes(10_000, precision="bf16-master", optimizer="adamw", n_trainable=500, n_tensors=2)
    assert master.params == 20_000 and master.optimizer == 12 * 500 + 8  # fp32 masters of the adapters only
    frozen = model_state_bytes(10_000, optimizer="adamw", n_trainable=0, n_tensors=0)
    assert frozen.grads == frozen.optimizer == 0
    z2 = model_state_bytes(10_000, optimizer="adamw", n_trainable=500, zero=2, world=4)
    assert z2.grads == 4 * 125 and z2.params == 40_000
    with pytest.raises(ConfigError, match="n_trainable"):
        model_state_bytes(100, n_trainable=101)


def test_parse_lora_and_its_errors():
    cfg = parse_lora("r=8,targets=q_proj,v_proj")
    assert cfg.r == 8 and cfg.targets == ("q_proj", "v_proj") and cfg.alpha == 16
    assert parse_lora("targets=qkv,r=4,alpha=8").alpha == 8
    for bad, needle in [("r=0,targets=q", "positive"), ("r=8", "names no layers"), ("rank=8,targets=q", "unknown key"),
                        ("q_proj", "not key=value"), ("r=x,targets=q", "integer")]:
        with pytest.raises(ConfigError, match=needle):
            parse_lora(bad)


def test_lora_starts_as_the_base_model_and_trains_only_adapters():
    torch.manual_seed(0)
    base = parse_model(TINY).build()
    x = torch.randint(0, 512, (2, 16))
    ref = base(x, x)[0].detach()
    model = apply_lora(base, parse_lora("r=4,targets=qkv,attn.proj"))
    out = model(x, x)
    assert torch.equal(out[0], ref)  # B starts at zero
    out[1].backward()
    wrapped = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 4  # qkv and attn.proj of 2 blocks; mlp.proj untouched
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)
    with pytest.raises(ConfigError, match="match no linear layer.*named.*qkv"):
        apply_lora(parse_model(TINY).build(), parse_lora("targets=q_proj"))


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
def test_lora_spec_trace_matches_a_real_step(precision):
    spec = replace(parse_model(TINY), lora=parse_lora("r=8,targets=qkv,proj"))
    pred = trace_step(spec, 4, 64, precision=precision)
    real = measure_step(spec, 4, 64, precision=precision)
    assert pred.peak == real.peak and within(pred.peak, real.allocator_peak)
    full = trace_step(parse_model(TINY), 4, 64, precision=precision)
    assert pred.optimizer < full.optimizer / 10 and pred.peak < full.peak  # the base holds no state
    est = memfit.estimate(TINY, batch=4, seq=64, precision=precision, lora="r=8,targets=qkv,proj")
    assert est.total == pred.peak


class HandLoRA(nn.Module):
    """A plain LoRA layer written out: frozen W, trainable A and B."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(HandLoRA(nn.Linear(128, 128)) for _ in range(4))
        self.head = nn.Linear(128, 10).requires_grad_(False)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), y)


def test_hand_written_lora_module_estimate_within_3pct_of_the_allocator():
    example = (torch.randn(64, 128), torch.randint(0, 10, (64,)))
    est = memfit.estimate(Tower, example)
    real = measure_module(Tower, example)
    assert est.total == real["peak"] and within(est.total, real["allocator"])
    trainable = 4 * 2 * 4 * 128
    assert real["breakdown"]["optimizer"] == 8 * trainable + 4 * 8 and est.per_device["grads"] <= 4 * trainable


def test_peft_lora_estimate_within_3pct_of_the_allocator():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    def build():
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    def batch(device):
        x = torch.randint(0, 512, (4, 64), device=device)
        return {"input_ids": x, "labels": x}

    est = memfit.estimate(build, batch)
    real = measure_module(build, batch)
    assert est.total == real["peak"] and within(est.total, real["allocator"])
    # per layer: q_proj 64->64 and v_proj 64->32 (2 KV heads of 16), each an A (8 x 64) and a B (out x 8)
    adapters = 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    assert real["breakdown"]["optimizer"] == 8 * adapters + 4 * 8  # AdamW's two states and 8 step counters


def test_cli_lora_json_and_bad_targets(capsys):
    assert main(["estimate", TINY, "--batch", "2", "--seq", "32", "--lora", "r=8,targets=qkv", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    adapters = 2 * (8 * 64 + 8 * 3 * 64)  # A (8 x 64) and B (192 x 8) per block
    assert data["per_device"]["optimizer"] == 8 * adapters + 4 * 4
    assert main(["estimate", TINY, "--lora", "r=8,targets=q_proj,v_proj"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "match no linear layer" in err[0]
