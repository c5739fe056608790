"""`memfit train --compress ... --resume`: each rank's compressor state (residuals, local momenta,
frozen-variance phase, step counters) is checkpointed beside the run's, so a run stopped and
resumed sends the same bits as an uninterrupted one: the same losses and weights, bitwise."""
from __future__ import annotations

import shutil

import pytest
import torch
from reference_run import train_rank

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


def _weights(run_dir) -> dict:
    from memfit.train.state import load_checkpoint

    return load_checkpoint(run_dir)["model"]


@pytest.mark.parametrize("strategy, spec", [("ddp", "sign:adam=2"), ("zero2", "topk:0.05,adam=2")])
def test_resumed_compressed_run_is_bitwise_the_uninterrupted_one(tmp_path, strategy, spec):
    from memfit.distributed.spawn import run_world

    cfg = dict(model=TINY, seq=32, batch=2, steps=6, warmup=1, eval_batches=1, save_every=100,
               strategy=strategy, compress=spec)
    whole = run_world(train_rank, 2, args=({**cfg, "out": str(tmp_path / "whole")}, None, None), timeout_s=300)
    part = tmp_path / "part"
    run_world(train_rank, 2, args=({**cfg, "out": str(part)}, 4, None), timeout_s=300)  # past the freeze
    assert sorted(p.name for p in (part / "compression-4").iterdir()) == ["rank0.pt", "rank1.pt"]
    bare = tmp_path / "bare"  # the same checkpoint without the compressor state: a control that must differ
    shutil.copytree(part, bare)
    shutil.rmtree(bare / "compression-4")
    resumed = run_world(train_rank, 2, args=(cfg, None, str(part)), timeout_s=300)
    assert resumed[0] == whole[0] and resumed[1] == whole[1]
    a, b = _weights(tmp_path / "whole"), _weights(part)
    assert all(torch.equal(a[k], b[k]) for k in a)
    restarted = run_world(train_rank, 2, args=(cfg, None, str(bare)), timeout_s=300)
    assert restarted[0][:4] == whole[0][:4] and restarted[0][4:] != whole[0][4:]
