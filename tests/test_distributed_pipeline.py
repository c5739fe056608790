"""--strategy pipeline on 2 gloo processes: the loss trajectory of one process with the same global
batch (GPipe and 1F1B, accumulation, clipping, checkpoint policies), fail-fast checks, bytes sent."""
from __future__ import annotations

import pytest
import torch

from memfit.core.errors import ConfigError
from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.multiproc

CFG = dict(layers=4, hidden=32, heads=4, vocab=64, seq=16)
GLOBAL_BATCH, STEPS = 4, 3
# fp32: the stages compute the same sums as one process, but per micro-batch (2 rows) and added,
# so results differ by reassociation only (~1e-7 relative per op); 1e-5 over 3 Adam steps leaves
# two orders of margin and still fails on a wrong scale or a missed micro-batch (>1e-3).
RTOL = 1e-5


def _batches(accum: int):
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, CFG["vocab"], (GLOBAL_BATCH, CFG["seq"] + 1), generator=g) for _ in range(accum)]
            for _ in range(STEPS)]


def _single(accum: int, policy: str | None = None) -> list[float]:
    from memfit.apply.checkpoint import checkpoint
    from memfit.apply.optimizer import TrainingOptimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    if policy:
        checkpoint(model, policy)
    losses = []
    with TrainingOptimizer(model, "adamw", lr=1e-2, clip=1.0) as opt:
        for micro in _batches(accum):
            tot = sum(m[:, 1:].numel() for m in micro)
            run = 0.0
            for m in micro:
                _, loss, _ = model(m[:, :-1].contiguous(), m[:, 1:].contiguous())
                opt.backward(loss / tot)
                run += float(loss.detach())
            opt.step()
            losses.append(run / tot)
    return losses


def _pipeline(rank: int, world: int, cases: list[tuple]) -> dict:
    from memfit.apply.checkpoint import checkpoint
    from memfit.distributed import TRAFFIC, distribute

    out = {}
    for schedule, mbs, accum, policy in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        if policy:
            checkpoint(model, policy)
        losses, sent = [], []
        with distribute(model, "pipeline", "adamw", lr=1e-2, clip=1.0, microbatches=mbs, schedule=schedule) as opt:
            for micro in _batches(accum):
                TRAFFIC.reset()
                loss, _, _ = opt.accumulate_step([(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in micro])
                losses.append(loss)
                sent.append(TRAFFIC.as_dict())
            out[schedule, mbs, accum, policy] = (losses, sent, sum(p.numel() for p in opt.stage_module.parameters()))
    return out


CASES = [("gpipe", 2, 1, None), ("1f1b", 4, 2, None), ("1f1b", 2, 1, "full"), ("gpipe", 4, 1, "sqrt")]


def test_pipeline_matches_one_process_with_the_global_batch():
    ranks = run_world(_pipeline, 2, args=(CASES,), timeout_s=240)
    for case in CASES:
        _, _, accum, policy = case
        want = _single(accum, policy)
        for r in (0, 1):
            got = ranks[r][case][0]
            assert got == pytest.approx(want, rel=RTOL), (case, r, got, want)
        # P2P: each micro-batch's activations go forward from stage 0, their gradients back from
        # stage 1: (B/M) x T x hidden x 4 bytes each, M micro-batches, accum batches. The tied
        # embedding's gradient is all-reduced between the two (vocab x hidden x 4, 2(N-1)/N).
        act = GLOBAL_BATCH * CFG["seq"] * CFG["hidden"] * 4 * accum
        tied = 2 * CFG["vocab"] * CFG["hidden"] * 4 // 2
        for r in (0, 1):
            sent = ranks[r][case][1][-1]["sent"]
            assert sent["p2p_send"] == act, (case, r, sent)
            assert sent["all_reduce"] == tied
    # the stages split the parameters (the tied matrix on both)
    full = GPT(GPTConfig(**CFG)).num_params()
    tied = CFG["vocab"] * CFG["hidden"]
    assert ranks[0][CASES[0]][2] + ranks[1][CASES[0]][2] == full + tied


def test_more_stages_than_blocks_fails_fast():
    from memfit.distributed.pipeline import check_pipeline

    with pytest.raises(ConfigError, match="at least 3 blocks"):
        check_pipeline(2, 3, 4, 4, "gpipe")
    with pytest.raises(ConfigError, match="does not split into 3 micro-batches"):
        check_pipeline(4, 2, 4, 3, "gpipe")
    with pytest.raises(ConfigError, match="1F1B needs at least"):
        check_pipeline(4, 4, 4, 2, "1f1b")
