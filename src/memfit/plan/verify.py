"""Check a plan on real steps, and plan again with the measured error when it runs over budget.

    opt = plan.apply(model, lr=3e-4)
    plan = memfit.plan.verify.check(plan, model, opt, lambda: my_step(model, opt, batch))

The user's loop may hold more than the planned step (e.g. logits kept alive through backward). The
last of `steps` real steps (steady state: optimizer state exists) is measured with the tracker; if its
peak exceeds the budget, the plan is solved again for the budget lowered by the excess, applied to the
model in place, and the note says so.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from memfit.core.units import format_bytes
from memfit.plan.plan import Plan


def measure(model: nn.Module, opt, step: Callable[[], None], steps: int = 2) -> int:
    from memfit.core.tracker import MemoryTracker

    with MemoryTracker(model, opt) as t:
        for i in range(steps):
            if i == steps - 1:
                t.reset_peak()
            step()
    return t.peak_bytes


def check(plan: Plan, model: nn.Module, opt, step: Callable[[], None], steps: int = 2) -> Plan:
    """`plan`, or a new plan applied in place when the measured peak exceeds the budget."""
    from memfit.plan.fit import fit

    peak = measure(model, opt, step, steps)
    plan.measured_peak = peak
    args = getattr(plan, "fit_args", None)
    if peak <= plan.budget or args is None:
        return plan
    over = peak - plan.budget
    new = fit(**{**args, "budget": f"{plan.budget - over}B"})  # bytes, with their unit
    new.budget = plan.budget
    new.notes.append(f"the first real steps peaked at {format_bytes(peak)}, {format_bytes(over)} over the budget: "
                     f"planned again for {format_bytes(plan.budget - over)}")
    new.install(model)
    new.measured_peak = measure(model, opt, step, 1)
    new.fit_args = args
    return new
