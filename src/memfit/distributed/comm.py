"""Collectives that count the bytes this rank sends, where they are called.

Counts are per rank and follow the algorithm each collective is costed with (ring for the
symmetric collectives, a star for the parameter server's reduce and broadcast), over M bytes of
payload and N ranks:

    all_reduce      2 M (N-1)/N        reduce-scatter + all-gather of the ring
    reduce_scatter  M (N-1)/N          M: the full (unscattered) input
    all_gather      M (N-1)/N          M: the full (gathered) output
    reduce          M on every rank but the root, 0 on the root
    broadcast       M (N-1) on the root, 0 elsewhere

These are the volumes the ZeRO paper compares (DDP 2Ψ(N-1)/N per rank and step, ZeRO-3 1.5x).
Scalar control messages (token counts, overflow flags) are counted apart as "control".

`reduce_scatter_` and `all_gather_` work in place on a flat buffer whose chunk r is rank r's. On
gloo, torch's reduce-scatter clones its whole input and all-reduces the clone, and its all-gather
stages the output in a temporary of the output's size: one bucket more per collective, freed by
gloo's worker thread. memfit's flat buffers are its own to overwrite, so on gloo it all-reduces
the buffer in place (the same traffic as gloo's reduce-scatter, without the clone) and gathers with
one in-place broadcast per rank's chunk (each rank sends its chunk to the N-1 others: the ring
all-gather's M (N-1)/N). Both are counted with the reduce-scatter's and all-gather's formulas, as
on NCCL, where the native collectives are used.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Bytes sent by this rank, per collective, since the last reset()."""

    sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: float) -> None:
        self.sent[op] = self.sent.get(op, 0) + int(round(nbytes))
        self.calls[op] = self.calls.get(op, 0) + 1

    @property
    def total(self) -> int:
        """Payload bytes, control messages excluded."""
        return sum(v for k, v in self.sent.items() if k != "control")

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()

    def as_dict(self) -> dict:
        return {"total": self.total, "sent": dict(self.sent), "calls": dict(self.calls)}


TRAFFIC = Traffic()
"""This process's counter; strategies add to it, the train loop reads it per step."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _n(group) -> int:
    return dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group=None, async_op: bool = False):
    n = _n(group)
    TRAFFIC.add("all_reduce", 2 * _nbytes(t) * (n - 1) / n)
    if async_op:
        return dist.all_reduce(t, group=group, async_op=True)
    return _released(dist.all_reduce, t, group=group)


def _gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
RELEASE_WAIT_S = 1.0
"""How long a collective waits for gloo's worker to drop its tensor before going on without it."""


def _released(collective, t: torch.Tensor, /, *args, group=None, **kwargs):
    """`collective(t, ..., group=group)`, returning only once the backend holds no reference to t's storage.

    gloo's worker thread keeps a collective's tensors (its work object) a moment after the collective
    has returned: in about one call in seven on 2 ranks here. A buffer its caller drops meanwhile is
    then freed on that thread, late and at no fixed point of the caller's step (under load, seen in the
    middle of the optimizer step that followed a ZeRO-2 bucket's reduce-scatter: that rank's tracked peak
    7% over its estimate, the other rank's exact). So the collective runs on an alias of t, whose
    reference the storage's use count shows, and the call waits until the worker has dropped it; the
    caller's buffers are then freed where its code drops them, on every rank and every run."""
    if _USE_COUNT is None or not _gloo(group):
        return collective(t, *args, group=group, **kwargs)
    st = t.untyped_storage()
    held = _USE_COUNT(st._cdata)
    alias = t.view(t.shape)
    out = collective(alias, *args, group=group, **kwargs)
    del alias
    deadline = time.monotonic() + RELEASE_WAIT_S
    while _USE_COUNT(st._cdata) > held and time.monotonic() < deadline:
        time.sleep(0)  # lets the worker take the GIL, which freeing the alias's Python object needs
    return out


class _Works:
    """Several async collectives waited on as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def reduce_scatter_(full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's chunk of the sum over ranks of `full` (a flat tensor, N equal chunks). On gloo
    the result is a view into `full`, which the call overwrites; elsewhere a new tensor."""
    n, r = _n(group), dist.get_rank(group)
    TRAFFIC.add("reduce_scatter", _nbytes(full) * (n - 1) / n)
    if _gloo(group):
        _released(dist.all_reduce, full, group=group)
        return full.view(n, -1)[r]
    out = torch.empty(full.numel() // n, dtype=full.dtype, device=full.device)
    dist.reduce_scatter_single(out, full, group=group)
    return out


def all_gather_(flat: torch.Tensor, group=None, async_op: bool = False):
    """Fill `flat` (N equal chunks) with every rank's chunk; this rank's chunk is already in place."""
    n, r = _n(group), dist.get_rank(group)
    TRAFFIC.add("all_gather", _nbytes(flat) * (n - 1) / n)
    chunks = flat.view(n, -1)
    if _gloo(group):
        work = _Works([dist.broadcast(chunks[k], group=group, group_src=k, async_op=True) for k in range(n)])
    else:
        work = dist.all_gather_single(flat, chunks[r].clone(), group=group, async_op=True)
    if async_op:
        return work
    work.wait()
    return None


def reduce(t: torch.Tensor, dst: int = 0, group=None):
    if dist.get_rank(group) != dst:
        TRAFFIC.add("reduce", _nbytes(t))
    return _released(dist.reduce, t, dst=dst, group=group)


def broadcast(t: torch.Tensor, src: int = 0, group=None, count: bool = True):
    if count and dist.get_rank(group) == src:
        TRAFFIC.add("broadcast", _nbytes(t) * (_n(group) - 1))
    return _released(dist.broadcast, t, src=src, group=group)


def control_sum(values: list[float], group=None, op=dist.ReduceOp.SUM) -> list[float]:
    """All-reduce a few scalars (token counts, overflow flags, squared norms) in one message."""
    t = torch.tensor(values, dtype=torch.float64)
    n = _n(group)
    TRAFFIC.add("control", 2 * _nbytes(t) * (n - 1) / n)
    _released(dist.all_reduce, t, op=op, group=group)
    return t.tolist()


def ddp_counting_hook(group, bucket):
    """DDP communication hook: sum-all-reduce each bucket (no averaging: memfit divides each
    rank's loss by the global token count) and count its bytes."""
    buf = bucket.buffer()
    n = _n(group)
    TRAFFIC.add("all_reduce", 2 * _nbytes(buf) * (n - 1) / n)
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
