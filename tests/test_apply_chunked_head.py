"""The chunked LM head: loss and gradients bit-identical to the unchunked head in fp32 on CPU, in
memfit's GPT and Hugging Face causal LMs; its memory traced exactly and lower than the plain head's."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from memfit.apply.chunked_head import (MIN_CHUNK, chunked_cross_entropy, reference_cross_entropy, spans,
                                      summed_loss_divisor)
from memfit.apply.gemm_blocking import cpu_rows_exact
from memfit.apply.head_swap import chunk_head, head_chunks
from memfit.core.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def _count_calls(monkeypatch, name: str) -> list:
    """Patch memfit.apply.chunked_head.<name> to record each call (one 1 per call) and run as before."""
    import memfit.apply.chunked_head as ch

    calls, real = [], getattr(ch, name)
    monkeypatch.setattr(ch, name, lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("n,h,v", [(64, 32, 1000), (37, 48, 4099), (300, 33, 1001), (129, 16, 257)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction,ignore", [("mean", -100), ("sum", -1)])
def test_loss_and_gradients_are_bit_identical_to_the_unchunked_head(n, h, v, bias, reduction, ignore):
    torch.manual_seed(n + v)
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.05).requires_grad_()
    b = (torch.randn(v) * 0.1).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,))
    y[torch.rand(n) < 0.2] = ignore
    inputs = [x, w] + ([b] if bias else [])
    ref = reference_cross_entropy(x, w, y, b, ignore_index=ignore, reduction=reduction)
    want = _grads(ref, inputs)
    for chunks in (2, 3, 8):
        got_loss = chunked_cross_entropy(x, w, y, b, chunks=chunks, ignore_index=ignore, reduction=reduction)
        got = _grads(got_loss, inputs)
        assert torch.equal(got_loss, ref)
        for a, c in zip(want, got):
            assert torch.equal(a, c), (chunks, (a - c).abs().max())


@pytest.mark.parametrize("reduction,scale,expect,recomputes", [
    ("mean", None, "auto", False),   # loss.backward(): the forward's grad wrt hidden is used
    ("sum", "count", "auto", False),  # loss / count, as memfit's training step divides it
    ("sum", None, "auto", True),      # another upstream gradient: backward recomputes it
    ("mean", 3.0, "auto", True),
    ("mean", 0.25, 0.25, False),      # the expected gradient given
    ("mean", None, None, True),       # none expected: always recomputed
])
def test_grad_wrt_hidden_from_the_forward_or_recomputed_is_bit_identical(monkeypatch, reduction, scale, expect,
                                                                          recomputes):
    calls = _count_calls(monkeypatch, "_grad_hidden")
    torch.manual_seed(3)
    x = torch.randn(200, 40, requires_grad=True)
    w = (torch.randn(3000, 40) * 0.05).requires_grad_()
    b = (torch.randn(3000) * 0.1).requires_grad_()
    y = torch.randint(0, 3000, (200,))
    y[::9] = -100
    count = (y != -100).sum()

    def scaled(loss):
        return loss if scale is None else loss / count if scale == "count" else loss * scale

    want = _grads(scaled(reference_cross_entropy(x, w, y, b, reduction=reduction)), [x, w, b])
    got = _grads(scaled(chunked_cross_entropy(x, w, y, b, chunks=4, reduction=reduction, expect_grad=expect)),
                 [x, w, b])
    assert all(torch.equal(a, c) for a, c in zip(want, got))
    assert bool(calls) == recomputes


def test_extreme_logits_and_all_ignored_tokens_match():
    torch.manual_seed(0)
    w = torch.randn(1000, 64, requires_grad=True)
    for scale in (30.0, 1e-3):
        x = (torch.randn(300, 64) * scale).requires_grad_()
        y = torch.randint(0, 1000, (300,))
        ref, got = reference_cross_entropy(x, w, y), chunked_cross_entropy(x, w, y, chunks=5)
        assert torch.equal(ref, got)
        assert all(torch.equal(a, c) for a, c in zip(_grads(ref, [x, w]), _grads(got, [x, w])))
    y = torch.full((300,), -100)
    assert chunked_cross_entropy(x, w, y, chunks=5).isnan()  # as F.cross_entropy: 0 / 0 tokens


def test_bf16_autocast_is_close_to_the_unchunked_head():
    torch.manual_seed(0)
    x = torch.randn(256, 64, requires_grad=True)
    w = (torch.randn(2000, 64) * 0.05).requires_grad_()
    y = torch.randint(0, 2000, (256,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference_cross_entropy(x, w, y)
        got = chunked_cross_entropy(x, w, y, chunks=4)
    assert torch.allclose(ref, got, rtol=1e-2)
    for a, c in zip(_grads(ref, [x, w]), _grads(got, [x, w])):
        assert a.dtype == c.dtype == torch.float32
        assert torch.allclose(a, c, rtol=5e-2, atol=1e-4 * a.abs().max().item())


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 80), st.sampled_from([1, 64]))
def test_spans_cover_the_range_in_aligned_chunks_of_at_least_the_minimum(n, chunks, align):
    out = spans(n, chunks, align=align)
    assert out[0][0] == 0 and out[-1][1] == n and len(out) <= chunks
    assert all(a[1] == b[0] for a, b in zip(out, out[1:]))
    assert all(s % align == 0 for s, _ in out)
    assert len(out) == 1 or all(e - s >= MIN_CHUNK for s, e in out)


def _gpt():
    return GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=1000, seq=64))


def test_gpt_with_chunked_head_matches_the_plain_model_bit_for_bit():
    torch.manual_seed(0)
    plain = _gpt()
    chunked = chunk_head(copy.deepcopy(plain), 4)
    x = torch.randint(0, 1000, (3, 64))
    y = x.clone()
    y[:, -5:] = -1
    logits, loss_a, n_a = plain(x, y)
    none, loss_b, n_b = chunked(x, y)
    assert none is None and logits.shape == (3, 64, 1000)
    assert torch.equal(loss_a, loss_b) and n_a == n_b
    loss_a.backward()
    loss_b.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert head_chunks(chunked) == 4
    assert chunk_head(chunked, None)(x, y)[0].shape == (3, 64, 1000)  # the plain head is back


def _hf(kind: str):
    transformers = pytest.importorskip("transformers")
    if kind == "bert-generation":  # its lm_head module holds the LM head's weight alone: chunkable
        cfg = transformers.BertGenerationConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                intermediate_size=128, vocab_size=1000, is_decoder=True)
    elif kind == "roberta":
        cfg = transformers.RobertaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         intermediate_size=128, vocab_size=1000, is_decoder=True)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=128, vocab_size=1000)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert-generation"])
def test_hugging_face_causal_lm_loss_and_gradients_match_bit_for_bit(kind):
    torch.manual_seed(0)
    plain = _hf(kind)
    plain.train()
    chunked = chunk_head(copy.deepcopy(plain), 3)
    x = torch.randint(0, 1000, (2, 64))
    labels = x.clone()
    labels[0, :10] = -100
    torch.manual_seed(1)  # the same dropout masks in both
    out_a = plain(input_ids=x, labels=labels)
    torch.manual_seed(1)
    out_b = chunked(input_ids=x, labels=labels)
    assert out_b.logits is None and torch.equal(out_a.loss, out_b.loss)
    out_a.loss.backward()
    out_b.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert chunked(input_ids=x).logits.shape == (2, 64, 1000)  # without labels: the model's own forward
    twin = copy.deepcopy(chunked)
    assert twin.forward.__self__ is twin  # a copy runs its own weights


def test_bad_requests_raise_config_errors():
    with pytest.raises(ConfigError, match="positive integer"):
        chunk_head(_gpt(), -2)
    with pytest.raises(ConfigError, match="reduction"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(50, 8), torch.zeros(4, dtype=torch.long), reduction="none")
    with pytest.raises(ConfigError, match="expect_grad"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(50, 8), torch.zeros(4, dtype=torch.long), expect_grad="1")
    with pytest.raises(ConfigError, match="causal LM"):
        chunk_head(torch.nn.Linear(4, 4), 2)
    model = _hf("gpt2")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="softcapping"):
        chunk_head(model, 2)
    # RoBERTa's LM head module runs a dense layer and a LayerNorm before its decoder weight: chunking the decoder
    # alone on the base model's output would compute another model's loss
    with pytest.raises(ConfigError, match="lm_head has layers of its own"):
        chunk_head(_hf("roberta"), 2)


@pytest.mark.slow
def test_gpt2_small_head_at_seq_1024_is_bit_identical():
    torch.manual_seed(0)
    x = torch.randn(1024, 768, requires_grad=True)
    w = (torch.randn(50257, 768) * 0.02).requires_grad_()
    y = torch.randint(0, 50257, (1024,))
    y[::7] = -100
    ref = reference_cross_entropy(x, w, y)
    want = _grads(ref, [x, w])
    got_loss = chunked_cross_entropy(x, w, y, chunks=8)
    assert torch.equal(got_loss, ref)
    got = _grads(got_loss, [x, w])
    assert torch.equal(want[1], got[1])  # the weight gradient: vocabulary slices over every token
    if cpu_rows_exact(1024 // 8, 50257, 768):
        assert torch.equal(want[0], got[0])
    else:  # this BLAS sums a 128-row block's dot products in another order than the whole product's:
        # two sums of the same 50257 products differ by at most 2 gamma_K sum |g w| (Higham, 3.1)
        u, k = 2.0**-24, 50257
        with torch.no_grad():  # the logits' gradient, the GEMM's left factor
            g = torch.softmax(x @ w.t(), dim=1)
            keep = y != -100
            g[keep, y[keep]] -= 1
            g[~keep] = 0
            g /= keep.sum()
            bound = 2 * k * u / (1 - k * u) * (g.abs() @ w.abs())
        assert ((want[0] - got[0]).abs() <= bound).all()


@pytest.mark.parametrize("divisor", [None, 347])
def test_a_summed_loss_divided_by_another_count_takes_the_forward_gradient(monkeypatch, divisor):
    """Gradient accumulation divides each micro-batch's summed loss by the whole batch's count."""
    calls = _count_calls(monkeypatch, "_grad_hidden")
    torch.manual_seed(5)
    x = torch.randn(150, 24, requires_grad=True)
    w = (torch.randn(900, 24) * 0.05).requires_grad_()
    y = torch.randint(0, 900, (150,))
    count = divisor or 150
    want = _grads(reference_cross_entropy(x, w, y, reduction="sum") / count, [x, w])
    with summed_loss_divisor(divisor):
        loss = chunked_cross_entropy(x, w, y, chunks=3, reduction="sum")
    assert all(torch.equal(a, c) for a, c in zip(want, _grads(loss / count, [x, w])))
    assert not calls


def test_accumulated_micro_batches_with_a_chunked_head_match_the_plain_model_bit_for_bit(monkeypatch):
    from memfit.apply.optimizer import TrainingOptimizer
    from memfit.train.step import accumulate_grads

    calls = _count_calls(monkeypatch, "_grad_hidden")
    torch.manual_seed(0)
    plain = _gpt()
    plain.eval()  # no dropout: both models see the same arithmetic
    chunked = chunk_head(copy.deepcopy(plain), 4)
    x = torch.randint(0, 1000, (4, 64))
    y = x.clone()
    y[1, :20] = -1
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    for model in (plain, chunked):
        accumulate_grads(model, TrainingOptimizer(model, "sgd", lr=0.0), batches)
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert not calls  # each micro-batch's gradient wrt the hidden states came from its forward


@pytest.mark.parametrize("n,h,v", [(384, 48, 1001), (616, 33, 4099), (1024, 64, 3000)])
@pytest.mark.parametrize("reduction,ignore", [("mean", -100), ("sum", -1)])
def test_weight_gradient_summed_in_the_forward_is_bit_identical(monkeypatch, n, h, v, reduction, ignore):
    """With at least two GEMM reduction blocks of tokens, fp32 and no bias, the forward sums dW over its
    token chunks (backward's vocabulary pass never runs) and still equals the unchunked head bit for bit."""
    from memfit.apply.gemm_blocking import cpu_k_block

    block = cpu_k_block()
    if block is None or n < 2 * block:
        pytest.skip(f"this BLAS's reduction block ({block}) leaves no bitwise fused path at {n} tokens "
                    "(tests/test_apply_chunked_head_fused.py checks its algebra with a GEMM of known order)")
    calls = _count_calls(monkeypatch, "_grad_weight")
    torch.manual_seed(n + v)
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.05).requires_grad_()
    y = torch.randint(0, v, (n,))
    y[torch.rand(n) < 0.2] = ignore
    count = (y != ignore).sum() if reduction == "sum" else 1  # a summed loss is divided by its count
    ref = reference_cross_entropy(x, w, y, ignore_index=ignore, reduction=reduction)
    want = _grads(ref / count, [x, w])
    for chunks in (1, 2, 3, 8):
        loss = chunked_cross_entropy(x, w, y, chunks=chunks, ignore_index=ignore, reduction=reduction)
        got = _grads(loss / count, [x, w])
        assert torch.equal(loss, ref)
        for a, c in zip(want, got):
            assert torch.equal(a, c), (chunks, (a - c).abs().max())
    assert calls == []
    # another upstream gradient than the forward summed under: backward's vocabulary pass redoes dW
    loss = chunked_cross_entropy(x, w, y, chunks=3, ignore_index=ignore, reduction=reduction)
    got = _grads(loss * 3.0, [x, w])
    assert calls == [1]
    ref = reference_cross_entropy(x, w, y, ignore_index=ignore, reduction=reduction)
    for a, c in zip(_grads(ref * 3.0, [x, w]), got):
        assert torch.equal(a, c)
