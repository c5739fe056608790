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

What FSDP2 runs that is priced: reshard_after_forward True (zero3) in fp32 or bf16 (FSDP2's
MixedPrecisionPolicy: bf16 gathered weights, fp32 shards, the fp32 shard cast into the gather per use).
Refused with one line: FSDP1, reshard_after_forward False (the unsharded weights kept from forward to
backward, which memfit does not estimate yet), CPU offload, fp16.
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
    reshard: bool = True
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

    def summary(self) -> str:
        ckpt = "every decoder layer recomputed" if self.checkpoint == "full" else "no recomputation"
        return (f"memfit: FSDP2 (zero3) on {self.world} ranks, {self.precision}: micro-batch {self.micro_batch} x "
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
    reshard = plugin.reshard_after_forward
    return setup_of(world, mixed_precision, reshard if isinstance(reshard, bool) else bool(reshard),
                    bool(getattr(plugin, "activation_checkpointing", False)))


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
    if world < 2:
        raise ConfigError(f"FSDP over {world} process: launch 2 or more (torchrun --nproc_per_node N)")
    if reshard is not True:
        raise ConfigError(f"reshard_after_forward={reshard!r} (shard_grad_op): memfit estimates FSDP2 with "
                          "reshard_after_forward=True (full_shard); use fsdp='full_shard'")
    mp = str(mixed_precision).lower()
    if mp in ("fp16", "16-mixed", "16-true"):
        raise ConfigError("fp16 with FSDP2 is not planned by memfit; use bf16 (or fp32)")
    if mp not in ("no", "fp32", "32-true", "bf16", "bf16-mixed", "bf16-true"):
        raise ConfigError(f"mixed precision {mixed_precision!r}: memfit plans FSDP2 in fp32 or bf16")
    precision = "bf16-mixed" if mp.startswith("bf16") else "32-true"
    return FsdpSetup(world=world, precision=precision, reshard=True, checkpointing=checkpointing)


def rank_estimate(spec: Any, micro: int, seq: int, setup: FsdpSetup, optimizer: str, checkpoint: str) -> Any:
    """memfit's zero3 Estimate of one rank of `setup` (per_device: the largest rank; ranks: each), with
    FSDP2's head-backward moment (head_moment) among the moments its peak is the highest of."""
    from memfit.measure.estimate import estimate
    from memfit.measure.rank_estimate import per_device, with_ranks

    # FSDP2's bf16 policy is memfit's bf16-master (bf16 compute weights gathered per layer, fp32 master)
    # without the bf16 shard FSDP2 does not keep (_fsdp2_states)
    precision = "32-true" if setup.precision == "32-true" else "bf16-master"
    one = estimate(spec, batch=micro, seq=seq, precision=precision, optimizer=optimizer, checkpoint=checkpoint)
    alone = dict(one.per_device)
    est = with_ranks(one, spec, "zero3", setup.world)
    if precision == "bf16-master":
        from memfit.integrations.torchtitan import _fsdp2_states

        _fsdp2_states(est)
    head = head_moment(spec, seq, setup, precision, optimizer, alone, est.ranks[0])
    if head["total"] > est.ranks[0]["total"]:
        est.ranks[0] = {**est.ranks[0], **head}
        est.per_device = per_device(est.ranks[0])
    return est


def head_moment(spec: Any, seq: int, setup: FsdpSetup, precision: str, optimizer: str, alone: dict,
                row: dict) -> dict:
    """FSDP2's moment at the head's backward: everything the forward saved is still there (the one-device
    peak's activations and temporaries), with the root's gathered weights (embedding, final norm, head)
    and one decoder layer's all-gathered weights (the last one, gathered again for its backward). The
    measured peak of a bare fully_shard step has these categories (bench/trainer_fsdp2.py); memfit's zero3
    moments gather a layer only inside the layers' backward, so this one is added here."""
    from memfit.distributed.rank_memory import rank_model_state

    states = rank_model_state(spec.on_meta(seq), "zero3", setup.world, precision, optimizer)[0]
    out = {"params": row["params"], "gathered": states["rest"] + states["one_block"], "grads": 0, "in_flight": 0,
           "optimizer": row["optimizer"], "activations": alone["activations"], "temporaries": alone["temporaries"]}
    out["total"] = sum(out.values())
    return out


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
                                    tried, est.ranks)
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
