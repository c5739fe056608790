"""memfit.fit end to end on a small GPT: the plan fits when run for real; bad input is one line, exit 2."""
from __future__ import annotations

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig
from memfit.plan.fit import PlanError, fit


def small():
    return GPT(GPTConfig(layers=4, hidden=64, heads=4, vocab=256, seq=64))


@pytest.mark.slow
def test_fit_plan_runs_under_budget_for_real():
    model = small()
    x = torch.randint(0, 256, (4, 32))
    budget = 5_000_000
    plan = fit(model, (x, x), budget=budget, allow=("recompute", "selective"))
    assert plan.predicted_peak <= budget and plan.measured_peak <= budget
    assert "blocks (4)" in plan.summary()
    opt = plan.apply(model, lr=1e-3)
    with memfit.track(model, opt) as tr:
        for _ in range(2):
            with opt.autocast():
                loss = model(x, x)[1]
            opt.backward(loss)
            opt.step()
    assert tr.peak_bytes <= budget


@pytest.mark.slow
def test_impossible_budget_says_what_dominates():
    x = torch.randint(0, 256, (4, 32))
    with pytest.raises(PlanError, match="parameters, gradients and optimizer state alone need"):
        fit(small(), (x, x), budget="1MiB", allow=("recompute",))


@pytest.mark.parametrize("argv", [["plan", "gpt2", "--budget", "lots"], ["plan", "gpt2", "--budget=-1GiB"],
                                  ["plan", "gpt2", "--budget", "1GiB", "--allow", "magic"]])
def test_bad_input_exits_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


def test_fit_needs_an_example():
    with pytest.raises(ConfigError, match="example"):
        fit(small(), None, budget="1GiB")


@pytest.mark.slow
def test_a_loop_holding_more_than_planned_is_replanned_to_fit():
    model = small()
    x = torch.randint(0, 256, (4, 32))
    budget = 5_000_000
    plan = fit(model, (x, x), budget=budget, allow=("recompute", "selective"), keep_output=False)
    _assert_replanned_when_the_loop_keeps_its_logits(plan, model, x, budget)


def test_fit_on_a_tiny_model_runs_under_budget_and_a_larger_loop_is_replanned():
    """The default tier's end-to-end check of memfit.fit and plan/verify.py (the slow tests above do
    the same on a 4-block model): a budget 7% under the plain step's tracked peak is met by the real
    step, and a loop that keeps its logits alive through backward is planned again to fit."""
    from memfit.apply.optimizer import TrainingOptimizer

    cfg = GPTConfig(layers=2, hidden=32, heads=2, vocab=256, seq=64)
    x = torch.randint(0, 256, (4, 32))
    model = GPT(cfg)
    opt = TrainingOptimizer(model, "adamw", lr=1e-3)
    with memfit.track(model, opt) as tr:
        opt.backward(model(x, x)[1])
        opt.step()
    budget = int(tr.peak_bytes * 0.93)
    model = GPT(cfg)
    # keep_output=False: planned for a loop that drops its logits, so the loop below (which keeps them)
    # is over the budget and must be planned again; a byte count under a MiB is written with its unit
    plan = fit(model, (x, x), budget=f"{budget}B", allow=("recompute", "selective"), keep_output=False)
    assert plan.predicted_peak <= budget and plan.measured_peak <= budget
    assert any(a.mode != "keep" for a in plan.actions)  # the plain step does not fit: something recomputes
    _assert_replanned_when_the_loop_keeps_its_logits(plan, model, x, budget)


def _assert_replanned_when_the_loop_keeps_its_logits(plan, model, x, budget):
    """plan/verify.py: a loop that keeps its logits alive through backward (which `plan` was not made
    for) measures over the budget, and is planned again to fit."""
    from memfit.plan.verify import check

    opt = plan.apply(model, lr=1e-3)
    held = {}

    def step():  # keeps the logits alive through backward, which the planned step does not
        with opt.autocast():
            held["logits"], loss, _ = model(x, x)
        opt.backward(loss)
        opt.step()

    new = check(plan, model, opt, step)
    assert plan.measured_peak > budget
    assert new is not plan and new.measured_peak <= budget and "over the budget" in new.notes[-1]
