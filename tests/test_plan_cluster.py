"""The cluster planner (memfit plan --gpus): the search's choices against the figures it composes,
the per-block counts against brute force, the composed per-rank peak against the full trace, and the
CLI's table, JSON, fit-report hint and train --plan options."""
from __future__ import annotations

import itertools
import json

import pytest

from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.plan.cluster_actions import counts
from memfit.plan.cluster_fit import plan_cluster
from memfit.plan.cluster_links import parse_interconnect, ring_seconds, topology
from memfit.plan.cluster_search import candidates
from memfit.plan.costs import PlanError

TINY = "llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=384,vocab=256"
ARGS = dict(batch=4, seq=32, device="cpu")


def test_counts_match_brute_force():
    allowed = ("recompute", "selective")
    for blocks, room in itertools.product((1, 3, 6), (0, 5, 9, 14, 20, 31)):
        got = counts(blocks, room, 5, 2, 1, 3, 1.0, 0.2, allowed)
        best = None
        for rec, sel in itertools.product(range(blocks + 1), repeat=2):
            keep = blocks - rec - sel
            if keep < 0:
                continue
            used = keep * 5 + sel * 2 + rec * 1 + (3 if rec + sel else 0)
            t = rec * 1.0 + sel * 0.2
            if used <= room and (best is None or t < best[0] - 1e-12):
                best = (t, (keep, sel, rec))
        assert (got is None) == (best is None), (blocks, room)
        if got is not None:
            assert got[2] * 1.0 + got[1] * 0.2 == pytest.approx(best[0]), (blocks, room, got, best)


def test_auto_is_the_smallest_count_and_its_check_holds():
    cp = plan_cluster(TINY, "8MiB", "auto", **ARGS)
    assert cp.gpus == 2  # one process does not fit 8 MiB (below), two do
    assert not any(r.feasible for r in candidates(_tiny("8MiB"), 1))
    assert cp.peak <= cp.budget and cp.traced_peak is not None and cp.traced_peak <= cp.budget
    # the composed figure is close to the full trace's
    assert abs(cp.peak - cp.traced_peak) <= 0.1 * cp.traced_peak
    assert [c["gpus"] for c in cp.by_count][:2] == [2, 4]
    assert cp.by_count[0]["tokens_per_s"] == pytest.approx(cp.tokens_per_s)
    t = cp.time
    parts = t["compute"] + t["recompute"] + t["comm_exposed"] + t["bubble"] + t["offload"]
    assert parts == pytest.approx(t["total"])
    assert "FLOP model" in cp.time_basis


def _tiny(budget):
    from memfit.plan.cluster_fit import problem_of

    return problem_of(TINY, budget, None, None, 4, 32, "32-true", "adamw", None, "cpu", None)


def test_sharding_lowers_the_per_rank_states_and_more_memory_never_loses_a_fit():
    rows = {(r.layout.strategy, r.layout.rows, r.layout.accum): r for r in candidates(_tiny("1GiB"), 4)}
    states = {s: rows[(s, 1, 1)].ranks[0]["params"] + rows[(s, 1, 1)].ranks[0]["grad_bytes"]
              + rows[(s, 1, 1)].ranks[0]["optimizer"] for s in ("ddp", "zero1", "zero2", "zero3")}
    assert states["ddp"] > states["zero1"] > states["zero2"] >= states["zero3"]
    z2, z3 = rows[("zero2", 1, 1)], rows[("zero3", 1, 1)]
    assert z2.layout.engine == z3.layout.engine == "fsdp2"  # what memfit train runs them on (--engine auto)
    # FSDP2's zero2 shards the weights as zero3 does and keeps every block's gathered to its backward
    assert states["zero2"] == states["zero3"] and z2.ranks[0]["extra"] > z3.ranks[0]["extra"]
    small, big = candidates(_tiny("7MiB"), 4), candidates(_tiny("9MiB"), 4)
    fit_small = {(r.layout.strategy, r.layout.tp, r.layout.pp, r.layout.rows, r.layout.accum) for r in small if r.feasible}
    fit_big = {(r.layout.strategy, r.layout.tp, r.layout.pp, r.layout.rows, r.layout.accum) for r in big if r.feasible}
    assert fit_small < fit_big


def test_comm_grows_with_a_slower_link():
    fast, slow = parse_interconnect("nvlink"), parse_interconnect("10")
    assert ring_seconds(slow, 1e9, 8) > ring_seconds(fast, 1e9, 8) > 0
    assert topology(16).group_link(16).name == "ib" and topology(16).group_link(8).name == "nvlink"
    with pytest.raises(ConfigError):
        parse_interconnect("carrier-pigeon")
    with pytest.raises(ConfigError):
        topology(16, nodes=3)


def test_cli_table_json_and_train_options(tmp_path, capsys):
    assert main(["plan", TINY, "--budget", "8MiB", "--gpus", "2", "--batch", "4", "--seq", "32", "--device", "cpu",
                 "--interconnect", "pcie", "--json", "--no-verify"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["gpus"] == 2 and data["plan"]["n_blocks"] == 4
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    from memfit.train.cluster_launch import cluster_options

    opts = cluster_options(str(path))
    assert opts["nproc"] == 2 and opts["strategy"] == data["cluster"]["layout"]["strategy"]
    assert opts["_torchrun"].startswith("torchrun --nproc-per-node 2")
    assert main(["plan", TINY, "--budget", "8MiB", "--gpus", "auto", "--batch", "4", "--seq", "32",
                 "--device", "cpu", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "best plan by device count" in out and "time basis: FLOP model" in out


def test_nothing_fits_one_device_names_the_smallest_cluster(capsys):
    assert main(["plan", TINY, "--budget", "8MiB", "--batch", "4", "--seq", "32", "--device", "cpu",
                 "--allow", "recompute", "--no-verify"]) == 2
    assert "the smallest cluster that fits is 2 devices of 8.00 MiB" in capsys.readouterr().err
    with pytest.raises(PlanError, match="no layout of up to"):
        plan_cluster(TINY, "1MiB", "auto", verify=False, **ARGS)


def test_fit_with_gpus_returns_the_cluster_plan():
    import memfit

    cp = memfit.fit(TINY, budget="8MiB", gpus=2, interconnect="ib", batch=4, seq=32, device="cpu", verify=False)
    assert cp.gpus == 2 and cp.peak <= cp.budget and cp.interconnect.startswith("ib")
    assert cp.ranked[0]["feasible"] and cp.ranked[0]["step_s"] <= min(r["step_s"] for r in cp.ranked if r["feasible"])


def test_the_70b_question_is_answered_and_its_rank_trace_is_within_the_budget():
    """`memfit plan llama-2-70b --budget 80GiB --gpus auto --precision bf16-master` (docs/cluster.md):
    ZeRO-3 with the optimizer offloaded. Inside a block's backward the reduced gradient slices of the
    later blocks go to the host with the optimizer, so the rank's trace holds none of them (it once
    counted 62 GiB of them on the device, and every layout was refused)."""
    import memfit

    cp = memfit.fit("llama-2-70b", budget="80GiB", gpus="auto", precision="bf16-master")
    lay = cp.layout
    assert cp.gpus >= 2 and lay["offload_optimizer"] and lay["strategy"].startswith("zero")
    assert cp.traced_peak is not None and cp.traced_peak <= cp.budget
    assert abs(cp.traced_peak - cp.peak) <= 0.05 * cp.budget  # the composed figure and the trace agree
