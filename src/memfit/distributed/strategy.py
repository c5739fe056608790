"""One call puts a model and its optimizer on a data-parallel strategy.

    from memfit.distributed import distribute, init
    init("cpu")                                   # under torchrun: gloo on CPU, NCCL on CUDA
    opt = distribute(model, "zero2", optimizer="adamw", lr=3e-4, precision="bf16-master", clip=1.0)
    for i, (x, y) in enumerate(micro_batches):    # this rank's share of the global batch
        with opt.micro_batch(last=i == k - 1), opt.autocast():
            _, loss, _ = opt.model(x, y)          # opt.model: the model to call (DDP wraps it)
        opt.backward(loss / global_tokens, final=i == k - 1)
    opt.step()

Every strategy has TrainingOptimizer's interface (autocast, backward, step, param_groups,
state_tensors, state_dict) plus `model`, `micro_batch(last)` and `tracked_module` (what
memfit.track should watch: the model and, for ZeRO, this rank's shard). Gradients are *summed*
across ranks: divide each rank's loss by the token count of the whole global batch
(`global_count`).
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.distributed import comm

STRATEGIES = ("ddp", "ps", "zero1", "zero2", "zero3", "pipeline", "tensor")


def check_strategy(name: str) -> str:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; accepted: {', '.join(STRATEGIES)}")
    return name


ENGINES = ("memfit", "fsdp2", "zero-redundancy", "auto")
"""Who carries out a ZeRO stage: memfit's flat engine (memfit.distributed.sharded), torch's FSDP2 for
zero2/zero3 (memfit.distributed.fsdp2: fully_shard per block; zero2 is reshard_after_forward=False),
or torch's DDP with ZeroRedundancyOptimizer for zero1 (memfit.distributed.zero_redundancy).
"auto" (the default): engine_for's choice."""
ENGINE_STRATEGIES = {"fsdp2": ("zero2", "zero3", "tensor", "pipeline"), "zero-redundancy": ("zero1",)}
"""tensor on fsdp2: FSDP2 over "dp" x a Hugging Face model's tensor plan over "tp" (zero3 with tp=);
pipeline on fsdp2 (or zero3 with pp=): the ("pp", "dp", "tp") mesh of memfit.distributed.mesh3d."""


def engine_strategies(engine: str) -> str:
    """The strategies `engine` carries out, in words: "zero2, zero3 and tensor"."""
    names = ENGINE_STRATEGIES.get(engine, ())
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "none"


_FP16 = ("16-mixed", "16-true", "16-master")


def engine_for(strategy: str, *, precision: str | None = None, optimizer: str = "adamw", offload: str | None = None,
               cuda: bool = False, compress: str | None = None, prefetch: bool = False) -> tuple[str, str | None]:
    """What engine="auto" runs `strategy` on, and (memfit's engine for zero2/zero3 only) the one thing
    of the run that needs it, in words: ("memfit", "fp16 loss scaling needs it").

    zero2/zero3: torch's FSDP2 unless the run uses what only memfit's flat engine does: fp16 loss
    scaling, gradient compression on the reduce-scatter, optimizer offload to disk (or to a CPU
    rank's own memory), quantized or factored optimizer state (DCP checkpoints hold state of each
    parameter's shape), a prefetch depth. zero1 stays memfit's: torch's ZeroRedundancyOptimizer runs
    under DDP, which keeps every gradient whole (docs/design.md has the figures). Every other
    strategy is memfit's own (pipeline and tensor: memfit.distributed.pipeline, tensor_parallel)."""
    if strategy not in ("zero2", "zero3"):
        return "memfit", None
    from memfit.apply.optimizers import info

    spec = info(optimizer)
    reason = None
    if precision in _FP16:
        reason = "fp16 loss scaling needs it"
    elif compress not in (None, "none"):
        reason = f"--compress {compress} (compressed reduce-scatter) needs it"
    elif offload == "disk":
        reason = "optimizer offload to disk needs it"
    elif offload == "cpu" and not cuda:
        reason = "optimizer offload to a CPU rank's memory needs it"
    elif spec.bits or (spec.states == 0 and spec.name != "sgd"):
        reason = f"optimizer {spec.name} (state not of the parameters' shape) needs it"
    elif prefetch:
        reason = "a prefetch depth needs it"
    return ("memfit", reason) if reason else ("fsdp2", None)


def engine_line(engine: str, reason: str | None) -> str:
    """The one line a run prints about its engine: "engine: memfit (fp16 loss scaling needs it)"."""
    if reason:
        return f"engine: memfit ({reason})"
    return "engine: fsdp2 (torch's fully_shard)" if engine == "fsdp2" else f"engine: {engine}"


def distribute(model: nn.Module, strategy: str, optimizer: str = "adamw", lr: float = 3e-4,
               engine: str = "auto", **kw: Any):
    """The strategy's optimizer over `model` (cast to the precision in place); see the module docstring.

    Keyword arguments are TrainingOptimizer's (weight_decay, precision, clip, offload, spill_dir, ...),
    plus group= (a process group; default the world) and, for zero3, prefetch=. `engine`: see ENGINES;
    "auto" is engine_for's choice from these arguments (the result's `engine_name` says which ran)."""
    check_strategy(strategy)
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; accepted: {', '.join(ENGINES)}")
    if engine == "auto":
        first = next(model.parameters(), None)
        engine, _ = engine_for(strategy, precision=kw.get("precision"), optimizer=optimizer, offload=kw.get("offload"),
                               cuda=first is not None and first.device.type == "cuda", prefetch=kw.get("prefetch") is not None)
    opt = _build(model, strategy, optimizer, lr, engine, kw)
    opt.engine_name = engine
    return opt


def _build(model: nn.Module, strategy: str, optimizer: str, lr: float, engine: str, kw: dict):
    if engine != "memfit" and strategy not in ENGINE_STRATEGIES[engine]:
        raise ConfigError(f"engine {engine} carries out {engine_strategies(engine)}, not {strategy}; "
                          "use engine memfit")
    if not dist.is_initialized():
        raise ConfigError("distribute() needs a process group: call memfit.distributed.init() under torchrun first")
    if engine == "zero-redundancy":
        from memfit.distributed.zero_redundancy import ZeroRedundancyDDP

        kw.pop("spill_dir", None)  # (no optimizer offload on this engine: offload= is refused by it)
        return ZeroRedundancyDDP(model, optimizer, lr, **kw)
    if engine == "fsdp2":
        from memfit.distributed.fsdp2 import FSDP2Optimizer

        kw.pop("prefetch", None)  # FSDP2 prefetches the next block itself
        kw.pop("spill_dir", None)  # (no disk offload on this engine: auto chose it without one)
        if strategy == "pipeline" or (kw.get("pp") or 1) > 1:  # 3-D: FSDP2 x TP x PP
            from memfit.distributed.mesh3d import Mesh3DOptimizer

            return Mesh3DOptimizer(model, optimizer, lr, **kw)
        if strategy == "tensor" and not 1 < kw.get("tp", 1) < dist.get_world_size(kw.get("group")):
            raise ConfigError(f"tensor on engine fsdp2 is FSDP2 over dp x the tensor plan over tp: give tp between 1 "
                              f"and the world of {dist.get_world_size(kw.get('group'))}, not {kw.get('tp')}")
        return FSDP2Optimizer(model, optimizer, lr, reshard=strategy != "zero2", **kw)
    if strategy == "ddp":
        from memfit.distributed.ddp import DDPOptimizer

        return DDPOptimizer(model, optimizer, lr, **kw)
    if strategy == "ps":
        from memfit.distributed.ps import ParameterServer

        return ParameterServer(model, optimizer, lr, **kw)
    if strategy == "pipeline":  # model parallel: docs/distributed.md, "pipeline" and "tensor"
        from memfit.distributed.pipeline import PipelineOptimizer

        return PipelineOptimizer(model, optimizer, lr, **kw)
    if strategy == "tensor":
        from memfit.distributed.tensor_parallel import TensorParallelOptimizer

        return TensorParallelOptimizer(model, optimizer, lr, **kw)
    from memfit.distributed.sharded import ShardedOptimizer

    return ShardedOptimizer(model, int(strategy[-1]), optimizer, lr, **kw)


def global_count(n: int | float, group=None) -> float:
    """Sum a per-rank count (target tokens) over the ranks: the divisor for each rank's summed loss."""
    return comm.control_sum([float(n)], group=group)[0]


def rank_slice(batch_size: int, rank: int, world: int) -> slice:
    """Rows of a global batch that `rank` takes: contiguous, in rank order, so the ranks together
    see exactly the sequences one process with the whole batch would see."""
    if batch_size % world:
        raise ConfigError(f"a global batch of {batch_size} sequences does not split over {world} ranks; "
                          f"use a batch divisible by {world}")
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)
