"""One optimizer step and one evaluation: the arithmetic of the loop, with no bookkeeping."""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class StepOutput(NamedTuple):
    loss: float
    """Mean loss per target token over the whole accumulated batch."""
    ntokens: int
    result: Any
    """The TrainingOptimizer's StepResult (stepped, grad_norm, loss_scale)."""


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, counted targets) for memfit's GPT or a Hugging Face causal LM; -1 = padding."""
    from memfit.models.gpt import GPT

    if isinstance(model, GPT):
        _, loss, n = model(x, y)
        return loss, n
    if getattr(model, "_memfit_head_chunks", None):  # chunked head (memfit.apply.head_swap): no logits
        from memfit.apply.head_swap import head_cross_entropy, hidden_states

        return head_cross_entropy(model, hidden_states(model, input_ids=x)[0], y, -1, "sum"), (y != -1).sum()
    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=-1, reduction="sum")
    return loss, (y != -1).sum()


def accumulate_grads(model: nn.Module, opt, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """Backward over all micro-batches into one set of grads; returns (mean loss per token, tokens).

    Each micro-batch's *summed* loss is divided by the target-token count of the whole accumulated
    batch, so the grads equal one large batch's mean-loss grads even when padding (-1) makes the
    micro-batches unequal. Dividing by the number of micro-batches instead would weight a token in
    a short micro-batch more than one in a long one.
    """
    from memfit.apply.chunked_head import summed_loss_divisor

    micro_batches = list(micro_batches)
    total = int(sum((y != -1).sum() for _, y in micro_batches))  # one host sync, not one per micro-batch
    denom = max(total, 1)  # an all-padding batch has zero loss and zero grads, not NaN
    running = None
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        with opt.autocast(), summed_loss_divisor(denom):  # a chunked head expects this gradient (exact)
            loss, _ = loss_sum(model, x, y)
        # final: with optimizer offload, updates may start while the last backward still runs.
        opt.backward(loss / denom, final=i == last)
        running = loss.detach().float() if running is None else running + loss.detach().float()
    mean = float(running) / denom if running is not None else 0.0  # one host sync per step
    return mean, total


def accumulate_step(model: nn.Module, opt, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> StepOutput:
    """accumulate_grads, then one optimizer step (which also zeroes the grads)."""
    loss, ntokens = accumulate_grads(model, opt, micro_batches)
    return StepOutput(loss, ntokens, opt.step())


@torch.no_grad()
def evaluate(model: nn.Module, opt, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean loss per token over fixed validation batches (dropout off)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in batches:
            with opt.autocast():
                loss, n = loss_sum(model, x.to(device), y.to(device))
            total += float(loss)
            count += int(n)
    finally:
        model.train(was_training)
    return total / max(count, 1)
