"""The planner's time model: segment costs, the chunked head's measured cost, and pricing an action list."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from memfit.apply.policy import BlockAction, resolve_policy
from memfit.plan.costs import _cost, _segment_seconds, head_cost, measured, predict_extra

KEEP, SEL, REC = BlockAction("keep"), BlockAction("selective"), BlockAction("recompute")


def test_segment_cost_interpolates_between_one_block_and_the_measured_length():
    per = _segment_seconds(1.0, {"4": 0.7})
    assert per(1) == 1.0 and per(4) == pytest.approx(0.7) and per(2) == pytest.approx(0.9)
    assert per(9) == pytest.approx(0.7)  # flat beyond the measured length
    assert _segment_seconds(1.0, None)(5) == 1.0  # without a measurement a segment costs its forwards


def test_cost_uses_the_segment_figure_only_for_segments():
    cost = _cost(0.5, 0.1, None, None, {"3": 0.2})
    assert cost(REC, 1) == 0.5 and cost(REC, 3) == pytest.approx(0.2) and cost(SEL, 1) == 0.1 and cost(KEEP, 1) == 0


def test_predict_extra_prices_each_segment_by_its_length():
    cost = _cost(1.0, 0.25, None, None, {"4": 0.5})
    assert predict_extra(resolve_policy("none", 12), cost) == 0
    assert predict_extra(resolve_policy("full", 12), cost) == pytest.approx(12.0)
    assert predict_extra(resolve_policy("selective", 12), cost) == pytest.approx(3.0)
    assert predict_extra(resolve_policy("sqrt", 12), cost) == pytest.approx(12 * 0.5)  # three segments of 4
    mixed = [KEEP, SEL] + [BlockAction("recompute", segment=7)] * 2 + [REC]
    assert predict_extra(mixed, cost) == pytest.approx(0.25 + 2 * (1.0 + (0.5 - 1.0) / 3) + 1.0)


def test_head_cost_offsets_the_measured_count_by_the_time_model():
    model = lambda k: 2.0 + k / 4  # noqa: E731
    assert head_cost(None, 1.0, 4, model) == 3.0
    costs = SimpleNamespace(head_s={"8": 0.8})
    assert head_cost(costs, 1.0, 8, model) == pytest.approx(0.8)
    assert head_cost(costs, 0.5, 16, model) == pytest.approx(0.4 + 2.0)  # the measurement plus the model's step
    # A head measured faster than the plain one stays cheapest at the measured count, not at the most chunks.
    faster = SimpleNamespace(head_s={"8": -0.1})
    assert head_cost(faster, 1.0, 64, model) > head_cost(faster, 1.0, 8, model)


def test_measured_scales_to_the_micro_batch():
    costs = SimpleNamespace(recompute_s=0.2, selective_s=0.04, segment_s={"4": 0.1})
    rec, sel, seg = measured(costs, 0.5, 9.0)
    assert (rec, sel, seg) == (pytest.approx(0.1), pytest.approx(0.02), {"4": pytest.approx(0.05)})
    # A figure at or below zero is noise: the FLOP model's forward, selective's share, no segment figure.
    noisy = SimpleNamespace(recompute_s=-0.2, selective_s=0.0, segment_s={"4": -0.1})
    assert measured(noisy, 0.5, 9.0) == (9.0, None, {})
    # A head timed faster than the plain one is noise too: the time model prices it.
    assert head_cost(SimpleNamespace(head_s={"8": -0.1}), 1.0, 8, lambda k: 0.1 * k) == pytest.approx(0.8)


SPEC = "gpt:layers=4,hidden=32,heads=2,vocab=64,seq=32"


def _costs(**kw):
    from memfit.profile.measure import BlockCosts

    base = dict(fwd_s=0.01, bwd_s=0.02, recompute_s=0.01, selective_s=0.002, input_bytes=0)
    return BlockCosts(**(base | kw))


def test_a_measured_saving_from_recomputing_is_treated_as_noise(monkeypatch):
    from memfit.plan.fit import fit

    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    kw = dict(budget="1GiB", batch=2, seq=16, allow=("recompute", "selective"), verify=False)
    assert {a.mode for a in fit(SPEC, costs=_costs(), **kw).actions} == {"keep"}
    # Recomputing adds work: a profile that timed it faster than keeping everything measured noise, and
    # with room to spare the plan still keeps everything (the FLOP model prices the action instead).
    for bad in (dict(selective_s=-0.001), dict(recompute_s=-0.001), dict(selective_s=0.0, recompute_s=0.0)):
        assert {a.mode for a in fit(SPEC, costs=_costs(**bad), **kw).actions} == {"keep"}


def test_measured_segment_costs_decide_between_segments_and_single_blocks():
    from memfit.apply.policy import resolve_policy
    from memfit.measure.blocks import chain_profile
    from memfit.measure.compose import BASE_ACTIONS
    from memfit.plan.fit import _Problem
    from memfit.plan.solve import solve

    # the planner's own source (the loop's step, holding the output): the profile that fit() traced in
    # test_a_measured_saving_from_recomputing_is_treated_as_noise, kept in this process
    problem = _Problem(SPEC, None, None, 2, 16)
    problem.keep_output = True  # fit()'s default
    prof = chain_profile(problem.source(2), "32-true", "adamw")
    lo, hi = prof.peak_of(resolve_policy("full", 4)), prof.peak_of(resolve_policy("none", 4))
    budgets = [lo + (hi - lo) * i // 8 for i in range(9)]

    def segmented(seg_s: float, budget: int) -> bool:
        got = solve(prof, budget, BASE_ACTIONS, _cost(0.01, 0.02, prof, None, {"2": seg_s}), n_blocks=4)
        return got is not None and any(a.segment is not None for a in got.actions)

    # Where a recomputed segment of 2 costs less per block than one block alone, some budget uses one;
    # where it costs more, none does (every budget here, from full checkpointing's peak up, fits blocks
    # recomputed one by one).
    assert any(segmented(0.001, b) for b in budgets)
    assert not any(segmented(0.05, b) for b in budgets)


def test_a_measured_head_offers_chunk_counts_from_the_timed_one_up():
    from memfit.plan.search import _measured_counts

    counts = [2, 4, 8, 16, 32]
    assert _measured_counts(counts, None) == counts  # no profile: every count, the model prices them
    assert _measured_counts(counts, SimpleNamespace(head_s={"8": 0.1})) == [8, 16, 32]
    assert _measured_counts([2, 4], SimpleNamespace(head_s={"8": 0.1})) == [4]  # (a small vocabulary)


def test_head_cost_takes_a_measured_saving_as_no_cost_when_the_head_runs_the_plain_gemms():
    """The chunked head with its weight gradient summed in the forward runs the plain head's GEMMs and can
    measure faster: priced at no cost at the profiled count (never a credit), the model's step above it."""
    faster = SimpleNamespace(head_s={"8": -0.3})
    model = lambda k: 0.1 * k  # noqa: E731
    assert head_cost(faster, 1.0, 8, model, same_gemms=True) == 0.0
    assert head_cost(faster, 1.0, 16, model, same_gemms=True) == pytest.approx(0.8)
    assert head_cost(faster, 1.0, 4, model, same_gemms=True) == 0.0
    assert head_cost(faster, 1.0, 8, model) == pytest.approx(0.8)  # an extra GEMM: the saving is noise
