"""When the full trace refuses the fastest candidate, the search goes on to the next one."""
import pytest

import memfit
from memfit.plan import trace_check as check_mod
from memfit.plan.costs import PlanError

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=256,seq=64"


def _fit(**kw):  # accumulation alone gives the smaller micro-batches to fall back on
    return memfit.fit(SPEC, budget="64MiB", batch=8, seq=64, device="cpu", **kw)


def test_a_refused_candidate_gives_way_to_the_next_fastest(monkeypatch):
    """The trace (stubbed) refuses every plan at full micro-batch: the search must settle on a smaller
    micro-batch that it had not solved before, and say so."""
    first = _fit(allow="accumulate")
    assert first.micro_batch == 8
    real = check_mod._trace_peak

    def strict(problem, plan):
        return plan.budget + 1 if plan.micro_batch == 8 else real(problem, plan)

    monkeypatch.setattr(check_mod, "_trace_peak", strict)
    plan = _fit(allow="accumulate")
    assert plan.micro_batch < 8 and plan.micro_batch * plan.accumulation == 8
    assert plan.measured_peak is not None and plan.measured_peak <= plan.budget
    assert any(c.refused and c.micro_batch == 8 for c in plan.ranked)
    assert any("refused by the full trace" in n for n in plan.notes)


def test_every_candidate_refused_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(check_mod, "_trace_peak", lambda problem, plan: plan.budget + 1)
    with pytest.raises(PlanError, match="once checked by a full trace; refused: 32-true micro-batch 8"):
        _fit(allow="accumulate")
