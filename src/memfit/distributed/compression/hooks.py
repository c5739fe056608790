"""DDP comm hooks: register a compressor on a user's DistributedDataParallel model.

    state = register_compression(ddp_model, "topk:0.01")     # or int8, sign, bf16, fp16, powersgd:4
    ... train ...
    state.summary()   # bytes sent per step per rank, ratio vs fp32 all-reduce, encode/decode seconds

The hooks finish their collectives before returning (an already-completed Future), which keeps
encode and decode times measurable and the order of collectives identical on every rank.
"""
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch_psgd

from memfit.distributed.compression.exchange import Traffic, allreduce_bytes
from memfit.distributed.compression.powersgd import torch_powersgd_bytes, torch_powersgd_state
from memfit.distributed.compression.spec import CompressionSpec, parse_compression
from memfit.distributed.compression.state import CompressionState


def _bucket_key(bucket) -> int:
    # Parameter identity, not bucket.index(): DDP rebuilds (reorders) its buckets after step 1.
    return hash(tuple(id(p) for p in bucket.parameters()))


def compression_hook(state: CompressionState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over ranks through `state`'s compressor."""
    buf = bucket.buffer()
    sizes = [g.numel() for g in bucket.gradients()]  # per-tensor groups (layout.py)
    buf.copy_(state.exchange(buf, _bucket_key(bucket), sizes))
    if bucket.is_last():
        state.end_step()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


class TorchPowerSGDState:
    """torch's PowerSGDState plus the same counters as CompressionState."""

    def __init__(self, spec: CompressionSpec, group=None) -> None:
        self.spec, self.group = spec, group
        self.psgd = torch_powersgd_state(spec.rank, spec.start, group)
        self.traffic = Traffic()
        self.encode_s = self.decode_s = 0.0
        self.steps = 0

    def summary(self) -> dict:
        out = CompressionState.summary(self)  # same fields
        out["compression"] = f"powersgd:{self.spec.rank} (torch powerSGD_hook)"
        return out


def torch_powersgd_hook(state: TorchPowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    world = dist.get_world_size(state.group)
    grads = bucket.gradients()
    state.traffic.uncompressed += allreduce_bytes(bucket.buffer().numel() * bucket.buffer().element_size(), world)
    state.traffic.add("all_reduce", torch_powersgd_bytes(state.psgd, grads, world))
    if bucket.is_last():
        state.steps += 1
    t0 = time.perf_counter()
    fut = _torch_psgd.powerSGD_hook(state.psgd, bucket)
    fut.wait()  # keep the timing honest and the hook synchronous like the others
    state.encode_s += time.perf_counter() - t0  # includes torch's collectives: compression not separable
    return fut


def register_compression(ddp_model: torch.nn.parallel.DistributedDataParallel,
                         spec: str | CompressionSpec | None, group=None):
    """Compress `ddp_model`'s gradient all-reduce; returns the state holding the byte counters.

    spec: "topk:0.01" | "int8" | "sign" | "bf16" | "fp16" | "powersgd:4" | "powersgd:4,batched" |
    "none" (memfit's fp32 all-reduce hook: bitwise the same result as DDP's default). Raises
    ConfigError for a bad spec. group: the process group DDP uses (None = the default group)."""
    parsed = parse_compression(spec)
    if parsed.name == "powersgd" and not parsed.batched:
        state = TorchPowerSGDState(parsed, group)
        ddp_model.register_comm_hook(state, torch_powersgd_hook)
        return state
    state = CompressionState(parsed, group)
    ddp_model.register_comm_hook(state, compression_hook)
    return state
