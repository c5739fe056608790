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
from memfit.plan.disk_profile import DiskProfile, disk_profile, is_disk
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
    dp = adjust(disk_profile(src, prof, disk, precision, optimizer))
    dcost = disk_cost(dp, cost, t_fwd, bandwidth)
    got = solve_with_disk(dp, limit, [*bases, *disk], cost, dcost, n, min(n, 16))
    if got is not None and (choice is None or got.time < choice.time):
        return got, dp, dcost
    return choice, (adjust(prof) if choice is not None else dp), (None if choice is not None else dcost)
