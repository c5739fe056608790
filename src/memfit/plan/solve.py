"""Choose every block's action: least predicted time with the predicted peak under a budget. Exact.

The step's live bytes along a chain (memfit.measure.compose) are: a constant, plus F_i = what the
blocks before i saved (the sum of their forward nets), plus the current stretch's excursion. In
backward, block i starts from the constant + F_{i+1} + the gradients of the blocks after it
(forward net + backward net = the block's gradients, whatever it saved). So every constraint of the
step is a bound on F at some block, and a dynamic program over the chain whose state is F is exact:
a state with less saved and less time dominates, so each prefix keeps only its Pareto front of
(saved bytes, time). A decision is one block's action, or a recomputed segment of n blocks (whose
recomputation happens in its last block's backward). `solve` checks its answer with
`ChainProfile.compose`; where the profile departs from that additive shape (first and last block,
autocast caches) it tightens the bound by the difference and solves again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from memfit.apply.policy import BlockAction
from memfit.measure.compose import ChainProfile, base_of
from memfit.measure.timeline import Stretch


@dataclass(frozen=True)
class Choice:
    actions: tuple[BlockAction, ...]
    peak: int
    time: float
    """Predicted extra seconds per step over keeping everything (recompute, offload, compression)."""


Cost = Callable[[BlockAction, int], float]
"""cost(base action, n blocks in its segment) -> extra seconds for ONE block of it."""


def _macro(prof: ChainProfile, base: BlockAction, n: int, seg_id: int) -> list[BlockAction]:
    if n == 1:
        return [base]
    return [replace(base, segment=seg_id)] * n


def solve(prof: ChainProfile, budget: int, bases: Sequence[BlockAction], cost: Cost, n_blocks: int | None = None,
          max_segment: int = 16, rounds: int = 4, must: Sequence[BlockAction] = ()) -> Choice | None:
    """The fastest action list whose composed peak fits `budget` (None if none does). `must`: only lists
    in which at least one block, alone (not in a segment), takes one of these actions (a lower bound's
    restricted optimum: memfit.plan.disk_plan.cannot_beat)."""
    n = n_blocks or prof.n_blocks
    bound = budget
    for _ in range(rounds):
        choice = _dp(prof, bound, bases, cost, n, max_segment, tuple(must))
        if choice is None:
            return None
        peak = prof.peak_of(choice.actions)
        if peak <= budget:
            return Choice(choice.actions, peak, choice.time)
        bound -= peak - budget
    return None


def _dp(prof: ChainProfile, budget: int, bases: Sequence[BlockAction], cost: Cost, n: int,
        max_segment: int, must: tuple[BlockAction, ...] = ()) -> Choice | None:
    g = _grads_per_block(prof)
    # Live bytes at the step's start and the constant parts, with the all-keep chain as the reference.
    start = sum(prof.start) + (n - prof.traced_blocks) * sum(prof.start_per_block)
    extra = n - prof.traced_blocks

    def part(name: str) -> Stretch:
        return getattr(prof, name) + prof.per_block[name].scaled(extra)

    pre, post_f, post_b, pre_b, opt = (part(p) for p in ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt"))
    c0 = start + pre.net_bytes  # live bytes when block 0's forward starts, before anything is saved
    after = c0 + post_f.net_bytes + post_b.net_bytes + n * g  # backward done: nothing saved is left
    if max(start, start + pre.peak_bytes, after + pre_b.peak_bytes, after + pre_b.net_bytes + opt.peak_bytes) > budget:
        return None
    # After the chain: head forward/backward, then backward of blocks, pre-backward and optimizer,
    # whose bases no longer depend on the choice (all saved bytes are freed by then).
    options: list[tuple[BlockAction, int]] = []
    for b in bases:
        if b.mode == "recompute" and str(b) in prof.seg_extra:
            options += [(b, k) for k in range(1, max_segment + 1)]
        elif str(b) in prof.fwd:
            options.append((b, 1))
    # Every decision (an action, or a segment of k blocks) at block i is feasible iff F <= its
    # threshold, and moves F by its forward nets: the DP only compares integers. Each front is a
    # Pareto set (F ascending, time strictly descending) held in numpy arrays, with back-pointers.
    # With `must`, a state also says whether a `must` block was taken yet (1; without `must`, always
    # 1): fronts are kept per flag, and only flag 1 may end the chain.
    head_net = post_f.net_bytes + post_b.net_bytes
    need = {o for o, (b, k) in enumerate(options) if k == 1 and b in must}
    pending: list[dict[int, list[tuple]]] = [{0: [], 1: []} for _ in range(n + 1)]
    fronts: list[dict[int, tuple]] = [{} for _ in range(n + 1)]
    zero = np.zeros(1, np.int64)
    fronts[0] = {0 if must else 1: (zero, np.zeros(1), zero, zero, zero, zero)}
    shapes: dict[tuple, tuple[int, int, int, int]] = {}
    for i in range(n):
        if i > 0:
            fronts[i] = {f: r for f, parts in pending[i].items() if (r := _reduce(parts)) is not None}
            pending[i] = {}
        for flag, (F, T, *_) in fronts[i].items():
            for o, (b, k) in enumerate(options):
                if i + k > n:
                    continue
                ckey = (b, k, i == 0, i + k == n)
                got = shapes.get(ckey)
                if got is None:  # a decision's stretches depend on its position only at the chain's ends
                    got = shapes[ckey] = _shape(*_stretches(prof, _macro(prof, b, k, 0), i, n))
                limit, delta = _threshold_fast(got, c0, i, k, n, g, budget, head_net)
                m = int(np.searchsorted(F, limit, side="right"))
                if m:
                    pending[i + k][1 if flag or o in need else 0].append(
                        (F[:m] + delta, T[:m] + cost(b, k) * k, np.full(m, i, np.int64), np.arange(m, dtype=np.int64),
                         np.full(m, o, np.int64), np.full(m, flag, np.int64)))
    last = _reduce(pending[n][1])
    if last is None:
        return None
    fronts[n] = {1: last}
    F, T = last[0], last[1]
    head_base = c0 + F
    ok = (head_base + post_f.peak_bytes <= budget) & (head_base + post_f.net_bytes + post_b.peak_bytes <= budget)
    if not ok.any():
        return None
    j = int(np.flatnonzero(ok)[np.argmin(T[ok])])
    best_t = float(T[j])
    decisions, at, flag = [], n, 1
    while at > 0:
        _, _, src_i, src_idx, opt_idx, src_flag = fronts[at][flag]
        decisions.append(options[int(opt_idx[j])])
        at, j, flag = int(src_i[j]), int(src_idx[j]), int(src_flag[j])
    acts: list[BlockAction] = []
    for seg_id, (b, k) in enumerate(reversed(decisions)):
        acts += _macro(prof, b, k, seg_id)
    return Choice(tuple(acts), 0, best_t)


def _reduce(parts: list[tuple]) -> tuple | None:
    """Merge candidate states into a Pareto front: F ascending, each state strictly faster than every
    state with less F (of equal F, the fastest)."""
    if not parts:
        return None
    F, T, *rest = (np.concatenate(c) for c in zip(*parts))
    order = np.lexsort((T, F))
    F, T = F[order], T[order]
    keep = np.empty(len(F), bool)
    keep[0] = True
    keep[1:] = T[1:] < np.minimum.accumulate(T)[:-1]
    order = order[keep]
    return (F[keep], T[keep], *(r[order] for r in rest))


def _stretches(prof: ChainProfile, acts: list[BlockAction], i: int, n: int) -> tuple[list[Stretch], list[Stretch]]:
    """Forward and backward stretches of blocks i .. i+len(acts)-1, with first/last corrections."""
    kinds, f, b = prof.keys(acts)
    f, b = list(f), list(b)
    if i == 0:
        df, db = prof.first[kinds[0]]
        f[0], b[0] = f[0] + df, b[0] + db
    if i + len(acts) == n:
        df, db = prof.last[kinds[-1]]
        f[-1], b[-1] = f[-1] + df, b[-1] + db
    return f, b


def _grads_per_block(prof: ChainProfile) -> int:
    k = "keep"
    return prof.fwd[k].net_bytes + prof.bwd[k].net_bytes


def _shape(f, bw) -> tuple[int, int, int, int]:
    """(worst forward excursion, forward delta, worst backward excursion over its own start, bwd net)."""
    run, worst_f = 0, -(1 << 62)
    for s in f:
        worst_f = max(worst_f, run + s.peak_bytes)
        run += s.net_bytes
    base, worst_b = 0, -(1 << 62)
    for b in reversed(bw):
        worst_b = max(worst_b, base + b.peak_bytes)
        base += b.net_bytes
    return worst_f, run, worst_b, base


def _threshold_fast(shape, c0: int, i: int, k: int, n: int, g: int, budget: int, head_net: int) -> tuple[int, int]:
    worst_f, delta, worst_b, _ = shape
    worst = max(worst_f, delta + head_net + (n - i - k) * g + worst_b)
    return budget - c0 - worst, delta


