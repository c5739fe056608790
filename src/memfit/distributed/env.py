"""The process group: joining it with timeouts (never a hang), the backend for the device, a free port.

torchrun (or `memfit train --nproc N`) sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; `init()`
reads them. Every collective gets `timeout_s` so a rank that died or diverged turns into an error
on the others instead of a hang.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from memfit.core.errors import ConfigError

DEFAULT_TIMEOUT_S = 120.0


def backend_for(device: torch.device | str) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for a rendezvous on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launched() -> bool:
    """True inside a process started by torchrun / memfit's launcher (the env names a world)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: torch.device | str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group described by the environment (if not joined yet); returns (rank, world)."""
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed; install a build with it or run one process")
    if not dist.is_initialized():
        if not launched():
            raise ConfigError("no process group: start with torchrun or `memfit train --nproc N`")
        device = torch.device(device)
        if device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", 0))
            if local >= torch.cuda.device_count():  # else a bare "CUDA error: invalid device ordinal"
                raise ConfigError(f"local rank {local} has no GPU: this machine has {torch.cuda.device_count()}; "
                                  "start one process per GPU, or use the CPU (gloo) with device cpu")
            torch.cuda.set_device(local)
        timeout = datetime.timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            store, rank_, world_ = _attempt_store(timeout)
            dist.init_process_group(backend_for(device), store=store, rank=rank_, world_size=world_, timeout=timeout)
        else:
            dist.init_process_group(backend_for(device), timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout: datetime.timedelta):
    """torchelastic's store seen through a prefix of its own per attempt.

    torchrun's c10d rendezvous shares one TCPStore across restarts, so the keys the failed
    attempt's ranks wrote (gloo's peer addresses under "default_pg/...") are still there; a
    restarted rank that reads one connects to a dead process ("Connection refused" in
    connectFullMesh). A prefix per TORCHELASTIC_RESTART_COUNT gives each attempt a clean
    namespace on the same store."""
    store, rank_, world_ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"memfit/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store), rank_, world_


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_device(device: torch.device | str) -> torch.device:
    """cuda -> this rank's GPU (LOCAL_RANK); cpu stays cpu."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
