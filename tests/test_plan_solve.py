"""The chain solver against brute force on random chains (every action list, segments included)."""
from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from memfit.apply.policy import BlockAction
from memfit.measure.compose import ChainProfile
from memfit.measure.timeline import ZERO, Stretch
from memfit.plan.solve import solve

KEEP, SEL, REC = BlockAction("keep"), BlockAction("selective"), BlockAction("recompute")


def s(peak: int, net: int) -> Stretch:
    return Stretch((0, 0, 0, max(peak, net, 0), 0), (0, 0, 0, net, 0))


def synthetic(n, g, a_k, a_s, x, r, peaks) -> ChainProfile:
    p = iter(peaks)
    fwd = {"keep": s(a_k + next(p), a_k), "selective": s(a_s + next(p), a_s), "recompute": s(x + next(p), x),
           "recompute|first": s(x + next(p), x), "recompute|rest": s(next(p), 0)}
    bwd = {"keep": s(next(p), g - a_k), "selective": s(next(p), g - a_s), "recompute": s(next(p), g - x),
           "recompute|rest": s(next(p), r)}
    zero = Stretch(ZERO, ZERO)
    around = {k: s(next(p), 0) for k in ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt")}
    ends = {k: (zero, zero) for k in fwd}
    return ChainProfile(
        n_blocks=n, start=(1000, 0, 0, 0, 0), start_per_block=ZERO, **around,
        per_block={k: zero for k in around}, fwd=fwd, bwd=bwd, seg_extra={"recompute": s(next(p), g - r)},
        deferred={}, traced_blocks=n, first=ends, last=ends)


def all_lists(n: int, sid: int = 0):
    """Every action list of n blocks: keep / selective / recompute segments of any length."""
    if n == 0:
        yield []
        return
    for first in (KEEP, SEL):
        for rest in all_lists(n - 1, sid):
            yield [first] + rest
    for k in range(1, n + 1):
        seg = [REC] if k == 1 else [BlockAction("recompute", segment=sid)] * k
        for rest in all_lists(n - k, sid + 1):
            yield seg + rest


COST = {"keep": 0.0, "selective": 0.3, "recompute": 1.0}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 7), g=st.integers(0, 50), a_k=st.integers(50, 200), a_s=st.integers(20, 120),
       x=st.integers(5, 30), r=st.integers(-100, 100), peaks=st.lists(st.integers(0, 300), min_size=20, max_size=20),
       slack=st.integers(0, 2000))
def test_solver_matches_brute_force(n, g, a_k, a_s, x, r, peaks, slack):
    prof = synthetic(n, g, a_k, a_s, x, r, peaks)
    cost = lambda b, k: COST[b.mode]  # noqa: E731
    lists = [list(l) for l in all_lists(n)]
    scored = []
    for acts in lists:
        scored.append((prof.peak_of(acts), sum(COST[a.mode] for a in acts), acts))
    lo = min(p for p, _, _ in scored)
    budget = lo + slack
    best = min(t for p, t, _ in scored if p <= budget)
    got = solve(prof, budget, (KEEP, SEL, REC), cost, max_segment=n)
    assert got is not None
    assert got.peak <= budget and prof.peak_of(got.actions) == got.peak
    assert abs(got.time - best) < 1e-9
    assert solve(prof, lo - 1, (KEEP, SEL, REC), cost, max_segment=n) is None


