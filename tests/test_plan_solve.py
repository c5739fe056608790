"""The chain solver against brute force on random chains (every action list, segments included)."""
from __future__ import annotations

import itertools

import pytest
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


# Chains of 7 blocks have 4616 action lists (6: 1352), most of this test's time: the default tier draws
# up to 6 blocks, which still hold segments of every length up to the whole chain; the slow tier up to 7.
@pytest.mark.parametrize("longest", [pytest.param(6, id="6-blocks"),
                                     pytest.param(7, id="7-blocks", marks=pytest.mark.slow)])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), g=st.integers(0, 50), a_k=st.integers(50, 200), a_s=st.integers(20, 120),
       x=st.integers(5, 30), r=st.integers(-100, 100), peaks=st.lists(st.integers(0, 300), min_size=20, max_size=20),
       slack=st.integers(0, 2000))
def test_solver_matches_brute_force(longest, data, g, a_k, a_s, x, r, peaks, slack):
    n = data.draw(st.integers(1, longest))
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




# Offload and compression: kinds whose forward keeps less on the device (what moves to the host, or what
# a compressed copy saves) at a time cost. Any subset of actions, random chains up to 8 blocks.
OFF, INT8, FP8 = BlockAction("keep", offload="cpu"), BlockAction("keep", compress="int8"), BlockAction("keep", compress="fp8")
REC_OFF = BlockAction("recompute", offload="cpu")
ALL = (KEEP, SEL, REC, OFF, INT8, FP8, REC_OFF)


def synthetic_any(n, g, saved, rest, peaks) -> ChainProfile:
    """One kind per base (saved[i] bytes kept by its forward), segment kinds for the recompute ones."""
    p = iter(peaks)
    fwd, bwd, seg_extra = {}, {}, {}
    for b, a in zip(ALL, saved):
        key = str(b)
        fwd[key], bwd[key] = s(a + next(p), a), s(next(p), g - a)
        if b.mode == "recompute":
            r = next(rest)
            fwd[key + "|first"], fwd[key + "|rest"] = s(a + next(p), a), s(next(p), 0)
            bwd[key + "|rest"], seg_extra[key] = s(next(p), r), s(next(p), g - r)
    zero = Stretch(ZERO, ZERO)
    around = {k: s(next(p), 0) for k in ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt")}
    ends = {k: (zero, zero) for k in fwd}
    return ChainProfile(
        n_blocks=n, start=(1000, 0, 0, 0, 0), start_per_block=ZERO, **around,
        per_block={k: zero for k in around}, fwd=fwd, bwd=bwd, seg_extra=seg_extra,
        deferred={}, traced_blocks=n, first=ends, last=ends)


def lists_of(n: int, bases, sid: int = 0):
    """Every action list of n blocks over `bases`, recompute ones also as segments of any length."""
    if n == 0:
        yield []
        return
    for b in bases:
        if b.mode != "recompute":
            for rest in lists_of(n - 1, bases, sid):
                yield [b] + rest
            continue
        for k in range(1, n + 1):
            seg = [b] if k == 1 else [BlockAction("recompute", offload=b.offload, segment=sid)] * k
            for rest in lists_of(n - k, bases, sid + 1):
                yield seg + rest


def list_cost(acts, costs) -> float:
    return sum(costs[str(BlockAction(a.mode, a.offload, a.compress))] for a in acts)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), g=st.integers(0, 50), saved=st.tuples(
       st.integers(50, 200), st.integers(20, 120), st.integers(5, 30), st.integers(0, 40), st.integers(10, 60),
       st.integers(10, 60), st.integers(0, 5)),
       peaks=st.lists(st.integers(0, 300), min_size=40, max_size=40),
       times=st.lists(st.floats(0.01, 2.0), min_size=6, max_size=6), slack=st.integers(0, 2000))
def test_solver_with_offload_and_compression_matches_brute_force(data, g, saved, peaks, times, slack):
    picked = data.draw(st.lists(st.sampled_from(ALL[1:]), min_size=1, max_size=3, unique=True))
    bases = (KEEP, *picked)
    segmentable = sum(b.mode == "recompute" for b in bases)
    n = data.draw(st.integers(1, 8 if segmentable <= 1 and len(bases) <= 3 else 6))
    rest = iter(data.draw(st.lists(st.integers(-100, 100), min_size=2, max_size=2)))
    prof = synthetic_any(n, g, saved, rest, peaks)
    costs = {str(KEEP): 0.0, **{str(b): t for b, t in zip(ALL[1:], times)}}
    cost = lambda b, k: costs[str(b)]  # noqa: E731
    scored = [(prof.peak_of(acts), list_cost(acts, costs), acts) for acts in lists_of(n, bases)]
    lo = min(p for p, _, _ in scored)
    budget = lo + slack
    best = min(t for p, t, _ in scored if p <= budget)
    got = solve(prof, budget, bases, cost, max_segment=n)
    assert got is not None
    assert got.peak <= budget and prof.peak_of(got.actions) == got.peak
    assert abs(got.time - best) < 1e-9
    assert abs(list_cost(got.actions, costs) - got.time) < 1e-9
    assert solve(prof, lo - 1, bases, cost, max_segment=n) is None
