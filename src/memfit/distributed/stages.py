"""memfit's GPT cut at block boundaries into pipeline stages.

    sizes = stage_sizes(layers=6, stages=2)        # [3, 3]: contiguous, earlier stages take the remainder
    stage = cut_to_stage(gpt, rank=0, stages=2)    # embeddings + blocks 0-2; gpt keeps only these
    parts = cut_to_stages(gpt, [0, 2], stages=4)   # interleaved: stages 0 and 2 of 4 on one rank

The first stage holds the token (and position) embeddings, the last the final norm and the head,
whose loss the schedule computes. Blocks another stage owns are replaced by nn.Identity in the GPT
itself, so their weights are freed and the GPT's state_dict() keeps the original names (a full
state dict is the union of the stages'). With tied embeddings the first and the last stage each
hold the shared matrix; their gradients are summed between the two before the step (Megatron's
scheme), so both copies stay equal.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError


def stage_sizes(layers: int, stages: int) -> list[int]:
    """Blocks per stage, contiguous; fails when a stage would get none."""
    if stages < 1 or layers < stages:
        raise ConfigError(f"{stages} pipeline stages need at least {stages} blocks, the model has {layers}; "
                          f"use at most {layers} processes (--nproc) with --strategy pipeline")
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def stage_blocks(layers: int, stages: int, rank: int) -> range:
    sizes = stage_sizes(layers, stages)
    lo = sum(sizes[:rank])
    return range(lo, lo + sizes[rank])


class GPTStage(nn.Module):
    """One pipeline stage of memfit's GPT: (embeddings) -> its blocks -> (final norm, head -> logits)."""

    def __init__(self, gpt: nn.Module, own: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.tok = gpt.tok if first else None
        self.pos = gpt.pos if first else None
        self.drop = gpt.drop if first else None
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in own)
        self.ln_f = gpt.ln_f if last else None
        self.head = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            ids, x = x, self.tok(x)
            if self.pos is not None:
                x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def cut_to_stage(gpt: nn.Module, rank: int, stages: int) -> GPTStage:
    """This rank's stage; the GPT drops (to nn.Identity / None) every part another stage owns."""
    return cut_to_stages(gpt, [rank], stages)[0]


def cut_to_stages(gpt: nn.Module, stage_ids: list[int], stages: int) -> list[GPTStage]:
    """The stages `stage_ids` (of `stages`) one rank runs, in that order; the GPT drops every part
    another rank's stages own (interleaved schedules give a rank several stages)."""
    from memfit.models.gpt import GPT

    if not isinstance(gpt, GPT):
        raise ConfigError(f"--strategy pipeline cuts memfit's GPT at block boundaries; got {type(gpt).__name__}. "
                          "Use a gpt spec or a known GPT-2/Llama name, or a data-parallel strategy")
    owns = [stage_blocks(len(gpt.blocks), stages, s) for s in stage_ids]
    parts = [GPTStage(gpt, own, s == 0, s == stages - 1) for s, own in zip(stage_ids, owns)]
    kept = {i for own in owns for i in own}
    for i in range(len(gpt.blocks)):
        if i not in kept:
            gpt.blocks[i] = nn.Identity()
    if 0 not in stage_ids:
        gpt.tok, gpt.pos = None, None
    if stages - 1 not in stage_ids:
        gpt.ln_f, gpt.head = None, None
    return parts


def tied_weight(stage: GPTStage) -> nn.Parameter | None:
    """The embedding matrix this stage shares with another (first and last stage, tied embeddings)."""
    if stage.first and stage.last:
        return None
    if stage.tok is not None and getattr(stage.tok, "_memfit_tied", False):
        return stage.tok.weight
    if stage.head is not None and getattr(stage.head, "_memfit_tied", False):
        return stage.head.weight
    return None


def mark_tied(gpt: nn.Module) -> None:
    """Remember, before the cut, whether head and embedding share their matrix."""
    tied = gpt.head.weight is gpt.tok.weight
    gpt.tok._memfit_tied = gpt.head._memfit_tied = tied
