"""Host memory as a planning constraint: what a plan keeps in the host's RAM, and how much there is.

    limit = host_limit(host_memory, device, cluster=False)   # bytes per node (a plan's `host_memory`)

What a plan needs on the host: optimizer offload keeps the optimizer state there (and, in a cluster
plan, each rank's gradients on their way to it: memfit.plan.cluster_fit); `offload:cpu` blocks keep
what they moved off the device until their backward. On a CPU device host and device are the same
RAM, so the device peak counts too. A plan whose need exceeds the limit is not chosen; when no plan
fits, the error says so in one line.

Defaults (stated in every plan's output):
* one device on this machine (its CPU, or its own GPU), and ranks on this machine's CPU (--gpus with
  --device cpu): this machine's RAM;
* one GPU planned from a machine without it (a CUDA device or a GPU name where torch sees no GPU):
  256 GiB, one GPU's share of a DGX H100 node (2 TiB / 8);
* a cluster of GPUs (--gpus N|auto): DEFAULT_NODE_HOST per node of 8 devices, a DGX H100 node's
  2 TiB of system memory.
"""
from __future__ import annotations

import os
from typing import Any

from memfit.core.units import format_bytes

DEFAULT_NODE_HOST = 2 * 2**40
"""Host memory per node of a GPU cluster plan when not given: a DGX H100 (8 GPUs) has 2 TiB."""


def machine_ram() -> int:
    """This machine's physical memory in bytes."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: psutil when it is installed
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except ImportError:
            return 1 << 62  # unknown: no constraint


def host_limit(host_memory: Any, device: str, cluster: bool = False) -> tuple[int, str]:
    """(bytes, where the figure came from) for a plan's host memory per node."""
    from memfit.plan.costs import parse_budget

    if host_memory is not None:
        return parse_budget(host_memory, "host memory"), "given"
    if cluster and device != "cpu":
        return DEFAULT_NODE_HOST, "default: a DGX H100 node's 2 TiB"
    if device != "cpu" and not _local_gpu(device):  # a GPU planned from elsewhere: its host is not this one
        return DEFAULT_NODE_HOST // 8, "default: one GPU's share of a DGX H100 node, 2 TiB / 8"
    return machine_ram(), "default: this machine's RAM"


def _local_gpu(device: str) -> bool:
    import torch

    return device.startswith("cuda") and torch.cuda.is_available()


def describe(need: int, limit: int, source: str, per: str = "") -> str:
    return (f"host memory{per}: {format_bytes(need)} needed of {format_bytes(limit)} ({source}; "
            "--host-memory / host_memory= to change)")


def offloaded_bytes(prof: Any, actions: Any) -> int:
    """Bytes `offload:cpu` blocks keep on the host at the end of the forward: per moved block (a
    segment's first only: it moves the segment's input), what its action saves on the device without
    the offload less with it (a bound where a segment's input is smaller than one block's)."""
    from dataclasses import replace

    base = getattr(prof, "base", prof)  # a DiskProfile's base chain profile
    total, seen = 0, set()
    for a in actions:
        if a.offload != "cpu" or (a.segment is not None and a.segment in seen):
            continue
        seen.add(a.segment)
        with_, without = (base.fwd.get(str(replace(a, segment=None, offload=o))) for o in ("cpu", None))
        if with_ is not None and without is not None:
            total += max(0, without.net_bytes - with_.net_bytes)
    return total


def offload_masters(prof: Any, n: int, precision: str) -> int:
    """Host bytes optimizer offload keeps beside the state the device-resident profile counts: without
    master weights (32-true, bf16-true, ...) the streamed optimizer updates a host copy of each trainable
    parameter in its own dtype, which is the gradients' size (a mode with master weights counts them in
    its optimizer state already). On a CPU device that copy is the parameter itself (not counted there)."""
    from memfit.apply.policy import BlockAction
    from memfit.apply.precision import precision_mode

    if precision_mode(precision).master_dtype is not None:
        return 0
    base = getattr(prof, "base", prof)
    return int(base.at_optimizer([BlockAction("keep")] * n)[1])


def host_need(prof: Any, actions: Any, peak: int, optimizer_state: int, device: str) -> int:
    """Host bytes of a single-device plan: the offloaded optimizer's host bytes (`optimizer_state`: its
    state, and its master copies: `offload_masters`), the cpu-offloaded activations, and on a CPU device
    (one RAM) the device peak too. `peak` is the composed peak with the optimizer state counted on the
    device, as the planner's profiles hold it."""
    moved = offloaded_bytes(prof, actions)
    return moved + (peak if device == "cpu" else optimizer_state)
