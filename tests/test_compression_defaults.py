"""Plain topk / sign pick the mode measured best for the optimizer: adam mode (adam=5) under an
Adam(W) that can carry it, error feedback under SGD or offloaded Adam; any mode option wins."""
from __future__ import annotations

import pytest
import torch

from memfit.apply.optimizer import TrainingOptimizer
from memfit.core.errors import ConfigError
from memfit.distributed.compression import parse_compression
from memfit.distributed.compression.defaults import ADAM_WARMUP, for_optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("spec", ["topk:0.01", "sign", "topk:0.05", "sign:chunk=256"])
@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_plain_topk_and_sign_run_adam_mode_under_adam(spec, name):
    opt = TrainingOptimizer(_model(), name, lr=1e-3)
    resolved = for_optimizer(parse_compression(spec), opt)
    assert resolved.adam == ADAM_WARMUP and resolved.name == parse_compression(spec).name
    assert resolved.ratio == parse_compression(spec).ratio and resolved.chunk == parse_compression(spec).chunk
    assert str(resolved).endswith(f"adam={ADAM_WARMUP}")
    # the measured-best adam mode (docs/compression.md): lr-scaled residual, the batch's second
    # moment, and top-k ranking the owed update by its first-order gain
    assert resolved.owed == "step" and resolved.variance == "batch"
    assert resolved.name == "sign" or resolved.selection == "gain"


@pytest.mark.parametrize("make", [
    lambda m: TrainingOptimizer(m, "sgd", lr=0.1),
    lambda m: TrainingOptimizer(m, "momentum", lr=0.1),
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    lambda m: TrainingOptimizer(m, "adamw", lr=1e-3, offload="cpu"),  # adam mode needs state beside params
    lambda m: None,  # no optimizer given: nothing to pick from
])
def test_plain_specs_keep_error_feedback_where_adam_mode_cannot_run(make):
    for spec in ("topk:0.01", "sign"):
        resolved = for_optimizer(parse_compression(spec), make(_model()))
        assert resolved.adam is None and resolved.error_feedback


@pytest.mark.parametrize("spec, adam", [
    ("topk:0.01,adam=off", None), ("sign:adam=off", None), ("sign:adam=12", 12), ("topk:0.01,adam=0", 0),
    ("topk:0.01,momentum=0.9", None), ("sign:ef=0", None), ("topk:0.01,start=3", None), ("int8", None),
    ("powersgd:4", None), ("bf16", None),
])
def test_a_spec_that_names_its_mode_is_kept(spec, adam):
    resolved = for_optimizer(parse_compression(spec), TrainingOptimizer(_model(), "adamw", lr=1e-3))
    assert resolved.adam == adam
    assert resolved == parse_compression(spec)


def test_adam_off_round_trips_and_is_refused_where_there_is_no_adam_mode():
    assert str(parse_compression("topk:0.01,adam=off")) == "topk:0.01,adam=off"
    assert parse_compression(str(parse_compression("sign:adam=off"))).adam_off
    with pytest.raises(ConfigError, match="adam=off applies to topk and sign"):
        parse_compression("int8:adam=off")


def _topk_rank(rank: int, world: int, out: str) -> tuple[dict, str]:
    from memfit.train import loop
    from memfit.train.report import format_summary

    cfg = loop.TrainConfig(model="gpt:layers=2,hidden=32,heads=2,vocab=256", seq=32, batch=2, steps=3, warmup=1,
                           eval_batches=1, strategy="ddp", compress="topk:0.01", out=out, device="cpu", track=False)
    result = loop.train(cfg, progress=False, log=lambda line: None)
    return result.metrics["run"]["compression"], format_summary(result.metrics, result.run_dir, result.stopped)


@pytest.mark.multiproc
def test_memfit_train_runs_plain_topk_in_adam_mode_and_says_so(tmp_path):
    # The loop the ranks of `memfit train --nproc 2 --compress topk:0.01` run, on two ranks forked from
    # the preloaded forkserver rather than a new interpreter's launcher and ranks.
    from memfit.distributed.spawn import run_world

    comp, summary = run_world(_topk_rank, 2, args=(str(tmp_path / "run"),), timeout_s=200)[0]
    assert comp["compression"] == f"topk:0.01,adam={ADAM_WARMUP}"
    assert f"compress topk:0.01,adam={ADAM_WARMUP}:" in summary
