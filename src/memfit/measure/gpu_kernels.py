"""The step a named GPU runs, traced on any machine: `with gpu_kernels(target("h100")): ...` inside
FakeTensorMode, on fake CPU tensors (a CPU-only torch cannot dispatch fake CUDA tensors through
composite ops such as attention: it has no CUDA device guard).

What differs from the CPU's step and is made to follow CUDA:
- attention: torch's CUDA backend choice and what that kernel saves (memfit.measure.gpu_attention);
- optimizers: torch.optim defaults to the foreach kernels for CUDA tensors (one temporary per list,
  e.g. AdamW's `exp_avg_sq.sqrt()` for all parameters at once), the per-tensor loop on the CPU;
- the allocator: `replay_on` replays the traced storages through the caching allocator's rules with
  the card's cuBLAS workspaces (memfit.measure.caching_allocator).
- autocast: CUDA's float32 list (layer_norm, softmax, sum, exp, pow, ...: memfit.measure.gpu_autocast),
  which the CPU's lacks.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from memfit.core.gpus import GpuSpec


@contextlib.contextmanager
def cuda_optimizer_defaults() -> Iterator[None]:
    """torch.optim picks foreach (the CUDA default) for CPU tensors too while inside."""
    import torch.optim.optimizer as optim_mod

    original = optim_mod._get_foreach_kernels_supported_devices
    optim_mod._get_foreach_kernels_supported_devices = lambda: [*original(), "cpu"]
    try:
        yield
    finally:
        optim_mod._get_foreach_kernels_supported_devices = original


@contextlib.contextmanager
def gpu_kernels(gpu: GpuSpec) -> Iterator["GpuAttentionMode"]:  # noqa: F821
    from memfit.measure.gpu_attention import GpuAttentionMode
    from memfit.measure.gpu_autocast import cuda_fp32_ops

    mode = GpuAttentionMode(gpu)
    with cuda_optimizer_defaults(), cuda_fp32_ops(), mode:
        yield mode


def replay_on(gpu: GpuSpec, events: list[tuple[int, int]]):
    """The traced step's storage events through the caching allocator, with `gpu`'s cuBLAS workspaces."""
    from memfit.measure.caching_allocator import replay, workspace_events

    return replay(workspace_events(gpu.capability) + events)
