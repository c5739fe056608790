"""torch's FSDP2 on 2 gloo ranks against `memfit estimate --strategy zero3 --world 2` (tests/fsdp2_grid.py).

Checkpointing the frameworks' way: torch's checkpoint_wrapper on each block (torchtitan's and
accelerate's) is estimated by `--checkpoint wrapper`, which keeps a Hugging Face KV cache on as the
wrapper does; Hugging Face's own `gradient_checkpointing_enable` switches the cache off and is
memfit's `full`. Shapes: 4 blocks of hidden 64, batch 4 x seq 128 per rank, so that the saved
activations the policies differ by are a tenth of a rank's peak or more.
"""
from __future__ import annotations

import pytest
import torch

import fsdp2_grid as grid
from memfit.distributed.spawn import run_world

SEQ, BATCH, HIDDEN = 128, 4, 64

# The bound. Seen (bench/results/fsdp2_layouts.json): checkpointed cases within 0.1%; without
# checkpointing FSDP2 holds a little more than memfit's flat ZeRO-3 (its all-gather and reduce-scatter
# buffers are per block, copied into and out of each parameter): -1.7% on GPT, -1.2% on Llama.
TOLERANCE = 0.03


def _llama(tmp_path, layers: int = 4, kv_heads: int = 4) -> str:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                         architectures=["LlamaForCausalLM"])
    (tmp_path / "llama").mkdir(parents=True)
    (tmp_path / "llama" / "config.json").write_text(cfg.to_json_string())
    return str(tmp_path / "llama" / "config.json")


def _gpt2(tmp_path) -> str:
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=256, n_embd=HIDDEN, n_layer=4, n_head=4, n_positions=SEQ,
                        architectures=["GPT2LMHeadModel"])
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(cfg.to_json_string())
    return str(tmp_path / "gpt2" / "config.json")


GPT = f"gpt:layers=4,hidden={HIDDEN},heads=4,vocab=256,seq={SEQ}"


def test_fsdp2_engine_refuses_what_it_cannot_run():
    from memfit.core.errors import ConfigError
    from memfit.distributed import distribute
    from memfit.distributed.fsdp2 import _policies

    model = torch.nn.Linear(2, 2)
    for kw, words in (({"strategy": "zero3", "engine": "deepspeed"}, "unknown engine"),
                      ({"strategy": "ddp", "engine": "fsdp2"}, "zero2 and zero3")):
        with pytest.raises(ConfigError, match=words):
            distribute(model, **kw)
    with pytest.raises(ConfigError, match="loss scaler"):
        _policies("16-mixed", None, torch.device("cpu"))
    with pytest.raises(ConfigError, match="CUDA ranks"):
        _policies("32-true", "cpu", torch.device("cpu"))
    assert _policies("bf16-master", None, torch.device("cpu"))["mp_policy"].param_dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_with_the_frameworks_checkpointing_within_3_percent(tmp_path):
    llama, gpt2 = _llama(tmp_path), _gpt2(tmp_path)
    cases = [grid.Case(m, True, w, BATCH, SEQ) for m in (GPT, llama, gpt2) for w in ("none", "checkpoint_wrapper")]
    cases += [grid.Case(llama, True, "hf", BATCH, SEQ)]
    # 13 blocks with grouped-query attention: the estimate composed from short traces (12 blocks and more)
    deep = _llama(tmp_path / "deep", layers=13, kv_heads=2)
    cases += [grid.Case(deep, True, w, 4, 64) for w in ("checkpoint_wrapper", "hf")]
    measured = run_world(grid.tracked, 2, (cases,), timeout_s=1200)
    rows = grid.errors(cases, 2, measured)
    bad = [(r["case"], r["estimate"], r["measured"]) for r in rows if max(map(abs, r["error"])) > TOLERANCE]
    assert not bad, bad
    # the cache is what the wrapper keeps beyond full recomputation: Hugging Face's own drops it
    wrapped, hf = (next(r for r in rows if r["model"] == llama and r["wrapper"] == w)["measured"][0]
                   for w in ("checkpoint_wrapper", "hf"))
    assert wrapped > hf


def _one_process_losses(case: grid.Case, world: int) -> list[float]:
    """The same three steps on one process with the global batch (world x batch rows), plain AdamW."""
    import torch

    from memfit.models.spec import parse_model

    torch.manual_seed(0)
    spec = parse_model(case.model)
    model = spec.build(seq=case.seq)
    model.train()
    vocab = spec.config.vocab if spec.config is not None else model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        x = torch.randint(0, vocab, (case.batch * world, case.seq), generator=g)
        loss = grid.loss_of(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_engine_trains_as_one_process_with_the_global_batch(tmp_path):
    """memfit.distributed.fsdp2 under zero3 and zero2 (reshard after forward or not): each step's loss,
    the mean of the two ranks' (equal token counts), is one process's on the whole batch. 1e-5
    relative: float32 gradients summed by a reduce-scatter instead of in one backward differ
    in the last bits, and three AdamW steps carry that into the weights (seen: 1.1e-7)."""
    llama = _llama(tmp_path)
    gpt = "gpt:layers=2,hidden=32,heads=4,vocab=128,seq=32"
    cases = [grid.Case(gpt, True), grid.Case(gpt, False), grid.Case(llama, True, "checkpoint_wrapper", 2, 32),
             grid.Case(gpt, True, precision="bf16-master")]
    measured = run_world(grid.tracked, 2, (cases,), timeout_s=600)
    for c in cases:
        ranks = [measured[r][c]["losses"] for r in range(2)]
        mean = [(a + b) / 2 for a, b in zip(*ranks)]
        # bf16-master: float32 shards gathered as bf16 (MixedPrecisionPolicy), the loss itself a bf16
        # number (spacing 1/64 near 4: 0.4%) after three steps on bf16 weights (seen on a hidden-64 GPT: 0.9%)
        rel = 2e-2 if c.precision != "32-true" else 1e-5
        assert mean == pytest.approx(_one_process_losses(c, 2), rel=rel), c.name
    zero3 = grid.errors(cases[:1], 2, measured)[0]  # and each rank within the estimate's bound (seen: -0.09%)
    assert max(map(abs, zero3["error"])) <= TOLERANCE, zero3
    # the gathered weights and the activations in bf16: less memory than float32
    assert measured[0][cases[3]]["total"] < measured[0][cases[0]]["total"]
