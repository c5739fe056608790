"""The collectives that move compressed gradients, with the bytes each rank sends counted at the call.

Only collectives that both gloo and NCCL support are used: all_gather_single (formerly
all_gather_into_tensor) of one packed uint8 payload per rank (top-k, int8, sign), all_to_all_single
of per-shard payloads (ZeRO's compressed reduce-scatter), and all_reduce in the wire dtype (casts,
PowerSGD's P and Q, which are linear and so can be summed as sent).

Bytes sent per rank are the ring algorithm's volumes for the tensor handed to the collective:
all_gather of B bytes per rank sends B * (N - 1); all_to_all sends what is addressed to other
ranks; all_reduce of B bytes sends 2 * B * (N - 1) / N
(the same formula as DDP's 2 Psi (N - 1) / N for uncompressed fp32 gradients).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from memfit.distributed import comm


@dataclass
class Traffic:
    """Bytes this rank sent, and what uncompressed fp32 all-reduce of the same gradients would send."""
    sent: int = 0
    uncompressed: int = 0
    calls: int = 0
    by_collective: dict = field(default_factory=dict)

    def add(self, collective: str, nbytes: int) -> None:
        self.sent += nbytes
        self.calls += 1
        self.by_collective[collective] = self.by_collective.get(collective, 0) + nbytes
        comm.TRAFFIC.add(f"compressed_{collective}", nbytes)  # the process-wide per-step count too

    @property
    def ratio(self) -> float:
        return self.uncompressed / self.sent if self.sent else float("nan")


# all_gather_into_tensor was renamed all_gather_single (the old name warns in newer torch)
all_gather_flat = _all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def allreduce_bytes(nbytes: int, world: int) -> int:
    return 2 * nbytes * (world - 1) // world


def allgather_bytes(nbytes: int, world: int) -> int:
    return nbytes * (world - 1)


def pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors of any dtypes into one flat uint8 buffer (their raw bytes)."""
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def unpack(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of pack for parts shaped and typed like `like` (the same on every rank)."""
    out, offset = [], 0
    for p in like:
        n = p.numel() * p.element_size()
        # clone: a slice at an odd byte offset cannot be viewed as a wider dtype
        out.append(buffer[offset:offset + n].clone().view(p.dtype).view(p.shape))
        offset += n
    return out


def gather_parts(parts: list[torch.Tensor], group, traffic: Traffic) -> list[list[torch.Tensor]]:
    """Every rank's payload, in rank order (the same list on every rank)."""
    world = dist.get_world_size(group)
    buf = pack(parts)
    out = torch.empty(world * buf.numel(), dtype=torch.uint8, device=buf.device)
    _all_gather_flat(out, buf, group=group)
    traffic.add("all_gather", allgather_bytes(buf.numel(), world))
    return [unpack(chunk, parts) for chunk in out.chunk(world)]


def all_reduce_sum(t: torch.Tensor, group, traffic: Traffic) -> torch.Tensor:
    """Sum over ranks in place (t's dtype on the wire)."""
    dist.all_reduce(t, group=group)
    traffic.add("all_reduce", allreduce_bytes(t.numel() * t.element_size(), dist.get_world_size(group)))
    return t


def scatter_parts(chunks: list[list[torch.Tensor]], group, traffic: Traffic, rank: int) -> list[list[torch.Tensor]]:
    """A compressed reduce-scatter's exchange: chunks[j] (this rank's payload for rank j's shard)
    goes to rank j; returns every rank's payload for this rank's shard, in rank order. Sends
    the bytes of the other ranks' payloads only: (N - 1) / N of a whole-buffer payload."""
    world = len(chunks)
    bufs = [pack(p) for p in chunks]
    splits = [b.numel() for b in bufs]
    own = splits[rank]
    out = torch.empty(world * own, dtype=torch.uint8, device=bufs[0].device)
    dist.all_to_all_single(out, torch.cat(bufs), output_split_sizes=[own] * world, input_split_sizes=splits,
                           group=group)
    traffic.add("all_to_all", sum(splits) - own)
    return [unpack(c, chunks[rank]) for c in out.chunk(world)]
