"""What a run leaves behind (docs/reliability.md): each run here gets a fresh temp folder (TMPDIR and
tempfile's cached choice), which must be empty once the run is over, with no process of the run still
alive. The default tier runs one process in this one (a run with disk offload, a step that raises with
disk offload, the folders a kill -9 left); the slow tier runs `--nproc 2` launches that finish, lose a
rank to SIGKILL, or get Ctrl-C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from proc_tree import descendants
from memfit.cli import main

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds processes through /proc")

SMALL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"
RUN = ["--model", SMALL, "--seq", "32", "--batch", "2", "--eval-every", "0", "--eval-batches", "1", "--no-track",
       "--device", "cpu", "--checkpoint", "full+offload:disk"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


_BEFORE: dict[Path, set[int]] = {}
"""Per test's temp folder: the processes below this one before the test (earlier tests' forkserver...)."""


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Iterator[Path]:
    """A fresh, empty temp folder for this test alone (the system's may hold anyone's files)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches its first answer: ask again
    assert tempfile.gettempdir() == str(folder)
    _BEFORE[folder] = set(alive(descendants(os.getpid())))
    _THREADS_BEFORE.clear()
    _THREADS_BEFORE.update(threading.enumerate())
    yield folder
    _BEFORE.pop(folder, None)


def new_processes(scratch: Path, seconds: float = 0.0) -> list[int]:
    """Processes below this one, started during the test, still running (`seconds` from now)."""
    return alive_after([p for p in descendants(os.getpid()) if p not in _BEFORE[scratch]], seconds)


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie has ended: only its exit code is left to collect)."""
    live = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            live.append(pid)
    return live


def alive_after(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still running `seconds` from now (or at the first moment none is)."""
    end = time.monotonic() + seconds
    while (live := alive(pids)) and time.monotonic() < end:
        time.sleep(0.1)
    return live


_THREADS_BEFORE: set[threading.Thread] = set()
"""The threads alive when the test began (an earlier test in this worker may have left its own)."""


def memfit_threads() -> list[str]:
    """memfit's threads started during this test and still alive (disk spill's and optimizer offload's writers)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("memfit-") and t not in _THREADS_BEFORE]


def spill_recorder(monkeypatch) -> list[Path]:
    """Records each spill folder made (activation and optimizer offload), so a test knows it spilled."""
    from memfit.core import spill

    made: list[Path] = []
    real = spill.SpillFolder.__init__

    def init(self, *args, **kw):
        real(self, *args, **kw)
        made.append(self.path)

    monkeypatch.setattr(spill.SpillFolder, "__init__", init)
    return made


def test_one_process_run_with_disk_offload_leaves_only_its_run_folder(scratch, tmp_path, monkeypatch):
    made = spill_recorder(monkeypatch)
    out = tmp_path / "run"
    assert main(["train", *RUN, "--steps", "2", "--offload-optimizer", "disk", "--quiet", "--out", str(out)]) == 0
    assert {p.name.split("-")[3] for p in made} == {"act", "optim"} and all(p.parent == scratch for p in made)
    assert os.listdir(scratch) == []
    assert sorted(os.listdir(out)) == ["checkpoint.pt", "metrics.json", "plot.png"]  # what the user keeps
    assert new_processes(scratch) == [] and memfit_threads() == []


def test_a_step_that_raises_with_disk_offload_removes_its_spill_folder_at_once(scratch, tmp_path, monkeypatch):
    """At once: not when the collector gets to the model, which the exception's traceback keeps alive."""
    from memfit.train import step

    made = spill_recorder(monkeypatch)
    real = step.loss_sum

    def failing(*args):
        out = real(*args)
        if not torch.is_grad_enabled():  # the evaluation before the first step
            return out
        # The forward ran: its saved activations go to spill files (written by the spill's threads).
        end = time.monotonic() + 30
        while not any(f for p in made for f in p.glob("*.bin")) and time.monotonic() < end:
            time.sleep(0.01)
        assert any(f for p in made for f in p.glob("*.bin")), "nothing was spilled"
        raise RuntimeError("a step failed")

    monkeypatch.setattr(step, "loss_sum", failing)
    with pytest.raises(RuntimeError, match="a step failed") as raised:
        main(["train", *RUN, "--steps", "2", "--quiet", "--out", str(tmp_path / "run")])
    assert raised.traceback  # still held here
    assert made and os.listdir(scratch) == []
    assert new_processes(scratch) == [] and memfit_threads() == []


def test_folders_that_a_kill_9_left_are_removed_by_the_next_run(scratch):
    """The launcher's scratch folder (memfit-launch-<pid>-...) and a run's compiler cache folder
    (memfit-inductor-<pid>-...) of a process that is gone; a live process's folders stay."""
    from memfit.cli.launch_env import compiler_cache, rank_environment

    dead = _dead_pid()
    left = [scratch / f"memfit-launch-{dead}-x1", scratch / f"memfit-inductor-{dead}-x2"]
    for folder in left:
        (folder / "ready").mkdir(parents=True)
        (folder / ".lock").touch()  # unlocked: its owner died (the kernel dropped the flock)
    live = scratch / "memfit-launch-1-x3"  # pid 1 lives
    live.mkdir()
    other = scratch / "memfit-launch-notes"  # not named for a process: not memfit's to remove
    other.mkdir()
    with rank_environment() as folder:
        assert not left[0].exists() and Path(folder).parent == scratch
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    with compiler_cache():
        assert not left[1].exists()
    assert sorted(os.listdir(scratch)) == ["memfit-launch-1-x3", "memfit-launch-notes"]


# In a process of its own: on the code before, SIGTERM's default action killed the process (-15).
SIGTERM_WHILE_PREPARING = """
import os, signal, sys
from memfit.cli import main, train
def config_of(given):  # the run is still being prepared (a plan being made, a model built)
    assert os.listdir(os.environ["TMPDIR"])  # its compiler cache folder
    os.kill(os.getpid(), signal.SIGTERM)
train.config_of = config_of
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_before_the_training_loop_ends_the_run_and_removes_its_folders(scratch, tmp_path):
    """In the loop a signal stops the run after a step, saved (test_reliability.py); before it, one
    ends the command at once, with the shell's code, and its temporary folders are removed."""
    env = {"PYTHONPATH": SRC, "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin", "TMPDIR": str(scratch)}
    proc = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_PREPARING, "train", *RUN, "--steps", "2",
                           "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143 and proc.stderr.strip().endswith("memfit: interrupted"), proc.stderr[-2000:]
    assert os.listdir(scratch) == [] and not (tmp_path / "run").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _launch(tmp_path: Path, scratch: Path, steps: int) -> subprocess.Popen:
    env = {"PYTHONPATH": SRC, "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin", "TMPDIR": str(scratch)}
    cmd = [sys.executable, "-m", "memfit", "train", *RUN, "--steps", str(steps), "--save-every", "0",
           "--strategy", "ddp", "--nproc", "2", "--out", str(tmp_path / "run")]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ranks_once_training(proc: subprocess.Popen, timeout: float = 240) -> list[int]:
    """The launcher's processes once rank 0 printed a progress line (the ranks are in their step loop)."""
    end, seen = time.monotonic() + timeout, []
    while time.monotonic() < end:
        line = proc.stdout.readline()
        seen.append(line)
        if line.startswith("step "):
            return descendants(proc.pid)
        if not line and proc.poll() is not None:
            raise AssertionError(f"the run ended before training: {''.join(seen)[-3000:]}")
    raise AssertionError("no progress line")


def _rank_pids(procs: list[int]) -> list[int]:
    return [p for p in procs if b"spawn_main" in _cmdline(p) and b"resource_tracker" not in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# Slow tier: real `--nproc 2` launches with disk offload (15-30 s each on 2 cores). Killed rank: its own
# spill folder outlives it (kill -9 runs no cleanup) until the launcher, once its ranks are gone, removes
# spill folders whose owner is dead; the rank the launcher then stops (or kills) cleans up or is cleaned up
# the same way. Everything else of a launch lives in its scratch folder, removed with it.
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("end, code", [("finish", 0), ("kill_rank", 2), ("ctrl_c", 130)])
def test_a_two_rank_run_leaves_nothing_in_the_temp_folder(scratch, tmp_path, end, code):
    proc = _launch(tmp_path, scratch, steps=3 if end == "finish" else 100000)
    procs = []
    if end != "finish":
        procs = _ranks_once_training(proc)
        ranks = _rank_pids(procs)
        assert len(ranks) == 2, procs
        spills = [n for n in os.listdir(scratch) if n.startswith("memfit-spill-")]
        assert {int(n.split("-")[2]) for n in spills} == set(ranks)  # each rank spills to the temp folder
        if end == "kill_rank":
            os.kill(ranks[-1], signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == code, output[-3000:]
    assert (tmp_path / "run" / "checkpoint.pt").exists() or end == "kill_rank"
    assert os.listdir(scratch) == []
    # A few seconds: the launcher's last children (its resource tracker, a rank) can still be exiting
    # when it has (seen as processes with no command line left, not yet zombies).
    left = alive_after(procs, 10.0) + new_processes(scratch, 10.0)
    assert left == [], [_cmdline(p)[:200] for p in left]
