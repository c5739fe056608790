"""torch's FSDP2 on 2 gloo ranks against `memfit estimate --strategy zero3 --world 2` (tests/fsdp2_grid.py).

Checkpointing the frameworks' way: torch's checkpoint_wrapper on each block (torchtitan's and
accelerate's) is estimated by `--checkpoint wrapper`, which keeps a Hugging Face KV cache on as the
wrapper does; Hugging Face's own `gradient_checkpointing_enable` switches the cache off and is
memfit's `full`. Shapes: 4 blocks of hidden 64, batch 4 x seq 128 per rank, so that the saved
activations the policies differ by are a tenth of a rank's peak or more.
"""
from __future__ import annotations

import pytest

import fsdp2_grid as grid
from memfit.distributed.spawn import run_world

SEQ, BATCH, HIDDEN = 128, 4, 64

# The bound. Seen (bench/results/fsdp2_layouts.json): checkpointed cases within 0.1%; without
# checkpointing FSDP2 holds a little more than memfit's flat ZeRO-3 (its all-gather and reduce-scatter
# buffers are per block, copied into and out of each parameter): -1.7% on GPT, -1.2% on Llama.
TOLERANCE = 0.03


def _llama(tmp_path, tie: bool = False) -> str:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                         tie_word_embeddings=tie, architectures=["LlamaForCausalLM"])
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(cfg.to_json_string())
    return str(tmp_path / "llama" / "config.json")


def _gpt2(tmp_path) -> str:
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=256, n_embd=HIDDEN, n_layer=4, n_head=4, n_positions=SEQ, architectures=["GPT2LMHeadModel"])
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(cfg.to_json_string())
    return str(tmp_path / "gpt2" / "config.json")


GPT = f"gpt:layers=4,hidden={HIDDEN},heads=4,vocab=256,seq={SEQ}"


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_with_the_frameworks_checkpointing_within_3_percent(tmp_path):
    llama, gpt2 = _llama(tmp_path), _gpt2(tmp_path)
    cases = [grid.Case(m, True, w, BATCH, SEQ) for m in (GPT, llama, gpt2) for w in ("none", "checkpoint_wrapper")]
    cases += [grid.Case(llama, True, "hf", BATCH, SEQ)]
    measured = run_world(grid.tracked, 2, (cases,), timeout_s=1200)
    rows = grid.errors(cases, 2, measured)
    bad = [(r["case"], r["estimate"], r["measured"]) for r in rows if max(map(abs, r["error"])) > TOLERANCE]
    assert not bad, bad
    by = {r["case"]: r for r in rows}
    # the cache is what the wrapper keeps beyond full recomputation: Hugging Face's own drops it
    wrapped, hf = (by[f"llama reshard=True ckpt={w}"]["measured"][0] for w in ("checkpoint_wrapper", "hf"))
    assert wrapped > hf
