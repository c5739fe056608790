"""A ZeRO checkpoint written by 2 ranks (zero2) loads into 3 ranks (zero3) and 1 rank (zero1) and
continues the uninterrupted single-process trajectory."""
from __future__ import annotations

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # 6 process groups: ~2-5 min on 2 busy cores

CFG = dict(layers=2, hidden=24, heads=4, vocab=64, seq=8)
BATCH = 6  # divisible by 1, 2 and 3 ranks


def _batches(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CFG["vocab"], (BATCH, CFG["seq"] + 1), generator=g) for _ in range(n)]


def _steps(opt, call, batches, rows, count):
    losses = []
    for b in batches:
        b = b[rows]
        tot = count(b[:, 1:].numel())
        with opt.autocast():
            _, loss, _ = call(b[:, :-1].contiguous(), b[:, 1:].contiguous())
        opt.backward(loss / tot)
        opt.step()
        losses.append(count(float(loss.detach())) / tot)
    return losses


def _work(rank, world, strategy, path, load, precision):
    from memfit.distributed import distribute, global_count
    from memfit.distributed.checkpoint import load_sharded, save_sharded

    torch.manual_seed(0 if not load else 123)  # a loaded run must not depend on its own init
    model = GPT(GPTConfig(**CFG))
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    with distribute(model, strategy, "adamw", lr=1e-2, precision=precision) as opt:
        if load:
            load_sharded(opt, path)
            return _steps(opt, opt.model, _batches(4)[2:], rows, global_count)
        losses = _steps(opt, opt.model, _batches(2), rows, global_count)
        save_sharded(opt, path)
        return losses


@pytest.mark.parametrize("precision", ["32-true", "bf16-master"])
def test_checkpoint_loads_into_another_world_size(tmp_path, precision):
    from memfit.apply.optimizer import TrainingOptimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    with TrainingOptimizer(model, "adamw", lr=1e-2, precision=precision) as opt:
        ref = _steps(opt, model, _batches(4), slice(None), float)
    path = str(tmp_path / "ckpt")
    first = run_world(_work, 2, args=("zero2", path, False, precision), timeout_s=120)
    rtol = 1e-5 if precision == "32-true" else 2e-3
    assert first[0] == pytest.approx(ref[:2], rel=rtol)
    for world, strategy in ((3, "zero3"), (1, "zero1")):
        after = run_world(_work, world, args=(strategy, path, True, precision), timeout_s=120)
        for losses in after:
            assert losses == pytest.approx(ref[2:], rel=rtol), (world, strategy)
