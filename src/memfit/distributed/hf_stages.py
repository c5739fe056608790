"""A Hugging Face causal LM cut at decoder layers into pipeline stages.

    stage = cut_hf_to_stage(model, rank=0, stages=2)   # embeddings + layers 0..k-1; model keeps only these
    parts = cut_hf_to_stages(model, [1, 3], stages=4)  # interleaved: two stages of one rank

The cut follows the model's own pipeline plan (`config.base_model_pp_plan`: embed_tokens, layers,
norm): the first stage holds the token embeddings, the last the final norm and the head, every
stage its contiguous decoder layers (memfit.distributed.stages.stage_sizes) and the rotary table
(buffers only). A stage runs the model's own base forward (its causal masks and position
embeddings made from the stage's input as the whole model makes them), with the layers another
stage owns replaced by a pass-through and, past the first stage, the received hidden states given
as `inputs_embeds`. Families whose base forward transforms `inputs_embeds` (Gemma's scaling,
Granite's multiplier, GPT-2's position table) would transform them again on every stage: only the
families listed in PIPELINE_FAMILIES, whose forward passes them through, are cut.

A rank of an interleaved schedule runs several stages of one model: each stage's forward runs the
base forward with the model's layers swapped, for that call, for the stage's own view (its layers,
pass-throughs elsewhere) and the final norm for a pass-through unless it is the last stage.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.distributed.stages import stage_blocks

PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""model_types whose base forward takes `inputs_embeds` as the first layer's input unchanged."""


class PassThrough(nn.Module):
    """A layer another stage owns: its input hidden states, unchanged."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def check_hf_pipeline(config) -> None:
    """Refuse a family memfit does not cut (see the module docstring), before anything is built."""
    kind = getattr(config, "model_type", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    if kind not in PIPELINE_FAMILIES or set(plan) != {"embed_tokens", "layers", "norm"}:
        raise ConfigError(f"--strategy pipeline cuts a Hugging Face model at its decoder layers for model_type "
                          f"{', '.join(PIPELINE_FAMILIES)}; {kind!r} is not one of them. Use --strategy tensor "
                          f"(where it ships a tensor plan) or a data-parallel strategy (ddp, zero1-3)")


def hf_tied(lm: nn.Module) -> bool:
    out, inp = lm.get_output_embeddings(), lm.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


class HFStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM: ids or hidden states in, hidden states or logits out."""

    def __init__(self, lm: nn.Module, own: range, first: bool, last: bool, tied: bool,
                 shared: bool = False) -> None:
        """shared: the model holds other stages of this rank too (interleaved): forward runs only `own`."""
        super().__init__()
        self.lm, self.first, self.last, self.tied = lm, first, last, tied
        layers = lm.base_model.layers
        object.__setattr__(self, "blocks", nn.ModuleList(layers[i] for i in own))  # not a second owner
        skip = PassThrough()
        view = nn.ModuleList(layers[i] if i in own else skip for i in range(len(layers))) if shared else None
        object.__setattr__(self, "view", view)

    @contextlib.contextmanager
    def _own_layers(self):
        """The base model with only this stage's layers (and its final norm on the last stage) for one call."""
        if self.view is None:
            yield
            return
        base = self.lm.base_model
        layers, norm = base.layers, base.norm
        base.layers = self.view
        if not self.last:
            base.norm = PassThrough()
        try:
            yield
        finally:
            base.layers, base.norm = layers, norm

    @property
    def config(self):
        """The model's config: a checkpoint policy applied to the stage switches its KV cache off, as it
        does for the whole model (a cache would keep every layer's keys and values through the step)."""
        return self.lm.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.lm.base_model
        with self._own_layers():
            h = base(input_ids=x) if self.first else base(inputs_embeds=x)
        h = h.last_hidden_state
        return self.lm.get_output_embeddings()(h) if self.last else h

    def tied_weight(self) -> nn.Parameter | None:
        """The matrix this stage shares with another (first and last stage, tied embeddings)."""
        if not self.tied or (self.first and self.last):
            return None
        if self.first:
            return self.lm.get_input_embeddings().weight
        return self.lm.get_output_embeddings().weight if self.last else None


def cut_hf_to_stage(lm: nn.Module, rank: int, stages: int) -> HFStage:
    """This rank's stage; the model drops every part another stage owns (see the module docstring)."""
    return cut_hf_to_stages(lm, [rank], stages)[0]


def cut_hf_to_stages(lm: nn.Module, stage_ids: list[int], stages: int) -> list[HFStage]:
    """The stages `stage_ids` (of `stages`) one rank runs, in that order; the model drops every part
    another rank's stages own."""
    check_hf_pipeline(lm.config)
    base = lm.base_model
    tied = hf_tied(lm)
    owns = [stage_blocks(len(base.layers), stages, s) for s in stage_ids]
    kept = {i for own in owns for i in own}
    for i in range(len(base.layers)):
        if i not in kept:
            base.layers[i] = PassThrough()
    if 0 not in stage_ids:
        base.embed_tokens = None
    if stages - 1 not in stage_ids:
        base.norm = PassThrough()
        head = next(n for n, m in lm.named_children() if m is lm.get_output_embeddings())
        setattr(lm, head, None)
    shared = len(stage_ids) > 1
    return [HFStage(lm, own, s == 0, s == stages - 1, tied, shared) for s, own in zip(stage_ids, owns)]


def hf_shifted(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) as a Hugging Face causal LM scores them: position t predicts token t + 1;
    ignored targets are -100."""
    return logits[:, :-1].reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1)
