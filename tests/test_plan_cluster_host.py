"""The cluster planner's host model: ranks on this machine's cores, compute calibrated, gloo measured."""
from __future__ import annotations

from dataclasses import replace

import pytest

from memfit.plan import cluster_host
from memfit.plan.cluster_host import Host, calibrate, step_flops
from memfit.plan.cluster_links import parse_interconnect, topology
from memfit.plan.cluster_memory import Layout, stage_sizes
from memfit.plan.cluster_time import step_time
from memfit.plan.cluster_unit import unit_profile

MODEL = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128"
SEQ = 32


@pytest.fixture(scope="module")
def setup():
    from memfit.models.spec import parse_model

    spec = parse_model(MODEL)
    return spec, unit_profile(spec, SEQ, 1, "32-true", "adamw"), unit_profile(spec, SEQ, 2, "32-true", "adamw")


def _time(setup, lay: Layout, host: Host | None) -> dict:
    spec, u1, u2 = setup
    lay = replace(lay, counts=[(k, 0, 0) for k in stage_sizes(spec.config.layers, lay.pp)])
    return step_time(lay, u2 if lay.tp > 1 else u1, spec.config, SEQ, topology(lay.gpus, "2"), 1e9, host)


def test_ranks_sharing_cores_do_not_overlap(setup):
    pipe = Layout("pipeline", dp=1, pp=2, rows=2, accum=4)
    ddp = Layout("ddp", dp=2, rows=2)
    for lay in (pipe, ddp):  # a core to spare: the GPU-style figure
        assert _time(setup, lay, Host(cores=4))["cores"] == 0.0
        assert _time(setup, lay, Host(cores=4))["total"] == pytest.approx(_time(setup, lay, None)["total"])
    # a core per rank and none to spare: gloo's work hides behind nothing
    fits = _time(setup, ddp, Host(cores=2))
    assert fits["cores"] == 0.0 and fits["comm"] > 0 and fits["comm_exposed"] == fits["comm"]
    assert _time(setup, ddp, None)["comm_exposed"] < fits["comm"]
    one = _time(setup, pipe, Host(cores=1))
    # on one core the two stages run one after the other: every micro-batch of both, no bubble saved
    alone = _time(setup, replace(pipe, pp=1, dp=1, strategy="none"), None)
    assert one["cores"] > 0
    assert one["compute"] + one["recompute"] + one["bubble"] + one["cores"] == pytest.approx(alone["compute"], rel=0.05)
    shared = _time(setup, ddp, Host(cores=1))
    assert shared["compute"] + shared["cores"] == pytest.approx(2 * shared["compute"])


def test_fixed_costs_make_small_micro_batches_and_tensor_parallel_slower(setup):
    big, small = Layout("ddp", dp=2, rows=4), Layout("ddp", dp=2, rows=1, accum=4)
    gpu = [_time(setup, lay, None)["compute"] for lay in (big, small)]
    assert gpu[0] == pytest.approx(gpu[1])  # the FLOP model alone cannot tell them apart
    host = Host(cores=2, overhead_s=0.01)
    assert _time(setup, small, host)["compute"] - _time(setup, big, host)["compute"] == pytest.approx(3 * 4 * 0.01)
    # the optimizer step once per step, for the weights the rank updates (ZeRO: its shard)
    stepped = Host(cores=2, step_s_per_elem=1e-8)
    one, acc = _time(setup, big, stepped)["compute"], _time(setup, small, stepped)["compute"]
    assert acc - one == pytest.approx(_time(setup, small, Host(cores=2))["compute"] - _time(setup, big, Host(cores=2))["compute"])
    z = Layout("zero1", dp=2, rows=4)
    assert _time(setup, big, stepped)["compute"] - _time(setup, z, stepped)["compute"] > 0
    tp = Layout("tensor", dp=1, tp=2, rows=8)
    plain, dt = _time(setup, tp, Host(cores=2)), _time(setup, tp, Host(cores=2, tp_pair_s=0.005))
    assert dt["compute"] - plain["compute"] == pytest.approx(4 * 2 * 0.005)


def test_calibration_recovers_rate_and_fixed_cost(monkeypatch):
    from memfit.models.spec import parse_model

    spec, rate, fixed, opt = parse_model(MODEL), 3e9, 0.02, 0.005
    steps = [fixed + opt + step_flops(spec, SEQ, r) / rate for r in cluster_host.CALIBRATE_ROWS]
    monkeypatch.setattr(cluster_host, "_cached", lambda name, key, measure: {"rows": list(cluster_host.CALIBRATE_ROWS),
                                                                             "step_s": steps, "optimizer_s": opt})
    got_rate, per_block, per_elem = calibrate(MODEL, SEQ, "32-true")
    assert got_rate == pytest.approx(rate) and per_block == pytest.approx(fixed / spec.config.layers)
    assert per_elem * cluster_host._numel(spec, SEQ) == pytest.approx(opt)


def test_loopback_is_a_measured_link(monkeypatch):
    monkeypatch.setattr(cluster_host, "loopback", lambda: {"latency_s": 2e-4, "bytes_per_s": 1.5e9, "tp_pair_s": 0.0})
    link = parse_interconnect("loopback")
    assert (link.bytes_per_s, link.latency_s) == (1.5e9, 2e-4) and "measured" in link.name
