"""Each rank's step peak under FSDP2 x tensor parallel on one ("dp", "tp") DeviceMesh (2-D).

    est = memfit.estimate("config.json", batch=1, seq=64, strategy="tensor", world=4, tp=2, engine="fsdp2")
    est.per_device, est.ranks                                                 # dp = world / tp = 2

The two estimates memfit already has, composed: tensor parallelism's (memfit.measure.parallel_estimate:
the model one TP rank holds, built with its plan's local shapes: column-parallel outputs and row-parallel
inputs divided by tp, the rest whole) is the model that ZeRO-3 shards over the dp ranks
(memfit.distributed.rank_memory, which memfit.distributed.fsdp2 matches on one dimension). So the TP
rank's model is traced for one step on its replica's rows, and its weights, gradients and optimizer
state are sharded dp ways, with the blocks gathered (dp-wide) around their forward and backward as
FSDP2 does. `batch` is per process, as for --strategy tensor: a replica of tp ranks runs tp x batch
rows, and every rank of it computes all of them.

A Hugging Face causal LM whose family ships a tensor plan (memfit.distributed.hf_tensor); the run
this estimates is `distribute(model, "zero3", engine="fsdp2", tp=tp)`; on the command line
`memfit estimate CONFIG --strategy tensor --tp T --world N --engine fsdp2`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.models.spec import ModelSpec, parse_model


@dataclass
class TPRankSpec(ModelSpec):
    """A Hugging Face config built with the shapes one rank of its tensor plan holds (its name says
    so: traces cached under the whole model's name are not this one's)."""

    tp: int = 1

    def build(self, seq: int | None = None) -> nn.Module:
        from memfit.distributed.hf_tensor import localize_hf

        return localize_hf(super().build(seq), self.tp)


def tp_rank_spec(spec: ModelSpec, tp: int) -> TPRankSpec:
    values = {f.name: getattr(spec, f.name) for f in fields(spec)}
    values["name"] = f"{spec.name} (one rank of tp={tp})"
    return TPRankSpec(**values, tp=tp)


def fsdp_tp_estimate(estimate: Callable[..., Any], model: Any, batch: int, seq: int | None, world: int, tp: int,
                     precision: str = "32-true", optimizer: str = "adamw", checkpoint: str = "none") -> Any:
    """The Estimate of a 2-D FSDP2 x TP step (see the module docstring): per_device the largest rank's,
    `ranks` each distinct rank of the world (a rank's figures are those of its place on "dp").
    `estimate`: memfit.measure.estimate.estimate (passed in: that module calls this one)."""
    from memfit.measure.parallel_estimate import check_tensor_spec

    spec = parse_model(model, families=True) if isinstance(model, str) else model
    if spec.config is not None or spec.task not in (None, "causal-lm"):
        raise ConfigError("FSDP2 x tensor parallel is estimated for a Hugging Face causal LM with a tensor plan "
                          "(a llama/qwen2/qwen3/mistral config.json); for memfit's GPT use --strategy tensor or zero3")
    check_tensor_spec(spec, world, tp)
    dp = world // tp
    if dp == 1:
        raise ConfigError(f"tp {tp} on {world} ranks leaves no data-parallel dimension for FSDP2 to shard; give "
                          f"--tp dividing {world} below it, or leave out --engine fsdp2")
    est = estimate(tp_rank_spec(spec, tp), batch=batch * tp, seq=seq, precision=precision, optimizer=optimizer,
                   checkpoint=checkpoint, strategy="zero3", world=dp, engine="fsdp2")
    est.model, est.world, est.strategy, est.batch = spec.name, world, "tensor", batch
    for row in est.ranks:  # rank r sits at dp place r // tp: every TP rank of a place holds what it holds
        row["rank_ids"] = sorted(r * tp + t for r in row["rank_ids"] for t in range(tp))
        row.update(strategy="tensor", world=world, dp=dp, tp=tp, rows=batch * tp)
    return est
