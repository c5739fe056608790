"""Compressors as pure encode/decode pairs: properties (hypothesis), the error-feedback invariant,
spec parsing and strategy checks. Single process; the 2-rank tests are in *_multiproc.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.core.errors import ConfigError
from memfit.distributed.compression import ErrorFeedback, check_compression_strategy, parse_compression
from memfit.distributed.compression.cast import decode_cast, encode_cast
from memfit.distributed.compression.exchange import pack, unpack
from memfit.distributed.compression.powersgd import square_side
from memfit.distributed.compression.quant8 import decode_int8, encode_int8
from memfit.distributed.compression.registry import make_codec
from memfit.distributed.compression.sign import decode_sign, encode_sign, pack_bits, unpack_bits
from memfit.distributed.compression.topk import decode_topk, encode_topk_per_segment, k_for, ratio_at

FAST = settings(max_examples=40, deadline=None)
floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)
vectors = st.lists(floats, min_size=1, max_size=300).map(lambda v: torch.tensor(v, dtype=torch.float32))


@FAST
@given(vectors, st.floats(min_value=1e-3, max_value=1.0))
def test_topk_keeps_the_k_largest_exactly(x, ratio):
    k = k_for(x.numel(), ratio)
    y = decode_topk(encode_topk_per_segment(x, ratio, None, torch.float32), x.numel())
    kept = y != 0
    assert int(kept.sum()) <= k  # fewer only where a kept value is itself 0
    assert torch.equal(y[kept], x[kept])
    if kept.any() and (~kept).any():  # nothing dropped is larger than anything kept
        assert x[~kept].abs().max() <= x[kept].abs().min()


@FAST
@given(vectors)
def test_topk_bf16_values_are_bf16_rounded(x):
    parts = encode_topk_per_segment(x, 0.5, None, torch.bfloat16)
    assert parts[0].dtype == torch.bfloat16 and parts[1].dtype == torch.int32
    y = decode_topk(parts, x.numel())
    idx = parts[1].long()
    assert torch.equal(y[idx], x[idx].bfloat16().float())


@FAST
@given(vectors, st.integers(1, 64), st.booleans())
def test_int8_error_within_one_step(x, chunk, stochastic):
    gen = torch.Generator().manual_seed(0) if stochastic else None
    codes, scales = encode_int8(x, chunk, gen)
    assert codes.dtype == torch.int8 and codes.numel() == x.numel() and scales.numel() == -(-x.numel() // chunk)
    y = decode_int8([codes, scales], x.numel(), chunk)
    step = torch.nn.functional.pad(scales, (0, 0)).repeat_interleave(chunk)[: x.numel()]
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-5) + 1e-30
    assert ((y - x).abs() <= bound).all()


def test_int8_stochastic_rounding_is_unbiased():
    x = torch.full((1000,), 0.3)
    x[0] = 1.27  # scale 0.01: 0.3 / 0.01 = 30 exactly... so use a value between levels
    x[1:] = 0.3049
    gen = torch.Generator().manual_seed(1)
    mean = torch.stack([decode_int8(encode_int8(x, 1000, gen), 1000, 1000) for _ in range(400)]).mean(0)
    nearest = decode_int8(encode_int8(x, 1000), 1000, 1000)
    assert (mean[1:] - 0.3049).abs().mean() < 2e-4 < (nearest[1:] - 0.3049).abs().mean()


@FAST
@given(vectors, st.integers(1, 50))
def test_sign_keeps_signs_and_chunk_l1_norm(x, chunk):
    y = decode_sign(encode_sign(x, chunk), x.numel(), chunk)
    assert torch.equal(y >= 0, x >= 0) or bool(((y >= 0) == (x >= 0))[(x != 0)].all())
    for a, b in zip(x.split(chunk), y.split(chunk)):
        assert torch.allclose(a.abs().sum(), b.abs().sum(), rtol=1e-4)
        assert torch.allclose(b.abs(), b.abs()[0].expand_as(b))  # one magnitude per chunk


@FAST
@given(st.lists(st.booleans(), min_size=1, max_size=100))
def test_bits_roundtrip(bits):
    t = torch.tensor(bits)
    packed = pack_bits(t)
    assert packed.numel() == -(-len(bits) // 8)
    assert torch.equal(unpack_bits(packed, len(bits)), t)


@FAST
@given(vectors)
def test_casts_are_plain_roundings(x):
    assert torch.equal(decode_cast(encode_cast(x, torch.bfloat16), x.numel()), x.bfloat16().float())
    half = decode_cast(encode_cast(x, torch.float16), x.numel())
    assert torch.isfinite(half).all()  # saturates instead of overflowing
    small = x.abs() < 60000
    assert torch.equal(half[small], x[small].half().float())


@FAST
@given(vectors, st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip(x, idx):
    parts = [x, torch.tensor([idx], dtype=torch.int32), x.bfloat16(), x.to(torch.int8)]
    back = unpack(pack(parts), parts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(parts, back))
    assert pack(parts).numel() == sum(p.numel() * p.element_size() for p in parts)


def _ef_steps(spec: str, grads):
    codec, fb = make_codec(parse_compression(spec)), ErrorFeedback(parse_compression(spec).momentum)
    for step, g in enumerate(grads):
        old = fb.residual.get("b", torch.zeros_like(g))
        x = fb.corrected("b", g)
        sent = codec.decode(codec.encode(x, step), g.numel())
        new = fb.update("b", x, sent)
        yield g, old, x, sent, new


@FAST
@given(st.sampled_from(["topk:0.01", "topk:0.2", "topk:0.1,values=fp32"]), st.integers(0, 1000))
def test_error_feedback_invariant_is_bitwise_for_topk(spec, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(257, generator=gen) * 10 ** torch.randint(-6, 6, (1,), generator=gen).item() for _ in range(5)]
    for g, old, x, sent, new in _ef_steps(spec, grads):
        assert torch.equal(sent + new, g + old)  # sent + new residual == grad + old residual, bitwise


@pytest.mark.parametrize("spec", ["sign", "int8,ef=1"])
def test_error_feedback_invariant_for_quantizers(spec):
    """residual = x - sent is one rounded fp32 subtraction, so sent + residual equals x to half an
    ulp of x (not bitwise: x - sent is not exact when sent and x differ by more than a factor 2)."""
    grads = [torch.randn(1000) for _ in range(5)]
    for g, old, x, sent, new in _ef_steps(spec, grads):
        assert torch.equal(x, g + old)
        assert torch.equal(new, x - sent)
        ulp = torch.finfo(torch.float32).eps * torch.maximum(x.abs(), sent.abs())
        assert ((sent + new - x).abs() <= ulp).all()


def test_error_feedback_sends_everything_eventually():
    """A constant gradient under top-k with feedback: the sum of what was sent tracks the sum of
    the gradients (the residual stays bounded) instead of dropping 99% of it."""
    g = torch.linspace(0.1, 1.0, 100)
    total = torch.zeros(100)
    for _, _, _, sent, new in _ef_steps("topk:0.1,values=fp32", [g] * 300):
        total += sent
    assert torch.allclose(total + new, g * 300, rtol=1e-4)
    assert (total > 0).all()  # even the smallest elements were sent
    assert new.abs().max() < 0.1 * (g * 300).max()  # the residual stays bounded: nothing is lost


def test_dgc_momentum_correction_and_masking():
    codec, fb = make_codec(parse_compression("topk:0.25,momentum=0.5,values=fp32")), ErrorFeedback(0.5)
    g = torch.tensor([4.0, 1.0, 2.0, 3.0])
    x = fb.corrected("b", g)
    sent = codec.decode(codec.encode(x, 0), 4)
    fb.update("b", x, sent)
    assert torch.equal(sent, torch.tensor([4.0, 0, 0, 0]))
    assert torch.equal(fb.velocity["b"], torch.tensor([0.0, 1, 2, 3]))  # sent element's momentum masked
    x2 = fb.corrected("b", g)  # u = 0.5 u + g; x = u + residual
    assert torch.equal(x2, torch.tensor([4.0, 1.5, 3, 4.5]) + torch.tensor([0.0, 1, 2, 3]))


def test_topk_warmup_decays_to_the_target_ratio():
    ratios = [ratio_at(s, 0.001, 100) for s in range(0, 120, 10)]
    assert ratios[0] == 0.25 and ratios[-1] == 0.001
    assert all(a > b for a, b in zip(ratios[:10], ratios[1:11]))


@pytest.mark.parametrize("spec, fragment", [
    ("topk:0", "outside (0, 1]"), ("topk:1.5", "outside (0, 1]"), ("topk:-1", "outside (0, 1]"),
    ("gzip", "unknown compressor 'gzip'"), ("powersgd:0", "rank 0 must be at least 1"),
    ("topk:abc", "not a number"), ("int8:foo=2", "unknown option"), ("int8,momentum=0.9", "topk and sign with error feedback"),
])
def test_bad_specs_raise_one_line_config_errors(spec, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        parse_compression(spec)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_spec_values():
    s = parse_compression("topk:0.001,momentum=0.9,warmup=50")
    assert (s.name, s.ratio, s.momentum, s.warmup, s.error_feedback) == ("topk", 0.001, 0.9, 50, True)
    assert parse_compression("int8").error_feedback is False and parse_compression("sign").error_feedback
    assert parse_compression("powersgd:8").rank == 8 and parse_compression(None).name == "none"
    assert parse_compression("int8:chunk=256,stochastic").chunk == 256


@pytest.mark.parametrize("strategy", ["zero3", "tensor"])
def test_strategies_without_a_gradient_reduction_to_compress_are_refused(strategy):
    with pytest.raises(ConfigError) as err:
        check_compression_strategy(strategy, "topk:0.01")
    msg = str(err.value)
    assert strategy in msg and "use ddp, zero1 or zero2" in msg and "\n" not in msg


def test_strategies_that_carry_compression():
    for strategy in ("ddp", "zero1", "zero2"):
        assert check_compression_strategy(strategy, "int8").name == "int8"
    assert check_compression_strategy("zero3", None).name == "none"  # no compression: nothing to refuse
    with pytest.raises(ConfigError, match="batched"):
        check_compression_strategy("zero2", "powersgd:4")  # torch's hook is DDP-only


def test_square_side():
    assert [square_side(n) for n in (1, 4, 5, 100, 101)] == [1, 2, 3, 10, 11]


@FAST
@given(st.lists(st.integers(1, 80), min_size=1, max_size=6), st.integers(1, 40), st.integers(0, 1000))
def test_groups_never_straddle_tensors(sizes, chunk, seed):
    """Per-tensor top-k budgets and scales: a tensor of tiny gradients next to a huge one keeps its
    own share of the top-k and its own int8/sign scales."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=gen) * 10.0 ** (3 * (i % 2)) for i, n in enumerate(sizes)]
    x = torch.cat(parts)
    topk = decode_topk(encode_topk_per_segment(x, 0.3, sizes, torch.float32), x.numel())
    for seg, n in zip(topk.split(sizes), sizes):
        assert int((seg != 0).sum()) == k_for(n, 0.3)  # randn values are never exactly 0
    for seg, orig in zip(decode_sign(encode_sign(x, chunk, sizes), x.numel(), chunk, sizes).split(sizes), parts):
        for a, b in zip(orig.split(chunk), seg.split(chunk)):
            assert torch.allclose(b.abs(), a.abs().mean().expand_as(b), rtol=1e-5)
    q = decode_int8(encode_int8(x, chunk, None, sizes), x.numel(), chunk, sizes)
    for seg, orig in zip(q.split(sizes), parts):
        for a, b in zip(orig.split(chunk), seg.split(chunk)):
            assert ((a - b).abs() <= a.abs().max() / 254 * (1 + 1e-5)).all()



def test_sign_momentum_correction_keeps_the_velocity():
    """Momentum correction for sign: u = m u + g is compressed with the residual, and since sign
    sends every element there is nothing to mask: u carries on (top-k zeroes what it sent)."""
    codec, fb = make_codec(parse_compression("sign:chunk=4,momentum=0.5")), ErrorFeedback(0.5, mask=False)
    g = torch.tensor([1.0, -2.0, 3.0, -4.0])
    for step in range(3):
        x = fb.corrected("b", g)
        sent = codec.decode(codec.encode(x, step), 4)
        residual = fb.update("b", x, sent)
        assert torch.equal(sent + residual, x) or torch.allclose(sent + residual, x, atol=1e-6)
    assert torch.allclose(fb.velocity["b"], g * (1 + 0.5 + 0.25))
