"""A run folder belongs to one run, and a checkpoint with a flipped bit is refused, never trained on.

docs/reliability.md, "One run per folder" and "Checksums".
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.train import state
from memfit.train.runlock import LOCK, RunLock

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=64"
FAST = ["--model", TINY, "--seq", "16", "--batch", "2", "--eval-batches", "1", "--quiet", "--no-track", "--device", "cpu"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def run3(tmp_path_factory) -> Path:
    """A finished 3-step run saved at steps 2 and 3 (checkpoint.pt and checkpoint.prev.pt)."""
    out = tmp_path_factory.mktemp("run3") / "run"
    assert main(["train", *FAST, "--steps", "3", "--save-every", "2", "--out", str(out)]) == 0
    return out


def _copy(run: Path, to: Path) -> Path:
    to.mkdir()
    for f in run.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s run lock, as a live run does, until it is killed."""
    code = ("import sys, time; from memfit.train.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC})
    assert proc.stdout.readline().strip() == "held"
    return proc


def _last_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if lines else ""


def test_a_folder_in_use_is_refused_and_a_killed_holder_leaves_no_lock(run3, tmp_path, capsys):
    run = _copy(run3, tmp_path / "busy")
    before = (run / state.CHECKPOINT).read_bytes()
    holder = _holder(run)
    try:
        capsys.readouterr()
        assert main(["train", "--resume", str(run), "--steps", "4", "--quiet", "--no-track"]) == 2
        err = _last_error(capsys)
        assert "is in use by another memfit train run" in err and f"pid {holder.pid}" in err and "started" in err
        assert (run / state.CHECKPOINT).read_bytes() == before  # the live run's checkpoint is untouched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 leaves the lock file behind but not the lock: the OS dropped it with the process.
    assert (run / LOCK).exists()
    assert main(["train", "--resume", str(run), "--steps", "4", "--quiet", "--no-track"]) == 0
    assert state.load_checkpoint(run)["step"] == 4 and not (run / LOCK).exists()


def test_a_fresh_run_refuses_a_folder_with_a_checkpoint_unless_told(run3, tmp_path, capsys):
    run = _copy(run3, tmp_path / "old")
    before = (run / state.CHECKPOINT).read_bytes()
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {run}" in err and "--overwrite" in err and err.count("\n") == 1  # one line
    assert (run / state.CHECKPOINT).read_bytes() == before
    assert main(["train", *FAST, "--steps", "1", "--out", str(run), "--resume", str(run)]) == 2  # not both
    capsys.readouterr()
    assert main(["train", "--resume", str(run3), "--out", str(run), "--steps", "4", "--quiet"]) == 2  # another run's
    assert "already holds another run's checkpoint.pt" in capsys.readouterr().err
    assert (run / state.CHECKPOINT).read_bytes() == before
    assert main(["train", *FAST, "--steps", "1", "--out", str(run), "--overwrite"]) == 0
    assert state.load_checkpoint(run)["step"] == 1 and not (run / state.PREVIOUS).exists()


def test_two_runs_in_one_process_into_one_folder(tmp_path):
    """flock holds between two opens of the same file, so even one process cannot hold a folder twice."""
    with RunLock(tmp_path):
        with pytest.raises(Exception, match="in use by another memfit train run"):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released: a new run takes it
        pass


def _flip(path: Path, tensor: torch.Tensor, nbytes: int = 1) -> None:
    """Flip bits inside `tensor`'s bytes where they lie in the file (found by their pattern)."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.contiguous().numpy().tobytes())
    assert at >= 0
    for i in range(nbytes):
        data[at + 4 + i] ^= 0x10 if nbytes == 1 else 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["weight", "optimizer"])
def test_a_flipped_bit_is_refused_on_resume_naming_the_tensor(run3, tmp_path, capsys, where):
    run = _copy(run3, tmp_path / where)
    ckpt = torch.load(run / state.CHECKPOINT, weights_only=True)
    if where == "weight":
        _flip(run / state.CHECKPOINT, ckpt["model"]["blocks.1.mlp.proj.weight"])
        named = "model weight blocks.1.mlp.proj.weight"
    else:
        opt = ckpt["optimizer"]["optimizer"]["state"]
        _flip(run / state.CHECKPOINT, opt[max(opt)]["exp_avg_sq"], nbytes=4)
        named = "optimizer state exp_avg_sq of parameter"
    corrupt = (run / state.CHECKPOINT).read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "5", "--quiet"]) == 2
    err = _last_error(capsys)
    assert "is corrupt" in err and named in err and f"--resume {run / state.PREVIOUS}" in err
    assert (run / state.CHECKPOINT).read_bytes() == corrupt  # nothing derived from it was written
    # The kept previous checkpoint (step 2) continues the run; the corrupt one never becomes the previous.
    assert main(["train", "--resume", str(run / state.PREVIOUS), "--steps", "4", "--quiet", "--no-track"]) == 0
    assert state.load_checkpoint(run)["step"] == 4 and state.load_checkpoint(run / state.PREVIOUS)["step"] == 2


def test_checksums_cover_every_entry_and_the_previous_checkpoint_is_kept(run3, tmp_path):
    from memfit.core.errors import ConfigError
    from memfit.train import integrity

    assert state.load_checkpoint(run3)["step"] == 3 and state.load_checkpoint(run3 / state.PREVIOUS)["step"] == 2
    ckpt = torch.load(run3 / state.CHECKPOINT, weights_only=True)
    assert set(ckpt[integrity.KEY]["entries"]) == set(ckpt) - {integrity.KEY}
    assert "model/blocks.1.mlp.proj.weight" in ckpt[integrity.KEY]["crc32"]
    edited = dict(ckpt, step=4)  # a plain value, not a tensor
    with pytest.raises(ConfigError, match="its 'step' entry does not match"):
        integrity.verify(edited, "x")
    state.save_checkpoint(tmp_path / "c.pt", edited)  # written without new checksums: the old ones no longer hold
    with pytest.raises(ConfigError, match="corrupt.*'step'.*no earlier checkpoint"):
        state.load_checkpoint(tmp_path / "c.pt")


def test_a_save_that_does_not_read_back_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from memfit.train import integrity

    path = tmp_path / state.CHECKPOINT
    state.save_checkpoint(path, {"w": torch.ones(3)}, sealed=True)
    before = path.read_bytes()
    real = integrity.seal

    def damaged(s):  # the file on disk will not match its checksums, as if damaged on its way there
        out = real(s)
        out[integrity.KEY]["crc32"]["w"] = "00000000"
        return out

    monkeypatch.setattr(integrity, "seal", damaged)
    with pytest.raises(OSError, match="does not read back.*tensor w does not match"):
        state.save_checkpoint(path, {"w": torch.zeros(3)}, sealed=True)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [state.CHECKPOINT]


def _memfit(*argv: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memfit", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.slow
def test_two_memfit_train_processes_into_one_folder(tmp_path):
    """Two real runs into one --out: the second is refused (exit 2) and the first ends with its own
    checkpoint; then a run killed with SIGKILL mid-run leaves no lock behind."""
    args = ("train", *FAST, "--save-every", "5", "--out", "run")
    # The first run ends by SIGTERM once the second is refused (saved, exit 143); its time limit is only a
    # ceiling long enough for the second's start on a loaded machine, which it used to train out in full.
    first = _memfit(*args, "--time-limit", "45", cwd=tmp_path)
    _wait_for(tmp_path / "run" / LOCK)
    second = _memfit(*args, "--steps", "2", "--overwrite", cwd=tmp_path)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 2 and f"in use by another memfit train run (pid {first.pid}" in err
    assert err.strip().splitlines()[-1].startswith("memfit train: error: run folder")
    assert first.poll() is None, "the first run ended before the second tried: the test proved nothing"
    _wait_for(tmp_path / "run" / state.CHECKPOINT)  # its step-5 save
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=600)
    assert first.returncode == 143 and state.load_checkpoint(tmp_path / "run")["step"] >= 5  # not the second's
    killed = _memfit("train", "--resume", "run", "--steps", "100000", "--quiet", "--no-track", cwd=tmp_path)
    _wait_for(tmp_path / "run" / LOCK)
    time.sleep(1)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert (tmp_path / "run" / LOCK).exists()  # the file stays; the lock went with the process
    again = _memfit("train", "--resume", "run", "--steps", "100000", "--time-limit", "5", "--quiet", "--no-track", cwd=tmp_path)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
