"""A tiny Llama built from a config and synthetic token data, shared by the framework integration tests
(nothing downloaded)."""
from __future__ import annotations

import torch

VOCAB, SEQ, ROWS = 512, 32, 32


def config():
    import transformers

    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128)


def model(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config())


def rows(n: int = ROWS, seed: int = 0) -> list[dict]:
    """Examples as a tokenized dataset holds them, with a text column the model does not take."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(), "text": "unused"})
    return out


def batch(n: int, seed: int = 0) -> dict:
    data = rows(n, seed)
    return {k: torch.stack([r[k] for r in data]) for k in ("input_ids", "labels")}


def peaks(m, b: dict) -> tuple[int, int]:
    """Predicted peaks (all blocks kept, all recomputed) of a training step on batch `b`."""
    import memfit

    keep = memfit.estimate(m, b, checkpoint="none").per_device["total"]
    full = memfit.estimate(m, b, checkpoint="full").per_device["total"]
    return keep, full


def accumulation_budget() -> int:
    """A budget that 4 rows cannot meet even all recomputed, and 2 rows can: the accumulation tests'."""
    m = model()
    return (peaks(m, batch(4))[1] + peaks(m, batch(2))[1]) // 2


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary ("t0" ... "t511"; t0 pads and ends), made in memory."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t0", unk_token="t1")
