"""`memfit train --strategy S --nproc N`: launch through torchrun's API, the same trajectory as one
process with N x batch, every rank's breakdown in metrics.json, and impossible configs failing
fast with one message and exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli import main
from reference_run import train_rank

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"
FAST = ["--model", TINY, "--seq", "32", "--eval-batches", "2", "--quiet", "--warmup", "1", "--steps", "3",
        "--device", "cpu"]  # gloo ranks on the CPU, also on a machine with GPUs
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.multiproc
@pytest.mark.slow  # the default tier launches the command in tests/test_launch_options.py (ddp, one-process trajectory)
def test_nproc_matches_one_process_with_the_global_batch(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *FAST, "--batch", "4", "--out", str(one)]) == 0
    # A fresh interpreter runs the launcher, as a user's shell would.
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    # memfit's engine: its collectives are the ones memfit's traffic counter sees (asserted below)
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", *FAST, "--batch", "2", "--strategy", "zero2",
                           "--engine", "memfit", "--nproc", "2", "--out", str(two)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m1 = json.loads((one / "metrics.json").read_text())
    m2 = json.loads((two / "metrics.json").read_text())
    # Same sequences, summed in a different order: fp32 reassociation only (see docs/distributed.md).
    assert m2["steps"]["loss"] == pytest.approx(m1["steps"]["loss"], rel=1e-5)
    assert m2["steps"]["tokens"] == m1["steps"]["tokens"]
    ranks = m2["memory"]["step_breakdown"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    single = m1["memory"]["step_breakdown"]["breakdown"]
    for r in ranks:
        assert r["breakdown"]["optimizer"] < 0.6 * single["optimizer"]  # ZeRO shards the Adam state
        assert r["bytes_sent"]["sent"]["reduce_scatter"] > 0 and r["bytes_sent"]["sent"]["all_gather"] > 0
    assert (two / "checkpoint.pt").exists() and (two / "plot.png").exists()


@pytest.mark.parametrize("extra, message", [
    (["--strategy", "zero9"], "invalid choice"),
    (["--strategy", "zero2", "--max-restarts", "1", "--steps", "2"], "applies with --nproc"),
    (["--strategy", "ddp", "--nproc", "2", "--steps", "2", "--offload-optimizer", "cpu"], "use --strategy zero1"),
    (["--strategy", "zero1", "--steps", "2"], "needs several processes"),
    (["--nproc", "1", "--strategy", "ddp", "--steps", "2"], None),
])
def test_impossible_configs_fail_fast_with_one_message(extra, message, capsys, tmp_path):
    if message is None:  # --nproc 1 is one process: --strategy then has no ranks to use
        message = "needs several processes"
    try:
        rc = main(["train", "--model", TINY, "--seq", "32", "--out", str(tmp_path / "r"), *extra])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err
    assert len(err.strip().splitlines()) == 1


def test_estimate_per_rank_lists_differing_ranks(capsys):
    import json as _json

    spec = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"
    assert main(["estimate", spec, "--batch", "2", "--strategy", "ps", "--world", "3", "--json"]) == 0
    ranks = _json.loads(capsys.readouterr().out)["ranks"]
    assert [r["rank_ids"] for r in ranks] == [[0], [1, 2]]  # each distinct rank once
    assert ranks[0]["optimizer"] > 0 and ranks[1]["optimizer"] == 0
    assert main(["estimate", spec, "--batch", "2", "--strategy", "zero3", "--world", "2", "--json"]) == 0
    z3 = _json.loads(capsys.readouterr().out)["ranks"]
    assert z3[0]["rank_ids"] == [0, 1] and z3[0]["gathered"] > 0



@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_resumed_strategy_run_continues_the_trajectory(tmp_path, strategy):
    from memfit.distributed.spawn import run_world

    cfg = dict(model=TINY, seq=32, batch=2, steps=4, warmup=1, eval_batches=2, save_every=2, strategy=strategy)
    whole = run_world(train_rank, 2, args=({**cfg, "out": str(tmp_path / "whole")}, None, None), timeout_s=300)
    part = str(tmp_path / "part")
    run_world(train_rank, 2, args=({**cfg, "out": part}, 2, None), timeout_s=300)
    resumed = run_world(train_rank, 2, args=(cfg, None, part), timeout_s=300)
    assert len(whole[0]) == len(resumed[0]) == 4
    assert resumed[0] == whole[0]  # the same layout: the same sums in the same order, bitwise

