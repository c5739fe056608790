"""`memfit train` refuses options the strategy would ignore (one line, exit 2, nothing started),
`--nproc N` alone trains ddp with a note, and a config error under torchrun is printed once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli import main

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"
FAST = ["--model", TINY, "--seq", "32", "--eval-batches", "1", "--quiet", "--warmup", "1", "--steps", "2",
        "--device", "cpu", "--no-track"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("extra, message", [
    (["--strategy", "zero2", "--microbatches", "4"], "--microbatches applies to --strategy pipeline, not --strategy zero2"),
    (["--strategy", "zero2", "--tp", "2"], "--tp applies to --strategy tensor, not --strategy zero2"),
    (["--strategy", "zero2", "--schedule", "gpipe"], "--schedule applies to --strategy pipeline"),
    (["--strategy", "zero2", "--dp", "2"], "--dp applies to --strategy pipeline"),
    (["--strategy", "ddp", "--tp", "2"], "--tp applies to --strategy tensor, not --strategy ddp"),
    (["--strategy", "tensor", "--microbatches", "2"], "--microbatches applies to --strategy pipeline"),
    (["--strategy", "pipeline", "--tp", "2"], "--tp applies to --strategy tensor, not --strategy pipeline"),
    (["--strategy", "none"], "--strategy none runs one process"),
    (["--microbatches", "2"], "--microbatches applies to --strategy pipeline, not --strategy ddp"),
])
def test_an_option_the_strategy_ignores_is_refused_in_one_line(extra, message, capsys, tmp_path):
    rc = main(["train", *FAST, "--out", str(tmp_path / "r"), "--nproc", "2", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert [line for line in err.splitlines() if "error" in line] == [err.strip().splitlines()[-1]]
    assert not (tmp_path / "r").exists()


def test_one_process_refuses_strategy_options_too(capsys, tmp_path):
    rc = main(["train", *FAST, "--out", str(tmp_path / "r"), "--microbatches", "2"])
    assert rc == 2 and "not --strategy none" in capsys.readouterr().err


def test_a_config_error_is_printed_by_rank_zero_only(capsys, tmp_path, monkeypatch):
    args = ["train", *FAST, "--out", str(tmp_path / "r"), "--strategy", "zero2", "--tp", "2"]
    monkeypatch.setenv("RANK", "1")
    assert main(args) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(args) == 2
    assert capsys.readouterr().err.count("--tp applies") == 1


def test_a_usage_error_is_printed_by_rank_zero_only(capsys, monkeypatch):
    args = ["train", *FAST, "--batch", "0"]  # refused by argparse itself, before memfit's checks
    monkeypatch.setenv("RANK", "1")
    assert main(args) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(args) == 2
    assert capsys.readouterr().err.count("argument --batch") == 1


def test_ctrl_c_while_memfit_starts_is_one_line_and_130(capsys, monkeypatch):
    import memfit.cli as cli

    def interrupted():
        raise KeyboardInterrupt  # what Ctrl-C in the seconds of importing torch raises

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == "memfit: interrupted\n"


def _env(tmp: Path) -> dict:
    env = {"PYTHONPATH": SRC, "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin", "TMPDIR": str(tmp)}
    return env  # OMP_NUM_THREADS left unset, as in a user's shell: the launcher sets it


@pytest.mark.multiproc
def test_nproc_alone_trains_ddp_with_a_note_and_leaves_nothing_behind(tmp_path):
    """The default tier's run of the command in a new interpreter, as a user's shell starts it: the
    launcher and its ranks train the trajectory of one process with the global batch (the slow
    tests/test_distributed_train.py runs it under ZeRO-2 and checks the sharded state)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out, one = tmp_path / "run", tmp_path / "one"
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", *FAST, "--batch", "2", "--nproc", "2",
                           "--out", str(out)], env=_env(scratch), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "without --strategy: training data-parallel with --strategy ddp" in proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["strategy"] == "ddp"
    assert sorted(os.listdir(scratch)) == []  # no torchelastic_*, torchinductor_*, pytorch-errorfile-*
    assert main(["train", *FAST, "--batch", "4", "--out", str(one)]) == 0
    single = json.loads((one / "metrics.json").read_text())
    # Same sequences, summed in a different order: fp32 reassociation only (see docs/distributed.md).
    assert metrics["steps"]["loss"] == pytest.approx(single["steps"]["loss"], rel=1e-5)
    assert metrics["steps"]["tokens"] == single["steps"]["tokens"]
    assert (out / "checkpoint.pt").exists()


@pytest.mark.multiproc
def test_config_error_under_torchrun_is_printed_once_with_exit_2_per_rank(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "memfit", "train", *FAST, "--strategy", "zero2", "--microbatches", "4",
                           "--out", str(tmp_path / "r")],
                          env=_env(scratch), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("memfit train: error: --microbatches applies") == 1, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr  # every rank exited 2 (torchrun itself reports 1)
    assert not (tmp_path / "r").exists()
