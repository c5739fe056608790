"""No work lost to a bad folder, a full disk, SIGTERM or kill -9 (docs/reliability.md names each promise)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.train import loop, state

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = "gpt:layers=1,hidden=16,heads=2,vocab=256,seq=32"
FAST = ["--model", TINY, "--seq", "16", "--batch", "2", "--eval-batches", "1", "--no-track", "--quiet"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _memfit(*argv: str, cwd: Path | None = None, prefix: tuple[str, ...] = (), **kw) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "memfit", *argv], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _one_error_line(err: str, command: str = "train") -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"memfit {command}: error:"), err
    return errors[0]


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240.0) -> int:
    """Wait until the run's checkpoint holds at least `step` steps; returns the step it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            saved = torch.load(run_dir / state.CHECKPOINT, weights_only=True)["step"]
            if saved >= step:
                return saved
        except (OSError, RuntimeError, EOFError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint at step {step} after {timeout} s")


# ---------------------------------------------------------------- the run folder, checked up front


def test_unwritable_working_folder_is_refused_before_training(tmp_path):
    """The default runs/ under a folder the user cannot write: one line, exit 2, before step 1."""
    cwd = tmp_path / "readonly"
    cwd.mkdir()
    cwd.chmod(0o555)
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:  # root writes anywhere: drop the capability that lets it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search"
        prefix = ("setpriv", "--bounding-set", caps, "--inh-caps", caps)
    proc = _memfit("train", *FAST, "--steps", "1", cwd=cwd, prefix=prefix)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    line = _one_error_line(err)
    assert "cannot create run folder 'runs/" in line and "Permission denied" in line and "--out" in line
    assert "0.00M-parameter" not in err  # refused before the run started
    assert not list(cwd.iterdir())


@pytest.mark.parametrize("out, needle", [
    ("file", "--out '{out}' is an existing file, not a folder"),
    ("file/run", "cannot create run folder '{out}' (Not a directory)"),
])
def test_out_that_cannot_be_a_folder(tmp_path, capsys, out, needle):
    (tmp_path / "file").write_text("not a folder")
    out = str(tmp_path / out)
    assert main(["train", *FAST, "--steps", "1", "--out", out]) == 2
    assert needle.format(out=out) in _one_error_line(capsys.readouterr().err)
    assert (tmp_path / "file").read_text() == "not a folder"


def test_resume_takes_the_checkpoint_file_too(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "2", "--out", str(run)]) == 0
    assert main(["train", "--resume", str(run / "checkpoint.pt"), "--steps", "3", "--quiet"]) == 0
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 3
    # The step-2 checkpoint is kept as checkpoint.prev.pt; no lock or temporary file is left.
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt", "metrics.json", "plot.png"]
    assert torch.load(run / "checkpoint.prev.pt", weights_only=True)["step"] == 2


# ---------------------------------------------------------------- a full disk


def _full_disk_at(monkeypatch, failing_steps: set[int]) -> list[int]:
    """torch.save writes part of the file, then fails as a full disk does, at these steps."""
    real, tried = torch.save, []

    def save(obj, f, *args, **kwargs):
        tried.append(obj["step"])
        if obj["step"] in failing_steps:
            f.write(b"\0" * 4096)  # a torn temp file: it must never replace the checkpoint
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return tried


def test_full_disk_warns_once_trains_on_and_saves_at_the_next_save(tmp_path, monkeypatch, capsys):
    tried = _full_disk_at(monkeypatch, {2})
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "6", "--save-every", "2", "--out", str(run)]) == 0
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert tried == [2, 4, 6]
    warnings = [line for line in err.splitlines() if "cannot save" in line]
    assert len(warnings) == 1 and "step 2" in warnings[0] and str(run) in warnings[0] and "free" in warnings[0]
    assert "No space left on device" in warnings[0] and "Traceback" not in err
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 6 and ckpt["history"]["steps"]["step"] == list(range(1, 7))
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


def test_full_disk_twice_stops_cleanly_with_exit_2(tmp_path, monkeypatch, capsys):
    _full_disk_at(monkeypatch, {4, 6, 8})
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "8", "--save-every", "2", "--out", str(run)]) == 2
    monkeypatch.undo()
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot save step 6 in {run}" in line and "free" in line and "last checkpoint saved is step 2" in line
    assert f"--resume {run}" in line
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 2  # the good one, untouched
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert main(["train", "--resume", str(run), "--quiet"]) == 0  # and it continues from there


# ---------------------------------------------------------------- signals


def test_sigterm_saves_cleans_up_and_exits_143(tmp_path):
    run, spill = tmp_path / "run", tmp_path / "spill"
    spill.mkdir()
    proc = _memfit("train", *FAST, "--steps", "100000", "--save-every", "1", "--out", str(run),
                   "--offload-optimizer", "disk", "--spill-dir", str(spill))
    _wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "SIGTERM" in err and "Traceback" not in err and "(SIGTERM)" in out
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    metrics = json.loads((run / "metrics.json").read_text())
    assert ckpt["step"] == metrics["steps"]["step"][-1] >= 2  # the state after the last finished step
    assert not list(spill.iterdir())  # the optimizer's spill folder is gone
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert main(["train", "--resume", str(run), "--steps", str(ckpt["step"] + 1), "--quiet"]) == 0


def test_second_signal_saves_without_the_final_evaluation(tmp_path, monkeypatch, capsys):
    from memfit.train import report

    real = report.record_step

    def record_then_two_signals(history, **kw):
        real(history, **kw)
        if kw["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(report, "record_step", record_then_two_signals)
    run = tmp_path / "r"
    assert main(["train", *FAST, "--steps", "5", "--save-every", "0", "--eval-every", "0", "--out", str(run)]) == 143
    err = capsys.readouterr().err
    assert "second SIGTERM: saving now" in err and "Traceback" not in err
    assert f"memfit: interrupted by SIGTERM: step 2 is saved in {run}" in err
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 2 and ckpt["history"]["val"]["step"] == [0]  # saved, the final evaluation skipped
    assert not (run / "plot.png").exists()
    assert main(["train", "--resume", str(run), "--quiet"]) == 0  # and it goes on from there


_DOUBLE_SIGTERM_TRIES = 3


@pytest.mark.slow
def test_double_sigterm_to_the_command_exits_143_with_the_line_never_aborts(tmp_path):
    """The second SIGTERM lands wherever the process is (a step, the save, the plot, the exit):
    each try exits 143 with the interrupted line, never SIGABRT or killed by the signal."""
    for i in range(_DOUBLE_SIGTERM_TRIES):
        run = tmp_path / f"r{i}"
        proc = _memfit("train", *FAST, "--steps", "100000", "--save-every", "1", "--out", str(run))
        _wait_for_step(run, 2, proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05 + 0.3 * i)  # the second during the last step, the save or the way out
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, (proc.returncode, err[-2000:])
        assert "memfit: interrupted by SIGTERM: step" in err and "Traceback" not in err and "terminate" not in err
        step = torch.load(run / "checkpoint.pt", weights_only=True)["step"]
        assert f"step {step} is saved" in err


# ---------------------------------------------------------------- kill -9


_KILLED_WRITER = """
import os, sys
from memfit.train import state
def write(f):
    f.write(b"half a checkpoint")
    f.flush()
    os.kill(os.getpid(), 9)
state.atomic_write(sys.argv[1], write)
"""


def test_temp_files_of_a_killed_save_are_removed_by_the_next_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "2", "--out", str(run)]) == 0
    good = (run / "checkpoint.pt").read_bytes()
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(run / "checkpoint.pt")], env=_env())
    assert killed.returncode == -signal.SIGKILL
    stale = [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert len(stale) == 1 and stale[0].name.startswith(".checkpoint.pt.")
    assert (run / "checkpoint.pt").read_bytes() == good  # the kill left the checkpoint whole
    # A temp file of a process that is still alive (another writer) is left alone.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = run / f".checkpoint.pt.{sleeper.pid}.abc123.tmp"
        live.write_bytes(b"in progress")
        capsys.readouterr()
        assert main(["train", "--resume", str(run), "--steps", "3", "--quiet"]) == 0
        err = capsys.readouterr().err
        assert "removed 1 temporary file(s) that a killed run left" in err
        assert not stale[0].exists() and live.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert state.remove_stale_temps(run) == [live]


@pytest.mark.slow
def test_kill_9_and_resume_with_disk_offload_is_bit_identical(tmp_path):
    opts = ["--steps", "8", "--save-every", "1", "--offload-optimizer", "disk", "--checkpoint", "full+offload:disk",
            "--dropout", "0.1", "--accum", "2"]
    spill = tmp_path / "spill"
    spill.mkdir()
    straight = _memfit("train", *FAST, *opts, "--spill-dir", str(spill), "--out", str(tmp_path / "straight"))
    assert straight.wait(timeout=600) == 0, straight.communicate()
    cut = tmp_path / "cut"
    proc = _memfit("train", *FAST, *opts, "--spill-dir", str(spill), "--out", str(cut))
    killed_at = _wait_for_step(cut, 3, proc)
    proc.kill()  # SIGKILL: no handler runs, no cleanup
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and killed_at < 8
    assert list(spill.iterdir())  # the killed run's spill folders are still there...
    assert main(["train", "--resume", str(cut), "--quiet"]) == 0
    assert not list(spill.iterdir())  # ...until the next run using that spill root removes them
    a = json.loads((tmp_path / "straight" / "metrics.json").read_text())["steps"]
    b = json.loads((cut / "metrics.json").read_text())["steps"]
    assert b["step"] == a["step"] == list(range(1, 9))
    assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"]  # bit for bit, not approximately
    wa = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)["model"]
    wb = torch.load(cut / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ctrl_c_exits_130_after_saving(tmp_path, monkeypatch, capsys):
    from memfit.train import report

    real = report.record_step

    def record_then_ctrl_c(history, **kw):
        real(history, **kw)
        if kw["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(report, "record_step", record_then_ctrl_c)
    assert main(["train", *FAST, "--steps", "5", "--save-every", "0", "--out", str(tmp_path / "r")]) == 130
    assert "(interrupted)" in capsys.readouterr().out
    assert torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["step"] == 2
