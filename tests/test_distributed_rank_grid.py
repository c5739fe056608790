"""Each rank's estimate against its tracked peak (tests/rank_grid.py), and the one schema of every estimate.

The default tier runs the cases that caught the per-rank bugs: deep models (the composed path from
12 blocks) under ZeRO-3 with and without checkpointing, a tied-embedding Llama under ddp and
zero2 with full checkpointing (the peak in backward), a 1F1B pipeline whose micro-batches all
fit in the warm-up, and a GPipe pipeline with full checkpointing (the peak is a block's recompute
beside the sends GPipe holds). `--runslow` runs the whole grid (docs/estimate.md has its table).
"""
from __future__ import annotations

import json

import pytest

import rank_grid as grid
from memfit.core import compat
from memfit.cli import main
from memfit.distributed.spawn import run_world

# Each strategy's worst error over the 372 cases of bench/results/rank_estimate.json (every depth,
# two and four ranks, the Hugging Face families), rounded up to the next half percent. The tracked
# figures are byte counts (the same on every run), and a rank's estimate is the one-device trace
# plus model states counted from the strategies' own flat layout to the byte: its error is the
# one-device trace's (strategy none: 0.25% at worst) plus what a strategy's own buffers add (tensor
# parallel: 1.14%, and 2.96% in the last run from a late free, below; ddp's gradient buckets beside the loss's backward under full recomputation were
# 1.23% until the trace recorded that moment, 0.22% since). A bug
# worth one block's weights (1.1% to 2.3% of a rank at hidden 32, e.g. ZeRO-3 gathering one block
# ahead instead of two) fails it; the old flat 3% passed that. memfit's own collectives return once
# gloo's worker thread has dropped their tensors (distributed/comm.py `_released`): before that, a
# ZeRO bucket's buffer was sometimes freed on that thread in the middle of the optimizer step (one
# rank -7.0% under load; on 2 ranks, 9 such late frees in 3 runs of the 1- and 2-block grid, none
# since). Tensor parallel is the exception: its collectives are DTensor's, whose buffers gloo's
# thread still frees late (its rank 1 is not the same on every run: -2.1%, -3.0%, -3.2% and, on
# four ranks under load, -4.7% seen; never over), so it keeps 5%.
TOLERANCE = {"none": 0.005, "ps": 0.005, "zero1": 0.005, "zero2": 0.01, "zero3": 0.005, "pipeline": 0.005,
             "ddp": 0.005, "tensor": 0.05}


# torch 2.15's pipeline schedules hold sends differently (core/compat.py); the stage trace follows
# 2.11-2.14's, so on 2.15 a pipeline rank is held to this looser bound (seen: -2.1% to +4.0%).
PIPELINE_TOLERANCE_215 = 0.05 if compat.pipeline_releases_sent_outputs() else None


def _bad(r: dict, tolerance: float | None) -> bool:
    if tolerance is None:
        tolerance = TOLERANCE[r["strategy"]]
    if PIPELINE_TOLERANCE_215 is not None and r["strategy"] == "pipeline":
        tolerance = PIPELINE_TOLERANCE_215
    return max(abs(e) for e in r["error"]) > tolerance


def _check(cases: list, world: int, tolerance: float | None = None) -> None:
    measured = run_world(grid.tracked, world, (cases,), timeout_s=1200)
    bad = [(r["case"], r["error"]) for r in grid.errors(cases, world, measured) if _bad(r, tolerance)]
    assert not bad, bad


@pytest.mark.multiproc
def test_covering_subset_each_rank_within_its_strategy_tolerance(tmp_path):
    llama = grid.hf_configs(tmp_path)["llama-tied"]
    cases = [grid.Case(grid.gpt(12), "zero3"), grid.Case(grid.gpt(13), "zero3", "bf16-master", "full"),
             grid.Case(llama, "ddp", checkpoint="full"), grid.Case(llama, "zero2", checkpoint="full"),
             grid.Case(grid.gpt(2), "pipeline", schedule="1f1b"),
             grid.Case(grid.gpt(2), "pipeline", "bf16-master", "full", schedule="gpipe")]
    _check(cases, 2)


@pytest.mark.multiproc
def test_accumulation_each_rank_within_1_percent():
    """`--accum 2`: the second micro-batch runs beside the first one's gradients (ZeRO-2/3: the rank's
    reduced slices and the flat buffer the last reduce-scatter left), on one device and on each rank."""
    g = grid.gpt(2)
    _check([grid.Case(g, "none", accum=2), grid.Case(g, "ddp", accum=2), grid.Case(g, "zero2", checkpoint="full", accum=2),
            grid.Case(g, "zero3", "bf16-master", accum=2), grid.Case(g, "pipeline", schedule="gpipe", accum=2)], 2,
           tolerance=0.01)


def test_accumulation_raises_the_estimate_by_the_held_gradients(capsys):
    args = (grid.gpt(2), "--batch", "2", "--seq", "32")
    for strategy, more in (((), True), (("--strategy", "zero2", "--world", "2"), True),
                           (("--strategy", "ddp", "--world", "2"), False)):  # ddp's buckets live between steps anyway
        one, two = (_json(capsys, *args, *strategy, "--accum", a) for a in ("1", "2"))
        assert two["accum"] == 2 and (two["per_device"]["total"] > one["per_device"]["total"]) == more
        assert two["per_device"]["grads"] > 0  # held through the later micro-batch
    assert main(["estimate", *args, "--strategy", "tensor", "--world", "2", "--accum", "2"]) == 2
    assert "--accum" in capsys.readouterr().err


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("depth", [d for d in grid.DEPTHS if d != 13])
def test_grid_gpt_each_rank_within_its_strategy_tolerance(depth):
    # Every case at 1 and 2 blocks; at 11 (the full trace's deepest) and 12 (the composed path's
    # threshold) half of it: each strategy with and without checkpointing, the precisions in turn, so
    # each strategy meets each precision and each checkpoint (the three-way combinations, twice the
    # cases, run at 1 and 2 blocks); at 24 and 48 each strategy once, checkpoint and precision
    # alternating. 13 blocks run in test_grid_four_ranks and the default tier's covering subset;
    # bench/rank_estimate.py runs every case at every depth.
    if depth in (1, 2):
        cases = grid.gpt_cases([depth])
    else:
        cases = grid.covering_cases(depth, each_once=depth > 13)
    _check(cases, 2)


@pytest.mark.multiproc
@pytest.mark.slow
def test_grid_four_ranks():
    # 2 blocks (no pipeline: fewer blocks than stages) and 13 (the composed path, four uneven stages);
    # 12, the composed path's threshold, runs on two ranks (test_grid_gpt_...[12]), and at four ranks
    # it took a third of this test's 91 CPU-s while proving nothing 13 does not.
    _check(grid.gpt_cases([2, 13], 4, precisions=("32-true",)), 4)


@pytest.mark.multiproc
@pytest.mark.slow
def test_grid_hf_families(tmp_path):
    _check(grid.hf_cases(grid.hf_configs(tmp_path)), 2)


def _json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_schema_per_device_is_the_largest_rank_and_ranks_are_distinct(capsys):
    spec = grid.gpt(12)
    z = _json(capsys, spec, "--batch", "2", "--seq", "32", "--strategy", "zero3", "--world", "1024")
    assert (z["strategy"], z["world"], z["zero"]) == ("zero3", 1024, 3)
    assert len(z["ranks"]) == 1 and z["ranks"][0]["rank_ids"] == list(range(1024))
    assert z["per_device"]["total"] == z["ranks"][0]["total"]
    same = _json(capsys, spec, "--batch", "2", "--seq", "32", "--zero", "3", "--world", "1024")
    assert same["per_device"] == z["per_device"] and same["strategy"] == "zero3"
    ps = _json(capsys, spec, "--batch", "2", "--seq", "32", "--strategy", "ps", "--world", "4")
    assert [r["rank_ids"] for r in ps["ranks"]] == [[0], [1, 2, 3]]
    assert ps["per_device"]["total"] == max(r["total"] for r in ps["ranks"])
    for data in (z, ps):
        for r in data["ranks"]:  # the categories are the peak moment's
            assert r["total"] == sum(r[c] for c in ("params", "gathered", "grads", "in_flight", "optimizer",
                                                    "activations", "temporaries"))
        assert data["per_device"]["total"] == sum(v for k, v in data["per_device"].items() if k != "total")


def test_zero3_keeps_the_activations_of_a_deep_model(capsys):
    """The composed path (12 blocks and more) names each block's saved bytes, so ZeRO-3 keeps them."""
    args = ("--batch", "1", "--seq", "32", "--strategy", "zero3", "--world", "2")
    acts = [_json(capsys, grid.gpt(n), *args)["per_device"]["activations"] for n in (11, 12)]
    one = _json(capsys, grid.gpt(12), "--batch", "1", "--seq", "32")
    assert acts[1] > acts[0] > 0.8 * one["per_device"]["activations"]
    saved = one["module_activations"]
    assert saved["blocks.5"] > 0 and saved["GPT"] >= sum(saved[f"blocks.{i}"] for i in range(12))


def test_contradicting_zero_and_strategy_refused(capsys):
    assert main(["estimate", grid.gpt(2), "--zero", "2", "--strategy", "zero3", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "contradicts" in err and len(err.strip().splitlines()) == 1


def test_composed_module_table_names_the_model_and_each_block_saves(capsys):
    capsys.readouterr()
    assert main(["estimate", grid.gpt(12), "--batch", "1", "--seq", "32", "--modules", "40"]) == 0
    out = capsys.readouterr().out
    assert f"GPT (whole model: {grid.gpt(12)}"[:39] in out  # the root row says which model it stands for
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("blocks.")]
    assert len(rows) == 12 and all(r[-2:] != ["0", "B"] for r in rows[:-1])  # saved for backward, per block
