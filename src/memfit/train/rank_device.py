"""Where a rank of `memfit train --strategy S` trains: its device (one GPU per process, or the CPU with a
note) and the engine that carries out its strategy (cfg.engine "auto" resolved once, before launch)."""
from __future__ import annotations

import os
from typing import Any

import torch

from memfit.core.errors import ConfigError


def resolve_engine(cfg: Any, device: torch.device | str | None = None) -> str | None:
    """Replace cfg.engine "auto" by the engine the run trains on (memfit.distributed.strategy.engine_for), so
    its config, metrics.json and checkpoints record it. Returns the line to print once (zero1-3), else None."""
    from memfit.core.device import resolve_device
    from memfit.distributed.strategy import engine_for, engine_line

    if getattr(cfg, "engine", "memfit") != "auto":
        return None
    on = torch.device(device) if device is not None else resolve_device(rank_device(cfg.device)[0])
    engine, reason = engine_for(cfg.strategy, precision=cfg.precision, optimizer=cfg.optimizer, cuda=on.type == "cuda",
                                offload=None if cfg.offload_optimizer in (None, "none") else cfg.offload_optimizer,
                                compress=getattr(cfg, "compress", None))
    cfg.engine = engine
    return engine_line(engine, reason) if cfg.strategy in ("zero1", "zero2", "zero3") else None


def rank_device(name: str | None, world: int | None = None) -> tuple[str | None, str | None]:
    """The device each rank trains on, and a warning to print once (or None).

    One GPU per process, as torchrun users expect (cuda = this rank's LOCAL_RANK GPU). With more
    processes on this machine (LOCAL_WORLD_SIZE, else `world`) than CUDA devices: --device cuda is a
    ConfigError naming both counts; no --device trains on the CPU (gloo), as on a machine without
    GPUs, and says so. cpu and cuda:N are taken as given."""
    from memfit.core.device import resolve_device

    processes = int(os.environ.get("LOCAL_WORLD_SIZE") or world or os.environ.get("WORLD_SIZE") or 1)
    if processes < 2 or not torch.cuda.is_available() or (gpus := torch.cuda.device_count()) >= processes:
        return name, None
    instead = f"--nproc {gpus} (one process per GPU)" if gpus > 1 else "one process (no --nproc) on the GPU"
    if name is None:
        return "cpu", (f"memfit train: {processes} processes on a machine with {gpus} GPU(s): training on cpu (gloo); "
                       f"run {instead}, or pass --device cpu to keep the CPU without this note")
    if resolve_device(name) == torch.device("cuda"):
        raise ConfigError(f"--device cuda runs one process per GPU: {processes} processes need {processes} GPUs and "
                          f"this machine has {gpus}; run {instead}, or pass --device cpu")
    return name, None
