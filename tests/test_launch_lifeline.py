"""No rank outlives its launcher: kill -9 of `memfit train --nproc 2` takes every rank with it within
seconds, and the sharded folder a killed save tore is removed on resume, never read as a checkpoint
(docs/reliability.md, "Several processes")."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from proc_tree import descendants

SRC = str(Path(__file__).resolve().parents[1] / "src")
GONE_WITHIN_S = 5.0
"""How long a rank may outlive its launcher: the watchdog polls every 0.5 s and the parent-death
signal is immediate; the rest is room for a loaded 2-core machine to schedule the exit."""

# A launcher stand-in: starts one "rank" (which binds itself to it) and prints the rank's pid.
_LAUNCHER = """
import os, subprocess, sys, time
from memfit.distributed.lifeline import launcher_environment
with launcher_environment():
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(rank.pid, flush=True)
time.sleep(600)
"""
_RANK = """
import time
from memfit.distributed.lifeline import bind_to_launcher
bind_to_launcher()
time.sleep(600)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMFIT_LAUNCHER_PID", "TORCHELASTIC_RUN_ID")}
    return {**env, "PYTHONPATH": SRC, **extra}


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_process_bound_to_its_launcher_dies_with_it_even_after_kill_9():
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK], env=_env(), stdout=subprocess.PIPE,
                                text=True)
    try:
        rank = int(launcher.stdout.readline())
        time.sleep(1.0)  # the rank has bound itself (importing memfit.distributed.lifeline imports no torch)
        assert _alive(rank)
        launcher.kill()
        launcher.wait(10)
        assert _gone_within([rank], GONE_WITHIN_S) == []
    finally:
        launcher.kill()
        launcher.wait(10)


def test_a_rank_whose_launcher_died_before_it_bound_itself_exits_at_once():
    """The race the parent-death signal leaves open: the launcher is gone before the rank set it."""
    gone = subprocess.run([sys.executable, "-c", "pass"])  # a pid that is not this rank's parent
    assert gone.returncode == 0
    rank = subprocess.run([sys.executable, "-c", _RANK], env=_env(MEMFIT_LAUNCHER_PID=str(os.getpid() + 10**6)),
                          capture_output=True, text=True, timeout=60)
    assert rank.returncode == -signal.SIGKILL
    assert "its launcher (pid" in rank.stderr and "is gone; exiting" in rank.stderr


def test_without_a_launcher_nothing_is_bound():
    from memfit.distributed import lifeline

    env = _env()
    code = "from memfit.distributed.lifeline import bind_to_launcher; assert bind_to_launcher() is None"
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    assert lifeline.LAUNCHER_ENV not in os.environ


SMALL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


def _memfit(*argv: str, tmp: Path, **kw) -> subprocess.Popen:
    env = _env(OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    return subprocess.Popen([sys.executable, "-m", "memfit", *argv], env=env, **kw)


# Slow tier: one real `--nproc 2` launch killed mid-save and its resume (well over 15 s on 2 cores).
@pytest.mark.multiproc
@pytest.mark.slow
def test_kill_9_of_the_launcher_takes_every_rank_and_a_torn_save_is_removed_on_resume(tmp_path):
    from memfit.train import state

    out, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    common = ["--model", SMALL, "--seq", "32", "--batch", "2", "--eval-every", "0", "--eval-batches", "1",
              "--no-track", "--device", "cpu", "--strategy", "zero2", "--quiet", "--out", str(out)]
    launcher = _memfit("train", *common, "--steps", "100000", "--save-every", "2", "--nproc", "2",
                       tmp=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 300
    while time.monotonic() < end and not (out / state.CHECKPOINT).exists():
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.2)
    ranks = descendants(launcher.pid)
    assert len([p for p in ranks if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]) >= 2
    launcher.kill()
    launcher.wait(30)
    assert _gone_within(ranks, GONE_WITHIN_S) == []
    assert [n for n in os.listdir(scratch) if n.startswith(f"memfit-launch-{launcher.pid}-")]  # kill -9 left it
    # A save that the kill tore, as the issue saw: a sharded folder without DCP's .metadata (written last).
    step = torch.load(out / state.CHECKPOINT, weights_only=True)["step"]
    torn = out / f"sharded-{step + 2}"
    torn.mkdir(exist_ok=True)
    (torn / "__0_0.distcp").write_bytes(b"half a shard")
    resumed = _memfit("train", *common, "--resume", str(out), "--steps", str(step + 1), "--nproc", "2",
                      tmp=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr[-3000:]
    assert f"sharded-{step + 2}" in stderr and "an interrupted save left" in stderr, stderr[-3000:]
    assert not torn.exists()
    assert torch.load(out / state.CHECKPOINT, weights_only=True)["step"] == step + 1
    assert os.listdir(scratch) == []  # the next launch removed what the killed one left (docs/reliability.md)
