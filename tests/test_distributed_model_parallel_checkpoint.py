"""Checkpoints of pipeline and tensor (torch.distributed.checkpoint): saved by one layout of ranks,
loaded into another (stages 2 -> 1, TP 2 -> 1, dp 1 -> 2, pipeline <-> tensor), the continued losses
equal the uninterrupted single-process run; `memfit train --resume` continues a stopped run exactly,
a half-written newer checkpoint folder is never picked up, and what cannot load fails with one line."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig
from reference_run import global_batches, single_losses, train_rank

pytestmark = pytest.mark.multiproc

CFG = dict(layers=2, hidden=32, heads=4, vocab=64, seq=16)
GLOBAL_BATCH, STEPS, SAVED_AT = 4, 4, 2
# Against one process on the same global batches. fp32: reassociation only (the stages and TP ranks
# add the same sums in another order, ~1e-7 relative per reduction), but over 4 AdamW steps at lr 1e-2
# the normalised update amplifies it where second moments are small: observed up to 1.0e-5 relative
# at step 4 (1e-5 suffices over the 3 steps of test_distributed_pipeline.py), so 5e-5. fp16
# (16-master): 2e-3, as in test_distributed_model_parallel_precision.py.
TOL = {"32-true": 5e-5, "16-master": 2e-3}


def _work(rank: int, world: int, strategy: str, options: dict, path: str, load: bool, precision: str,
          offload: str | None):
    from memfit.distributed import distribute

    torch.manual_seed(123 if load else 0)  # a loaded run must not depend on its own initial weights
    model = GPT(GPTConfig(**CFG))
    batches = global_batches(CFG, GLOBAL_BATCH, STEPS, 1)
    losses = []
    with distribute(model, strategy, "adamw", lr=1e-2, clip=1.0, precision=precision, offload=offload,
                    **options) as opt:
        rows = opt.data_rows(GLOBAL_BATCH) if strategy == "tensor" else slice(None)
        if load:
            opt.load_sharded(path)
        scale = opt.scaler.scale if opt.scaler is not None else None
        for micro in batches[SAVED_AT:] if load else batches[:SAVED_AT]:
            losses.append(opt.accumulate_step([(m[rows, :-1].contiguous(), m[rows, 1:].contiguous())
                                               for m in micro])[0])
        if not load:
            opt.save_sharded(path)
    return losses, scale


# (writer, its world and options), then the layouts that read its checkpoint
LAYOUTS = [
    (("pipeline", 2, dict(microbatches=2, schedule="gpipe")), "32-true",
     [("pipeline", 1, dict(microbatches=1, schedule="gpipe"), None), ("tensor", 2, dict(tp=2), "cpu")]),
    (("tensor", 2, dict(tp=2)), "16-master",
     [("tensor", 2, dict(tp=1), None), ("pipeline", 2, dict(microbatches=2, schedule="1f1b"), None)]),
]


@pytest.mark.slow
@pytest.mark.parametrize("writer, precision, readers", LAYOUTS, ids=["pipeline-32-true", "tensor-16-master"])
def test_checkpoint_loads_into_another_layout(tmp_path, writer, precision, readers):
    want = single_losses(CFG, global_batches(CFG, GLOBAL_BATCH, STEPS, 1), None, "adamw", precision)
    strategy, world, options = writer
    path = str(tmp_path / "ckpt")
    first = run_world(_work, world, args=(strategy, options, path, False, precision, None), timeout_s=180)
    assert first[0][0] == pytest.approx(want[:SAVED_AT], rel=TOL[precision])
    for strategy, world, options, offload in readers:  # offload "cpu": masters and state land on the host
        after = run_world(_work, world, args=(strategy, options, path, True, precision, offload), timeout_s=180)
        for losses, scale in after:
            assert losses == pytest.approx(want[SAVED_AT:], rel=TOL[precision]), (strategy, world, options)
            assert scale == (2.0**16 if precision == "16-master" else None)  # the loss scaler's state came back


TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


@pytest.mark.slow
@pytest.mark.parametrize("strategy, extra", [("pipeline", dict(schedule="gpipe", microbatches=2)),
                                             ("tensor", dict(precision="16-master"))])
def test_resumed_run_continues_the_uninterrupted_trajectory(tmp_path, strategy, extra):
    cfg = dict(model=TINY, seq=32, batch=2, steps=4, warmup=1, eval_batches=2, save_every=2, strategy=strategy,
               **extra)
    whole = run_world(train_rank, 2, args=({**cfg, "out": str(tmp_path / "whole")}, None, None), timeout_s=300)
    part = tmp_path / "part"
    run_world(train_rank, 2, args=({**cfg, "out": str(part)}, 2, None), timeout_s=300)
    assert json.loads((part / "metrics.json").read_text())["steps"]["step"][-1] == 2
    # The periodic and the final save at step 2 went to two folders (never one over the other); the
    # newest complete one is checkpoint.pt's, the other checkpoint.prev.pt's. A save that died half-way
    # (no .metadata: DCP renames it into place last) at the same step, or a folder checkpoint.pt does
    # not name, is never read.
    from memfit.train.distributed import complete_folder

    good = complete_folder(part, 2)
    assert sorted(p.name for p in part.glob("sharded-*")) == ["sharded-2", "sharded-2.1"] and good.name == "sharded-2.1"
    for torn in ("sharded-2.9", "sharded-3"):
        shutil.copytree(good, part / torn)
        next(p for p in (part / torn).iterdir() if p.suffix == ".distcp").write_bytes(b"torn")
    (part / "sharded-2.9" / ".metadata").unlink()
    resumed = run_world(train_rank, 2, args=(cfg, None, str(part)), timeout_s=300)
    assert len(whole[0]) == len(resumed[0]) == 4
    # The same arithmetic in the same order on the same ranks: bitwise.
    assert resumed[0] == whole[0]
    assert sorted(p.name for p in part.glob("sharded-*")) == ["sharded-2.1", "sharded-4"]  # prev's and the last


SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.slow
def test_a_checkpoint_that_cannot_load_fails_with_one_line(tmp_path):
    """A pipeline run's folder resumed after its sharded folder was lost: exit 2 and one line."""
    run = tmp_path / "run"
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "memfit", "train", "--quiet", "--nproc", "2", "--device", "cpu"]
    proc = subprocess.run([*base, "--model", TINY, "--seq", "32", "--batch", "2", "--steps", "1", "--warmup", "1",
                           "--eval-batches", "1", "--strategy", "pipeline", "--out", str(run)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(run / "sharded-1")
    proc = subprocess.run([*base, "--resume", str(run), "--steps", "2"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "has no sharded-1/" in proc.stderr and "Traceback" not in proc.stderr
    assert len({line for line in proc.stderr.splitlines() if "sharded-1" in line}) == 1
