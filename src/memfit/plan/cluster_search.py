"""The cluster search: every layout memfit runs on N devices, its per-block actions, peak and time.

    rows = candidates(problem, n)         # feasible and not, fastest first
    n, rows = smallest(problem)           # gpus="auto": the smallest count with a feasible layout

Layouts (as memfit train runs them, `--batch` per process): one process; ddp and zero1-3 over N;
tensor with a TP degree dividing the heads and the key/value heads (dp = N / tp); pipeline with
stages dividing N (dp = N / stages), gpipe, 1f1b or interleaved 1F1B (V = 2..MAX_VIRTUAL stages per
rank where the blocks split evenly into stages x V), micro-batches dividing the replica's rows.
Within each: micro-batch x accumulation at the same global batch, optimizer offload and the head
in chunks (one process, ddp, zero), the precision when allowed, and per rank the block action counts
(memfit.plan.cluster_actions; a pipeline runs one action on every block). Nothing here traces:
every figure composes from the unit profiles (memfit.plan.cluster_unit).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from memfit.plan.cluster_actions import counts, uniform
from memfit.plan.cluster_links import Topology
from memfit.plan.cluster_memory import Layout, fixed_bytes, rank_peaks, stage_sizes
from memfit.plan.cluster_time import step_time
from memfit.plan.cluster_unit import states_only, unit_profile
from memfit.plan.costs import SELECTIVE_SHARE

HEAD_CHUNKS = 8
MAX_GPUS = 4096
MAX_VIRTUAL = 8
"""The most virtual stages per rank searched: beyond, the bubble saved is below 1/(8 M) of a slot
while the P2P sends keep growing."""


@dataclass
class ClusterProblem:
    spec: object
    seq: int
    batch: int
    """Global batch (sequences per optimizer step)."""
    budget: int
    topo_of: object
    """gpus -> Topology."""
    precisions: tuple
    optimizer: str
    allowed: tuple
    flops: float
    tp_max: int = 8
    units: dict = field(default_factory=dict)
    host: object = None
    """memfit.plan.cluster_host.Host when the devices are this machine's CPU cores, else None."""
    host_memory: int = 1 << 62
    """Host memory per node (bytes, memfit.plan.host_memory): a layout needing more is not feasible."""
    host_source: str = ""

    @property
    def cfg(self):
        """The model's shape (memfit.plan.cluster_shape): memfit's GPT or a Hugging Face causal LM."""
        from memfit.plan.cluster_shape import shape_of

        return shape_of(self.spec)

    def unit(self, tp: int, precision: str):
        key = (tp, precision)
        if key not in self.units:
            self.units[key] = unit_profile(self.spec, self.seq, tp, precision, self.optimizer)
        return self.units[key]


@dataclass
class Row:
    layout: Layout
    peak: int
    ranks: list
    time: dict
    feasible: bool
    tokens: int = 0
    """Tokens per optimizer step (global batch x sequence)."""
    host: int = 0
    """Host memory per node the layout needs (bytes; `host_need`)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time["total"] if self.time.get("total") else 0.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(per: int, allowed) -> list[tuple[int, int]]:
    """(rows per micro-batch, micro-batches) for `per` rows: all of them at once, then halves."""
    out, b = [(per, 1)], per
    while "accumulate" in allowed and b % 2 == 0:
        b //= 2
        out.append((b, per // b))
    return out


def layouts(p: ClusterProblem, n: int) -> list[Layout]:
    cfg, out = p.cfg, []
    if p.batch % n:
        return out
    per = p.batch // n  # memfit train's --batch: sequences per process per step
    offs = [None] + (["cpu"] if "optimizer-offload" in p.allowed else [])
    heads = [None] + ([HEAD_CHUNKS] if "chunked-head" in p.allowed else [])
    for prec in p.precisions:
        base = dict(precision=prec, optimizer=p.optimizer)
        for strategy in (["none"] if n == 1 else ["ddp", "zero1", "zero2", "zero3"]):
            for rows, acc in _splits(per, p.allowed):
                out += [Layout(strategy, dp=n, rows=rows, accum=acc, offload_optimizer=o, head_chunks=h,
                               engine=engine_of(p, strategy, prec, o, acc), **base)
                        for o in offs for h in heads]
        for tp in _divisors(n)[1:]:
            if cfg.tp and tp <= p.tp_max and cfg.heads % tp == 0 and (cfg.kv_heads or cfg.heads) % tp == 0:
                out += [Layout("tensor", dp=n // tp, tp=tp, rows=tp * b, accum=acc, **base)
                        for b, acc in _splits(per, p.allowed)]
        for pp in _divisors(n)[1:]:
            if pp > cfg.layers or not cfg.pp:
                continue
            replica = pp * per
            for m in _divisors(replica):
                for sched in ("1f1b", "gpipe"):
                    if sched == "1f1b" and m < pp:
                        continue
                    out.append(Layout("pipeline", dp=n // pp, pp=pp, rows=replica // m, accum=m, schedule=sched,
                                      **base))
                out += [Layout("pipeline", dp=n // pp, pp=pp, rows=replica // m, accum=m, schedule="interleaved",
                               virtual_stages=v, **base) for v in virtual_counts(cfg.layers, pp, m)]
    return out


def virtual_counts(layers: int, pp: int, m: int) -> list[int]:
    """Virtual stages per rank the interleaved schedule can run: V >= 2 with the blocks cut evenly into
    pp x V stages, M >= pp micro-batches in rounds torch accepts (memfit.distributed.interleaved)."""
    rounds = max(1, m // pp)
    if m < pp or m % rounds:
        return []
    return [v for v in range(2, MAX_VIRTUAL + 1) if layers % (pp * v) == 0]


def engine_of(p: ClusterProblem, strategy: str, precision: str, offload: str | None, accum: int) -> str:
    """The engine memfit train runs a zero2/zero3 layout on (memfit.distributed.strategy.engine_for), so
    that it is estimated as it will run. With accumulation memfit's: FSDP2 as memfit.distributed.fsdp2
    runs it keeps the earlier micro-batches' gradients whole (unreduced), memfit's engine a shard."""
    from memfit.distributed.strategy import engine_for
    from memfit.measure.fsdp2_estimate import PRECISIONS

    engine, _ = engine_for(strategy, precision=precision, optimizer=p.optimizer, offload=offload,
                           cuda=p.host is None)
    return "fsdp2" if engine == "fsdp2" and accum == 1 and precision in PRECISIONS else "memfit"


def _over_floor(p: ClusterProblem, lay: Layout) -> bool:
    """Whether the model states alone exceed the budget on some rank (decided without a trace)."""
    cfg = p.cfg
    unit = states_only(p.spec, p.seq, lay.tp)
    probe = replace(lay, counts=[(0, 0, 0)] * lay.pp)
    tied = bool(getattr(cfg, "tied_embeddings", False))
    return max(r["total"] for r in rank_peaks(probe, unit, cfg.layers, tied)) > p.budget


def _solve(p: ClusterProblem, lay: Layout) -> Layout | None:
    """The layout with its per-stage block counts, or None when no counts fit."""
    if _over_floor(p, lay):
        return None
    unit, cfg = p.unit(lay.tp, lay.precision), p.cfg
    tied = bool(getattr(cfg, "tied_embeddings", False))
    block_f = 2 * unit.block_numel * p.seq  # forward FLOPs of one block per sequence (ratios only)
    out = []
    for r, k in enumerate(stage_sizes(cfg.layers, lay.pp)):
        base, keep, sel, rec = fixed_bytes(lay, unit, cfg.layers, r, tied)
        room, working = p.budget - base, lay.rows * unit.saved["keep"]
        if lay.strategy == "pipeline":
            got = uniform(k, room, {"keep": keep, "selective": sel, "recompute": rec}, working, p.allowed)
        else:
            got = counts(k, room, keep, sel, rec, working, block_f, SELECTIVE_SHARE * block_f, p.allowed)
        if got is None:
            return None
        out.append(got)
    if lay.strategy == "pipeline":  # one action everywhere: the one the fullest stage needs
        heaviest = max(out, key=lambda c: (c[2], c[1]))
        out = [(s, 0, 0) if heaviest[0] else (0, s, 0) if heaviest[1] else (0, 0, s)
               for s in stage_sizes(cfg.layers, lay.pp)]
    return replace(lay, counts=out)


def evaluate(p: ClusterProblem, lay: Layout) -> Row:
    """Peak and time of a layout whose counts are set (or the all-keep figures when they are not)."""
    cfg = p.cfg
    unit = p.unit(lay.tp, lay.precision)
    ranks = rank_peaks(lay, unit, cfg.layers, bool(getattr(cfg, "tied_embeddings", False)))
    peak = max(r["total"] for r in ranks)
    t = step_time(lay, unit, cfg, p.seq, p.topo_of(lay.gpus), p.flops, p.host)
    host = host_need(p, lay, peak)
    return Row(lay, peak, ranks, t, peak <= p.budget and host <= p.host_memory, p.batch * p.seq, host)


def host_per_rank(p: ClusterProblem, lay: Layout) -> int:
    """Host bytes of one rank: with optimizer offload its optimizer state and its gradients (on their
    way to the host step), the largest rank's; else none that the plan puts there."""
    if not lay.offload_optimizer:
        return 0
    on = rank_peaks(replace(lay, offload_optimizer=None), p.unit(lay.tp, lay.precision), p.cfg.layers,
                    bool(getattr(p.cfg, "tied_embeddings", False)))
    return max(r["optimizer"] + r["grad_bytes"] for r in on)


def host_need(p: ClusterProblem, lay: Layout, peak: int) -> int:
    """Host bytes per node: the ranks a node holds (8 a node on GPUs) times each one's host bytes; ranks
    on this machine's CPU (p.host) share its RAM with their device bytes too."""
    if p.host is not None:
        return lay.gpus * (peak + host_per_rank(p, lay))
    return min(lay.gpus, p.topo_of(lay.gpus).per_node) * host_per_rank(p, lay)


def candidates(p: ClusterProblem, n: int) -> list[Row]:
    rows = []
    for lay in layouts(p, n):
        solved = _solve(p, lay)
        if solved is not None:
            rows.append(evaluate(p, solved))
        elif _over_floor(p, lay):  # no trace for a layout whose states alone do not fit
            rows.append(Row(lay, max(r["total"] for r in rank_peaks(replace(lay, counts=[(0, 0, 0)] * lay.pp),
                            states_only(p.spec, p.seq, lay.tp), p.cfg.layers)), [], {"total": 0.0,
                            "comm_bytes": 0}, False, p.batch * p.seq))
        else:
            rows.append(replace(evaluate(p, lay), feasible=False))
    # ties (the head in chunks or the optimizer offloaded costing nothing by the model) go to the simpler plan
    return sorted(rows, key=lambda r: (not r.feasible, r.time["total"] if r.feasible else r.peak,
                                       r.layout.head_chunks is not None, r.layout.offload_optimizer is not None))


def counts_to_try(batch: int, upto: int = MAX_GPUS) -> list[int]:
    """Device counts in order: 1 to 8, then whole nodes of 8; only those dividing the global batch."""
    out = [n for n in range(1, 9)] + list(range(16, upto + 1, 8))
    return [n for n in out if batch % n == 0]


def smallest(p: ClusterProblem) -> tuple[int | None, list[Row]]:
    """The smallest device count with a feasible layout, and its rows (None, [] when none up to MAX_GPUS)."""
    for n in counts_to_try(p.batch):
        rows = candidates(p, n)
        if rows and rows[0].feasible:
            return n, rows
    return None, []
