"""Per-rank plans for a Hugging Face causal LM that a framework shards with torch's FSDP2 (`fully_shard`
per decoder layer and once on the root, as accelerate's FSDP2 plugin, the HF Trainer's `fsdp=` and
Lightning's FSDPStrategy / ModelParallelStrategy do).

    setup = read_plugin(accelerator.state.fsdp_plugin, "bf16", world=2)   # what the framework will run
    plan = plan_ranks(model, batch, "6GiB", setup, optimizer="adamw", accumulation=1)
    plan.micro_batch, plan.accumulation, plan.checkpoint, plan.predicted

Each candidate (a micro-batch that divides the optimizer step's rows, with or without every decoder
layer recomputed) is estimated per rank with memfit's zero3 estimate (memfit.measure.rank_estimate:
each rank's weight, gradient and Adam slices, the gathered root and two gathered layers, one layer's
gradients in flight, activations from the one-device trace of the rank's micro-batch). Without
recomputation, with FSDP2's head-backward moment added (head_moment), it is a bare fully_shard step's
measured per-rank peak within 0.1%, and above the HF Trainer's (bench/trainer_fsdp2.py). A step of
several micro-batches adds the unsharded gradients held between them (held_gradients). The plan takes
the largest
micro-batch that fits without recomputation, else the largest that fits with it; recomputation is
memfit's own (memfit.checkpoint "full"), which is what the estimate prices, not torch's
checkpoint_wrapper, which saves more per layer.

What FSDP2 runs that is priced (memfit.measure.fsdp2_estimate): reshard_after_forward True (full_shard),
False (shard_grad_op: each layer's gathered weights kept from its forward to its backward) or an int N
(a 1/N shard kept), in fp32 or bf16 (FSDP2's MixedPrecisionPolicy: bf16 gathered weights, fp32 shards,
the fp32 shard cast into the gather per use). Refused with one line: FSDP1, CPU offload, fp16.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.core.errors import ConfigError
from memfit.core.units import format_bytes, parse_bytes
from memfit.plan.costs import PlanError


@dataclass
class FsdpSetup:
    """What FSDP2 will run, as memfit reads it from a framework's configuration."""

    world: int
    precision: str = "32-true"
    """memfit's name: 32-true (no mixed precision) or bf16-mixed (FSDP2 gathering bf16 weights)."""
    reshard: bool | int = True
    """FSDP2's reshard_after_forward: True (full_shard), False (shard_grad_op), an int N (1/N kept)."""
    checkpointing: bool = False
    """Whether the framework's configuration asked for activation checkpointing (the plan decides)."""


@dataclass
class RankPlan:
    """The chosen per-rank configuration and what was estimated on the way."""

    micro_batch: int
    accumulation: int
    checkpoint: str
    predicted: int
    """The largest rank's estimated peak, bytes."""
    budget: int
    world: int
    precision: str
    tried: list[dict] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)
    reshard: bool | int = True

    def summary(self) -> str:
        ckpt = "every decoder layer recomputed" if self.checkpoint == "full" else "no recomputation"
        layout = "zero3" if self.reshard is True else f"reshard_after_forward={self.reshard}"
        return (f"memfit: FSDP2 ({layout}) on {self.world} ranks, {self.precision}: micro-batch {self.micro_batch} x "
                f"accumulation {self.accumulation} per rank, {ckpt}; predicted per-rank peak "
                f"{format_bytes(self.predicted)} of {format_bytes(self.budget)}")


def read_plugin(plugin: Any, mixed_precision: str, world: int) -> FsdpSetup:
    """The FsdpSetup of accelerate's FullyShardedDataParallelPlugin (the HF Trainer builds one from
    `fsdp=`/`fsdp_config`); `mixed_precision`: the accelerator's ("no", "bf16", "fp16")."""
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise ConfigError(f"fsdp_version {version}: memfit plans FSDP2 only; set fsdp_config "
                          "{'fsdp_version': 2} (FSDP1 is deprecated by transformers and accelerate)")
    if _offloads(getattr(plugin, "cpu_offload", None)):
        raise ConfigError("FSDP2 with CPU offload is not estimated per rank by memfit; remove offload "
                          "(fsdp_config cpu_offload / fsdp='offload')")
    return setup_of(world, mixed_precision, _reshard_of(plugin.reshard_after_forward),
                    bool(getattr(plugin, "activation_checkpointing", False)))


def _reshard_of(value: Any) -> Any:
    """FSDP2's reshard_after_forward from accelerate's plugin: a bool or an int as torch takes it; a
    sharding-strategy name (accelerate's FSDP1 spelling) by what it means for FSDP2."""
    if isinstance(value, (bool, int)):
        return value
    name = str(getattr(value, "name", value)).upper()
    return {"FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False, "_HYBRID_SHARD_ZERO2": False,
            "NO_SHARD": False, "TRUE": True, "FALSE": False}.get(name, value)


def _offloads(policy: Any) -> bool:
    """Whether a plugin's cpu_offload moves states to the host (FSDP2: a CPUOffloadPolicy, not the plain
    OffloadPolicy accelerate sets when off; FSDP1: a CPUOffload with offload_params, or True)."""
    if policy is None or isinstance(policy, bool):
        return bool(policy)
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy

        if isinstance(policy, CPUOffloadPolicy):
            return True
    except ImportError:
        pass
    return bool(getattr(policy, "offload_params", False))


def setup_of(world: int, mixed_precision: str, reshard: Any, checkpointing: bool) -> FsdpSetup:
    """An FsdpSetup from plain values; refuses what memfit does not price (see the module docstring)."""
    from memfit.measure.fsdp2_estimate import check_reshard

    if world < 2:
        raise ConfigError(f"FSDP over {world} process: launch 2 or more (torchrun --nproc_per_node N)")
    mp = str(mixed_precision).lower()
    if mp in ("fp16", "16-mixed", "16-true"):
        raise ConfigError("fp16 with FSDP2 is not planned by memfit; use bf16 (or fp32)")
    if mp not in ("no", "fp32", "32-true", "bf16", "bf16-mixed", "bf16-true"):
        raise ConfigError(f"mixed precision {mixed_precision!r}: memfit plans FSDP2 in fp32 or bf16")
    precision = "bf16-mixed" if mp.startswith("bf16") else "32-true"
    return FsdpSetup(world=world, precision=precision, reshard=check_reshard(reshard, world),
                     checkpointing=checkpointing)


def rank_estimate(spec: Any, micro: int, seq: int, setup: FsdpSetup, optimizer: str, checkpoint: str) -> Any:
    """memfit's Estimate of one FSDP2 rank of `setup` (memfit.measure.fsdp2_estimate: zero3's figures with
    FSDP2's head-backward moment and the weights reshard_after_forward keeps)."""
    from memfit.measure.estimate import estimate
    from memfit.measure.fsdp2_estimate import fsdp2_estimate

    return fsdp2_estimate(estimate, spec, micro, seq, setup.world, precision=setup.precision, optimizer=optimizer,
                          checkpoint=checkpoint, reshard=setup.reshard)


def held_gradients(spec: Any, setup: FsdpSetup) -> int:
    """The unsharded gradients a rank holds between the micro-batches of an accumulated step: accelerate
    (and so the Trainer and Lightning) turns FSDP2's gradient sync off for all but the last micro-batch
    (set_requires_gradient_sync(False)), so every layer's full gradient, in the compute dtype, stays
    until the last one. Added whole to one micro-batch's peak: an upper bound on a later micro-batch's."""
    return spec.counts()[0] * (2 if setup.precision == "bf16-mixed" else 4)


def hf_spec(model: Any, folder: str) -> Any:
    """A ModelSpec of a Hugging Face causal LM's own config (written to `folder`), for memfit's estimates."""
    from memfit.models.spec import ModelSpec

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if inner is not model or any(not p.requires_grad for p in model.parameters()):
        raise ConfigError("FSDP2 planning covers a fully trained causal LM; a model with frozen weights or "
                          "adapters (peft) is not estimated per rank")
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ConfigError(f"FSDP2 planning takes a Hugging Face causal LM (a model with a config); got "
                          f"{type(model).__name__}")
    path = Path(folder) / "config.json"
    path.write_text(json.dumps(config.to_dict(), default=str))
    return ModelSpec(type(inner).__name__, hf_config=path)


def batch_shape(batch: Any) -> tuple[int, int]:
    """(rows, tokens per row) of a causal-LM batch (its input_ids)."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ConfigError("FSDP2 planning reads the batch's input_ids (rows x tokens); the batch has none")
    return int(ids.shape[0]), int(ids.shape[1])


def plan_ranks(model: Any, batch: Any, budget: Any, setup: FsdpSetup, *, optimizer: str = "adamw",
               accumulation: int = 1, keep_effective_batch: bool = True, where: str = "memfit") -> RankPlan:
    """The per-rank plan (see the module docstring) for `batch` (one rank's micro-batch as the loop
    collates it) and `accumulation` steps per optimizer step; keep_effective_batch False keeps the
    micro-batch (only recomputation is chosen). PlanError when nothing fits, with the smallest need."""
    cap = parse_bytes(budget)
    rows, seq = batch_shape(batch)
    total = rows * accumulation
    micros = [m for m in range(total, 0, -1) if total % m == 0] if keep_effective_batch else [rows]
    tried: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="memfit-fsdp-") as folder:
        spec = hf_spec(model, folder)
        held = held_gradients(spec, setup)
        for checkpoint in ("none", "full"):
            for micro in micros:
                est = rank_estimate(spec, micro, seq, setup, optimizer, checkpoint)
                need = est.per_device["total"] + (held if micro < total else 0)
                tried.append({"micro_batch": micro, "checkpoint": checkpoint, "per_rank": need})
                if need <= cap:
                    return RankPlan(micro, total // micro, checkpoint, need, cap, setup.world, setup.precision,
                                    tried, est.ranks, setup.reshard)
    least = min(tried, key=lambda t: t["per_rank"])
    raise PlanError(f"{where}: nothing fits {format_bytes(cap)} per rank under FSDP2 on {setup.world} ranks: the "
                    f"smallest (micro-batch {least['micro_batch']}, checkpoint {least['checkpoint']}) needs "
                    f"{format_bytes(least['per_rank'])} per rank; raise the budget or add ranks")


def apply_checkpointing(model: Any, plan: RankPlan) -> None:
    """memfit's recomputation of every decoder layer when the plan chose it (the estimate's policy), before
    the framework shards the model; none otherwise (a previous one removed)."""
    from memfit.apply.checkpoint import checkpoint

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpoint(inner, plan.checkpoint)
