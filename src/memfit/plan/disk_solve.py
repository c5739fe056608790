"""The chain DP of memfit.plan.solve with disk offload: exact, read-ahead coupling included.

Block i's backward starts from c0 + F_{i+1} + head nets + g per later block + X, where X is the
restore bytes R_p of a disk block p <= i that a moved block after i has already read ahead (and,
for p = i, the block's own R). So a left-to-right DP needs, besides F, what the last moved block
was: `free` (none, or cpu: a cpu copy's read-ahead allocates nothing on the tracing device),
`owes p` (disk block p, read ahead by a later moved block: every block until that one carries R_p
in backward, the next moved block's stretch is its variant after p), or `closed` (a disk block
read lazily: no moved block may follow). A disk decision branches on being read ahead or not;
`owes` states cannot end the chain. Each (block, state) keeps its Pareto front of (F, time).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from memfit.apply.policy import BlockAction
from memfit.plan.disk_profile import DiskProfile, is_disk
from memfit.plan.solve import Choice, Cost, _grads_per_block, _macro, _shape, _stretches

DiskCost = Callable[[BlockAction, bool], float]
"""disk_cost(disk action, read ahead) -> extra seconds for that block."""

FREE, CLOSED = 0, 1


def _options(dp: DiskProfile, bases: Sequence[BlockAction], n_disk: list[str], max_segment: int) -> list[tuple]:
    """(action, blocks, read ahead, needs state, new state) for every decision the DP may take."""
    base = dp.base
    owes = {k: 2 + j for j, k in enumerate(n_disk)}
    out = []
    for b in bases:
        key = str(b)
        if is_disk(b):
            for s in [FREE, *owes.values()]:
                prev = None if s == FREE else n_disk[s - 2]
                out.append((b, 1, True, s, owes[key], prev))
                out.append((b, 1, False, s, CLOSED, prev))
            continue
        ks = range(1, max_segment + 1) if b.mode == "recompute" and key in base.seg_extra else [1]
        if key not in base.fwd:
            continue
        for k in ks:
            if not b.offload:
                out += [(b, k, False, s, s, None) for s in (FREE, CLOSED, *owes.values())]
                continue
            out.append((b, k, False, FREE, FREE, None))
            if k == 1:
                out += [(b, 1, False, s, FREE, n_disk[s - 2]) for s in owes.values()]
    return out


def _decision(dp: DiskProfile, b: BlockAction, k: int, pf: bool, prev: str | None, i: int, n: int):
    """Forward and backward stretches of a decision at block i (ends included)."""
    if not is_disk(b) and prev is None:
        return _stretches(dp.base, _macro(dp.base, b, k, 0), i, n)
    key = str(b)
    f = dp.fwd[key] if is_disk(b) else dp.base.fwd[key]
    bw = dp.bwd[(key, pf, prev)]
    if i == 0:
        df, db = dp.first[(key, pf)] if is_disk(b) else dp.base.first[key]
        f, bw = f + df, bw + db
    if i == n - 1:
        df, db = dp.last[key] if is_disk(b) else dp.base.last[key]
        f, bw = f + df, bw + db
    return [f], [bw]


def solve_with_disk(dp: DiskProfile, budget: int, bases: Sequence[BlockAction], cost: Cost,
                    disk_cost: DiskCost | None = None, n_blocks: int | None = None, max_segment: int = 16,
                    rounds: int = 4) -> Choice | None:
    """As memfit.plan.solve.solve, over a DiskProfile: checked with its composed peak, the bound
    lowered by any difference (ends, deferred frees) and solved again."""
    n = n_blocks or dp.n_blocks
    bound = budget
    for _ in range(rounds):
        choice = _dp(dp, bound, bases, cost, disk_cost, n, max_segment)
        if choice is None:
            return None
        peak = dp.peak_of(choice.actions)
        if peak <= budget:
            return Choice(choice.actions, peak, choice.time)
        bound -= peak - budget
    return None


def _dp(dp: DiskProfile, budget: int, bases: Sequence[BlockAction], cost: Cost, disk_cost: DiskCost | None,
               n: int, max_segment: int) -> Choice | None:
    """The fastest action list (disk blocks included) whose composed peak fits `budget` on the model."""
    prof = dp.base
    g = _grads_per_block(prof)
    extra = n - prof.traced_blocks
    start = sum(prof.start) + extra * sum(prof.start_per_block)
    pre, post_f, post_b, pre_b, opt = (getattr(prof, p) + prof.per_block[p].scaled(extra)
                                       for p in ("pre_fwd", "post_fwd", "post_bwd", "pre_bwd", "opt"))
    c0 = start + pre.net_bytes
    after = c0 + post_f.net_bytes + post_b.net_bytes + n * g
    if max(start, start + pre.peak_bytes, after + pre_b.peak_bytes, after + pre_b.net_bytes + opt.peak_bytes) > budget:
        return None
    disk = [str(b) for b in bases if is_disk(b)]
    options = _options(dp, bases, disk, max_segment)
    restore = [0, 0] + [dp.restore[d] for d in disk]
    head_net = post_f.net_bytes + post_b.net_bytes
    n_states = 2 + len(disk)
    fronts: list[list] = [[None] * n_states for _ in range(n + 1)]
    pending: list[list[list]] = [[[] for _ in range(n_states)] for _ in range(n + 1)]
    zero = np.zeros(1, np.int64)
    fronts[0][FREE] = (zero, np.zeros(1), zero, zero, zero, zero)
    # Per option, once: its time and the restore bytes its backward starts with (see the module doc).
    fixed = [(disk_cost(b, pf) if (is_disk(b) and disk_cost is not None) else cost(b, k) * k,
              restore[to] if (is_disk(b) and pf) else (restore[need] if not b.offload else 0))
             for b, k, pf, need, to, prev in options]
    shapes: dict[tuple, tuple] = {}
    for i in range(n):
        if i > 0:
            fronts[i] = [_reduce6(p) for p in pending[i]]
        later = budget - c0 - head_net - (n - i) * g
        for o, (b, k, pf, need, to, prev) in enumerate(options):
            front = fronts[i][need]
            if front is None or i + k > n:
                continue
            ckey = (o, i == 0, i + k == n)
            got = shapes.get(ckey)
            if got is None:
                got = shapes[ckey] = _shape(*_decision(dp, b, k, pf, prev, i, n))
            worst_f, delta, worst_b, _ = got
            t, offset = fixed[o]
            # budget - c0 - max(worst_f, delta + head_net + (n - i - k) * g + offset + worst_b)
            limit = min(budget - c0 - worst_f, later + k * g - delta - offset - worst_b)
            F = front[0]
            m = int(F.searchsorted(limit, side="right"))
            if m:
                pending[i + k][to].append((F[:m] + delta, front[1][:m] + t, i, o, need))
    fronts[n] = [_reduce6(p) for p in pending[n]]
    return _best(fronts, options, n, c0, post_f, post_b, budget)


def _reduce6(parts: list[tuple]):
    """Merge candidate rows (F, T, from block, option, from state; a prefix of that state's front each)
    into a Pareto front with back-pointers (solve._reduce, plus the state each row came from)."""
    if not parts:
        return None
    F = np.concatenate([p[0] for p in parts])
    T = np.concatenate([p[1] for p in parts])
    lens = np.fromiter((len(p[0]) for p in parts), np.int64, len(parts))
    meta = np.array([p[2:] for p in parts], np.int64)
    si, op, st = (np.repeat(meta[:, c], lens) for c in range(3))
    sx = np.arange(len(F), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    order = np.lexsort((T, F))
    F, T = F[order], T[order]
    keep = np.empty(len(F), bool)
    keep[0] = True
    keep[1:] = T[1:] < np.minimum.accumulate(T)[:-1]
    order = order[keep]
    return F[keep], T[keep], si[order], sx[order], op[order], st[order]


def _best(fronts, options, n: int, c0: int, post_f, post_b, budget: int) -> Choice | None:
    """The fastest end state (not one still owing a read-ahead) whose head fits; its actions."""
    best = None
    for s in (FREE, CLOSED):
        fr = fronts[n][s]
        if fr is None:
            continue
        F, T = fr[0], fr[1]
        ok = (c0 + F + post_f.peak_bytes <= budget) & (c0 + F + post_f.net_bytes + post_b.peak_bytes <= budget)
        if ok.any():
            j = int(np.flatnonzero(ok)[np.argmin(T[ok])])
            if best is None or T[j] < best[0]:
                best = (float(T[j]), s, j)
    if best is None:
        return None
    t, s, j = best
    decisions, at = [], n
    while at > 0:
        _, _, src_i, src_idx, opt_idx, src_state = fronts[at][s]
        decisions.append(options[int(opt_idx[j])])
        at, j, s = int(src_i[j]), int(src_idx[j]), int(src_state[j])
    acts: list[BlockAction] = []
    for seg_id, (b, k, *_rest) in enumerate(reversed(decisions)):
        acts += _macro(None, b, k, seg_id)
    return Choice(tuple(acts), 0, t)
