"""Rank-side probes of memfit.plan.cluster_host's loopback measurement: what the ranks of
`memfit train --nproc N` pay on this machine beside their FLOPs, timed on 2 gloo ranks.

    times = schedule_times(rank, world)         # pipeline schedules at several micro-batch counts
    per_mb = microbatch_s(times, latency_s)     # {"gpipe": s, "1f1b": s}
    share = core_share(sharing_times(rank, world), world, cores)

The pipeline schedules. torch.distributed.pipelining pays, per micro-batch and stage, beside the
stage's own forward and backward: the P2P send and receive through gloo, the receive buffers, an
autograd.backward call per micro-batch and the schedule's Python. On a GPU that hides under the
compute; on this CPU it is milliseconds, and a FLOP model cannot see it (more micro-batches only
shrink its bubble). The probe runs memfit's own PipelineOptimizer (the schedules `memfit train
--strategy pipeline` runs) on a GPT whose FLOPs are negligible, at each of MICROBATCHES
micro-batches of one sequence, beside a plain forward and backward of the rank's stage at one
sequence. The slope of the schedule's seconds over the micro-batch count is one micro-batch of the
slowest stage; less the plain stage (the time model counts a stage's own work from its FLOPs and
fixed cost per block) and the link's latency (counted per micro-batch beside the P2P bytes), it is
the schedule's fixed cost.

The cores. The compute rate is calibrated in one process; ranks that compute at once share the
cores with whatever else runs here (Linux's scheduler shares a busy machine between sessions first,
and memfit's launcher starts each rank in a session of its own, so the probe's ranks take one each
too). The probe times a small GPT's forward and backward on each rank alone (the other waiting) and
on both at once: two ranks' throughput together over one's alone is the cores they get between
them, out of the min(2, cores) they would get on an idle machine.

Every timing is interleaved (rounds that run each function in turn, so a load that changes during
the probe falls on all alike) and bracketed by barriers (both ranks time the same span).
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (2, 8)
"""Micro-batch counts timed (1F1B needs at least one per stage); the slope is fitted through them."""
MODEL = "llama:layers=2,hidden=16,heads=2,kv_heads=1,ffn=32,vocab=16"
"""One block a stage, 16 wide: the FLOPs are negligible beside the schedule's fixed cost."""
SEQ = 8
ROUNDS = 8
CALLS = 3
"""Calls a timed batch: one preemption of a loaded machine spoils one batch, and the median drops it."""
SHARING_MODEL = "llama:layers=2,hidden=128,heads=2,kv_heads=1,ffn=384,vocab=128"
"""The sharing probe's work: a small GPT's forward and backward at SHARING_ROWS sequences of SEQ_SHARING,
the mix of matmuls and small ops a rank's step is (a bare matmul loop shares a core differently)."""
SHARING_ROWS, SEQ_SHARING = 2, 64


def interleaved(fns: dict, rounds: int = ROUNDS, calls: int = CALLS) -> dict[str, float]:
    """Median seconds of one call of each function over `rounds` rounds (a warm-up round first)."""
    import statistics
    import time

    import torch.distributed as dist

    out: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds + 1):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            dist.barrier()  # the batch ends when every rank is done: one rank's time is the world's
            if r:
                out[k].append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in out.items()}


def schedule_times(rank: int, world: int) -> dict[str, float]:
    """Seconds of one schedule run (forward and backward, no optimizer step) per schedule and
    micro-batch count, keyed "gpipe@2"; and "plain": this rank's stage alone at one sequence."""
    import torch

    from memfit.distributed.pipeline import PipelineOptimizer
    from memfit.models.spec import parse_model

    spec = parse_model(MODEL)
    fns, stage = {}, None
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            torch.manual_seed(0)
            opt = PipelineOptimizer(spec.build(seq=SEQ), "adamw", lr=0.0, microbatches=m, schedule=schedule)
            x = torch.randint(0, spec.config.vocab, (m, SEQ))
            fns[f"{schedule}@{m}"] = (lambda o, x: lambda: o.run_batch(x, x, float(x.numel())))(opt, x)
            stage = opt.stage_module
    inp = (torch.randint(0, spec.config.vocab, (1, SEQ)) if rank == 0 else
           torch.randn(1, SEQ, spec.config.hidden, requires_grad=True))
    fns["plain"] = lambda: stage(inp).float().sum().backward()
    return interleaved(fns)


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def microbatch_s(times: dict[str, float], latency_s: float) -> dict[str, float]:
    """Per schedule, the fixed seconds per micro-batch and stage (see the module docstring), at least 0."""
    out = {}
    for schedule in SCHEDULES:
        per = slope(list(MICROBATCHES), [times[f"{schedule}@{m}"] for m in MICROBATCHES])
        out[schedule] = max(per - times["plain"] - latency_s, 0.0)
    return out


def sharing_times(rank: int, world: int) -> dict[str, float]:
    """Seconds of a small GPT's forward and backward on each rank alone ("alone@R", the others
    waiting) and on every rank at once ("together")."""
    import torch

    from memfit.models.spec import parse_model

    spec = parse_model(SHARING_MODEL)
    torch.manual_seed(0)
    model = spec.build(seq=SEQ_SHARING)
    x = torch.randint(0, spec.config.vocab, (SHARING_ROWS, SEQ_SHARING))

    def work() -> None:
        model(x).float().sum().backward()

    fns = {f"alone@{r}": (lambda r: lambda: work() if rank == r else None)(r) for r in range(world)}
    return interleaved({**fns, "together": work})


def core_share(times: dict[str, float], world: int, cores: int) -> float:
    """The share of min(world, cores) cores that `world` ranks computing at once get: their
    throughput together over one's alone, between 1 / min(world, cores) (they take turns) and 1."""
    alone = sum(times[f"alone@{r}"] for r in range(world)) / world
    usable = min(world, cores)
    return min(max(world * alone / times["together"] / usable, 1 / usable), 1.0)
