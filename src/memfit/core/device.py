"""The one check of a device name that memfit accepts: cpu, cuda or cuda:N (on a machine with CUDA), and,
where memfit only predicts (estimate, plan), a named GPU such as h100 (memfit.core.gpus) on any machine."""
from __future__ import annotations

import torch

from memfit.core.errors import ConfigError
from memfit.core.gpus import NAMES, GpuSpec, target

ACCEPTED = "cpu, cuda, cuda:N"


def estimate_device(name: "str | GpuSpec | None") -> tuple[str, GpuSpec | None]:
    """Where a prediction traces and for which GPU: a named GPU (h100, a100-80gb, ...) traces on the CPU
    as that GPU runs the step, on any machine; anything else is `resolve_device`'s (None: cpu)."""
    gpu = target(name)
    if gpu is not None:
        return "cpu", gpu
    if name is None:
        return "cpu", None
    try:
        return str(resolve_device(name)), None
    except ConfigError as exc:
        if "CUDA build" in str(exc):
            raise ConfigError(f"device {name!r}: this machine has no CUDA GPU; name the GPU to estimate or plan for, "
                              f"which works from any machine: {NAMES}") from None
        raise ConfigError(f"{exc}; or a GPU to estimate for from any machine: {NAMES}") from None


def resolve_device(name: str | torch.device | None) -> torch.device:
    """`name` as a torch.device; None: cuda when available, else cpu.

    ConfigError for a name torch cannot read, a device type other than cpu/cuda, and cuda on a
    machine (or a PyTorch build) without CUDA."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = target(name)
    if gpu is not None:
        raise ConfigError(f"{name!r} names a GPU to estimate or plan for (memfit estimate/plan --device {gpu.name}); "
                          "to run on this machine's GPU use cuda")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {name!r}; accepted: {ACCEPTED}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {name!r}; accepted: {ACCEPTED}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} needs a CUDA build of PyTorch with a GPU; use cpu (to estimate or plan "
                          f"for a GPU from this machine, name it: --device {next(iter(NAMES.split(', ')))})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
