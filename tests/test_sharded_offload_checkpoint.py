"""ZeRO checkpoints of offloaded optimizer state (cpu and disk) save and resume bit for bit, and the
optimizer's step counter is the saved one after every load."""
from __future__ import annotations

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.multiproc]

CFG = dict(layers=2, hidden=16, heads=2, vocab=32, seq=8)
BATCH = 4


def _batches(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CFG["vocab"], (BATCH, CFG["seq"] + 1), generator=g) for _ in range(n)]


def _steps(opt, batches, rows, count):
    losses = []
    for b in batches:
        b = b[rows]
        tot = count(b[:, 1:].numel())
        with opt.autocast():
            _, loss, _ = opt.model(b[:, :-1].contiguous(), b[:, 1:].contiguous())
        opt.backward(loss / tot)
        opt.step()
        losses.append(count(float(loss.detach())) / tot)
    return losses


def _counter(opt) -> float:
    from memfit.apply.param_state import param_states, step_of

    with param_states(opt.inner) as slots:
        return float(step_of(slots))


def _work(rank, world, strategy, offload, precision, spill, path):
    """Uninterrupted 4 steps, then 2 steps + save, then a fresh optimizer loads and does 2 more."""
    from memfit.distributed import distribute, global_count
    from memfit.distributed.checkpoint import load_sharded, save_sharded

    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    kw = dict(lr=1e-2, precision=precision, offload=offload, spill_dir=spill, clip=1.0)
    out = {}
    torch.manual_seed(0)
    with distribute(GPT(GPTConfig(**CFG)), strategy, "adamw", engine="memfit", **kw) as opt:
        out["ref"] = _steps(opt, _batches(4), rows, global_count)
        out["ref_weights"] = [p.detach().clone() for p in opt.engine.shards]
    torch.manual_seed(0)
    with distribute(GPT(GPTConfig(**CFG)), strategy, "adamw", engine="memfit", **kw) as opt:
        _steps(opt, _batches(2), rows, global_count)
        save_sharded(opt, path)
        out["saved_counter"] = _counter(opt)
        _steps(opt, _batches(4)[2:3], rows, global_count)  # the save left the live state untouched
    torch.manual_seed(123)  # the loaded run must not depend on its own initialisation
    with distribute(GPT(GPTConfig(**CFG)), strategy, "adamw", engine="memfit", **kw) as opt:
        load_sharded(opt, path)
        out["loaded_counter"] = _counter(opt)
        out["resumed"] = _steps(opt, _batches(4)[2:], rows, global_count)
        out["weights"] = [p.detach().clone() for p in opt.engine.shards]
        out["final_counter"] = _counter(opt)
    return out


@pytest.mark.parametrize("strategy,offload,precision", [
    ("zero3", "disk", "bf16-master"),  # the default tier: one process group (~15 s on 2 busy cores)
    pytest.param("zero2", "disk", "32-true", marks=pytest.mark.slow),
    pytest.param("zero1", "cpu", "bf16-master", marks=pytest.mark.slow),
])
def test_offloaded_zero_checkpoint_resumes_bitwise(tmp_path, strategy, offload, precision):
    spill = str(tmp_path / "spill")
    ranks = run_world(_work, 2, args=(strategy, offload, precision, spill, str(tmp_path / "ck")), timeout_s=120)
    for r in ranks:
        assert r["resumed"] == r["ref"][2:]  # bitwise: same world, same reduction order
        assert all(torch.equal(a, b) for a, b in zip(r["weights"], r["ref_weights"]))
        assert (r["saved_counter"], r["loaded_counter"], r["final_counter"]) == (2.0, 2.0, 4.0)
