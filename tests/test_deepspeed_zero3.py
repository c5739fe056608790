"""DeepSpeed ZeRO-3's buffers and gathered weights as memfit.integrations.deepspeed_zero3 computes them from
a config, without DeepSpeed: the defaults are DeepSpeed 0.19's (deepspeed/runtime/zero/config.py), the
arithmetic that of stage3.py and partitioned_param_coordinator.py. The measured comparison is
bench/deepspeed_config.py's."""
from __future__ import annotations

import json

import pytest

from memfit.core.errors import ConfigError
from memfit.integrations.deepspeed_zero3 import (Zero3Settings, gathered_numel, partitions, persistent, read_zero3,
                                                 sub_groups, zero3_buffers)


def test_absent_keys_take_deepspeeds_defaults_and_both_spellings_are_read():
    s = read_zero3("ds.json", {})
    # DeepSpeedZeroConfig: reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, persistence 1e5,
    # max_live / max_reuse / sub_group_size 1e9, contiguous_gradients true; grad_accum_dtype: the weights'
    assert (s.reduce_bucket, s.prefetch_bucket, s.persistence, s.max_live, s.max_reuse, s.sub_group) == \
        (500_000_000, 50_000_000, 100_000, 1_000_000_000, 1_000_000_000, 1_000_000_000)
    assert s.contiguous and s.grad_bytes is None
    s = read_zero3("ds.json", {"stage3_prefetch_bucket_size": 7, "param_persistence_threshold": 0,
                               "reduce_bucket_size": 5e3, "contiguous_gradients": False}, {"grad_accum_dtype": "fp32"})
    assert (s.prefetch_bucket, s.persistence, s.reduce_bucket, s.contiguous, s.grad_bytes) == (7, 0, 5000, False, 4)
    for bad in ({"stage3_max_reuse_distance": "auto"}, {"reduce_bucket_size": 0}):
        with pytest.raises(ConfigError, match="number of elements"):
            read_zero3("ds.json", bad)


def test_buffer_bytes_follow_the_weights_dtype_offload_and_sub_groups():
    parts = partitions([1001, 10, 4000], world=4)
    assert parts == [251, 3, 1000]  # each tensor padded on its own
    s = Zero3Settings(reduce_bucket=64)
    fp32 = zero3_buffers(s, parts, 4, fp32_weights=True, offloaded=False)
    assert fp32 == {"grads": 1254 * 4, "bucket": 64 * 4, "copy": 1254 * 4, "step": 1254 * 4}
    bf16 = zero3_buffers(s, parts, 2, fp32_weights=False, offloaded=False)
    assert bf16 == {"grads": 1254 * 2, "bucket": 64 * 2, "copy": 0, "step": 1254 * 4}
    wide = zero3_buffers(Zero3Settings(reduce_bucket=64, grad_bytes=4, contiguous=False), parts, 2, False, False)
    assert (wide["grads"], wide["bucket"]) == (1254 * 4, 0)
    off = zero3_buffers(s, parts, 4, fp32_weights=True, offloaded=True)
    assert (off["grads"], off["copy"], off["step"], off["bucket"]) == (0, 0, 0, 64 * 4)
    # a sub-group closes once it reaches sub_group_size: 251+3 < 300, +1000 closes it
    assert sub_groups(parts, 300) == [1254] and sub_groups(parts, 200) == [251, 1003]
    assert zero3_buffers(Zero3Settings(sub_group=200), parts, 4, True, False)["step"] == 1003 * 4


def test_persistence_keeps_small_tensors_whole_within_the_model_threshold():
    params = [(1, 50), (2, 200), (3, 60), (4, 30)]
    assert persistent(params, Zero3Settings(persistence=100)) == {1, 3, 4}
    assert persistent(params, Zero3Settings(persistence=100, model_persistence=100)) == {1, 4}
    assert persistent(params, Zero3Settings(persistence=0)) == set()


def test_reuse_distance_and_prefetch_decide_what_forward_ends_holding():
    mods = [[(1, 10)], [(2, 20)], [(3, 30)], [(4, 40)]]
    # everything is reused within 1e9 elements of the trace (forward, then backward): all held
    assert gathered_numel(mods, Zero3Settings(), set()) == 100
    # max_reuse 100, no prefetch: module 3's next use is 40 + 40 elements away (kept), module 2's
    # 30 + 40 + 40 >= 100 (released), module 1's further
    assert gathered_numel(mods, Zero3Settings(max_reuse=100, prefetch_bucket=0), set()) == 70
    assert gathered_numel(mods, Zero3Settings(max_reuse=0, prefetch_bucket=0), set()) == 40
    # a persistent tensor is never released
    assert gathered_numel(mods, Zero3Settings(max_reuse=0, prefetch_bucket=0), {1}) == 50
    # prefetch walks the trace past forward's end: at module 3 the next entries are backward's 4 and 3
    # (held, passed over), then 2 (20 < the 25-element bucket, so one more) and 1; 3 is kept, fetched for later
    assert gathered_numel(mods, Zero3Settings(max_reuse=0, prefetch_bucket=25), set()) == 100
    # with max_live_parameters 40: module 3 may prefetch only 10 elements (4 is fetched whole), then module
    # 3 is released and module 4 finds 40 live, so prefetches nothing
    assert gathered_numel(mods, Zero3Settings(max_reuse=0, prefetch_bucket=25, max_live=40), set()) == 40


def test_estimate_deepspeed_zero3_holds_every_weight_and_its_buffers(tmp_path):
    from memfit.integrations.deepspeed import estimate_config
    from memfit.measure.estimate import estimate

    gpt = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 0}}))
    got = estimate_config(str(path), gpt, world=2, seq=16)
    plain = estimate(gpt, batch=2, seq=16, precision="32-true", strategy="zero3", world=2)
    n, row = plain.n_params, got.ranks[0]
    # fp32 weights: every weight whole at forward's end (a 2-block model is far inside 1e9 elements of
    # reuse), the gradient partition and the fp32 partition copy, the 1000-element bucket beside memfit's
    assert row["gathered"] == 4 * n and row["grads"] == row["params"] >= 4 * n // 2
    assert row["in_flight"] == plain.ranks[0]["in_flight"] + 4000 and "IPG bucket 4,000 B" in got.note
    assert row["optimizer"] == plain.ranks[0]["optimizer"] + row["params"]
    # the rest is memfit's ZeRO-3 row, its gathered blocks and reduced slices replaced by DeepSpeed's, at the
    # one-device moment with the most activations and temporaries (every weight is gathered near all of them)
    was = plain.ranks[0]
    live = max(m["activations"] + m["temporaries"] for m in plain.moments.values() if m["grads"] < 4 * n)
    assert live >= was["activations"] + was["temporaries"]
    assert got.per_device["total"] == row["total"] == (3 * row["params"] + 4 * n + was["in_flight"] + 4000
                                                       + was["optimizer"] + live)
