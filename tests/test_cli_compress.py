"""`memfit train --compress SPEC`: bad requests exit 2 with one line before anything starts, and a
2-rank run records what the compressor sent in metrics.json and the printed summary."""
from __future__ import annotations

import pytest

from memfit.cli import main

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"
FAST = ["--model", TINY, "--seq", "32", "--eval-batches", "1", "--quiet", "--warmup", "1", "--steps", "3",
        "--device", "cpu"]  # gloo ranks on the CPU, also on a machine with GPUs


@pytest.mark.parametrize("extra, message", [
    (["--strategy", "ddp", "--compress", "topk:0"], "outside (0, 1]"),
    (["--strategy", "ddp", "--compress", "topk:1.5"], "outside (0, 1]"),
    (["--strategy", "zero2", "--compress", "gzip"], "unknown compressor 'gzip'"),
    (["--strategy", "zero1", "--compress", "powersgd:0"], "rank 0 must be at least 1"),
    (["--strategy", "ddp", "--compress", "int8,foo=1"], "unknown option"),
    (["--strategy", "zero3", "--compress", "int8"], "does not apply to --strategy zero3"),
    (["--strategy", "ps", "--compress", "sign"], "does not apply to --strategy ps"),
    (["--strategy", "zero2", "--compress", "powersgd:4"], "powersgd:4,batched"),
    (["--strategy", "none", "--compress", "topk:0.01"], "--strategy none runs one process"),
    (["--strategy", "zero2", "--compress", "int8:adam=10"], "applies to topk and sign"),
    (["--strategy", "ddp", "--compress", "sign:adam=-1"], "0 or more"),
    (["--strategy", "ddp", "--optimizer", "sgd", "--compress", "sign:adam=5"], "adam and adamw"),
    (["--strategy", "ddp", "--compress", "topk:0.01,adam=5,select=biggest"], "accepted: agree, gain, x"),
])
def test_bad_compression_requests_exit_2_with_one_line(extra, message, capsys, tmp_path):
    rc = main(["train", *FAST, "--out", str(tmp_path / "r"), "--nproc", "2", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def _compressed_rank(rank: int, world: int, out: str) -> tuple[dict, str]:
    from memfit.train import loop
    from memfit.train.report import format_summary

    cfg = loop.TrainConfig(model=TINY, seq=32, batch=2, steps=3, warmup=1, eval_batches=1, strategy="zero2",
                           compress="int8", out=out, device="cpu")
    result = loop.train(cfg, progress=False, log=lambda line: None)
    return result.metrics["run"]["compression"], format_summary(result.metrics, result.run_dir, result.stopped)


@pytest.mark.multiproc
def test_compressed_run_reports_bytes_ratio_and_coding_share(tmp_path):
    # The loop the ranks of `memfit train --nproc 2` run, on two ranks forked from the preloaded forkserver
    # (a new interpreter's launcher and ranks importing torch were most of this test's time; the command
    # itself runs in tests/test_distributed_train.py and tests/test_launch_options.py).
    from memfit.distributed.spawn import run_world

    comp, summary = run_world(_compressed_rank, 2, args=(str(tmp_path / "run"),), timeout_s=200)[0]
    assert comp["compression"] == "int8" and comp["steps"] == 3
    # int8 codes + a scale per 1024 elements, each shard's to its rank (all_to_all), vs an fp32 reduce-scatter
    assert 3.5 <= comp["ratio"] <= 4.0
    assert comp["bytes_sent_per_step"] * comp["ratio"] == pytest.approx(comp["uncompressed_bytes_per_step"])
    assert 0 < comp["coding_share_of_step"] < 1
    assert "compress int8:" in summary and "fewer than uncompressed" in summary  # the end-of-run summary's line
