"""The moment that is no module's highest: under full recomputation a Llama's loss backward (what the
recomputation keeps, the logits and their gradient) holds the most activations and temporaries of the
step, before any gradient exists. On one process the peak is later (a block's recompute beside the
gradients made so far); once every gradient is held beside it (DDP's buckets, which live between steps;
the earlier micro-batches' gradients under accumulation) that moment is the peak. The trace records it
(memfit.core.ledger: busiest_categories) and the per-rank estimate adds it (rank_memory.rank_totals).

Default tier: one process, two micro-batches per step. Slow, multiproc: DDP and ZeRO-R on 2 gloo ranks,
the bench's case (bench/torch_engines.py). Before the moment was recorded all three were 6-7.3% under.
"""
from __future__ import annotations

import pytest

import hf_family_configs as fam
import rank_grid as grid
from memfit.distributed.rank_memory import BUSIEST

# The tracked figures are byte counts. Seen: -0.06% one process, -0.07% (DDP), -0.08% (ZeRO-R): the
# few hundred bytes every estimate of these models is under (the rank grid's other rows, -0.05% to
# -0.1%); the old miss was 6.0% to 7.3%, so 0.5% still fails it by an order of magnitude.
TOLERANCE = 0.005


def _error(est: int, got: int) -> float:
    return (est - got) / got


def test_accumulation_peak_is_the_loss_backward_beside_the_held_gradients(tmp_path):
    from memfit.measure.estimate import estimate

    path = fam.write_config(tmp_path, "llama")
    case = grid.Case(path, "none", checkpoint="full", accum=2)
    got = grid.tracked(0, 1, [case])[case]  # one process: no process group, two micro-batches a step
    est = estimate(path, batch=grid.BATCH, seq=grid.SEQ, checkpoint="full", accum=2)
    assert abs(_error(est.total, got["total"])) < TOLERANCE, (est.per_device, got)
    # the moment: between the blocks (the head's side), before any gradient, and not a module's peak
    busy = est.moments[BUSIEST]
    assert busy["grads"] == 0 and BUSIEST not in est.modules
    assert busy["activations"] + busy["temporaries"] > max(
        m["activations"] + m["temporaries"] for k, m in est.moments.items() if k != BUSIEST)
    assert est.per_device["activations"] == busy["activations"]  # the peak is that moment's


@pytest.mark.slow
@pytest.mark.multiproc
def test_ddp_and_zero_redundancy_ranks_hold_their_buckets_beside_the_loss_backward(tmp_path):
    from memfit.distributed.spawn import run_world

    path = fam.write_config(tmp_path, "llama")
    cases = [grid.Case(path, "ddp", checkpoint="full"),
             grid.Case(path, "zero1", checkpoint="full", engine="zero-redundancy")]
    measured = run_world(grid.tracked, 2, (cases,), timeout_s=1200)
    rows = grid.errors(cases, 2, measured)
    assert all(abs(e) < TOLERANCE for r in rows for e in r["error"]), [(r["case"], r["error"]) for r in rows]


@pytest.mark.slow
def test_the_composed_trace_finds_the_same_moment_as_the_whole_trace():
    """From 12 blocks the estimate composes short traces (memfit.measure.compose): each stretch keeps
    its point with the most activations + temporaries (Stretch.busy), and the composed moment is the
    whole trace's to the byte (12 blocks, full recomputation: the last block's recompute in backward)."""
    from memfit.measure.blocks import composed_step
    from memfit.measure.trace import trace_step
    from memfit.models.spec import parse_model

    spec = parse_model(grid.gpt(12))
    whole = trace_step(spec, batch=grid.BATCH, seq=grid.SEQ, checkpoint="full")
    composed = composed_step(spec, grid.BATCH, grid.SEQ, checkpoint="full")
    (name, moment), = whole.other_moments.items()
    assert name == f"blocks.11.{BUSIEST}" and moment["grads"] < whole.grads
    assert {k: v for k, v in composed.other_moments[name].items() if k != "total"} == moment
