"""`memfit estimate --engine fsdp2`: torch FSDP2's per-rank figures (memfit.measure.fsdp2_estimate). The
measured comparison, on gloo ranks, is tests/test_fsdp2_layouts.py (slow) and bench/fsdp2_layouts.py."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from memfit.cli import main

GPT = "gpt:layers=3,hidden=32,heads=2,vocab=128,seq=32"
BLOCK = 4 * (12 * 32 * 32 + 13 * 32)  # one GPT block's fp32 weights: qkv, proj, fc, proj, 2 norms


def _total(*extra: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", GPT, "--batch", "2", "--seq", "32", "--world", "4", "--json", *extra]) == 0
    return json.loads(out.getvalue())


def test_fsdp2_keeps_what_reshard_after_forward_says():
    full, half, whole = (_total("--engine", "fsdp2", "--reshard-after-forward", r) for r in ("true", "2", "false"))
    # False keeps the blocks' gathered weights from forward to backward, 2 of 4 ranks half of them: more
    # than True by at most what the blocks other than the running one hold (exactly that at the head's
    # backward moment, tests/test_fsdp2_layouts.py measures it)
    assert "1/2" in half["note"] and "kept whole" in whole["note"]
    full, half, whole = (e["per_device"]["total"] for e in (full, half, whole))
    assert full < half < whole
    assert whole - full <= 2 * BLOCK and half - full <= 3 * BLOCK // 2


@pytest.mark.parametrize("argv, words", [
    (["--engine", "fsdp2", "--reshard-after-forward", "3"], "divisor of the world size"),
    (["--engine", "fsdp2", "--reshard-after-forward", "maybe"], "true, false or a number"),
    (["--reshard-after-forward", "2"], "add --engine fsdp2"),
    (["--engine", "fsdp2", "--strategy", "ddp"], "shards like zero3"),
    (["--engine", "fsdp2", "--accum", "2"], "drop --accum"),
    (["--engine", "fsdp2", "--precision", "16-mixed"], "fp16 needs a loss scaler"),
])
def test_what_fsdp2_does_not_run_is_one_line(argv, words, capsys):
    assert main(["estimate", GPT, "--batch", "2", "--seq", "32", "--world", "4", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
