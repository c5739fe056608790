"""Adaptive plans: a longer sequence bucket recomputes more and still fits; plans are cached per bucket."""
from __future__ import annotations

import pytest

from memfit.measure.trace import trace_step
from memfit.plan.adaptive import AdaptivePlan

SPEC = "gpt:layers=3,hidden=32,heads=2,vocab=64,seq=256"


@pytest.mark.slow
def test_longer_buckets_recompute_more_and_fit():
    short = trace_step(SPEC, batch=2, seq=64, checkpoint="none").peak
    long_ = trace_step(SPEC, batch=2, seq=256, checkpoint="none").peak
    budget = (short + long_) // 2
    ap = AdaptivePlan(SPEC, budget, bucket=64)
    p_short, p_long = ap.for_shape(2, 50), ap.for_shape(2, 256)
    assert ap.for_shape(2, 64) is p_short  # same bucket, solved once
    kept = lambda p: sum(a.mode == "keep" for a in p.actions)  # noqa: E731
    assert kept(p_short) > kept(p_long)
    for seq, plan in ((64, p_short), (256, p_long)):
        assert trace_step(SPEC, batch=2, seq=seq, checkpoint=plan.actions).peak <= budget
    # the plan for the shortest length runs over budget on the longest
    assert trace_step(SPEC, batch=2, seq=256, checkpoint=p_short.actions).peak > budget



def test_buckets_solve_once_for_their_longest_length_and_reinstall_on_change(monkeypatch):
    """The default tier's check of AdaptivePlan's own logic (the slow test above runs the planner):
    each bucket is solved once, for its longest length, and a model gets a plan installed only when
    its bucket changes."""
    import memfit.plan.fit as fit_module

    solved, installed = [], []

    class FakePlan:
        def __init__(self, seq):
            self.seq = seq

        def install(self, model):
            installed.append((id(model), self.seq))

    def fake_fit(model, budget=None, **kw):
        solved.append((kw["batch"], kw["seq"], budget))
        return FakePlan(kw["seq"])

    monkeypatch.setattr(fit_module, "fit", fake_fit)
    ap = AdaptivePlan(SPEC, "1MiB", bucket=64)
    assert ap.for_shape(2, 50).seq == 64 and ap.for_shape(2, 64) is ap.for_shape(2, 1)
    assert ap.for_shape(2, 65).seq == 128 and ap.for_shape(3, 10) is not ap.for_shape(2, 10)
    assert solved == [(2, 64, "1MiB"), (2, 128, "1MiB"), (3, 64, "1MiB")]
    model, other = object(), object()
    for shape in ((2, 10), (2, 60), (2, 100), (2, 128), (2, 5)):
        ap.apply(model, *shape)
    ap.apply(other, 2, 5)
    assert installed == [(id(model), 64), (id(model), 128), (id(model), 64), (id(other), 64)]
