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

# Seen (bench/results/fsdp2_layouts.json, `--engine fsdp2`): every case within 0.1% but HF GPT-2 with
# reshard_after_forward False (-0.6%, one block's weights more than the moments place, not yet found
# where). The bound is the byte counting's, not the machine's (MemTracker counts tensors exactly): 1%.
TOLERANCE = 0.01


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
                      ({"strategy": "ddp", "engine": "fsdp2"}, "zero2, zero3, tensor and pipeline")):
        with pytest.raises(ConfigError, match=words):
            distribute(model, **kw)
    with pytest.raises(ConfigError, match="loss scaler"):
        _policies("16-mixed", None, torch.device("cpu"))
    with pytest.raises(ConfigError, match="CUDA ranks"):
        _policies("32-true", "cpu", torch.device("cpu"))
    assert _policies("bf16-master", None, torch.device("cpu"))["mp_policy"].param_dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_with_the_frameworks_checkpointing_within_1_percent(tmp_path):
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


@pytest.mark.slow
@pytest.mark.multiproc
def test_reshard_after_forward_false_and_n_within_1_percent_on_4_ranks(tmp_path):
    """FSDP2's reshard_after_forward False (Trainer's shard_grad_op) and 2 of 4 ranks (a 1/2 shard of each
    block kept from forward to backward), estimated with `--engine fsdp2 --reshard-after-forward`; the
    three layouts' peaks in the order of what they keep, and the losses equal across them."""
    gpt = f"gpt:layers=4,hidden={HIDDEN},heads=4,vocab=256,seq={SEQ}"
    cases = [grid.Case(gpt, r, "none", 4, 128) for r in (True, 2, False)]
    measured = run_world(grid.tracked, 4, (cases,), timeout_s=900)
    rows = grid.errors(cases, 4, measured)
    bad = [(r["case"], r["estimate"], r["measured"]) for r in rows if max(map(abs, r["error"])) > TOLERANCE]
    assert not bad, bad
    peaks = [max(r["measured"]) for r in rows]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    assert measured[0][cases[1]]["losses"] == pytest.approx(measured[0][cases[0]]["losses"], rel=1e-6)


# `--engine fsdp2` against FSDP2 itself. Seen: +0.06% (llama, qwen3, 2 blocks of width 32), -0.03% (GPT,
# 4 blocks of width 64), +0.07% under Hugging Face's checkpointing and torch's checkpoint_wrapper, where
# the ZeRO-3 estimate (no --engine) is -4.5%, -4.2%, -1.7%: FSDP2's step counter per tensor and its flat
# all-gather buffer between blocks. 0.5%: the bytes neither estimate sees (a rotary buffer, small views).
ENGINE_TOLERANCE = 0.005


@pytest.mark.slow
@pytest.mark.multiproc
def test_engine_fsdp2_estimates_fsdp2_itself(tmp_path):
    import hf_family_configs as fam

    paths = {}
    for family in ("llama", "qwen3"):
        (tmp_path / family).mkdir()
        (tmp_path / family / "config.json").write_text(fam.config(family).to_json_string())
        paths[family] = str(tmp_path / family / "config.json")
    cases = [grid.Case(paths["llama"], True, "none", 2, 32), grid.Case(paths["qwen3"], True, "none", 2, 32),
             grid.Case(paths["llama"], True, "hf", 2, 32), grid.Case(GPT, True, "none", BATCH, SEQ)]
    measured = run_world(grid.tracked, 2, (cases,), timeout_s=900)
    for c in cases:
        est, plain = grid.estimated(c, 2), grid.estimated(c, 2, engine="memfit")
        got = [measured[r][c]["total"] for r in range(2)]
        assert all(abs(est - g) <= ENGINE_TOLERANCE * g for g in got), (c.name, est, got)
        if c.wrapper == "none":  # what --engine fsdp2 adds is seen: the ZeRO-3 estimate misses by more
            assert abs(plain - got[0]) > ENGINE_TOLERANCE * got[0], (c.name, plain, got)
