"""A sharded ZeRO checkpoint resumes bitwise on CPU, in every precision mode the sharded optimizer
supports (the default tier's check; tests/test_distributed_checkpoint.py reshards across world
sizes). Two ranks train 2 steps, save, and go on for 2 more; a fresh model with another seed loads
the checkpoint and takes the same 2 steps: Adam's step counter, the losses and the weights must be
identical, since the same ops run on the same values in the same order."""
from __future__ import annotations

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.multiproc

CFG = dict(layers=2, hidden=16, heads=2, vocab=32, seq=8)
PRECISIONS = ["32-true", "bf16-master", "16-master"]


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG["vocab"], (4, CFG["seq"] + 1), generator=g) for _ in range(4)]


def _steps(opt, batches, rows):
    from memfit.distributed import global_count

    losses = []
    for b in batches:
        b = b[rows]
        tot = global_count(b[:, 1:].numel())
        with opt.autocast():
            _, loss, _ = opt.model(b[:, :-1].contiguous(), b[:, 1:].contiguous())
        opt.backward(loss / tot)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _adam_steps(opt) -> set[float]:
    from memfit.apply.param_state import param_states

    with param_states(opt.inner) as slots:
        return {float(s.state["step"]) for s in slots if "step" in s.state}


def _work(rank, world, path):
    from memfit.distributed import distribute
    from memfit.distributed.checkpoint import load_sharded, save_sharded

    rows = slice(rank * 2, rank * 2 + 2)
    out = {}
    for precision in PRECISIONS:
        torch.manual_seed(0)
        with distribute(GPT(GPTConfig(**CFG)), "zero2", "adamw", engine="memfit", lr=1e-2, precision=precision) as opt:
            _steps(opt, _batches()[:2], rows)
            save_sharded(opt, f"{path}/{precision}")
            ref = _steps(opt, _batches()[2:], rows)
            ref_w = torch.cat([p.detach().float().flatten() for p in opt.model.parameters()])
        torch.manual_seed(123)  # the loaded run must not depend on its own initialisation
        with distribute(GPT(GPTConfig(**CFG)), "zero2", "adamw", engine="memfit", lr=1e-2, precision=precision) as opt:
            load_sharded(opt, f"{path}/{precision}")
            loaded_steps = _adam_steps(opt)
            got = _steps(opt, _batches()[2:], rows)
            got_w = torch.cat([p.detach().float().flatten() for p in opt.model.parameters()])
            out[precision] = (loaded_steps, ref, got, torch.equal(ref_w, got_w))
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return run_world(_work, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout_s=240)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_resume_is_bitwise_and_keeps_the_step_counter(resumed, precision):
    for rank in range(2):
        loaded_steps, ref, got, same_weights = resumed[rank][precision]
        assert loaded_steps == {2.0}, (rank, loaded_steps)  # Adam's bias correction depends on it
        assert got == ref and same_weights, (rank, got, ref)
