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
    # two cores of which other work leaves half: the ranks take turns as on one core
    assert _time(setup, ddp, Host(cores=2, core_share=0.5))["total"] == pytest.approx(shared["total"])


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
    steps = [fixed + step_flops(spec, SEQ, r) / rate for r in cluster_host.CALIBRATE_ROWS]
    monkeypatch.setattr(cluster_host, "_cached", lambda name, key, measure: {"rows": list(cluster_host.CALIBRATE_ROWS),
                                                                             "fwd_bwd_s": steps, "optimizer_s": opt})
    got_rate, per_block, per_elem = calibrate(MODEL, SEQ, "32-true")
    assert got_rate == pytest.approx(rate) and per_block == pytest.approx(fixed / spec.config.layers)
    assert per_elem * cluster_host._numel(spec, SEQ) == pytest.approx(opt)


def test_loopback_is_a_measured_link(monkeypatch):
    monkeypatch.setattr(cluster_host, "loopback", lambda: {"latency_s": 2e-4, "bytes_per_s": 1.5e9, "tp_pair_s": 0.0})
    link = parse_interconnect("loopback")
    assert (link.bytes_per_s, link.latency_s) == (1.5e9, 2e-4) and "measured" in link.name


def test_pipeline_schedule_cost_is_paid_per_micro_batch_and_slot(setup):
    """1F1B at 8 micro-batches of 1 sequence against 2 of 4: the FLOP model alone prefers more
    micro-batches (a smaller bubble); the schedule's fixed cost per micro-batch and stage, paid in
    every slot (accum + stages - 1 of them), turns that round."""
    many, few = Layout("pipeline", dp=1, pp=2, rows=1, accum=8), Layout("pipeline", dp=1, pp=2, rows=4, accum=2)
    bare = {k: _time(setup, lay, Host(cores=4))["total"] for k, lay in (("many", many), ("few", few))}
    assert bare["many"] < bare["few"]
    mb1 = bare["many"] / 9  # one slot of one sequence: 9 slots, linear in the FLOPs
    cost = Host(cores=4, pp_1f1b_s=mb1, pp_gpipe_s=1.0)  # GPipe's figure must not reach a 1F1B layout
    got = {k: _time(setup, lay, cost) for k, lay in (("many", many), ("few", few))}
    assert got["many"]["total"] - bare["many"] == pytest.approx(9 * mb1)
    assert got["few"]["total"] - bare["few"] == pytest.approx(3 * mb1)
    assert got["many"]["bubble"] - _time(setup, many, Host(cores=4))["bubble"] == pytest.approx(mb1)
    assert got["many"]["total"] > got["few"]["total"]
    # measured as wall time: on one core (stages taking turns) every slot still pays it
    turns = _time(setup, many, Host(cores=1, pp_1f1b_s=mb1))["total"] - _time(setup, many, Host(cores=1))["total"]
    assert turns == pytest.approx(9 * mb1)
    gpipe = replace(many, schedule="gpipe")
    assert _time(setup, gpipe, cost)["total"] - _time(setup, gpipe, Host(cores=4))["total"] == pytest.approx(9.0)
    ddp = Layout("ddp", dp=2, rows=4)  # no schedule outside a pipeline
    assert _time(setup, ddp, cost)["total"] == _time(setup, ddp, Host(cores=4))["total"]


def test_loopback_fit_recovers_the_schedule_cost_and_core_share(monkeypatch):
    """The probe's timings made from known costs (each schedule run: a constant, then per
    micro-batch the plain stage, the link's latency and the schedule's cost; two ranks at once 1.6
    times as slow as one alone): the fit returns them."""
    from memfit.distributed import spawn
    from memfit.plan import cluster_probe as probe

    latency, plain, cost = 1e-4, 0.004, {"gpipe": 0.007, "1f1b": 0.005}
    times = {f"{s}@{m}": 0.003 + m * (plain + latency + cost[s]) for s in probe.SCHEDULES for m in probe.MICROBATCHES}
    sharing = {"alone@0": 0.010, "alone@1": 0.012, "together": 0.0176}
    result = (2 * latency, 2 * latency + (4 << 20) / 1e9, 0.0, 0.0, {**times, "plain": plain}, sharing)
    monkeypatch.setattr(spawn, "run_world", lambda fn, world, **kw: [result] * world)
    monkeypatch.setattr(cluster_host, "host_of", lambda *a, **kw: Host(cores=2))
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    monkeypatch.setattr(cluster_host, "_MEMO", {})
    got = cluster_host.loopback()
    assert got["pp_gpipe_s"] == pytest.approx(cost["gpipe"]) and got["pp_1f1b_s"] == pytest.approx(cost["1f1b"])
    assert got["latency_s"] == pytest.approx(latency) and got["bytes_per_s"] == pytest.approx(1e9)
    assert got["core_share"] == pytest.approx(2 * 0.011 / 0.0176 / 2)
    # a schedule measured no slower than its stage's own work costs nothing, not less than nothing
    assert probe.microbatch_s({**times, "plain": 1.0}, latency) == {"gpipe": 0.0, "1f1b": 0.0}
    # ranks that take turns get one core of the two; on one core, all of it
    assert probe.core_share({**sharing, "together": 0.05}, 2, 2) == 0.5
    assert probe.core_share(sharing, 2, 1) == 1.0


@pytest.mark.multiproc
@pytest.mark.slow
def test_probes_run_memfits_schedules_on_two_ranks():
    from memfit.distributed.spawn import run_world
    from memfit.plan import cluster_probe as probe

    times = run_world(probe.schedule_times, 2, timeout_s=120)[0]
    assert set(times) == {f"{s}@{m}" for s in probe.SCHEDULES for m in probe.MICROBATCHES} | {"plain"}
    assert all(t > 0 for t in times.values())
    sharing = run_world(probe.sharing_times, 2, timeout_s=120)[0]
    assert set(sharing) == {"alone@0", "alone@1", "together"} and 0.5 <= probe.core_share(sharing, 2, 2) <= 1
