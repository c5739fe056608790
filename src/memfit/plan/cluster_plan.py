"""ClusterPlan: the chosen layout on N devices (plain data), its table, summary, JSON and launch lines.

The JSON (`memfit plan ... --gpus N --json`) holds a `plan` field that `memfit train --plan FILE`
reads as any plan (per-block actions, per-process micro-batch x accumulation, precision, offload)
and a `cluster` field with what the launch needs (process count, strategy and its degrees).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.core.units import format_bytes
from memfit.plan.cluster_memory import Layout


def degrees(lay: Layout) -> str:
    if lay.strategy == "tensor":
        return f"tp {lay.tp} x dp {lay.dp}"
    if lay.strategy == "pipeline":
        v = f" x{lay.virtual_stages}" if lay.schedule == "interleaved" else ""
        return f"pp {lay.pp} x dp {lay.dp}, {lay.accum} mb {lay.schedule}{v}"
    return f"dp {lay.dp}"


def per_process_batch(lay: Layout) -> tuple[int, int]:
    """memfit train's (--batch, --accum): sequences per process per micro-step, micro-steps."""
    if lay.strategy == "pipeline":
        return lay.rows * lay.accum // lay.pp, 1
    if lay.strategy == "tensor":
        return lay.rows // lay.tp, lay.accum
    return lay.rows, lay.accum


def train_flags(lay: Layout) -> list[str]:
    """The strategy flags of memfit train for this layout (not the per-block plan, which --plan carries)."""
    if lay.gpus == 1:
        return []
    out = ["--nproc", str(lay.gpus), "--strategy", lay.strategy]
    if lay.strategy == "tensor":
        out += ["--tp", str(lay.tp)]
    if lay.strategy == "pipeline":
        out += ["--dp", str(lay.dp), "--microbatches", str(lay.accum), "--schedule", lay.schedule]
        if lay.schedule == "interleaved":
            out += ["--virtual-stages", str(lay.virtual_stages)]
    if lay.strategy in ("zero2", "zero3"):  # the engine the layout was estimated for, named
        out += ["--engine", lay.engine]
    return out


@dataclass
class ClusterPlan:
    model: str
    budget: int
    gpus: int
    layout: dict
    """The chosen Layout as a dict (strategy, dp, tp, pp, rows, accum, schedule, counts, ...)."""
    peak: int
    """Predicted peak of the largest rank (composed)."""
    ranks: list
    time: dict
    """Seconds per optimizer step by term (compute, recompute, comm, comm_exposed, bubble, offload, total)."""
    tokens_per_s: float
    time_basis: str
    interconnect: str
    global_batch: int
    seq: int
    plan: dict
    """The per-block plan (memfit.plan.plan.Plan.to_json) that `memfit train --plan` applies on each rank."""
    traced_peak: int | None = None
    """The largest rank's peak from a full trace of the chosen plan (memfit's per-rank estimate)."""
    ranked: list = field(default_factory=list)
    by_count: list = field(default_factory=list)
    """gpus="auto": the best plan at this count and the next counts up (gpus, strategy, tokens/s per device)."""
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    """Seconds the search took."""
    host_memory: int = 0
    """Host memory per node the plan was held to (bytes; memfit.plan.host_memory)."""
    host_need: int = 0
    """Host memory per node the chosen layout needs (bytes)."""
    host_text: str = ""

    @property
    def lay(self) -> Layout:
        return Layout(**self.layout)

    def to_json(self) -> dict[str, Any]:
        engine = {"engine": self.lay.engine} if self.lay.strategy in ("zero2", "zero3") else {}
        return {**asdict(self), "torchrun": self.torchrun_command(), **engine}

    def train_command(self) -> str:
        b, a = per_process_batch(self.lay)
        return " ".join(["memfit", "train", "--model", self.model, "--plan", "PLAN.json", "--seq", str(self.seq),
                         *train_flags(self.lay)]) + f"   (per process: --batch {b} --accum {a})"

    def torchrun_command(self) -> str:
        """For users who launch their own processes (one node; add --nnodes/--rdzv-endpoint for more)."""
        flags = train_flags(self.lay)[2:]  # torchrun starts the processes: no --nproc
        nodes = f" --nnodes {-(-self.gpus // 8)}" if self.gpus > 8 else ""
        return (f"torchrun --nproc-per-node {min(self.gpus, 8)}{nodes}"
                + f" -m memfit train --model {self.model} --plan PLAN.json --seq {self.seq} " + " ".join(flags))

    def summary(self) -> str:
        lay, t = self.lay, self.time
        b, a = per_process_batch(lay)
        acts = ", ".join(f"stage {i}: " * (len(lay.counts) > 1) + f"{k} keep, {s} selective, {r} recompute"
                         for i, (k, s, r) in enumerate(lay.counts))
        engine = f" on {'FSDP2' if lay.engine == 'fsdp2' else 'memfit'}" if lay.strategy in ("zero2", "zero3") else ""
        lines = [f"cluster plan for {self.model} on {self.gpus} x {format_bytes(self.budget)} devices "
                 f"({self.interconnect}): {lay.strategy}{engine} ({degrees(lay)})",
                 f"  largest rank's predicted peak {format_bytes(self.peak)}"
                 + (f"; full trace of that rank: {format_bytes(self.traced_peak)}" if self.traced_peak else ""),
                 f"  per process: micro-batch {b} x accumulation {a} (global batch {self.global_batch} x seq "
                 f"{self.seq}), {lay.precision}, {lay.optimizer}"
                 + (f", optimizer offloaded to {lay.offload_optimizer}" if lay.offload_optimizer else "")
                 + (f", head in {lay.head_chunks} chunks" if lay.head_chunks else ""),
                 f"  blocks per rank: {acts}",
                 f"  predicted step {t['total']:.3g} s = compute {t['compute']:.3g} + recompute {t['recompute']:.3g}"
                 f" + exposed comm {t['comm_exposed']:.3g} (of {t['comm']:.3g}) + bubble {t['bubble']:.3g}"
                 f" + offload {t['offload']:.3g}" + (f" + shared cores {t['cores']:.3g}" if t.get("cores") else "")
                 + f"; {self.tokens_per_s:,.0f} tokens/s"
                 f" ({self.tokens_per_s / self.gpus:,.0f} per device); comm {format_bytes(t['comm_bytes'])} per rank",
                 f"  time basis: {self.time_basis}",
                 *([f"  {self.host_text}"] if self.host_text else []),
                 f"  run it: {self.train_command()}",
                 f"  or: {self.torchrun_command()}"]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  answered in {self.seconds:.1f} s")
        return "\n".join(lines)
