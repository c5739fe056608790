"""pipeline and tensor with fp16 loss scaling (a global overflow check across ranks), the other
precision modes, and optimizer offload per rank: the trajectory of one process with the same global
batch and settings, and the offloaded optimizer state leaving each rank's tracked memory."""
from __future__ import annotations

import pytest
import torch

from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig
from reference_run import global_batches, single_losses

pytestmark = pytest.mark.multiproc

CFG = dict(layers=2, hidden=32, heads=4, vocab=64, seq=16)
GLOBAL_BATCH, STEPS = 4, 3
OPTIONS = {"pipeline": dict(microbatches=2, schedule="1f1b"), "tensor": dict(tp=2)}
# Tolerances against one process in the same precision (tests/test_distributed_pipeline.py and
# test_distributed_tensor.py give the reasoning): fp32 reassociation only, 1e-5 (optimizer offload
# to the CPU runs torch's own update on the same fp32 values, so it adds nothing). 16-bit modes: the
# ranks round their partial results once more (stage boundaries, the TP partial sums), at most 2^-11
# relative in fp16 and 2^-8 in bf16 per rounding, which Adam carries into the weights; observed
# <= 1e-4 (fp16) and ~1e-4 (bf16) over 3 steps, so 2e-3 for both, as for the data-parallel strategies.
TOL = {"32-true": 1e-5, "16-master": 2e-3, "16-mixed": 2e-3, "bf16-master": 2e-3, "16-true": 2e-3}


def _rows(opt, strategy):
    return opt.data_rows(GLOBAL_BATCH) if strategy == "tensor" else slice(None)


def _run(rank: int, world: int, strategy: str, cases: list[tuple]) -> dict:
    from memfit.core.tracker import track
    from memfit.distributed import distribute

    out = {}
    for precision, offload in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        losses, tracked = [], None
        with distribute(model, strategy, "adamw", lr=1e-2, clip=1.0, precision=precision, offload=offload,
                        **OPTIONS[strategy]) as opt:
            rows = _rows(opt, strategy)
            for step, micro in enumerate(global_batches(CFG, GLOBAL_BATCH, STEPS, 1)):
                tracker = track(opt.tracked_module, opt, device="cpu") if step == STEPS - 1 else None
                with tracker if tracker is not None else torch.enable_grad():
                    loss, _, result = opt.accumulate_step([(m[rows, :-1].contiguous(), m[rows, 1:].contiguous())
                                                           for m in micro])
                assert result.stepped
                losses.append(loss)
            tracked = tracker.breakdown
        out[precision, offload] = (losses, tracked)
    return out


CASES = [("16-master", None), ("16-mixed", None), ("32-true", None), ("32-true", "cpu"), ("bf16-master", "cpu")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
def test_precisions_and_offload_match_one_process(strategy):
    ranks = run_world(_run, 2, args=(strategy, CASES), timeout_s=300)
    batches = global_batches(CFG, GLOBAL_BATCH, STEPS, 1)
    for precision, offload in CASES:
        want = single_losses(CFG, batches, None, "adamw", precision)
        for r in (0, 1):
            got = ranks[r][precision, offload][0]
            assert got == pytest.approx(want, rel=TOL[precision]), (strategy, precision, offload, r, got, want)
    # Each rank offloads its own stage's / shard's optimizer state: none of it is left in the tracked
    # (device) figures, and each rank's peak falls by at least the Adam moments it held. On this CPU
    # machine the host is the device: this is the tracker's accounting, not a drop in process RSS.
    for r in (0, 1):
        kept, gone = ranks[r]["32-true", None][1], ranks[r]["32-true", "cpu"][1]
        print(f"{strategy} rank {r}: optimizer {kept['optimizer']:,} -> {gone['optimizer']:,} B, "
              f"peak {kept['total']:,} -> {gone['total']:,} B")  # docs/distributed.md's table (-s)
        assert kept["optimizer"] > 0 and gone["optimizer"] == 0, (strategy, r, kept, gone)
        assert gone["total"] <= kept["total"] - 0.9 * kept["optimizer"], (strategy, r, kept, gone)


def _overflow(rank: int, world: int) -> dict:
    """fp16: rank `bad`'s gradients get an inf at the second step; every rank must skip it."""
    from memfit.distributed import distribute
    from memfit.distributed.mp_optimizer import local

    out = {}
    for strategy, bad in (("pipeline", 0), ("tensor", 1)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        with distribute(model, strategy, "adamw", lr=1e-2, clip=1.0, precision="16-master",
                        **OPTIONS[strategy]) as opt:
            reduce, poison = opt._reduce_grads, [False]

            def poisoned():
                reduce()
                if poison[0] and rank == bad:  # a block's own gradient: never shared with the other rank
                    i = next(i for i, n in enumerate(opt.names) if n.startswith("blocks.0.mlp.fc"))
                    local(opt.params[i].grad).view(-1)[0] = float("inf")

            opt._reduce_grads = poisoned
            rows, results = _rows(opt, strategy), []
            for step, micro in enumerate(global_batches(CFG, GLOBAL_BATCH, STEPS, 1)):
                poison[0] = step == 1
                before = [local(p.detach()).clone() for p in opt.params]
                _, _, result = opt.accumulate_step([(m[rows, :-1].contiguous(), m[rows, 1:].contiguous())
                                                    for m in micro])
                unchanged = all(torch.equal(b, local(p.detach())) for b, p in zip(before, opt.params))
                results.append((result.stepped, result.loss_scale, opt.scaler.scale, unchanged))
        out[strategy] = results
    return out


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    ranks = run_world(_overflow, 2, timeout_s=240)
    for strategy in ("pipeline", "tensor"):
        for r in (0, 1):
            steps = ranks[r][strategy]
            # step 2 skipped everywhere (no weight moved), the scale halved once on every rank
            assert [s[0] for s in steps] == [True, False, True], (strategy, r, steps)
            assert [s[2] for s in steps] == [2.0**16, 2.0**15, 2.0**15], (strategy, r, steps)
            assert steps[1][3] and not steps[0][3], (strategy, r, steps)
