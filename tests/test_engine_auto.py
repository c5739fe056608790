"""--engine auto (the default of memfit train, memfit estimate and distribute()): torch's FSDP2 for zero2
and zero3 unless the run uses what only memfit's flat engine does, which one line on stderr names;
zero1 and the other strategies stay memfit's. The 2-rank run on the default is
tests/test_fsdp2_train.py's smoke test; the cluster plan's engine is tests/test_plan_cluster_file_train.py's."""
from __future__ import annotations

import pytest

from memfit.cli import main
from memfit.distributed.strategy import engine_for, engine_line
from memfit.train.config import TrainConfig

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


@pytest.mark.parametrize("strategy, kw, engine, words", [
    ("zero3", {}, "fsdp2", None),
    ("zero2", {"precision": "bf16-master"}, "fsdp2", None),
    ("zero3", {"precision": "16-mixed"}, "memfit", "fp16 loss scaling needs it"),
    ("zero2", {"compress": "int8"}, "memfit", "--compress int8"),
    ("zero3", {"offload": "disk"}, "memfit", "offload to disk"),
    ("zero3", {"offload": "cpu"}, "memfit", "CPU rank"),
    ("zero3", {"offload": "cpu", "cuda": True}, "fsdp2", None),  # FSDP2's CPUOffloadPolicy
    ("zero3", {"optimizer": "adamw8bit"}, "memfit", "adamw8bit"),
    ("zero3", {"optimizer": "adafactor"}, "memfit", "adafactor"),
    ("zero1", {}, "memfit", None),
    ("ddp", {}, "memfit", None),
])
def test_auto_picks_fsdp2_unless_the_run_needs_memfits_engine(strategy, kw, engine, words):
    got, reason = engine_for(strategy, **kw)
    assert got == engine
    assert (reason is None) == (words is None) and (words is None or words in reason), reason


def test_the_fp16_fallback_is_one_line_on_stderr_before_the_launch(capsys):
    from memfit.cli.train import _engine_given

    cfg = TrainConfig(model=TINY, strategy="zero3", precision="16-mixed", device="cpu")
    given = _engine_given(cfg, {"strategy": "zero3", "nproc": 2})
    assert given["engine"] == cfg.engine == "memfit"  # the ranks get it as --engine memfit
    assert capsys.readouterr().err == "memfit train: engine: memfit (fp16 loss scaling needs it)\n"
    cfg = TrainConfig(model=TINY, strategy="zero2", device="cpu")
    assert _engine_given(cfg, {"strategy": "zero2", "nproc": 2})["engine"] == "fsdp2"
    assert capsys.readouterr().err == f"memfit train: {engine_line('fsdp2', None)}\n"
    cfg = TrainConfig(model=TINY, strategy="zero3", engine="memfit", precision="16-mixed", device="cpu")
    assert _engine_given(cfg, {"strategy": "zero3", "engine": "memfit"})["engine"] == "memfit"
    assert capsys.readouterr().err == ""  # asked for: nothing to explain


def test_estimate_defaults_to_the_engine_train_runs(capsys):
    import json

    args = [TINY, "--batch", "2", "--strategy", "zero3", "--world", "2", "--json"]
    assert main(["estimate", *args]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main(["estimate", *args, "--engine", "fsdp2"]) == 0
    fsdp2 = json.loads(capsys.readouterr().out)
    assert auto["engine"] == "fsdp2" and auto["per_device"] == fsdp2["per_device"] and auto["ranks"] == fsdp2["ranks"]
    assert main(["estimate", *args, "--precision", "16-mixed"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["engine"] == "memfit"
    assert out.err == "engine: memfit (fp16 loss scaling needs it)\n"
