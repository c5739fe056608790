"""Swap a model's LM head + cross-entropy for the chunked one (memfit.apply.chunked_head), in place.

    memfit.chunk_head(model, 8)                     # memfit GPT or a Hugging Face causal LM
    _, loss, n = gpt(x, y)                          # logits None; loss and gradients as before
    loss = hf_model(input_ids=x, labels=x).loss     # output.logits is None
    chunk_head(model, None)                         # back to the plain head

memfit's GPT gets a `head_loss` (its forward calls it instead of head + cross-entropy). A Hugging Face
causal LM gets an instance `forward` that, when called with `labels`, runs the base model, shifts the
labels as the library's ForCausalLMLoss does, and computes the loss chunked; without labels it is the
model's own forward. Parameters, state_dict keys and call signatures are unchanged.
"""
from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from memfit.apply.chunked_head import chunked_cross_entropy, summed_loss_divisor
from memfit.core.errors import ConfigError

# Hugging Face models that transform their logits after the head (the chunked head computes plain ones).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class ChunkedHeadLoss:
    """GPT.head_loss: head + cross-entropy computed in `chunks` chunks (picklable, copyable)."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks

    def __call__(self, hidden, weight, bias, targets, ignore_index: int, reduction: str) -> torch.Tensor:
        return chunked_cross_entropy(hidden, weight, targets, bias, chunks=self.chunks, ignore_index=ignore_index,
                                     reduction=reduction)


def head_chunks(model: nn.Module) -> int | None:
    """The chunk count of the installed chunked head, or None for the plain head."""
    return getattr(model, "_memfit_head_chunks", None)


def chunk_head(model: nn.Module, chunks: int | None) -> nn.Module:
    """Install a chunked LM head with `chunks` chunks (None or 0: restore the plain head); returns model."""
    from memfit.models.gpt import GPT

    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0):
        raise ConfigError(f"head chunks must be a positive integer or none, got {chunks!r}")
    chunks = chunks or None
    if isinstance(model, GPT):
        model.head_loss = ChunkedHeadLoss(chunks) if chunks else None
    elif chunks:
        _check_hf(model)
        model.forward = types.MethodType(_signed_forward(type(model).forward), model)
    else:
        if getattr(getattr(model.__dict__.get("forward"), "__func__", None), "_memfit_chunked", False):
            del model.forward  # only our own instance forward: the model's class forward is back
        model.__dict__.pop("_memfit_head_chunks", None)
        return model
    model._memfit_head_chunks = chunks
    return model


def head_weight(model: nn.Module) -> torch.Tensor:
    """The LM head's weight (vocab, hidden) of memfit's GPT or a Hugging Face causal LM."""
    from memfit.models.gpt import GPT

    if isinstance(model, GPT):
        return model.head.weight
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"found no LM head in {type(model).__name__}: expected memfit's GPT or a Hugging Face "
                          "causal LM with an nn.Linear lm_head")
    return head.weight


def _check_hf(model: nn.Module) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or not hasattr(model, "base_model") or model.base_model is model:
        raise ConfigError(f"cannot chunk the head of {type(model).__name__}: expected memfit's GPT or a Hugging Face "
                          "causal LM (a base model plus an nn.Linear lm_head)")
    # The chunked head feeds the base model's last hidden state straight to lm_head: a module with weights
    # between them (ELECTRA's generator_predictions: dense, activation, LayerNorm) would be skipped.
    own = {id(p) for p in head.parameters()} | {id(p) for p in model.base_model.parameters()}
    between = [n for n, m in model.named_children()
               if m is not model.base_model and any(id(p) not in own for p in m.parameters())]
    if between:
        raise ConfigError(f"cannot chunk the head of {type(model).__name__}: its {between[0]} has layers of its own "
                          "between the base model's output and the LM head's weight; leave chunked-head out of "
                          "--allow for this model")
    cfg = getattr(model, "config", None)
    found = [a for a in _LOGIT_TRANSFORMS if getattr(cfg, a, None) not in (None, 1, 1.0)]
    if found:
        raise ConfigError(f"{type(model).__name__} transforms its logits ({found[0]}); the chunked head computes "
                          "plain lm_head logits: leave chunked-head out of --allow for this model")
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        raise ConfigError(f"{type(model).__name__} uses the {model.loss_type} loss; the chunked head computes the "
                          "causal-LM cross-entropy only")


def hidden_states(model: nn.Module, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The base model's last hidden state (and its output) for a Hugging Face causal LM."""
    out = model.base_model(**kwargs)
    return out[0], out


def head_cross_entropy(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                       reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the model's LM head on `hidden` against (already shifted) `targets`, chunked."""
    head = model.get_output_embeddings()
    return chunked_cross_entropy(hidden, head.weight, targets, head.bias, chunks=head_chunks(model) or 1,
                                 ignore_index=ignore_index, reduction=reduction)


def _signed_forward(plain):
    """_chunked_forward under the class forward's name and signature: Trainer's column filter
    (remove_unused_columns) and its loss-kwargs check read `inspect.signature(model.forward)`."""
    def forward(self: nn.Module, *args: Any, **kwargs: Any):
        return _chunked_forward(self, *args, **kwargs)

    functools.update_wrapper(forward, plain)
    forward._memfit_chunked = True
    return forward


def _chunked_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The instance forward of a Hugging Face causal LM with a chunked head (bound with MethodType, so a
    deepcopy of the model is bound to the copy)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    plain = type(self).forward
    given = dict(inspect.signature(plain).bind(self, *args, **kwargs).arguments)
    labels = given.pop("labels", None)
    if labels is None:
        return plain(self, *args, **kwargs)
    given.pop("self", None)
    extra = given.pop("kwargs", {})
    num_items = extra.pop("num_items_in_batch", None)
    given.pop("logits_to_keep", None)
    hidden, out = hidden_states(self, **given, **extra)
    # As transformers' ForCausalLMLoss: tokens < n predict n; the last position has no target.
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    with summed_loss_divisor(num_items):  # (None: the loss's own count) the gradient backward will bring
        loss = head_cross_entropy(self, hidden, shifted.to(hidden.device), -100,
                                  "mean" if num_items is None else "sum")
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                  hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))
