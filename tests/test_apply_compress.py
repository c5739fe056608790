"""Compression of saved activations: codec round trips, sizes, gradient error, measured memory."""
import os
import sys

import pytest
import torch

import memfit
from memfit.apply import compress as codecs
from memfit.core.errors import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
from test_apply_checkpoint import block_memory, step, tiny  # noqa: E402

# codec -> (max error relative to the tensor's absmax, minimum size ratio from fp32)
BOUNDS = {"int8": (0.5 / 127 + 1e-6, 3.5), "int8-channel": (0.5 / 127 + 1e-6, 3.9),
          "fp8": (2**-4 + 1e-6, 3.9), "bf16": (2**-8, 2.0), "fp16": (2**-11, 2.0)}


@pytest.mark.parametrize("codec", list(BOUNDS))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_round_trip_error_size_and_layout(codec, layout):
    base = torch.randn(8, 64, 96) * torch.logspace(-2, 2, 96)  # channels of very different scales
    t = {"contiguous": base, "transposed": base.transpose(0, 2), "strided": base[:, ::2]}[layout]
    packed = codecs.encode(t, codec)
    out = codecs.decode(packed)
    assert out.shape == t.shape and out.dtype == t.dtype
    if layout != "strided":
        assert out.stride() == t.stride()  # backward kernels see the layout they saw in forward
    max_err, ratio = BOUNDS[codec]
    if codec == "int8":  # per-block scales: error bounded by each block's own absmax
        assert ((out - t).abs() <= t.abs().amax() * max_err).all()
    elif codec in ("bf16", "fp16"):  # relative rounding, plus fp16's subnormal spacing near zero
        assert ((out - t).abs() <= t.abs() * max_err + 2**-24).all()
    else:
        assert (out - t).abs().max() <= t.abs().amax() * max_err
    assert t.numel() * 4 / packed.nbytes >= ratio


def test_int8_block_scales_follow_local_magnitude():
    t = torch.cat([torch.randn(64) * 1e-3, torch.randn(64) * 1e3])
    out = codecs.decode(codecs.encode(t, "int8"))
    small = (out[:64] - t[:64]).abs().max() / t[:64].abs().max()
    assert small < 0.005  # the large block's scale does not swamp the small one


def test_passthrough_for_integers_and_narrow_types():
    for t in (torch.arange(10), torch.ones(4, dtype=torch.bool), torch.randn(8).to(torch.bfloat16)):
        assert codecs.encode(t, "bf16") is t
    assert codecs.encode(torch.arange(10), "int8") is not None
    with pytest.raises(ConfigError, match="accepted: int8"):
        codecs.check_codec("int4")


@pytest.mark.parametrize("policy, tol", [("none+compress:int8", 0.03), ("none+compress:int8-channel", 0.05),
                                         ("none+compress:fp8", 0.15), ("none+compress:bf16", 0.02),
                                         ("full+compress:int8", 0.03), ("selective+offload:cpu+compress:int8", 0.03)])
def test_gradient_error_is_small_and_reported(policy, tol, tmp_path):
    ref, _, _ = step(tiny(dropout=0.0), "none", micro=1)
    got, _, _ = step(tiny(dropout=0.0), policy, micro=1, spill_dir=str(tmp_path))
    errs = {k: ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k in ref}
    worst = max(errs.values())
    assert 0 < worst < tol, (policy, worst)  # lossy (so not zero), but close


def test_int8_saved_activations_measured_smaller(tmp_path):
    none, _ = block_memory("none", tmp_path)
    int8, _ = block_memory("none+compress:int8", tmp_path)
    bf16, _ = block_memory("none+compress:bf16", tmp_path)
    assert int8 < bf16 < none
    # int8 stores ~1/3.76 of fp32; small tensors and bool masks stay as they are
    assert none / int8 > 2.5
