"""Several processes that fail or run on a clock: kill -9 of one rank with torchrun's restarts
resumes from the last checkpoint and ends in the uninterrupted run's state (bitwise); a rank that
dies with no restart left is one line; a time-limited run stops every rank at the same step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from proc_tree import descendants

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def _train(out: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "memfit", "train", "--model", TINY, "--seq", "32", "--eval-batches", "2",
            "--quiet", "--warmup", "1", "--batch", "2", "--strategy", "zero2", "--nproc", "2", "--out", str(out), "--device", "cpu",
            *extra]
    return subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks(pid: int) -> list[int]:
    """The launcher's worker processes (spawned by torch.multiprocessing), found through /proc."""
    found = []
    for k in descendants(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes():
                found.append(k)
        except OSError:
            pass
    return sorted(found)


def _kill_a_rank_after_first_save(proc: subprocess.Popen, out: Path) -> int | None:
    """kill -9 the last-started rank once the run folder has a checkpoint; its pid (None: the run ended first)."""
    while proc.poll() is None:
        if (out / "checkpoint.pt").exists():
            ranks = _ranks(proc.pid)
            if ranks:
                os.kill(ranks[-1], signal.SIGKILL)
                return ranks[-1]
        time.sleep(0.01)
    return None


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc")
def test_kill_9_of_one_rank_restarts_and_ends_in_the_uninterrupted_state(tmp_path):
    steps = ["--steps", "30", "--save-every", "3"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = _train(killed, *steps, "--max-restarts", "1")
    victim = _kill_a_rank_after_first_save(proc, killed)
    _, err = proc.communicate(timeout=500)
    assert victim is not None, "the run ended before a rank could be killed"
    assert proc.returncode == 0, err[-3000:]
    said = [line for line in err.splitlines() if "memfit train: restart 1: resuming from step" in line]
    assert len(said) == 1 and int(said[0].split("step ")[1].split()[0]) < 30  # resumed mid-run
    plain = _train(whole, *steps)
    _, err = plain.communicate(timeout=500)
    assert plain.returncode == 0, err[-3000:]

    a, b = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (whole, killed))
    assert a["step"] == b["step"] == 30
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # bitwise
    assert torch.equal(a["sampler"]["generator"], b["sampler"]["generator"])
    for rank in (0, 1):  # every rank's optimizer shard (DCP files), byte for byte
        name = f"sharded-30/__{rank}_0.distcp"
        assert (whole / name).read_bytes() == (killed / name).read_bytes()
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (whole, killed))
    assert m2["steps"]["loss"] == m1["steps"]["loss"]  # the redone steps replace the lost ones


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc")
def test_a_killed_rank_without_restarts_is_one_line(tmp_path):
    proc = _train(tmp_path / "r", "--steps", "400", "--save-every", "2")
    victim = _kill_a_rank_after_first_save(proc, tmp_path / "r")
    _, err = proc.communicate(timeout=300)
    assert victim is not None
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 2
    assert "was killed by SIGKILL and --max-restarts is 0" in last and f"--resume {tmp_path / 'r'}" in last


def _timed_rank(rank, world, out, fast_clock):
    import time as time_mod

    from memfit.train import loop

    if rank == 1:  # this rank's clock runs 1.5x fast: alone it would fit a shorter run and stop first
        real = time_mod.perf_counter
        time_mod.perf_counter = lambda: 1.5 * real()
    cfg = loop.TrainConfig(model=TINY, seq=32, batch=2, warmup=1, eval_batches=1, eval_every=0, time_limit=fast_clock,
                           strategy="zero1", out=out, track=False, device="cpu")
    result = loop.train(cfg, progress=False)
    return result.step, result.stopped, result.metrics["steps"]["lr"], result.metrics["run"]["horizon"]


@pytest.mark.multiproc
def test_time_limited_run_stops_every_rank_at_the_same_step(tmp_path):
    from memfit.distributed.spawn import run_world

    r0, r1 = run_world(_timed_rank, 2, args=(str(tmp_path / "run"), 4.0), timeout_s=200)
    assert r0[0] == r1[0] > 6  # same number of steps, past calibration
    assert r0[1] == r1[1] in ("time_limit", "steps")  # "steps": the fitted length was reached
    assert r0[3] == r1[3] is not None and r0[2] == r1[2]  # one fitted length, one learning-rate schedule
    assert (tmp_path / "run" / "checkpoint.pt").exists()
