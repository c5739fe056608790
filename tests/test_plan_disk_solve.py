"""Disk offload in the solver: the DP against brute force on random chains up to 8 blocks (7 in the
default tier), with the read-ahead coupling (a moved block reads the previous disk block back in its own
backward)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from memfit.apply.policy import BlockAction
from memfit.measure.compose import ChainProfile
from memfit.measure.timeline import ZERO, Stretch
from memfit.plan.disk_profile import DiskProfile, coupling, disk_bases, is_disk, walks
from memfit.plan.disk_solve import solve_with_disk

KEEP, SEL, REC = BlockAction("keep"), BlockAction("selective"), BlockAction("recompute")
OFF, REC_OFF = BlockAction("keep", offload="cpu"), BlockAction("recompute", offload="cpu")
DK, DR = BlockAction("keep", offload="disk"), BlockAction("recompute", offload="disk")
BASE = (KEEP, SEL, REC, OFF, REC_OFF)
DISK = (DK, DR)
MOVED = (OFF, REC_OFF, DK, DR)


def s(peak: int, net: int) -> Stretch:
    return Stretch((0, 0, 0, max(peak, net, 0), 0), (0, 0, 0, net, 0))


def synthetic(n, g, saved, restore, peaks) -> DiskProfile:
    """A profile whose nets follow the model: a block's forward + backward nets are its gradients g,
    plus R of the disk block it reads ahead, less its own R when it was read ahead."""
    p = iter(peaks)
    fwd, bwd, seg_extra = {}, {}, {}
    for b, a in zip(BASE, saved):
        key = str(b)
        fwd[key], bwd[key] = s(a + next(p), a), s(next(p), g - a)
        if b.mode == "recompute":
            fwd[key + "|first"], fwd[key + "|rest"] = s(a + next(p), a), s(next(p), 0)
            bwd[key + "|rest"], seg_extra[key] = s(next(p), 7), s(next(p), g - 7)
    zero = Stretch(ZERO, ZERO)
    around = {k: s(next(p), 0) for k in ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt")}
    ends = {k: (zero, zero) for k in fwd}
    base = ChainProfile(n_blocks=n, start=(1000, 0, 0, 0, 0), start_per_block=ZERO, **around,
                        per_block={k: zero for k in around}, fwd=fwd, bwd=bwd, seg_extra=seg_extra,
                        deferred={}, traced_blocks=n, first=ends, last=ends)
    R = {str(d): r for d, r in zip(DISK, restore)}
    dfwd = {str(d): s(next(p), 0) for d in DISK}
    dbwd = {}
    for x in MOVED:
        net_x = g - (fwd[str(x)].net_bytes if str(x) in fwd else 0)
        for prev in (None, *DISK):
            for pf in ((False, True) if is_disk(x) else (False,)):
                net = net_x + (R[str(prev)] if prev else 0) - (R[str(x)] if pf else 0)
                dbwd[(str(x), pf, None if prev is None else str(prev))] = s(next(p) + (R[str(prev)] if prev else 0), net)
    first = {(str(d), pf): (zero, zero) for d in DISK for pf in (False, True)}
    return DiskProfile(base, dfwd, dbwd, first, {str(d): (zero, zero) for d in DISK}, R)


def lists_of(n: int, bases, sid: int = 0):
    if n == 0:
        yield []
        return
    for b in bases:
        ks = range(1, n + 1) if b.mode == "recompute" and not is_disk(b) else [1]
        for k in ks:
            seg = [b] if k == 1 else [BlockAction("recompute", offload=b.offload, segment=sid)] * k
            for rest in lists_of(n - k, bases, sid + 1):
                yield seg + rest


def list_cost(acts, costs) -> float:
    pf = coupling(acts)
    return sum(costs[(str(BlockAction(a.mode, a.offload)), pf[i][0] if is_disk(a) else False)]
               for i, a in enumerate(acts))


# The brute force enumerates every action list (thousands at 6-8 blocks, each priced by a walk of the
# chain: about 12 CPU-s for 25 examples up to 8 blocks). The default tier draws chains one block
# shorter, which still holds every base, segments of several blocks and read-ahead pairs; the slow
# tier runs the full 8 (6 with four or more bases) on the same draws.
@pytest.mark.parametrize("longest", [pytest.param((7, 5), id="7-blocks"),
                                     pytest.param((8, 6), id="8-blocks", marks=pytest.mark.slow)])
@settings(max_examples=25, deadline=None)
@given(data=st.data(), g=st.integers(0, 50), saved=st.tuples(
       st.integers(50, 200), st.integers(20, 120), st.integers(5, 30), st.integers(0, 40), st.integers(0, 5)),
       restore=st.tuples(st.integers(50, 250), st.integers(5, 30)),
       peaks=st.lists(st.integers(0, 300), min_size=60, max_size=60),
       times=st.lists(st.floats(0.01, 2.0), min_size=8, max_size=8), slack=st.integers(0, 1500))
def test_disk_solver_matches_brute_force(longest, data, g, saved, restore, peaks, times, slack):
    disk = data.draw(st.lists(st.sampled_from(DISK), min_size=1, max_size=2, unique=True))
    other = data.draw(st.lists(st.sampled_from(BASE[1:]), min_size=0, max_size=2, unique=True))
    bases = (KEEP, *other, *disk)
    few = len(bases) <= 3 and sum(b.mode == "recompute" for b in other) <= 1
    n = data.draw(st.integers(1, longest[0] if few else longest[1]))
    dp = synthetic(n, g, saved, restore, peaks)
    t = iter(times)
    costs = {(str(KEEP), False): 0.0, **{(str(b), False): next(t) for b in BASE[1:]},
             **{(str(d), pf): next(t) for d in DISK for pf in (False, True)}}
    cost = lambda b, k: costs[(str(b), False)]  # noqa: E731
    disk_cost = lambda b, pf: costs[(str(b), pf)]  # noqa: E731
    scored = [(dp.peak_of(a), list_cost(a, costs), a) for a in lists_of(n, bases) if dp.supports(a)]
    lo = min(p for p, _, _ in scored)
    budget = lo + slack
    best = min(c for p, c, _ in scored if p <= budget)
    got = solve_with_disk(dp, budget, bases, cost, disk_cost, max_segment=n)
    assert got is not None
    assert got.peak <= budget and dp.peak_of(got.actions) == got.peak
    assert abs(got.time - best) < 1e-9 and abs(list_cost(got.actions, costs) - got.time) < 1e-9
    assert solve_with_disk(dp, lo - 1, bases, cost, disk_cost, max_segment=n) is None


def test_read_ahead_coupling_is_what_the_store_does():
    acts = [DK, KEEP, OFF, DR, REC, DK, SEL]
    # DK(0) is read ahead by OFF(2); OFF couples to DK; DR(3) read ahead by DK(5); DK(5) is the last moved.
    assert coupling(acts) == [(True, None), (False, None), (False, str(DK)), (True, None),
                              (False, None), (False, str(DR)), (False, None)]
    assert disk_bases(("offload-disk",)) == [DK] and disk_bases(("offload-disk", "recompute")) == [DK, DR]
    assert disk_bases(("offload-cpu", "recompute")) == []


@pytest.mark.parametrize("disk", [(DK,), (DR,), DISK])
@pytest.mark.parametrize("cpu", [(), (OFF,), (OFF, REC_OFF)])
def test_walks_cover_every_variant(disk, cpu):
    from memfit.plan.disk_profile import _measured

    got = {k for w in walks(disk, cpu) for k in _measured(w)}
    need = {(str(x), pf, None if prev is None else str(prev)) for x in (*cpu, *disk) for prev in (None, *disk)
            for pf in ((False, True) if is_disk(x) else (False,)) if is_disk(x) or prev is not None}
    assert need <= got
