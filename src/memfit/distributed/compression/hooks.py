"""DDP comm hooks: register a compressor on a user's DistributedDataParallel model.

    state = register_compression(ddp_model, "topk:0.01")     # or int8, sign, bf16, fp16, powersgd:4
    ... train ...
    state.summary()   # bytes sent per step per rank, ratio vs fp32 all-reduce, encode/decode seconds

The hooks finish their collectives before returning (an already-completed Future), which keeps
encode and decode times measurable and the order of collectives identical on every rank.
"""
import functools
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch_psgd

from memfit.distributed.compression.cpu_sync import cpu_buckets_on_cuda_hosts
from memfit.distributed.compression.defaults import for_optimizer
from memfit.distributed.compression.exchange import Traffic, allreduce_bytes
from memfit.distributed.compression.powersgd import torch_powersgd_bytes, torch_powersgd_state
from memfit.core.errors import ConfigError
from memfit.distributed.compression.spec import CompressionSpec, check_compression_strategy, parse_compression
from memfit.distributed.compression.state import CompressionState


def _canonical(state: CompressionState, bucket) -> tuple[tuple, list[int]]:
    """The bucket's parameters in model order (positions) and the matching gradient order.

    Not bucket.index() or the bucket's own order: DDP rebuilds (reorders) its buckets after step 1
    and again in a resumed process, and residuals laid out in model order survive both."""
    index = state.param_index or {}
    ids = [index.get(id(p), id(p)) for p in bucket.parameters()]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return tuple(ids[i] for i in order), order


def compression_hook(state: CompressionState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over ranks through `state`'s compressor."""
    buf = bucket.buffer()
    grads = bucket.gradients()
    key, order = _canonical(state, bucket)
    sizes = [grads[i].numel() for i in order]  # per-tensor groups (layout.py)
    if order == list(range(len(grads))) or sum(sizes) != buf.numel():
        buf.copy_(state.exchange(buf, key, sizes))
    else:  # exchange in model order, write back in the bucket's
        out = state.exchange(torch.cat([grads[i].reshape(-1) for i in order]), key, sizes)
        offset = 0
        for i, n in zip(order, sizes):
            grads[i].copy_(out[offset:offset + n].view_as(grads[i]))
            offset += n
    if bucket.is_last():
        state.end_step()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


class TorchPowerSGDState:
    """torch's PowerSGDState plus the same counters as CompressionState."""

    def __init__(self, spec: CompressionSpec, group=None, average: bool = True) -> None:
        self.spec, self.group, self.average = spec, group, average
        self.psgd = torch_powersgd_state(spec.rank, spec.dense_steps, group)
        self.traffic = Traffic()
        self.encode_s = self.decode_s = 0.0
        self.steps = 0

    def state_dict(self) -> dict:
        """torch's PowerSGDState fields (error feedback, P/Q memories, rng), the counters."""
        keep = [k for k in self.psgd.__slots__ if k not in ("process_group", "rng")]
        name, key, pos, has_gauss, gauss = self.psgd.rng.get_state()  # numpy's: as a tensor for weights_only
        return {"spec": str(self.spec), "steps": self.steps, "sent": self.traffic.sent,
                "uncompressed": self.traffic.uncompressed, "psgd": {k: getattr(self.psgd, k) for k in keep},
                "rng": [name, torch.from_numpy(key.copy()), pos, has_gauss, gauss]}

    def load_state_dict(self, state: dict) -> None:
        if state["spec"] != str(self.spec):
            raise ValueError(f"the saved compressor state is for {state['spec']}, this run compresses with {self.spec}")
        self.steps, self.traffic.sent, self.traffic.uncompressed = state["steps"], state["sent"], state["uncompressed"]
        for k, v in state["psgd"].items():
            setattr(self.psgd, k, v)
        name, key, pos, has_gauss, gauss = state["rng"]
        self.psgd.rng.set_state((name, key.numpy(), pos, has_gauss, gauss))

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
    with cpu_buckets_on_cuda_hosts(bucket.buffer().device):  # gloo buckets on a CUDA machine
        fut = _torch_psgd.powerSGD_hook(state.psgd, bucket)
        out = fut.wait()  # keep the timing honest and the hook synchronous like the others
    state.encode_s += time.perf_counter() - t0  # includes torch's collectives: compression not separable
    if state.average:
        return fut
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(out.mul_(world))  # torch's hook averages; memfit's strategies sum
    return done


def register_compression(target, spec: str | CompressionSpec | None, group=None, optimizer=None):
    """Compress the gradient reduction of `target`; returns the state holding the byte counters.

    target: a torch DistributedDataParallel model (gradients averaged, DDP's convention), or what
    memfit.distributed.distribute returned for ddp, zero1 or zero2 (gradients summed, memfit's).
    spec: "topk:0.01" | "int8" | "sign" | "bf16" | "fp16" | "powersgd:4" | "powersgd:4,batched" |
    "none" (an fp32 all-reduce through the same path: bitwise the uncompressed result). Raises
    ConfigError (one line) for a bad spec or a target whose reduction cannot carry it.
    group: the process group of a torch DDP model (None = the default group).
    optimizer: for specs with adam= (frozen-variance Adam, onebit.py), the Adam(W) optimizer of a
    torch DDP model; memfit's strategies bring their own. Plain topk / sign run in adam mode when
    that optimizer is an Adam(W) that can carry it (defaults.py); without one, plain error feedback."""
    engine = getattr(target, "engine", target)
    if optimizer is None and not isinstance(target, torch.nn.parallel.DistributedDataParallel) and target is not engine:
        optimizer = target  # memfit's strategies: what distribute() returned is the optimizer
    if optimizer is None and getattr(target, "comm_hook", None) is not None:
        optimizer = target
    spec = for_optimizer(parse_compression(spec), optimizer)
    if hasattr(engine, "stage") and hasattr(engine, "compression"):  # memfit's ZeRO: ShardedOptimizer, ZeroEngine
        strategy = f"zero{engine.stage}"
        state = CompressionState(check_compression_strategy(strategy, spec), engine.group, average=False)
        state.per_call_steps = False  # the engine reports optimizer steps; micro-batches are not steps
        _compressed_adam(state, optimizer)
        if engine.stage < 3:  # zero3 passes the check only uncompressed ("none"): nothing to attach
            engine.compression = state
        return state
    memfit_ddp = getattr(target, "comm_hook", None)
    if memfit_ddp is not None:  # memfit's DDPOptimizer: its one hook dispatches to ours
        state, hook = _state_and_hook(check_compression_strategy("ddp", spec), memfit_ddp.group, average=False)
        state.param_index, state.params = _positions(target.ddp.module)
        _compressed_adam(state, optimizer)
        memfit_ddp.compression = functools.partial(hook, state)
        target.compression = state
        return state
    if not isinstance(target, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(f"register_compression takes a DistributedDataParallel model or what memfit's "
                          f"distribute() returned for ddp, zero1 or zero2, not {type(target).__name__}; "
                          "the parameter server and zero3 do not carry compression")
    state, hook = _state_and_hook(parse_compression(spec), group, average=True)
    state.param_index, state.params = _positions(target.module)
    _compressed_adam(state, optimizer)
    try:
        target.register_comm_hook(state, hook)
    except RuntimeError as exc:  # DDP takes one comm hook, once
        raise ConfigError(f"register_compression: this DDP model already has a comm hook ({exc}); "
                          "register compression on a fresh DistributedDataParallel") from None
    return state


def _positions(model: torch.nn.Module) -> tuple[dict[int, int], list]:
    params = list(model.parameters())
    return {id(p): i for i, p in enumerate(params)}, params


def _compressed_adam(state, optimizer) -> None:
    if getattr(state.spec, "adam", None) is not None:
        from memfit.distributed.compression.onebit import attach

        attach(state, optimizer)


def _state_and_hook(parsed: CompressionSpec, group, average: bool):
    if parsed.name == "powersgd" and not parsed.batched:
        return TorchPowerSGDState(parsed, group, average), torch_powersgd_hook
    return CompressionState(parsed, group, average), compression_hook
