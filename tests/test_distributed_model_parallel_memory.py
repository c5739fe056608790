"""Per-rank memory under pipeline and tensor: the tracker's peak on each of 2 gloo ranks against the
estimate (memfit.measure.parallel_estimate), and the rank differences the schedules imply."""
from __future__ import annotations

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.multiproc

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
CFG = dict(layers=4, hidden=64, heads=4, vocab=128, seq=32)
BATCH = 4  # per process: a global batch of 8
CASES = [("pipeline", dict(schedule="gpipe", microbatches=4)), ("pipeline", dict(schedule="1f1b", microbatches=4)),
         ("tensor", dict(tp=2))]


def _measure(rank: int, world: int) -> dict:
    """The tracker's figures at the third step (optimizer state exists) for each case."""
    from memfit.core.tracker import track
    from memfit.distributed import distribute

    out = {}
    for strategy, kw in CASES:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        g = torch.Generator().manual_seed(1)
        with distribute(model, strategy, "adamw", lr=1e-3, **kw) as opt:
            rows = opt.data_rows(BATCH * world) if strategy == "tensor" else slice(None)
            for step in range(3):
                m = torch.randint(0, CFG["vocab"], (BATCH * world, CFG["seq"] + 1), generator=g)[rows]
                tracker = track(opt.tracked_module, opt, device="cpu") if step == 2 else None
                with tracker if tracker is not None else torch.enable_grad():
                    opt.accumulate_step([(m[:, :-1].contiguous(), m[:, 1:].contiguous())])
            out[strategy, kw.get("schedule")] = tracker.breakdown
    return out


def test_per_rank_estimate_matches_the_tracked_peak():
    from memfit.measure.parallel_estimate import pipeline_ranks, tensor_ranks
    from memfit.models.spec import parse_model

    measured = run_world(_measure, 2, timeout_s=240)
    spec = parse_model(SPEC)
    for strategy, kw in CASES:
        if strategy == "pipeline":
            est = pipeline_ranks(spec, BATCH, CFG["seq"], 2, kw["microbatches"], kw["schedule"])
        else:
            est = tensor_ranks(spec, BATCH, CFG["seq"], 2, kw["tp"])
        for r in (0, 1):
            got = measured[r][strategy, kw.get("schedule")]
            assert est[r]["params"] == got["params"], (strategy, kw, r)  # the stage's / the shard's weights
            assert abs(est[r]["total"] - got["total"]) <= 0.03 * got["total"], (strategy, kw, r, est[r], got)
    gpipe = [measured[r]["pipeline", "gpipe"]["activations"] for r in (0, 1)]
    one_f = [measured[r]["pipeline", "1f1b"]["activations"] for r in (0, 1)]
    # 1F1B: rank 0 keeps 2 micro-batches in flight, the last rank 1; GPipe keeps all 4 on both.
    assert one_f[0] > 1.6 * one_f[1] and gpipe[0] > 1.8 * one_f[0] and gpipe[1] > 3.5 * one_f[1]
    # TP halves the attention and MLP weights: less than 60% of the whole model's on each rank.
    whole = GPT(GPTConfig(**CFG)).num_params() * 4
    assert measured[0]["tensor", None]["params"] < 0.6 * whole


def test_estimate_cli_lists_pipeline_ranks_apart(capsys):
    import json

    from memfit.cli import main

    assert main(["estimate", SPEC, "--batch", "4", "--strategy", "pipeline", "--world", "2", "--json"]) == 0
    ranks = sorted(json.loads(capsys.readouterr().out)["ranks"], key=lambda r: r["rank_ids"])
    assert [r["rank_ids"] for r in ranks] == [[0], [1]]
    assert [r["microbatches_in_flight"] for r in ranks] == [2, 1]  # 1F1B: stages - rank
    assert ranks[0]["total"] != ranks[1]["total"]
    assert main(["estimate", SPEC, "--batch", "4", "--strategy", "tensor", "--world", "2", "--tp", "2"]) == 0
    assert "tp 2 x dp 1" in capsys.readouterr().out
    assert main(["estimate", SPEC, "--batch", "4", "--strategy", "tensor", "--world", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err
