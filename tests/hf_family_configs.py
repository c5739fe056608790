"""Tiny configs (width 32-64, two layers, vocabulary 128-256) of Hugging Face causal-LM families that the
installed transformers builds from a config, for the family grid (tests/test_hf_family_grid.py).
Nothing is downloaded: each model is built with random weights."""
from __future__ import annotations

VOCAB = 256
_BASE = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

FAMILIES: dict[str, dict] = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64),
    "llama": _BASE,
    "mistral": {**_BASE, "sliding_window": 16},
    "mixtral": {**_BASE, **_MOE},
    "qwen2": {**_BASE, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    "qwen3": {**_BASE, "head_dim": 8},
    "qwen3_moe": {**_BASE, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "phi": {**_BASE, "num_key_value_heads": 4},
    "phi3": {**_BASE, "pad_token_id": 0},
    "gemma": {**_BASE, "head_dim": 8},
    "gemma2": {**_BASE, "head_dim": 8, "sliding_window": 16},
    "gemma3_text": {**_BASE, "head_dim": 8, "sliding_window": 16, "num_hidden_layers": 3,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "gpt_neox": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                     vocab_size=VOCAB, max_position_embeddings=64),
    "falcon": dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                   new_decoder_architecture=True, num_kv_heads=2),
    "olmo2": _BASE,
    "stablelm": _BASE,
    "cohere": _BASE,
    "cohere2": {**_BASE, "sliding_window": 16},
    "granite": _BASE,
    "starcoder2": {**_BASE, "sliding_window": 16},
    "smollm3": {**_BASE, "pad_token_id": 0},
}
"""model_type -> its config's keys (as a config.json holds them)."""


def config(family: str):
    import transformers

    return transformers.AutoConfig.for_model(family, **FAMILIES[family])


def write_config(folder, family: str) -> str:
    """The family's config.json written to folder/family/ (made if missing); its path."""
    d = folder / family
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(config(family).to_json_string())
    return str(d / "config.json")


def model(family: str, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(family))


def batch(rows: int = 4, seq: int = 32, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (rows, seq), generator=g)
    return {"input_ids": x, "labels": x.clone()}


def token_batches(steps: int, rows: int, seq: int, seed: int = 1) -> list:
    """`steps` batches of random token ids, (rows, seq) each: the same for every caller and rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, seq), generator=g) for _ in range(steps)]


def one_process_losses(model, batches: list) -> list[float]:
    """Each step's loss of `model` trained in one process (AdamW, lr 1e-2, clipped at 1.0): the
    reference the parallel layouts' losses are compared with."""
    from memfit.apply.optimizer import TrainingOptimizer

    out = []
    with TrainingOptimizer(model, "adamw", lr=1e-2, clip=1.0) as opt:
        for x in batches:
            loss = model(input_ids=x, labels=x).loss
            opt.backward(loss)
            opt.step()
            out.append(float(loss.detach()))
    return out
