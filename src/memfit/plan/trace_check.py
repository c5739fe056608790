"""The single-device plan's full-trace check: the chosen step traced whole, and solved again when the
trace finds it over the budget (device bytes) or over the host memory.

The composed figures can miss: the device peak by what the chain profile does not see, the host
need by what the offload mechanisms hold beyond the composed offloaded bytes. Each miss the trace
shows tightens that constraint by as much, and the block actions are solved again: a device miss
lowers the solver's bound, a host miss lowers the room the composed host need may take (the solver
then drops the cpu-offloaded activations, the only host bytes block actions decide). It ends in a
plan whose trace fits both, or in a one-line PlanError.
"""
from __future__ import annotations

from typing import Any

from memfit.core.units import format_bytes
from memfit.plan.costs import PlanError
from memfit.plan.disk_plan import solve_any
from memfit.plan.host_memory import host_need
from memfit.plan.loop_step import traced
from memfit.plan.plan import Plan

ROUNDS = 3
"""Traces of one candidate before it is refused (each re-solve tightens a constraint by a traced miss)."""


def _trace_peak(problem, plan: Plan) -> int:
    """The chosen step's peak from a full trace on the device it will run on, as the loop runs it
    (memfit.plan.loop_step: two micro-batches when it accumulates, the output kept or dropped). Its
    host need (the trace's host bytes, plus the peak on a CPU device, one RAM) goes to plan.host_need."""
    peak, host = traced(problem, plan)
    plan.host_need = host + (peak if plan.device == "cpu" else 0)
    return peak


def _resolve(prof, bound: int, bases, cost, dcost, n: int, room: int, opt_host: int, device: str):
    """(choice, its composed host need) for the device bound, its composed host need within `room`: with
    every kind, else without cpu-offloaded activations, whose choice is taken even over the room (its
    trace then says what the plan needs). (None, 0) when nothing fits the device bound; (None, need)
    when only cpu-offloaded activations fit it, beyond the room."""
    choice = solve_any(prof, bound, bases, cost, n_blocks=n, max_segment=min(n, 16), dcost=dcost)
    need = host_need(prof, choice.actions, choice.peak, opt_host, device) if choice is not None else 0
    cpu_free = [b for b in bases if b.offload != "cpu"]
    if choice is None or need <= room or len(cpu_free) == len(bases):
        return choice, need
    alone = solve_any(prof, bound, cpu_free, cost, n_blocks=n, max_segment=min(n, 16), dcost=dcost)
    if alone is None:
        return None, need
    return alone, host_need(prof, alone.actions, alone.peak, opt_host, device)


def verify(problem, plan: Plan, prof, bases, cost, dcost=None, relief: int = 0, opt_host: int = 0) -> None:
    """A full trace of the chosen step; while it exceeds the budget or the host memory, solve again with
    that constraint tightened by the miss. relief: the optimizer state an optimizer-offload plan keeps on
    the host (its profile holds it on the device); opt_host: all the host bytes its optimizer keeps."""
    bound = plan.budget + relief
    limit = getattr(problem, "host_limit", 1 << 62)
    room = limit  # what the composed host need may take
    host_missed = False
    for _ in range(ROUNDS):
        composed = plan.host_need
        peak = _trace_peak(problem, plan)
        plan.measured_peak = peak
        over, host_over = peak - plan.budget, plan.host_need - limit
        if over <= 0 and host_over <= 0:
            return
        if host_over > 0 and not any(a.offload == "cpu" for a in plan.actions):
            raise PlanError(f"the full trace needs {format_bytes(plan.host_need)} of host memory with no activations "
                            f"offloaded, more than the {format_bytes(limit)} there is ({problem.host_source})")
        if over > 0:
            # The composed figure missed by traced - predicted (more than `over` when it was under the budget):
            # the next solve's figure must leave that much room, or it picks the same actions again.
            bound = min(bound - over, plan.budget + relief - (peak - plan.predicted_peak))
            plan.notes.append(f"the full trace found {format_bytes(peak)}, {format_bytes(over)} over the composed "
                              "figure's budget: solved again with the bound lowered by that much")
        if host_over > 0:
            host_missed = True
            room = min(room - host_over, limit - max(0, plan.host_need - composed))
            plan.notes.append(f"the full trace needs {format_bytes(plan.host_need)} of host memory, "
                              f"{format_bytes(host_over)} over the {format_bytes(limit)} there is: solved again with "
                              "the composed host need held that much lower")
        choice, host = _resolve(prof, bound, bases, cost, dcost, plan.n_blocks, room, opt_host, plan.device)
        if choice is None and host:
            raise PlanError(f"no plan fits {format_bytes(plan.budget)} within {format_bytes(limit)} of host memory "
                            f"once checked by a full trace: the plan that fits needs about "
                            f"{format_bytes(host + limit - room)} of host memory ({problem.host_source})")
        if choice is None:
            raise PlanError(f"no plan fits {format_bytes(plan.budget)} once checked by a full trace")
        plan.actions, plan.predicted_peak, plan.host_need = list(choice.actions), choice.peak - relief, host
    within = f" and {format_bytes(limit)} of host memory" if host_missed else ""
    raise PlanError(f"no plan fits {format_bytes(plan.budget)}{within} once checked by a full trace")
