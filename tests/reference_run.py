"""One process on the whole global batch: the reference the model-parallel tests compare with."""
from __future__ import annotations

import torch

from memfit.models.gpt import GPT, GPTConfig


def global_batches(cfg: dict, global_batch: int, steps: int, accum: int) -> list[list[torch.Tensor]]:
    """`steps` lists of `accum` (global_batch, seq + 1) token windows, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, cfg["vocab"], (global_batch, cfg["seq"] + 1), generator=g) for _ in range(accum)]
            for _ in range(steps)]


def single_losses(cfg: dict, batches: list[list[torch.Tensor]], policy: str | None = None,
                  optimizer: str = "adamw", precision: str = "32-true") -> list[float]:
    """Per-step mean loss of one process (lr 1e-2, clip 1.0), seed 0 as the ranks use."""
    from memfit.apply.checkpoint import checkpoint
    from memfit.apply.optimizer import TrainingOptimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    if policy:
        checkpoint(model, policy)
    losses = []
    with TrainingOptimizer(model, optimizer, lr=1e-2, clip=1.0, precision=precision) as opt:
        for micro in batches:
            tot = sum(m[:, 1:].numel() for m in micro)
            run = 0.0
            for m in micro:
                with opt.autocast():
                    _, loss, _ = model(m[:, :-1].contiguous(), m[:, 1:].contiguous())
                opt.backward(loss / tot)
                run += float(loss.detach())
            opt.step()
            losses.append(run / tot)
    return losses


def train_rank(rank, world, cfg: dict, stop_at, resume_dir):
    """One rank of `memfit train` (the loop in process): fresh with cfg up to stop_at, or resumed from
    resume_dir; its per-step losses."""
    from memfit.train import loop

    if resume_dir is not None:
        result = loop.train(*loop.resume_config(resume_dir, {}), progress=False)
    else:  # run_world's ranks are a gloo group: the CPU, also on a machine with GPUs
        result = loop.train(loop.TrainConfig(**{"device": "cpu", **cfg}), stop_at=stop_at, progress=False)
    return result.metrics["steps"]["loss"]
