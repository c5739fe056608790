"""Named GPU targets (--device h100) from a CPU machine: torch's CUDA attention backend choice, what the
chosen kernel saves per layer (Korthikanti et al. 2022's formula), CUDA's dropout mask, the reserve,
the bf16 default, and the CLI/API entry points."""
import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memfit.cli import main
from memfit.core.device import resolve_device
from memfit.core.errors import ConfigError
from memfit.core.gpus import GPUS, target
from memfit.measure.gpu_attention import choose_backend

TINY = "gpt:layers=2,hidden=64,heads=4,vocab=256,seq=64"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _packed(dtype, b=2, h=4, s=16, d=16):
    """q, k, v as (b, h, s, d) views of one fused qkv projection (memfit's GPT): cuDNN's packed layout."""
    x = torch.empty(b, s, 3, h, d, dtype=dtype, device="meta")
    return [t.transpose(1, 2) for t in x.unbind(2)]


def _dense(dtype, b=2, h=4, s=16, d=16):
    """q, k, v contiguous in (b, h, s, d) (e.g. after rotary embeddings): not a cuDNN layout."""
    return [torch.empty(b, h, s, d, dtype=dtype, device="meta") for _ in range(3)]


@pytest.mark.parametrize("gpu,tensors,kw,expected", [
    ("h100", _packed(BF16), {}, "cudnn"),                      # sm90: cuDNN first (torch's priority order)
    ("h100", _packed(BF16), dict(dropout_p=0.1), "cudnn"),
    ("h100", _dense(BF16), dict(is_causal=True), "flash"),     # not a cuDNN layout: flash
    ("a100-80gb", _packed(BF16), dict(dropout_p=0.1), "flash"),  # sm80: no cuDNN preference
    ("h100", _dense(BF16), dict(attn_mask=torch.empty(16, 16, device="meta")), "efficient"),  # flash takes no mask
    ("h100", _dense(FP32), dict(dropout_p=0.1), "efficient"),  # flash and cuDNN need 16-bit
    ("h100", _dense(FP32, d=6), {}, "math"),                   # efficient needs head_dim % 4 in fp32
    ("h100", _dense(BF16, d=12), {}, "flash"),                 # flash: any head_dim <= 256 (torch pads it)
    ("h100", _dense(BF16, d=260), {}, "math"),                 # over 256: no flash; efficient needs d % 8
    ("t4", _dense(BF16), {}, "math"),                          # sm75: no bf16 kernel
    ("t4", _dense(FP16), {}, "efficient"),                     # sm75: no flash
    ("rtx4090", _dense(BF16, d=200), dict(dropout_p=0.1), "efficient"),  # sm89 flash backward: head_dim <= 192
    ("h100", _dense(BF16, d=200), dict(dropout_p=0.1), "flash"),
])
def test_backend_choice_follows_torch_cuda_rules(gpu, tensors, kw, expected):
    assert choose_backend(target(gpu), *tensors, **kw) == expected


def test_backend_choice_honours_sdpa_kernel_switches():
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert choose_backend(target("h100"), *_packed(BF16)) == "efficient"
    with sdpa_kernel([SDPBackend.MATH]):
        assert choose_backend(target("h100"), *_packed(BF16)) == "math"


def _per_layer(device, dropout, h=256, a=4, s=128, b=2, precision=None):
    from memfit.apply.precision import PrecisionMode
    from memfit.measure.trace import trace_step
    from memfit.models.spec import parse_model

    # The paper's 16-bit everything: bf16 weights and activations without autocast.
    precision = precision or PrecisionMode("bf16, no autocast", BF16, None, None, False)
    spec = parse_model(f"gpt:layers=2,hidden={h},heads={a},vocab=64,seq={s},dropout={dropout}")
    r = trace_step(spec, batch=b, seq=s, precision=precision, optimizer="sgd", device=device, steps=1)
    return r.module_activations["blocks.0"] / (s * b * h), r


@pytest.mark.parametrize("dropout,formula", [(0.1, 34), (0.0, 32)])
def test_saved_bytes_per_layer_match_the_flash_formula(dropout, formula):
    # Korthikanti et al. 2022: 34 sbh per layer with flash attention (16-bit, 1-byte dropout masks), 32 without
    # dropout. Beyond it memfit counts the kernel's fp32 logsumexp (4as/h = 1/16 sbh here) and the norms' fp32
    # row statistics (16/h sbh): under 0.5% of the formula at this shape.
    got, r = _per_layer("h100", dropout)
    assert formula <= got <= formula * 1.005, got
    assert set(r.attention) == {"cudnn"}  # memfit's GPT: fused qkv, packed layout, sm90
    assert r.cuda_reserved >= r.cuda_allocated >= r.peak
    # memfit's bf16 modes autocast, and CUDA's autocast runs LayerNorm in fp32: each of the two norms then
    # keeps an fp32 copy of its bf16 input, 2 bytes per element more (2 x 2 sbh), and its row statistics
    # change dtype too (at most 16 bytes per row and norm: 32/h sbh for both).
    auto, _ = _per_layer("h100", dropout, precision="bf16-true")
    assert 4 <= auto - got <= 4 + 32 / 256


def test_cpu_trace_keeps_the_scores_the_gpu_does_not():
    cpu, _ = _per_layer("cpu", 0.1)
    gpu, _ = _per_layer("h100", 0.1)
    assert cpu > gpu + 20  # CPU math attention: s x s fp32 softmax, dropout mask and output (as = 512 per sbh)


def test_api_estimates_for_a_named_gpu_in_bf16_master():
    import memfit

    est = memfit.estimate(TINY, batch=2, seq=64, device="h100")
    assert est.device == "h100" and est.precision == "bf16-master" and est.precision_default == "bf16-master"
    assert est.device_memory == GPUS["h100"].memory
    assert est.per_device["reserved"] >= est.per_device["total"]
    assert est.headroom == est.device_memory - est.per_device["reserved"] - est.context
    told = memfit.estimate(TINY, batch=2, seq=64, device="h100", precision="32-true")
    assert told.precision == "32-true" and told.precision_default is None
    cpu = memfit.estimate(TINY, batch=2, seq=64)
    assert cpu.precision == "32-true" and "reserved" not in cpu.per_device and cpu.device is None


def test_cli_device_h100_json_and_text(capsys):
    assert main(["estimate", TINY, "--batch", "2", "--seq", "64", "--device", "h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    per = data["per_device"]
    assert per["reserved"] >= per["total"] > 0 and data["precision"] == "bf16-master"
    assert data["device"] == "h100" and data["device_memory"] == GPUS["h100"].memory
    assert main(["estimate", TINY, "--batch", "2", "--seq", "64", "--device", "H100",
                 "--device-memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "bf16-master (the default on h100" in text and "reserved" in text and "device memory 1.00 GiB" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_names_the_gpus(capsys):
    assert main(["estimate", TINY, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "h100" in err[0]


def test_a_gpu_name_is_refused_where_memfit_runs_the_step():
    with pytest.raises(ConfigError, match="estimate or plan"):
        resolve_device("h100")


@pytest.mark.slow
def test_plan_for_a_named_gpu_takes_its_budget_and_bf16(capsys):
    # No --budget, no --precision: the H100's capacity less the CUDA context, and bf16-master, both said.
    assert main(["plan", TINY, "--batch", "4", "--seq", "64", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "note: budget 78.67GiB" in out and "note: precision bf16-master" in out


def test_plan_without_a_budget_on_the_cpu_says_what_to_give(capsys):
    assert main(["plan", TINY, "--device", "cpu"]) == 2
    assert "give --budget" in capsys.readouterr().err


def test_expandable_segments_grow_one_segment_in_20_mib_pages():
    from memfit.measure.caching_allocator import expandable_from_env, replay

    MiB = 1 << 20
    # A 30 MiB block freed, then a 50 MiB request: the default allocator keeps A's 30 MiB segment and
    # adds a 50 MiB one; expandable segments grow the freed tail (40 MiB mapped) by one 20 MiB page.
    events = [(1, 30 * MiB), (1, 0), (2, 50 * MiB)]
    assert replay(events, expandable=False).peak_reserved == 80 * MiB
    assert replay(events, expandable=True).peak_reserved == 60 * MiB
    # A used block at the end: the next miss maps new pages after it (50 MiB rounds up to 60).
    events = [(1, 30 * MiB), (2, 30 * MiB), (1, 0), (3, 50 * MiB)]
    assert replay(events, expandable=True).peak_reserved == 120 * MiB
    assert replay(events, expandable=True).peak_allocated == 80 * MiB
    assert expandable_from_env("expandable_segments:True") and not expandable_from_env("max_split_size_mb:128")


def test_cuda_autocast_keeps_norms_and_softmax_in_fp32_only_while_inside():
    import torch.nn.functional as F

    from memfit.measure.gpu_kernels import gpu_kernels

    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=BF16):
        h = F.linear(x, torch.randn(8, 8))
        with gpu_kernels(target("h100")):  # CUDA's list: layer_norm, softmax (no dtype), sum in fp32
            assert F.layer_norm(h, (8,)).dtype == FP32 and torch.softmax(h, -1).dtype == FP32
            assert h.sum().dtype == FP32 and torch.softmax(h, -1, dtype=BF16).dtype == BF16
            assert F.linear(h, torch.randn(8, 8)).dtype == BF16
        assert F.layer_norm(h, (8,)).dtype == BF16  # the CPU's own list again


def test_a_tensor_parallel_rank_gets_no_reserve_replayed_on_the_one_device_step():
    """The allocator's reserve is replayed on the one-device step: data-parallel ranks run that step (their
    states sharded) and keep it; a TP rank runs 1/tp of each block on tp x the rows, so none is claimed
    (and the headroom falls back to the allocated figure)."""
    import memfit

    dp = memfit.estimate(TINY, batch=2, seq=64, device="h100", strategy="zero3", world=2)
    tp = memfit.estimate(TINY, batch=2, seq=64, device="h100", strategy="tensor", world=2, tp=2)
    assert dp.per_device["reserved"] >= dp.per_device["total"]
    assert "reserved" not in tp.per_device and tp.headroom == tp.device_memory - tp.per_device["total"] - tp.context
