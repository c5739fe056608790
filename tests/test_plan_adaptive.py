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
