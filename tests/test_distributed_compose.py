"""Strategies compose with precision modes, checkpoint policies and optimizer offload, and fp16
loss scaling skips a step on every rank when any rank's shard overflows."""
from __future__ import annotations

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.multiproc

CFG = dict(layers=3, hidden=32, heads=4, vocab=64, seq=16)
BATCH, STEPS = 4, 3
# (strategy, precision, checkpoint policy, offload); single-process references use the same settings.
CASES = [
    ("zero2", "bf16-master", "none", None),
    ("zero3", "32-true", "full", None),
    ("zero3", "32-true", "sqrt", None),
    ("zero1", "32-true", "none", "cpu"),
    ("ddp", "bf16-master", "full", None),
]
# The default tier's subset: one strategy each with a 16-bit master, a checkpoint policy and
# optimizer offload (the whole list and the overflow test are slow: ~1 min on 2 busy cores).
QUICK = [CASES[0], CASES[1], CASES[3]]
RTOL = {"32-true": 1e-5, "bf16-master": 2e-3}


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CFG["vocab"], (BATCH, CFG["seq"] + 1), generator=g) for _ in range(STEPS)]


def _model(policy: str) -> GPT:
    from memfit.apply.checkpoint import checkpoint

    torch.manual_seed(0)
    return checkpoint(GPT(GPTConfig(**CFG)), policy)


def _train(opt, call, rows, count, inject=None) -> list:
    out = []
    for s, b in enumerate(_batches()):
        b = b[rows]
        tot = count(b[:, 1:].numel())
        with opt.autocast():
            _, loss, _ = call(b[:, :-1].contiguous(), b[:, 1:].contiguous())
        opt.backward(loss / tot, final=True)
        if inject is not None:
            inject(s)
        r = opt.step()
        out.append((count(float(loss.detach())) / tot, r.stepped, r.loss_scale))
    return out


def _work(rank: int, world: int, cases=CASES, overflow=True) -> dict:
    from memfit.distributed import distribute, global_count

    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    res = {}
    for case in cases:
        strategy, precision, policy, offload = case
        with distribute(_model(policy), strategy, "adamw", engine="memfit", lr=1e-2, precision=precision, clip=1.0,
                        offload=offload) as opt:
            res[case] = _train(opt, opt.model, rows, global_count)
    if not overflow:
        return res
    # fp16 overflow on rank 0's shard only, at step 1: every rank must skip that step.
    with distribute(_model("none"), "zero2", "adamw", engine="memfit", lr=1e-2, precision="16-master") as opt:
        def inject(step):
            if step == 1 and rank == 0:
                opt.engine.grads[0][0] = float("inf")
        res["overflow"] = _train(opt, opt.model, rows, global_count, inject)
    return res


@pytest.fixture(scope="module")
def world():
    return run_world(_work, 2, timeout_s=240)


@pytest.fixture(scope="module")
def quick_world():
    return run_world(_work, 2, args=(QUICK, False), timeout_s=240)


@pytest.mark.parametrize("case", QUICK, ids=lambda c: "-".join(str(x) for x in c))
def test_a_subset_composes_and_matches_one_process(quick_world, case):
    _matches_one_process(quick_world, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_composes_and_matches_one_process(world, case):
    _matches_one_process(world, case)


def _matches_one_process(world, case):
    from memfit.apply.optimizer import TrainingOptimizer

    strategy, precision, policy, offload = case
    model = _model(policy)
    with TrainingOptimizer(model, "adamw", lr=1e-2, precision=precision, clip=1.0, offload=offload) as opt:
        ref = [x[0] for x in _train(opt, model, slice(None), float)]
    for rank in range(2):
        got = [x[0] for x in world[rank][case]]
        assert got == pytest.approx(ref, rel=RTOL[precision]), (rank, got, ref)


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world):
    for rank in range(2):
        steps = world[rank]["overflow"]
        assert [s[1] for s in steps] == [True, False, True]
        assert steps[2][2] == steps[1][2] / 2  # the scale was halved on every rank
    assert [s[2] for s in world[0]["overflow"]] == [s[2] for s in world[1]["overflow"]]
