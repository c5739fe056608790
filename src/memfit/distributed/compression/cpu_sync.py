"""Let torch's PowerSGD hook decompress CPU (gloo) buckets on a machine that has CUDA.

torch's powerSGD_hook ends with `if torch.cuda.is_available(): torch.cuda.synchronize(device)`
where `device` is the bucket's device; for a CPU bucket on a CUDA machine that raises
"Expected a cuda device, but got: cpu". `cpu_buckets_on_cuda_hosts` makes torch.cuda.synchronize
a no-op for a CPU device argument (there is nothing to wait for) while the hook runs, and only
when the bucket is on the CPU and CUDA is available: elsewhere nothing is patched.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_lock = threading.Lock()
_depth = 0
_original = None


def _is_cpu(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and torch.device(device).type == "cpu"


def _synchronize(device=None) -> None:
    if device is not None and _is_cpu(device):
        return  # CPU work is already done when the callback runs
    _original(device)


@contextlib.contextmanager
def cpu_buckets_on_cuda_hosts(device: torch.device) -> Iterator[None]:
    """While open, torch.cuda.synchronize(<a cpu device>) returns at once (for `device` on the CPU
    of a CUDA machine; otherwise a no-op context). Re-entrant and thread-safe: the first opener
    patches, the last closer restores."""
    global _depth, _original
    if device.type != "cpu" or not torch.cuda.is_available():
        yield
        return
    with _lock:
        if _depth == 0:
            _original = torch.cuda.synchronize
            torch.cuda.synchronize = _synchronize
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.cuda.synchronize = _original
