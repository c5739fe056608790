"""Plan: what the planner chose (plain data), its summary text, JSON form, and how to apply it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch.nn as nn

from memfit.apply.policy import BlockAction, parse_items, to_string
from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes, format_seconds

ALLOW = ("recompute", "selective", "offload-cpu", "offload-disk", "compress", "chunked-head", "accumulate",
         "optimizer-offload", "precision", "step-in-backward")
DEFAULT_ALLOW = ("recompute", "selective", "offload-cpu", "offload-disk", "accumulate", "chunked-head",
                 "optimizer-offload")
HOST_OFFLOAD = ("offload-cpu", "optimizer-offload")
"""Moves bytes to host memory: on a CPU device that is the same RAM, so by default it is not planned there."""


def parse_allow(allow: Any, device: str = "cuda") -> tuple[str, ...]:
    """The allowed names; the default set on a CPU device leaves out HOST_OFFLOAD (docs/planner.md)."""
    if allow is None:
        return tuple(a for a in DEFAULT_ALLOW if device != "cpu" or a not in HOST_OFFLOAD)
    items = [a.strip() for a in allow.split(",")] if isinstance(allow, str) else [str(a).strip() for a in allow]
    items = [a for a in items if a]
    bad = [a for a in items if a not in ALLOW]
    if bad:
        raise ConfigError(f"unknown allow name {bad[0]!r}; accepted: {', '.join(ALLOW)}")
    return tuple(items)


@dataclass
class Candidate:
    """One configuration of the outer search, with its best per-block actions."""

    micro_batch: int
    accumulation: int
    offload_optimizer: str | None
    precision: str
    peak: int
    time: float
    actions: str
    feasible: bool
    head_chunks: int | None = None
    """The LM head and loss in this many chunks (memfit.apply.chunked_head); None = the plain head."""
    refused: bool = False
    """Feasible by the composed figure, refused by the full trace of its step (the search went on)."""
    host: int = 0
    """Host memory it needs (bytes; memfit.plan.host_memory); over the plan's host memory: not feasible."""
    step_in_backward: bool = False
    """Each parameter updated during backward, no gradient buffer (memfit.apply.step_in_backward)."""


@dataclass
class Plan:
    model: str
    budget: int
    actions: list[BlockAction]
    micro_batch: int
    accumulation: int
    optimizer: str
    precision: str
    offload_optimizer: str | None
    predicted_peak: int
    predicted_time: float
    """The time model's step (see `time_basis`): seconds with memfit profile costs, else an uncalibrated
    FLOP-model figure that only ranks configurations."""
    n_blocks: int
    head_chunks: int | None = None
    """The LM head and loss computed in this many chunks (memfit.apply.chunked_head); None = plain."""
    ranked: list[Candidate] = field(default_factory=list)
    where: str = ""
    measured_peak: int | None = None
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    """Where the model trains: on "cpu" host and device are the same RAM (see `memory_note`)."""
    seq: int | None = None
    """Tokens per sequence the plan was made for (a plan file is self-contained: memfit train --plan)."""
    global_batch: int | None = None
    """Sequences per optimizer step (micro_batch x accumulation)."""
    model_digest: str | None = None
    """sha256 (first 16 hex digits) of the model's configuration, or of a module's parameter shapes."""
    keep_output: bool = True
    """Budgeted for the caller holding the model's output (logits, an HF cache) through backward, as
    `out = model(**batch); out.loss.backward()` does; False when the loop drops it before backward."""
    time_basis: str = "flop-model"
    """What predicted_time is: "flop-model" (uncalibrated, for ranking only) or "profile" (seconds)."""
    baseline_time: float = 0.0
    """The same time model's step with every activation kept, at the same global batch."""
    host_memory: int = 0
    """Host memory the plan was held to (bytes; memfit.plan.host_memory; 0: not known)."""
    host_need: int = 0
    """Host memory the plan needs: optimizer offload's state, cpu-offloaded activations, and on a CPU
    device the step itself (predicted; the full trace's figure when it checked the plan)."""
    host_source: str = ""
    step_in_backward: bool = False
    """The optimizer step runs in backward (memfit.apply.step_in_backward): no gradient buffer, and no
    clipping by the global gradient norm (what the plan gives up, said in `notes`)."""

    def memory_note(self) -> str | None:
        """On a CPU device, what the device figures mean for the process's physical memory."""
        if self.device != "cpu":
            return None
        moved = [w for w, on in (("offload:cpu", any(a.offload == "cpu" for a in self.actions)),
                                 ("optimizer offload", bool(self.offload_optimizer))) if on]
        text = "device is CPU: host and device are the same RAM, so the peak is the tracker's device accounting"
        if moved:
            text += f"; {' and '.join(moved)} move bytes to host memory, which the process's RSS still holds"
        if any(a.offload == "disk" for a in self.actions):
            text += "; offload:disk moves bytes out of RAM to spill files (RSS goes down too)"
        return text

    def summary(self) -> str:
        lines = [f"plan for {self.model} under {format_bytes(self.budget)}: predicted peak "
                 f"{format_bytes(self.predicted_peak)} ({self.where or 'peak'})",
                 f"  blocks ({self.n_blocks}): {to_string(self.actions)}",
                 f"  micro-batch {self.micro_batch} x accumulation {self.accumulation}, {self.precision}, "
                 f"{self.optimizer}" + (f", optimizer offloaded to {self.offload_optimizer}" if self.offload_optimizer else "")
                 + (", optimizer step in backward" if self.step_in_backward else ""),
                 f"  head chunks: {self.head_chunks or 'none'}",
                 f"  {self.time_text()}",
                 "  the caller's output: " + ("budgeted as held through backward (keep_output=True)" if self.keep_output
                                              else "assumed dropped before backward (keep_output=False)")]
        if self.host_memory and self.host_need is not None:  # (a plan file may leave the need out)
            from memfit.plan.host_memory import describe

            lines.append("  " + describe(self.host_need, self.host_memory, self.host_source or "given"))
        if self.measured_peak is not None:
            two = " (two micro-batches, the second holding the first's gradients)" if self.accumulation > 1 else ""
            lines.append(f"  checked by a full trace of the step{two}: peak {format_bytes(self.measured_peak)}")
        lines += [f"  note: {n}" for n in self.notes]
        note = self.memory_note()
        if note:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def time_text(self) -> str:
        """The predicted time as what it is: seconds from measured costs, else relative to keeping everything."""
        if self.time_basis == "profile":
            return f"predicted step time: {format_seconds(self.predicted_time)} (memfit profile costs)"
        rel = self.predicted_time / self.baseline_time if self.baseline_time > 0 else 1.0
        return (f"predicted time: {rel:.2f}x the step that keeps every activation (uncalibrated FLOP model, "
                "for ranking; --profile for seconds)")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["actions"] = to_string(self.actions)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "the plan") -> "Plan":
        """The plan of `d` (its JSON form), every field checked first (memfit.plan.plan_schema)."""
        from memfit.plan.plan_schema import check_plan

        check_plan(d, where)
        d = dict(d)
        parsed = parse_items(d["actions"])
        if isinstance(parsed, str):
            raise ConfigError(f"{where}: actions must be a per-block list, got {d['actions']!r}")
        if len(parsed) != d["n_blocks"]:
            raise ConfigError(f"{where}: actions name {len(parsed)} blocks, n_blocks says {d['n_blocks']}; write it "
                              "again with `memfit plan ... --json`")
        d["actions"] = list(parsed)
        try:
            d["ranked"] = [Candidate(**c) for c in d.get("ranked", [])]
        except TypeError:
            raise ConfigError(f"{where}: ranked holds a configuration that is not a memfit candidate; write it again "
                              "with `memfit plan ... --json`") from None
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def check_model(self, model: nn.Module) -> None:
        from memfit.apply.checkpoint import find_blocks

        n = len(find_blocks(model))
        if n != self.n_blocks:
            raise ConfigError(f"this plan is for a model with {self.n_blocks} blocks ({self.model}); "
                              f"the model has {n}: plan it again for this model")

    def install(self, model: nn.Module, spill_dir: str | None = None) -> nn.Module:
        """Apply the per-block actions and the head chunks to `model` in place (no optimizer)."""
        from memfit.apply.checkpoint import checkpoint
        from memfit.apply.head_swap import chunk_head

        self.check_model(model)
        checkpoint(model, self.actions, spill_dir=spill_dir)
        if self.head_chunks or getattr(model, "_memfit_head_chunks", None):
            chunk_head(model, self.head_chunks)
        return model

    def apply(self, model: nn.Module, lr: float = 3e-4, spill_dir: str | None = None, **optimizer_kwargs: Any):
        """Apply the per-block actions and head chunks in place; return the TrainingOptimizer planned for."""
        from memfit.apply.optimizer import TrainingOptimizer

        self.install(model, spill_dir)
        if self.step_in_backward:
            optimizer_kwargs.setdefault("step_in_backward", True)
        return TrainingOptimizer(model, self.optimizer, lr=lr, precision=self.precision,
                                 offload=self.offload_optimizer, **optimizer_kwargs)
