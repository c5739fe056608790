"""--strategy pipeline on 2 gloo processes: the loss trajectory of one process with the same global
batch (GPipe and 1F1B, accumulation, clipping, checkpoint policies), fail-fast checks, bytes sent."""
from __future__ import annotations

import pytest
import torch

from memfit.core.errors import ConfigError
from memfit.distributed.spawn import run_world
from memfit.models.gpt import GPT, GPTConfig
from reference_run import global_batches, single_losses

pytestmark = pytest.mark.multiproc

CFG = dict(layers=4, hidden=32, heads=4, vocab=64, seq=16)
GLOBAL_BATCH, STEPS = 4, 3
# fp32: the stages compute the same sums as one process, but per micro-batch (2 rows) and added,
# so results differ by reassociation only (~1e-7 relative per op); 1e-5 over 3 Adam steps leaves
# two orders of margin and still fails on a wrong scale or a missed micro-batch (>1e-3).
RTOL = 1e-5
# bf16-master: the stages send bf16 activations and their gradients, where one process keeps them
# in its graph; the same bf16 roundings occur, in another order, one step at most 2^-9 relative,
# which Adam carries into the weights (observed ~1e-4 over 3 steps). As for the data-parallel
# strategies in bf16-master, 2e-3.
RTOL_BF16 = 2e-3


def _batches(accum: int):
    return global_batches(CFG, GLOBAL_BATCH, STEPS, accum)


def _single(accum: int, policy: str | None = None, precision: str = "32-true") -> list[float]:
    return single_losses(CFG, _batches(accum), policy, "adamw", precision)


def _pipeline(rank: int, world: int, cases: list[tuple]) -> dict:
    from memfit.apply.checkpoint import checkpoint
    from memfit.distributed import TRAFFIC, distribute

    out = {}
    for schedule, mbs, accum, policy, precision in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        if policy:
            checkpoint(model, policy)
        losses, sent = [], []
        with distribute(model, "pipeline", "adamw", lr=1e-2, clip=1.0, microbatches=mbs, schedule=schedule,
                        precision=precision) as opt:
            for micro in _batches(accum):
                TRAFFIC.reset()
                loss, _, _ = opt.accumulate_step([(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in micro])
                losses.append(loss)
                sent.append(TRAFFIC.as_dict())
            out[schedule, mbs, accum, policy, precision] = (losses, sent, sum(p.numel() for p in opt.stage_module.parameters()))
    return out


CASES = [("gpipe", 2, 1, None, "32-true"), ("1f1b", 4, 2, None, "32-true"), ("1f1b", 2, 1, "full", "32-true"),
         ("gpipe", 4, 1, "sqrt", "32-true"), ("1f1b", 2, 1, None, "bf16-master")]


def test_pipeline_matches_one_process_with_the_global_batch():
    ranks = run_world(_pipeline, 2, args=(CASES,), timeout_s=240)
    for case in CASES:
        _, _, accum, policy, precision = case
        want = _single(accum, policy, precision)
        for r in (0, 1):
            got = ranks[r][case][0]
            assert got == pytest.approx(want, rel=RTOL if precision == "32-true" else RTOL_BF16), (case, r, got, want)
        # P2P: each micro-batch's activations go forward from stage 0, their gradients back from
        # stage 1: (B/M) x T x hidden x 4 bytes each, M micro-batches, accum batches. The tied
        # embedding's gradient is all-reduced between the two (vocab x hidden x 4, 2(N-1)/N).
        size = 4 if precision == "32-true" else 2
        act = GLOBAL_BATCH * CFG["seq"] * CFG["hidden"] * size * accum
        tied = 2 * CFG["vocab"] * CFG["hidden"] * size // 2
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


def test_torch_pipelining_and_dtensor_interfaces_memfit_relies_on():
    """Pins for docs/design.md's private-API table: the stage builds its sends in these two methods
    (overridden to count bytes); a DTensor's shard is `_local_tensor`; the functional collectives
    live in the `_c10d_functional` namespace."""
    import inspect

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor

    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        assert list(inspect.signature(getattr(PipelineStage, name)).parameters)[1:] in (["fwd_chunk_id"],
                                                                                        ["bwd_chunk_id"])
    assert "_local_tensor" in DTensor.__slots__
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    import torch.nn.modules.module as module

    # torch 2.13 takes the target (its backward set-up runs the loss); earlier torch (args, kwargs) only
    assert list(inspect.signature(PipelineScheduleSingle._initialize_stage).parameters)[:4] in (
        ["self", "args", "kwargs", "target"], ["self", "args", "kwargs"])
    assert "_stage_backward_initialized" in inspect.getsource(PipelineScheduleSingle.__init__)
    from memfit.distributed.pipeline import _GLOBAL_HOOKS

    assert all(isinstance(getattr(module, name), dict) for name in _GLOBAL_HOOKS)
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        assert getattr(torch.ops._c10d_functional, op).default.namespace == "_c10d_functional"


def _dp_pp(rank: int, world: int) -> tuple:
    from memfit.distributed import distribute

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    losses = []
    with distribute(model, "pipeline", "adamw", lr=1e-2, clip=1.0, microbatches=2, schedule="1f1b", dp=2) as opt:
        rows = opt.data_rows(GLOBAL_BATCH)
        for micro in _batches(1):
            losses.append(opt.accumulate_step([(m[rows, :-1].contiguous(), m[rows, 1:].contiguous())
                                               for m in micro])[0])
        val = opt.evaluate([(m[rows, :-1].contiguous(), m[rows, 1:].contiguous()) for m in _batches(1)[0]])
        return losses, (opt.dp, opt.stages, opt.dp_rank, opt.rank, rows.start, rows.stop), val


@pytest.mark.slow
def test_dp_x_pp_on_four_ranks():
    """2 replicas of a 2-stage pipeline: rank = replica x 2 + stage; each replica takes its rows, the
    stages' gradients are summed over the replicas; the trajectory is one process's (fp32, 1e-5)."""
    ranks = run_world(_dp_pp, 4, timeout_s=300)
    want = _single(1)
    for r, (losses, shape, _) in enumerate(ranks):
        assert losses == pytest.approx(want, rel=RTOL), (r, losses, want)
        assert shape == (2, 2, r // 2, r % 2, 2 * (r // 2), 2 * (r // 2) + 2)
    assert ranks[0][2] == ranks[1][2] and ranks[2][2] == ranks[3][2]  # a replica's stages agree


def test_pipeline_replicas_must_divide_the_world():
    ranks = run_world(_bad_dp, 2, timeout_s=120)
    assert all("do not divide the world of 2" in r for r in ranks)


def _bad_dp(rank: int, world: int) -> str:
    from memfit.distributed import distribute

    try:
        distribute(GPT(GPTConfig(**CFG)), "pipeline", "adamw", dp=3)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_first_step_set_up_takes_either_torch_signature():
    """torch 2.13's _initialize_stage(args, kwargs, target), earlier torch's (args, kwargs): the first
    micro-batch's rows reach either, with nn.Module's global hooks set aside during the call."""
    from types import SimpleNamespace

    import torch.nn.modules.module as module

    from memfit.distributed.pipeline import PipelineOptimizer

    calls = []

    class New:
        def _initialize_stage(self, args, kwargs, target=None, loss_kwargs=None):
            calls.append((args[0].shape, kwargs, target.shape, len(module._global_forward_hooks)))

    class Old:
        def _initialize_stage(self, args, kwargs):
            calls.append((args, kwargs))

    x, y = torch.zeros(4, 8, dtype=torch.long), torch.ones(4, 8, dtype=torch.long)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        PipelineOptimizer._initialize(SimpleNamespace(microbatches=2, rank=0, schedule=New()), x, y)
        PipelineOptimizer._initialize(SimpleNamespace(microbatches=2, rank=1, schedule=Old()), x, None)
        assert len(module._global_forward_hooks) == 1  # put back after the call
    finally:
        handle.remove()
    assert calls == [((2, 8), {}, (2, 8), 0), ((), {})]
