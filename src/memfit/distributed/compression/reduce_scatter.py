"""Compressed reduce-scatter for ZeRO-2 (and ZeRO-1's gradient reduction).

    state = CompressionState("topk:0.01", group)         # one per gradient stream, kept across steps
    shard = compressed_reduce_scatter(flat_grad, group, state, key=bucket_id, sizes=param_numels)
    ...                                                     # after the optimizer step:
    state.end_step()

Every rank passes its full flat gradient buffer (same length on every rank, divisible by the
world size: an even flat split, as ZeRO's flat partition pads to). The compressed payload of the
whole buffer is exchanged (all_gather for top-k / int8 / sign, all_reduce for casts and PowerSGD),
decoded, averaged, and the rank's contiguous 1/N shard is returned: the mean over ranks (the sum
for a state made with average=False, as memfit's ZeRO uses), so the caller must not divide by
the world size again. Error feedback is kept per `key` over the full
buffer, exactly as in the DDP hooks: the elements of other ranks' shards that this rank did not
send stay in its residual too. Use a distinct `key` per bucket when a step reduces several.

Top-k, int8 and sign gather whole-buffer payloads, so a rank sends (N - 1) x payload bytes
against (N - 1) / N x 4 bytes per element for an fp32 reduce-scatter: compression pays while the
payload is smaller than 1/N of the fp32 buffer (top-k 1%: 6% of it; int8 at N=2: 25%).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from memfit.core.errors import ConfigError
from memfit.distributed.compression.state import CompressionState


def compressed_reduce_scatter(flat_grad: torch.Tensor, group, state: CompressionState, key=0,
                              sizes: list[int] | None = None) -> torch.Tensor:
    """This rank's shard (numel / N elements, flat_grad's dtype) of the mean (or, average=False, the
    sum) of all ranks' flat_grad.

    sizes: the lengths of the parameters laid out in flat_grad (padding may be its own entry), so
    top-k budgets and int8/sign scales stay within one tensor; None treats the buffer as one."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if flat_grad.dim() != 1:
        raise ConfigError(f"compressed_reduce_scatter takes a flat 1-D gradient, got shape {tuple(flat_grad.shape)}")
    if flat_grad.numel() % world:
        raise ConfigError(f"compressed_reduce_scatter: {flat_grad.numel()} elements do not split evenly over "
                          f"{world} ranks; pad the flat buffer to a multiple of the world size")
    shard = state.exchange(flat_grad, key, sizes, shard=rank)
    # uncompressed baseline for ZeRO is a reduce-scatter, not an all-reduce: half the bytes
    state.traffic.uncompressed -= flat_grad.numel() * flat_grad.element_size() * (world - 1) // world
    return shard.clone()
