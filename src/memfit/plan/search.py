"""The outer search of memfit.fit: micro-batch x accumulation, optimizer offload, precision."""
from __future__ import annotations

from typing import Any

from memfit.core.units import format_bytes
from memfit.measure.blocks import chain_profile
from memfit.plan.costs import HOST_BW, PlanError, _bases, _block_seconds, _cost, head_cost, measured
from memfit.plan.head import head_counts, head_profile, head_seconds, sums_weight_grad
from memfit.plan.plan import Candidate, Plan
from memfit.plan import disk_plan
from memfit.plan.disk_plan import disk_beaten, disk_cost, solve_any, with_disk
from memfit.plan.disk_profile import DiskProfile, disk_bases
from memfit.plan.accumulate import accumulating
from memfit.plan.host_memory import host_need, offload_masters
from memfit.plan.loop_step import input_bytes
from memfit.plan.trace_check import verify as verify_plan
from memfit.apply.policy import BlockAction, to_string


def _opt_bytes(prof, n: int) -> int:
    extra = n - prof.traced_blocks
    return prof.start[2] + extra * prof.start_per_block[2]


def _state_bytes(prof, n: int, action: BlockAction) -> int:
    """Parameters, gradients and optimizer state as the optimizer step begins (no block action, head
    chunking or micro-batch changes them)."""
    return sum(prof.at_optimizer([action] * n)[:3])


def _configs(problem, allowed, precision):
    micros = [problem.batch]
    if "accumulate" in allowed:
        b = problem.batch
        while b % 2 == 0 and b > 1:
            b //= 2
            micros.append(b)
    offloads = [None] + (["cpu"] if "optimizer-offload" in allowed else [])
    precisions = [precision] + (["bf16-master"] if "precision" in allowed and precision != "bf16-master" else [])
    out = []
    for p, m, o in ((p, m, o) for p in precisions for m in micros for o in offloads):
        out.append((p, m, o, False))
        if _twin(allowed, p, m, o, problem.batch):
            out.append((p, m, o, True))  # right after its twin: solved with it (see search)
    return out


def _twin(allowed, precision: str, micro: int, off, batch: int) -> bool:
    """Whether a configuration has a step-in-backward twin: allowed, one micro-batch per step, no optimizer
    offload, and a precision without master weights or fp16 loss scaling (memfit.apply.step_in_backward)."""
    from memfit.apply.precision import precision_mode

    mode = precision_mode(precision)
    return ("step-in-backward" in allowed and micro == batch and off is None and mode.master_dtype is None
            and not mode.loss_scaling)


MAX_REFUSED = 4  # full-trace checks that may fail before the search gives up


def search(problem, limit: int, allowed: tuple[str, ...], optimizer: str, precision: str, verify: bool) -> Plan:
    """The fastest candidate that fits, checked by a full trace; a candidate the trace refuses (even
    with its block actions solved again for a lower bound) gives way to the next fastest, and once
    none is left the configurations that were not tried yet (smaller micro-batches, optimizer
    offload, another precision) are solved too."""
    bases = _bases(allowed)
    disk = disk_bases(allowed)  # traced on top of the chain profile only when needed (memfit.plan.disk_plan)
    segs = "recompute" in allowed
    rows: list[tuple[Candidate, Any, Any, int]] = []
    configs = iter(_configs(problem, allowed, precision))
    refused: list[str] = []
    floors: dict[str, tuple[int, int]] = {}
    below: list[tuple] = []  # configurations whose floor alone exceeds the budget (traced only for an error)
    open_rows = lambda: [r for r in rows if r[0].feasible and not r[0].refused]  # noqa: E731
    # With offload-cpu allowed, disk kinds are traced only when nothing fits without them (disk_plan's
    # CPU_BEFORE_DISK): in any configuration, not just the one being solved.
    defer_disk = disk_plan.CPU_BEFORE_DISK and any(b.offload == "cpu" for b in bases)
    solved: list[tuple] = []
    while True:
        # Smaller micro-batches, offload and other precisions cost time: solved only while nothing fits.
        for (prec, micro, off, sib), set_aside in ([] if open_rows() else _and_then(configs, below)):
            src = problem.source(micro)
            profile = lambda: chain_profile(src, prec, optimizer, bases=bases, with_segments=segs,  # noqa: E731
                                            step_in_backward=sib)
            twin = not sib and _twin(allowed, prec, micro, off, problem.batch)  # solved next, before any break
            if not set_aside and _over_floor(problem, (prec, sib), optimizer, off, limit, floors, profile):
                below.append((prec, micro, off, sib))
                continue
            prof = profile()
            solved.append((src, prof, (prec, micro, off, sib)))
            rows += _config_rows(problem, src, prof, (prec, micro, off, sib), limit, (bases, disk), optimizer, allowed,
                                 defer_disk)
            if open_rows() and not twin:
                break
        if not open_rows() and defer_disk and disk:
            # Nothing fits without disk offload: now the configurations tried are solved with it too.
            defer_disk = False
            rows = [r for r in rows if r[0].feasible or r[0].host]
            for src, prof, config in solved:
                rows += _config_rows(problem, src, prof, config, limit, (bases, disk), optimizer, allowed, False)
                if open_rows():
                    break
        if not open_rows():
            host = [r[0] for r in rows if r[0].host > getattr(problem, "host_limit", 1 << 62)]
            if host and not refused:
                least = min(host, key=lambda c: c.host)
                raise PlanError(f"no plan fits: those within {format_bytes(limit)} need at least "
                                f"{format_bytes(least.host)} of host memory ({_label(least)}), more than the "
                                f"{format_bytes(problem.host_limit)} there is ({problem.host_source}); give "
                                "--host-memory (host_memory=) or a larger budget")
            if refused:
                raise PlanError(f"no plan fits {format_bytes(limit)} once checked by a full trace; refused: "
                                + "; ".join(refused))
            raise PlanError(_impossible(rows, limit, [*bases, *disk], allowed))
        row = min(open_rows(), key=lambda r: r[0].time)
        try:
            plan = _chosen(problem, limit, row, rows, optimizer, verify, [*bases, *disk])
        except PlanError as exc:
            if len(refused) >= MAX_REFUSED:
                raise
            row[0].refused = True
            refused.append(_label(row[0]) + (f" ({exc})" if "host memory" in str(exc) else ""))
            # rows set aside as slower than the refused one may be the next fastest: solved with disk now
            rows = [r[0].later_disk() if getattr(r[0], "later_disk", None) else r for r in rows]
            continue
        for r in rows:  # (a set-aside row's closure holds its profile: not kept with the plan)
            r[0].__dict__.pop("later_disk", None)
        plan.notes[:0] = [f"refused by the full trace, next fastest tried: {r}" for r in refused]
        plan.ranked += [Candidate(m, problem.batch // m, o, p, 0, 0.0, "", False, step_in_backward=s)
                        for p, m, o, s in below]
        return plan


def _and_then(configs, below: list[tuple]):
    """(configuration, set aside before) not tried yet; once they are spent, those set aside over
    their floor that no other set-aside one undercuts (traced only when nothing else fits, so that the
    error names the smallest need)."""
    for c in configs:
        yield c, False
    for c in _minimal(below):
        yield c, True
    below.clear()


def _minimal(configs: list[tuple]) -> list[tuple]:
    """The configurations (precision, micro-batch, optimizer offload, step in backward) not undercut by
    another of the same precision with a micro-batch no larger, the optimizer state offloaded and the
    step in backward if it is not: less
    activation and no more state never needs more memory, so only these can name the smallest need."""
    def undercut(a, b):
        sib_a, sib_b = len(a) > 3 and a[3], len(b) > 3 and b[3]  # (3-tuples: without the step in backward)
        return (a != b and a[0] == b[0] and b[1] <= a[1] and (b[2] is not None or a[2] is None)
                and (sib_b or not sib_a))
    return [a for a in configs if not any(undercut(a, b) for b in configs)]


def _over_floor(problem, prec: tuple, optimizer: str, off: str | None, limit: int, floors: dict, profile) -> bool:
    """Whether the bytes no block action, head chunking, disk offload or smaller micro-batch changes
    (parameters, gradients and optimizer state as the optimizer step begins, less the optimizer
    state with optimizer offload) exceed the budget: then the configuration cannot fit and is not
    solved. Read once per precision from the configuration's own chain profile (`profile()`), which
    the search needs next anyway unless the floor rules it out (no separate all-keep trace)."""
    if prec not in floors:
        n = problem.source(problem.batch).n_blocks
        keep = profile()
        floors[prec] = (_state_bytes(keep, n, BlockAction("keep")), _opt_bytes(keep, n))
    fixed, opt = floors[prec]
    return fixed - (opt if off else 0) > limit


def _label(c: Candidate) -> str:
    off = ", optimizer offload" if c.offload_optimizer else ""
    head = f", head in {c.head_chunks} chunks" if c.head_chunks else ""
    sib = ", step in backward" if c.step_in_backward else ""
    return f"{c.precision} micro-batch {c.micro_batch} x {c.accumulation}{off}{head}{sib}"


def _chosen(problem, limit: int, row, rows, optimizer: str, verify: bool, all_bases) -> Plan:
    """The plan for one candidate row, checked by a full trace when `verify` (PlanError if refused)."""
    cand, choice, prof, n = row
    composed = prof.compose(list(choice.actions))
    plan = Plan(model=problem.name, budget=limit, actions=list(choice.actions), micro_batch=cand.micro_batch,
                accumulation=cand.accumulation, optimizer=optimizer, precision=cand.precision,
                offload_optimizer=cand.offload_optimizer, predicted_peak=cand.peak, predicted_time=cand.time,
                n_blocks=n, head_chunks=cand.head_chunks, keep_output=getattr(problem, "keep_output", True),
                ranked=[r[0] for r in sorted(rows, key=lambda r: (not r[0].feasible, r[0].time))],
                where=composed.where, device=getattr(problem, "device", "cpu"), host_need=cand.host,
                host_memory=getattr(problem, "host_limit", 0), host_source=getattr(problem, "host_source", ""),
                step_in_backward=cand.step_in_backward)
    if cand.step_in_backward:
        plan.notes.append("step in backward: no global clipping (each parameter is updated as its gradient arrives; "
                          "train with --clip 0), one micro-batch per step")
    base = prof.base if isinstance(prof, DiskProfile) else prof
    relief = _opt_bytes(base, n) if cand.offload_optimizer else 0
    t_block = _problem_cost(problem, getattr(base, "per_micro", base), cand.micro_batch)[1]
    plan.baseline_time = cand.accumulation * 3 * n * t_block
    plan.time_basis = "profile" if getattr(problem, "costs", None) is not None else "flop-model"
    if cand.offload_optimizer:
        plan.notes.append("optimizer offload: peak composed from the device-resident profile minus the optimizer "
                          "state" + (", then checked by a full trace with the state on the host" if verify else ""))
    if verify:
        cost, t_fwd, _, costs = _problem_cost(problem, getattr(base, "per_micro", base), cand.micro_batch)
        bw = getattr(costs, "bandwidth", None)
        dcost = disk_cost(prof, cost, t_fwd, bw) if isinstance(prof, DiskProfile) else None
        masters = offload_masters(base, n, cand.precision) if cand.offload_optimizer else 0
        verify_plan(problem, plan, prof, all_bases, cost, dcost, relief, relief + masters)
    return plan


def _problem_cost(problem, prof, micro: int) -> tuple:
    """(cost per block action, seconds of one block's forward, FLOP-model speed factor, measured costs)."""
    t_fwd, t_sel, seg, speed = _block_seconds(prof, problem.tokens(micro)), None, None, 1.0
    costs = getattr(problem, "costs", None)
    if costs is not None:  # measured on this machine (memfit profile), scaled to this micro-batch
        flop_fwd = t_fwd
        t_fwd, t_sel, seg = measured(costs, micro / problem.batch, flop_fwd)
        speed = t_fwd / max(flop_fwd, 1e-12)
    return _cost(t_fwd, t_sel, prof, getattr(costs, "bandwidth", None), seg), t_fwd, speed, costs


def _config_rows(problem, src, prof, config, limit: int, bases, optimizer: str, allowed,
                 defer_disk: bool = False) -> list[tuple]:
    """One configuration solved with the plain head and, where allowed, with the head in chunks:
    fewest chunks first, while more chunks still make the plan faster (or make it fit at all)."""
    prec, micro, off, sib = config
    bases, disk = bases
    disk = [] if sib else disk  # disk kinds are traced without the step in backward: not planned with it
    n = src.n_blocks
    tokens = problem.tokens(micro)
    _, t_fwd, speed, costs = _problem_cost(problem, prof, micro)
    bw = getattr(costs, "bandwidth", None)
    relief = _opt_bytes(prof, n) if off else 0
    accum = problem.batch // micro
    device = getattr(problem, "device", "cpu")
    opt_host = relief + (offload_masters(prof, n, prec) if off else 0)
    adjust = later_micro_batch(problem, micro, accum)

    host_limit = getattr(problem, "host_limit", 1 << 62)

    def row(chunks: int | None, p, allowed_bases=bases, defer: bool = False, beat: float = float("inf")) -> tuple:
        cost = _problem_cost(problem, p, micro)[0]
        choice = solve_any(adjust(p), limit + relief, allowed_bases, cost, n_blocks=n, max_segment=min(n, 16))
        if defer and choice is None and disk and not defer_disk:  # set aside: see DEFER_PLAIN_DISK
            cand = Candidate(micro, accum, off, prec, 0, 0.0, "", False, chunks, step_in_backward=sib)
            cand.later_disk = lambda: row(chunks, p, allowed_bases)  # (not a field: plans do not carry it)
            return cand, None, adjust(p), n
        head = head_cost(costs, micro / problem.batch, chunks, lambda k: head_seconds(src, tokens, k, speed, prec, device),
                         sums_weight_grad(src, tokens, prec, device)) if chunks else 0.0
        kinds, later = [] if defer_disk else disk, None
        room = (beat - 2 * relief / HOST_BW) / accum - 3 * n * t_fwd - head  # block seconds of a row faster than `beat`
        if kinds and BOUND_ROW_DISK and choice is not None and room < choice.time and disk_beaten(
                src, p, adjust, limit + relief, allowed_bases, kinds, cost, n, room, bw, prec, optimizer):
            # no disk plan makes this row faster than `beat` (a row before it): solved without the disk
            # kinds, which are traced for it only if the chosen plan is refused (`later_disk`, as above)
            kinds, later = [], lambda p0=p: row(chunks, p0, allowed_bases)
        choice, p, _ = with_disk(src, p, choice, limit + relief, allowed_bases, kinds, cost, t_fwd, bw, prec, optimizer, n,
                                 adjust)
        if choice is None:
            return Candidate(micro, accum, off, prec, 0, 0.0, "", False, chunks, step_in_backward=sib), None, p, n
        host = host_need(p, choice.actions, choice.peak, opt_host, device)
        if host > host_limit:  # without cpu-offloaded activations, or not at all
            if any(b.offload == "cpu" for b in allowed_bases):
                return row(chunks, p, [b for b in allowed_bases if b.offload != "cpu"])
            return Candidate(micro, accum, off, prec, choice.peak - relief, 0.0, to_string(choice.actions), False,
                             chunks, host=host, step_in_backward=sib), None, p, n
        time = accum * (3 * n * t_fwd + choice.time + head) + 2 * relief / HOST_BW
        cand = Candidate(micro, accum, off, prec, choice.peak - relief, time, to_string(choice.actions), True,
                         chunks, host=host, step_in_backward=sib)
        if later is not None:
            cand.later_disk = later
        return cand, choice, p, n

    counts = _measured_counts(head_counts(src), costs) if "chunked-head" in allowed else []
    out = [row(None, prof, defer=bool(counts) and DEFER_PLAIN_DISK)]
    later = getattr(out[0][0], "later_disk", None)
    if not counts or (out[0][1] is not None and out[0][1].time == 0):
        return out  # (a plan that keeps everything cannot get faster with the head in chunks)
    best = out[0][0].time if out[0][0].feasible else float("inf")
    for i, k in enumerate(counts):  # (profiles are cached: the most chunks' is not traced twice)
        r = row(k, head_profile(src, prof, k, prec, optimizer, sib), beat=best)
        out.append(r)
        if r[0].feasible:
            if later is not None:
                # the plain head's disk plan, set aside, must be slower than this row (else it is traced now)
                tau = (r[0].time - 2 * relief / HOST_BW) / accum - 3 * n * t_fwd  # its actions' and head's
                cost = _problem_cost(problem, prof, micro)[0]
                if not disk_beaten(src, prof, adjust, limit + relief, bases, disk, cost, n, tau, bw, prec, optimizer):
                    out[0], later = later(), None  # as without deferral from here on
                    best = out[0][0].time if out[0][0].feasible else float("inf")
            if r[0].time >= best:
                return _settled(out, later)
            best = r[0].time
        elif i == 0 and len(counts) > 1:  # if the most chunks do not fit, fewer will not: trace no others
            # (probed only once the fewest do not fit: where they do, as usually, the probe is a trace spent)
            most = row(counts[-1], head_profile(src, prof, counts[-1], prec, optimizer, sib))
            if not most[0].feasible:
                return _settled(out + [most], later)
    return _settled(out, later)


BOUND_ROW_DISK = True
"""A row with the head in more chunks is solved with disk kinds only where `cannot_beat` leaves a disk plan
that could make it faster than the row before it (the loop stops at a row no faster, and the search takes
the fastest row, the earlier on a tie); False: as any row (the same plan chosen, the disk kinds traced)."""
DEFER_PLAIN_DISK = True
"""The plain head's row, when nothing fits it without disk kinds, is solved with them only once a row
with the head in chunks might be slower than its disk plan (`cannot_beat`); False: at once (the same plan,
the disk kinds traced)."""


def _settled(out: list, later) -> list:
    """The rows, the plain head's traced with disk kinds when no other row fits (as without deferral); a
    row still set aside keeps how to trace it (`later_disk`: the search calls it if the chosen plan is
    refused, so that the next fastest is the same as without deferral)."""
    if later is None:
        return out
    if not any(r[0].feasible for r in out[1:]):
        return [later(), *out[1:]]
    return out


def _measured_counts(counts: list[int], costs) -> list[int]:
    """With a measured profile, chunk counts from the one it timed up: the head model extrapolates
    upward well (each chunk rereads the head weight) but not downward, where fewer, larger chunks
    fault in larger scratch buffers (HF Llama's head measured +0.23 s at 2 chunks, +0.11 s at 8)."""
    got = getattr(costs, "head_s", None) if costs is not None else None
    if not got:
        return counts
    k0 = min(int(k) for k in got)
    return [k for k in counts if k >= k0] or counts[-1:]


def later_micro_batch(problem, micro: int, accum: int):
    """profile -> the profile the solver bounds: with accumulation, a later micro-batch's (gradients
    held, and under memfit train the step's other micro-batches on the device); else the profile."""
    if accum <= 1:
        return lambda p: p
    ahead = (accum - 1) * input_bytes(problem, micro) if problem.spec is not None else 0
    return lambda p: accumulating(p, ahead)


def _impossible(rows, limit: int, bases, allowed) -> str:
    """The smallest budget that would fit (over the configurations tried) and what dominates it."""
    best = None
    for cand, _, prof, n in rows:
        lo, hi = 0, prof.peak_of([bases[0]] * n) if n else 0
        cost = lambda b, k: 0.0  # noqa: E731  (only feasibility matters here)
        if solve_any(prof, hi, bases, cost, n_blocks=n) is None:
            continue
        while hi - lo > max(1, hi // 1000):
            mid = (lo + hi) // 2
            if solve_any(prof, mid, bases, cost, n_blocks=n, rounds=2) is None:
                lo = mid
            else:
                hi = mid
        relief = _opt_bytes(prof, n) if cand.offload_optimizer else 0
        need = hi - relief
        fixed = _state_bytes(prof, n, bases[0]) - relief
        if best is None or need < best[0]:
            at = solve_any(prof, hi, bases, cost, n_blocks=n)
            best = (need, fixed, prof.compose(at.actions).where if at is not None else "", cand)
    if best is None:
        return f"no configuration fits {format_bytes(limit)}"
    need, fixed, where, cand = best
    if fixed * 2 >= need:
        return (f"budget {format_bytes(limit)} is too small: the smallest plan needs {format_bytes(need)}; "
                f"parameters, gradients and optimizer state alone need {format_bytes(fixed)} "
                f"({_label(cand)}); {_floor_hint(allowed, cand)}")
    if where.startswith("head") and "chunked-head" not in allowed:
        return (f"budget {format_bytes(limit)} is too small: the smallest plan needs {format_bytes(need)} "
                f"(the LM head's logits dominate, at {where}: allow chunked-head, or a smaller --batch)")
    return (f"budget {format_bytes(limit)} is too small: the smallest plan needs {format_bytes(need)} "
            f"(activations dominate: allow recompute, or a smaller --batch)")


def _floor_hint(allowed, cand: Candidate) -> str:
    hint = []
    if "optimizer-offload" not in allowed:
        hint.append("allow optimizer offload")
    if cand.precision != "bf16-master":
        hint.append("a 16-bit master mode (--precision bf16-master)")
    if "step-in-backward" not in allowed and _twin(("step-in-backward",), cand.precision, 1, None, 1):
        hint.append("allow step-in-backward (no gradient buffer, no global clipping)")
    if not hint:  # what is left on the device is the weights and gradients themselves
        hint.append("shard them over more devices (memfit train --nproc N --strategy zero3) or train a smaller model")
    return " or ".join(hint)
