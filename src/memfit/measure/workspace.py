"""Kernel workspaces that never surface as a tensor, added to a traced step where a kernel is known to need them.

The tracker counts tensor storages; a kernel's internal buffers are invisible to it (and to any
dispatch-level view). On the CPU, oneDNN's convolution backward reorders the incoming gradient, the
input and the weight into its blocked layout before computing: a transient copy of each, live while
the op allocates its outputs (measured with the allocator's profiler events, tests/test_measure_plain_modules.py).
`WorkspaceTracker` holds such a transient around the op, so the trace's peak sees it.
"""
from __future__ import annotations

import torch

from memfit.core.ledger import TEMPORARIES
from memfit.core.tracker import MemoryTracker


BLOCK = 8
"""oneDNN's blocked layouts group channels by 8 (AVX2; 16 on AVX-512 machines): a partial group is padded."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _blocked(t: torch.Tensor) -> int:
    """Bytes of t (N, C, ...) with C padded to a whole channel block."""
    c = t.shape[1]
    return _nbytes(t) // max(c, 1) * (-(-c // BLOCK) * BLOCK)


def workspace_bytes(func, args) -> int:
    """Bytes a CPU kernel allocates internally for this call (0 when none is known)."""
    if func is torch.ops.aten.convolution_backward.default:
        grad_output, inputs, weight = args[0], args[1], args[2]
        if grad_output.device.type == "cpu" and grad_output.dim() >= 4:
            return _blocked(grad_output) + _blocked(inputs) + _nbytes(weight)
    return 0


class WorkspaceTracker(MemoryTracker):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = workspace_bytes(func, args) if self._dev_type == "cpu" else 0
        if not n:
            return super().__torch_dispatch__(func, types, args, kwargs)
        scratch = torch.empty(n, dtype=torch.uint8, device=args[0].device)
        if self._register(scratch, TEMPORARIES):
            with self._lock:
                self._check_peak()
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            del scratch
