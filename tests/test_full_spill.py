"""A spill folder that fills up mid-run: one line saying what to do, exit 2, the work saved where it
can be, and a resume that continues the uninterrupted run (docs/reliability.md, "A full disk").

The disk is simulated: the optimizer offload's gradient write (or the activation spill's write)
raises ENOSPC on its Nth call, as a full disk does."""
from __future__ import annotations

import errno
import json

import torch

from memfit.cli import main

TINY = "gpt:layers=1,hidden=16,heads=2,vocab=256,seq=32"
FAST = ["--model", TINY, "--seq", "16", "--batch", "2", "--eval-batches", "1", "--no-track", "--quiet",
        "--eval-every", "0"]


def _fail_nth(monkeypatch, cls, name: str, n: int) -> list[int]:
    """cls.name raises ENOSPC on its n-th call (counting from 1) and after; returns the call count."""
    real, calls = getattr(cls, name), [0]

    def failing(self, *a, **k):
        calls[0] += 1
        if calls[0] >= n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(cls, name, failing)
    return calls


def _one_line(err: str) -> str:
    """The one error line (the run's own start line aside)."""
    lines = [line for line in err.splitlines() if line.strip() and "-parameter model" not in line]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def _losses(run) -> list[float]:
    return json.loads((run / "metrics.json").read_text())["steps"]["loss"]


def test_gradient_spill_filling_up_saves_the_last_step_and_resumes_bitwise(tmp_path, monkeypatch, capsys):
    from memfit.apply.chunk_files import ChunkFiles

    spill = tmp_path / "spill"
    opts = [*FAST, "--offload-optimizer", "disk", "--spill-dir", str(spill), "--save-every", "0", "--dropout", "0.1"]
    counted = _fail_nth(monkeypatch, ChunkFiles, "write_grads", 10**9)  # counts only
    assert main(["train", *opts, "--steps", "6", "--out", str(tmp_path / "straight")]) == 0
    per_step = counted[0] // 6
    monkeypatch.undo()
    capsys.readouterr()
    calls = _fail_nth(monkeypatch, ChunkFiles, "write_grads", 3 * per_step + 1)  # the 4th step's first write
    cut = tmp_path / "cut"
    assert main(["train", *opts, "--steps", "6", "--out", str(cut)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert calls[0] > 3 * per_step
    assert line.startswith("memfit train: error: spill folder") and "filled up during step 4" in line, line
    assert "No space left on device" in line and "step 3 is saved in" in line, line
    assert f"memfit train --resume {cut}" in line and "--spill-dir" in line, line
    assert torch.load(cut / "checkpoint.pt", weights_only=True)["step"] == 3  # saved, though --save-every 0
    assert not list(spill.iterdir())  # the spill folder is removed all the same
    monkeypatch.undo()
    assert main(["train", "--resume", str(cut), "--quiet"]) == 0
    assert _losses(cut) == _losses(tmp_path / "straight")  # bit for bit: the failed step was put back


def test_a_step_torn_by_the_full_disk_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """The optimizer state's write-back fails after the chunk's weights were updated: that step is
    half done and must not be saved; the last checkpoint stays the good state."""
    from memfit.apply.chunk_files import ChunkFiles
    from memfit.train import report

    real_record, real_save = report.record_step, ChunkFiles.save_state
    armed = []

    def record(history, **kw):
        real_record(history, **kw)
        if kw["step"] == 3:
            armed.append(True)  # step 4's write-back finds the disk full

    def save_state(self, k, buf):
        if armed:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(self, k, buf)

    monkeypatch.setattr(report, "record_step", record)
    monkeypatch.setattr(ChunkFiles, "save_state", save_state)
    run = tmp_path / "run"
    opts = [*FAST, "--offload-optimizer", "disk", "--spill-dir", str(tmp_path / "spill"), "--save-every", "2"]
    code = main(["train", *opts, "--steps", "6", "--out", str(run)])
    err = capsys.readouterr().err
    assert code == 2, err
    line = _one_line(err)
    assert "filled up during step 4" in line and "the last checkpoint is step 2" in line, line
    assert "is saved" not in line
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 2


def test_activation_spill_filling_up_is_one_line_and_resumes(tmp_path, monkeypatch, capsys):
    from memfit.apply.disk_spill import DiskSpill

    spill = tmp_path / "spill"
    opts = [*FAST, "--checkpoint", "none+offload:disk", "--spill-dir", str(spill), "--save-every", "0"]
    real, calls = DiskSpill.write, [0]

    def write(self, path, box, ready):
        calls[0] += 1
        if calls[0] == 40:
            box.pop()
            raise_full(self)
        return real(self, path, box, ready)

    def raise_full(self):
        from memfit.apply.disk_spill import SpillError, spill_error_message

        self.error = spill_error_message(OSError(errno.ENOSPC, "No space left on device"), str(self.dir.parent), "x")
        raise SpillError(self.error)

    monkeypatch.setattr(DiskSpill, "write", write)
    run = tmp_path / "run"
    assert main(["train", *opts, "--steps", "30", "--out", str(run)]) == 2
    line = _one_line(capsys.readouterr().err)
    step = torch.load(run / "checkpoint.pt", weights_only=True)["step"]
    assert f"filled up during step {step + 1}" in line and f"step {step} is saved" in line, line
    monkeypatch.undo()
    assert main(["train", "--resume", str(run), "--steps", str(step + 1), "--quiet"]) == 0
