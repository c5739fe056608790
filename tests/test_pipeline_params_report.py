"""A pipeline run reports the whole model's parameters (banner and run.params), not stage 0's."""
from __future__ import annotations

import pytest

from memfit.models.spec import parse_model

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


def _pipeline_rank(rank: int, world: int, out: str) -> tuple[int, list[str]]:
    from memfit.train import loop

    said: list[str] = []
    cfg = loop.TrainConfig(model=MODEL, seq=32, batch=2, steps=1, warmup=1, eval_batches=1, strategy="pipeline",
                           out=out, track=False, device="cpu")
    result = loop.train(cfg, progress=False, log=said.append)
    return result.metrics["run"]["params"], said


@pytest.mark.multiproc
def test_pipeline_run_reports_the_whole_models_parameters(tmp_path):
    # The ranks `memfit train --nproc 2` starts run this same loop (tests/test_distributed_train.py runs
    # the command itself in a new interpreter); forked from the preloaded forkserver they skip
    # importing torch afresh, which was most of this test's time.
    from memfit.distributed.spawn import run_world

    ranks = run_world(_pipeline_rank, 2, args=(str(tmp_path / "run"),), timeout_s=200)
    whole = sum(p.numel() for p in parse_model(MODEL).build(seq=32).parameters())
    stage0 = ranks[0]
    assert stage0[0] == whole
    assert any(f"{whole / 1e6:.2f}M-parameter model" in line for line in stage0[1]), stage0[1]
