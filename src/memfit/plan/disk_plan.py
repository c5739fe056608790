"""Disk offload in memfit.fit's search: when to trace the disk kinds, their time, and the solve.

The disk kinds cost extra short traces (memfit.plan.disk_profile), so they are traced only when the
plan without them does not fit or costs time (a plan that keeps everything cannot get faster).
Time model: a disk block writes its restore bytes R in forward and reads them back in backward, at
the measured spill-file rate (memfit profile's "disk": write + read bytes per second, so one
direction takes R / rate). A block read ahead by a later moved block has at least that block's
backward (about two forwards) to hide its read in; a block read lazily waits for all of it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from memfit.apply.policy import BlockAction
from memfit.plan.costs import DISK_BW, HOOK_S
from memfit.plan.disk_profile import DiskProfile, disk_profile, is_disk, restore_bytes
from memfit.plan.disk_solve import solve_with_disk
from memfit.plan.solve import Choice, Cost, solve


CPU_BEFORE_DISK = True
"""With offload-cpu allowed, a plan that fits without disk kinds is taken without tracing them (about
10 short traces). Each disk kind has a cpu counterpart that takes the same blocks off the device and,
in every list tried (docs/planner.md), never holds more device bytes; it is not a proof, and the time
model can price a disk kind below its cpu one (measured rates, or a recomputed block whose input is
all it moves), so this is a choice: host memory is the planner's to spend when it is allowed."""


def _has_cpu(bases: Sequence[BlockAction]) -> bool:
    return any(b.offload == "cpu" for b in bases)


def disk_cost(dp: DiskProfile, cost: Cost, t_fwd: float, bandwidth: dict[str, float] | None = None):
    """disk_cost(action, read ahead) -> extra seconds: the mode's own cost plus the spill traffic."""
    rate = (bandwidth or {}).get("disk", DISK_BW)

    def f(b: BlockAction, pf: bool) -> float:
        one_way = dp.restore[str(b)] / rate
        read = max(0.0, one_way - 2 * t_fwd) if pf else one_way
        return cost(BlockAction(b.mode), 1) + HOOK_S + one_way + read

    return f


BOUND_DISK = True
"""Skip the disk kinds' traces where `cannot_beat` shows they cannot give a faster plan (False: always
traced where the plan without them costs time; the plan is the same either way)."""
DISK_BOUND_STEPS = 8
"""Budgets the no-disk solver is asked at to bound what disk kinds could gain (`cannot_beat`)."""


def cannot_beat(prof: Any, limit: int, bases: Sequence[BlockAction], cost: Cost, n: int, tau: float,
                bandwidth: dict[str, float] | None = None, disk: Sequence[BlockAction] = (),
                restore: dict[str, int] | None = None) -> bool:
    """Whether every plan with disk kinds under `limit` takes more than `tau` extra seconds, by the solver
    alone (no disk trace). Take such a plan P and P' = P with each disk block its plain mode. A disk
    block costs its mode's time plus HOOK_S plus its restore bytes R over the disk rate at least
    (`disk_cost`), and moving R bytes to disk lowers no point of the step by more than R, so P' fits
    limit + sum(R) and t(P) >= t(P') + sum(R) / rate + HOOK_S. With x = sum(R) in [x_j-1, x_j] that is at
    least T(limit + x_j) + x_j-1 / rate + HOOK_S, T(b) the no-disk optimum under b (the exact solver,
    which is no faster under less); beyond x = tau * rate the disk traffic alone exceeds tau.
    `disk`: the disk kinds the plans may take. P has at least one disk block, a single block, so P' has
    at least one single block in a disk kind's plain mode (keep, or recompute): T is then the optimum of
    such lists alone (solve's `must`), never below the unrestricted one (a list of selective blocks
    that fits limit + x is no P' of any disk plan). Without `disk`: the unrestricted optimum.
    `restore`: R per disk kind (`restore_bytes`, the DiskProfile's own). Then x >= r, the least R, and,
    with no cpu kind in `bases`, the last moved block is a disk block read lazily (the disk solver's
    read-ahead states cannot end the chain), whose read-back costs R / rate once more (`disk_cost`):
    t(P) >= T(limit + x_j) + max(x_j-1, r) / rate + r / rate + HOOK_S."""
    if tau < HOOK_S:
        return True
    rate = (bandwidth or {}).get("disk", DISK_BW)
    must = sorted({BlockAction(d.mode) for d in disk if is_disk(d)}, key=str)
    plain = [b for b in bases if not is_disk(b)]
    plain += [m for m in must if m not in plain]  # (P' may take them even where the plan's bases do not)
    least = min((restore[str(d)] for d in disk if is_disk(d)), default=0) if restore else 0
    lazy = least if restore and not _has_cpu(plain) else 0
    step = tau * rate / DISK_BOUND_STEPS
    for j in range(1, DISK_BOUND_STEPS + 1):
        if j * step < least:
            continue  # no disk plan moves this little
        got = solve(prof, limit + int(j * step) + 1, plain, cost, n_blocks=n, max_segment=min(n, 16), must=must)
        if got is not None and got.time + (max((j - 1) * step, least) + lazy) / rate + HOOK_S <= tau * (1 + 1e-9):
            return False
    return True


RESTORE_BOUND = True
"""Where `cannot_beat` alone cannot rule disk kinds out, bound again with their restore bytes (two short
traces per kind, shared with the disk profile) before tracing the disk profile (about ten more); False:
the disk profile at once (the same plan)."""


def disk_beaten(src, prof: Any, adjust: Callable[[Any], Any], limit: int, bases: Sequence[BlockAction],
                disk: Sequence[BlockAction], cost: Cost, n: int, tau: float, bandwidth, precision: str,
                optimizer: str) -> bool:
    """`cannot_beat` on adjust(prof) (the solver's profile), then, where it cannot tell, with the disk
    kinds' restore bytes."""
    if cannot_beat(adjust(prof), limit, bases, cost, n, tau, bandwidth, disk):
        return True
    if not RESTORE_BOUND or not disk or tau < HOOK_S:
        return False
    restore = restore_bytes(src, getattr(prof, "unchunked", prof), disk, precision, optimizer)
    return cannot_beat(adjust(prof), limit, bases, cost, n, tau, bandwidth, disk, restore)


def solve_any(prof: Any, budget: int, bases: Sequence[BlockAction], cost: Cost, n_blocks: int | None = None,
              max_segment: int = 16, rounds: int = 4, dcost: Any = None) -> Choice | None:
    """memfit.plan.solve.solve, or the disk solver when `prof` is a DiskProfile."""
    if isinstance(prof, DiskProfile):
        return solve_with_disk(prof, budget, bases, cost, dcost, n_blocks, max_segment, rounds)
    return solve(prof, budget, [b for b in bases if not is_disk(b)], cost, n_blocks=n_blocks,
                 max_segment=max_segment, rounds=rounds)


def with_disk(src, prof, choice: Choice | None, limit: int, bases: Sequence[BlockAction],
              disk: Sequence[BlockAction], cost: Cost, t_fwd: float, bandwidth, precision: str, optimizer: str,
              n: int, adjust: Callable[[Any], Any] = lambda p: p) -> tuple[Choice | None, Any, Any]:
    """The better of `choice` (no disk) and the best plan with disk kinds: (choice, profile, disk cost).
    With cpu offload allowed, disk kinds are traced only when nothing fits without them (see
    CPU_BEFORE_DISK). `adjust`: what the solver bounds instead of a profile (memfit.plan.accumulate);
    `choice` was solved on adjust(prof), and the profile returned is adjusted."""
    if not disk or (choice is not None and (choice.time == 0 or (CPU_BEFORE_DISK and _has_cpu(bases)))):
        return choice, adjust(prof), None
    if BOUND_DISK and choice is not None and disk_beaten(src, prof, adjust, limit, bases, disk, cost, n, choice.time,
                                                         bandwidth, precision, optimizer):
        return choice, adjust(prof), None  # no disk plan can be faster: the disk kinds are not traced
    dp = adjust(disk_profile(src, prof, disk, precision, optimizer))
    dcost = disk_cost(dp, cost, t_fwd, bandwidth)
    got = solve_with_disk(dp, limit, [*bases, *disk], cost, dcost, n, min(n, 16))
    if got is not None and (choice is None or got.time < choice.time):
        return got, dp, dcost
    return choice, (adjust(prof) if choice is not None else dp), (None if choice is not None else dcost)
