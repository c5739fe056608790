"""The one check of a device name that memfit accepts: cpu, cuda or cuda:N (on a machine with CUDA)."""
from __future__ import annotations

import torch

from memfit.core.errors import ConfigError

ACCEPTED = "cpu, cuda, cuda:N"


def resolve_device(name: str | torch.device | None) -> torch.device:
    """`name` as a torch.device; None: cuda when available, else cpu.

    ConfigError for a name torch cannot read, a device type other than cpu/cuda, and cuda on a
    machine (or a PyTorch build) without CUDA."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {name!r}; accepted: {ACCEPTED}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {name!r}; accepted: {ACCEPTED}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} needs a CUDA build of PyTorch with a GPU; use cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
