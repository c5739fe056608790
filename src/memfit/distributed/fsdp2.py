"""ZeRO-3 (and a ZeRO-2-like layout) on torch's FSDP2: `fully_shard` on each repeated block, then the root.

    opt = FSDP2Optimizer(model, "adamw", lr=3e-4, precision="bf16-master")       # zero3
    opt = distribute(model, "zero3", engine="fsdp2")                             # the same
    opt = distribute(model, "zero2", engine="fsdp2")   # reshard_after_forward=False
    opt = distribute(hf_model, "zero3", engine="fsdp2", tp=2)  # 2-D: FSDP2 over "dp" x the model's TP plan

Any module whose repeated blocks memfit finds (memfit.apply.checkpoint.find_blocks: memfit's GPT,
Hugging Face causal LMs, the largest nn.ModuleList otherwise) is sharded block by block, as
torchtitan and accelerate do; apply a checkpoint policy (memfit's, or torch's checkpoint_wrapper)
before. The interface is memfit's strategies' (model, micro_batch, autocast, backward, step,
tracked_module), so a loop written for `distribute` runs on it unchanged, gradients summed over the
ranks as the strategies sum them (FSDP2's default averages).

Precision: 32-true shards float32 weights; bf16-mixed and bf16-master shard float32 weights (they
are the master) and gather them as bf16 for compute (MixedPrecisionPolicy, gradients reduced in
float32); bf16-true shards bf16 weights. fp16 modes are refused (FSDP2 has no loss scaler here).
CPUOffloadPolicy (`offload="cpu"`) only with CUDA ranks: on a CPU rank there is nothing to offload to.

2-D (`tp` > 1, a Hugging Face causal LM): one DeviceMesh ("dp", "tp") of world / tp x tp ranks, as
torchtitan and accelerate build it. The model's own tensor plan goes on "tp" first
(memfit.distributed.hf_tensor.shard_hf), then `fully_shard` on "dp" shards those DTensors (and the
replicated weights) further: each rank holds 1/dp of its TP shard. A replica's tp ranks take the same
rows (`data_rows`); gradients are averaged over "dp" by FSDP2 (each replica's loss is its mean), and
the plan's replicated_with_grad_allreduce weights (Qwen3's q/k norms) are summed over "tp" at the step.

What differs from memfit's own engine (memfit.distributed.sharded): zero2 here still shards the
weights (FSDP2 gathers each block in forward and keeps it gathered to its backward, so between steps
a rank holds a shard; memfit's zero2 keeps every weight whole); under bf16-master memfit keeps bf16
weights beside a float32 master shard, FSDP2 only the float32 shard; clipping, gradient compression
and optimizer offload to disk are memfit's engine's only.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from memfit.apply.checkpoint import find_blocks
from memfit.apply.optimizer import StepResult
from memfit.apply.precision import precision_mode
from memfit.apply.torch_optim import make_torch_optimizer
from memfit.core.errors import ConfigError

_MIXED = ("bf16-mixed", "bf16-master")
_AS_IS = ("32-true", "bf16-true")


def _policies(precision: str, offload: str | None, device: torch.device) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    out: dict[str, Any] = {}
    if precision in _MIXED:
        out["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif precision not in _AS_IS:
        raise ConfigError(f"precision {precision!r} on the fsdp2 engine is not supported (fp16 needs a loss "
                          f"scaler); use one of {', '.join(_AS_IS + _MIXED)}, or the memfit engine")
    if offload not in (None, "none"):
        if offload != "cpu" or device.type != "cuda":
            raise ConfigError(f"offload={offload!r} on the fsdp2 engine: only 'cpu' with CUDA ranks "
                              "(CPUOffloadPolicy); on CPU ranks leave it out, for disk use the memfit engine")
        out["offload_policy"] = CPUOffloadPolicy()
    return out


def clip_across_meshes(params, limit: float) -> float:
    """torch's clip_grad_norm_ for gradients on different meshes (2-D: the plan's shards on ("dp", "tp"),
    the rest on "dp" alone), which its stacked norms refuse: each rank's squared local shards, weighted
    by the share of the world holding each element (shard dimensions' sizes / world), summed over the
    world; then every gradient scaled by min(1, limit / (norm + 1e-6)). Returns the norm."""
    world = dist.get_world_size()
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        sharded = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_shard()) \
            if hasattr(g, "placements") else 1
        total += local.double().square().sum() * (sharded / world)
    dist.all_reduce(total)
    norm = float(total.sqrt())
    if math.isfinite(norm):
        coef = min(1.0, limit / (norm + 1e-6))
        for g in grads:
            (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
    return norm


def sum_over_tp(model: nn.Module, names: list[str], group) -> None:
    """Sum the gradients of the plan's replicated_with_grad_allreduce weights over "tp": each TP rank's
    gradient covers its own heads only."""
    for name in names:
        p = model.get_parameter(name)
        if p.grad is not None:
            dist.all_reduce(p.grad.to_local(), group=group)


def clip_then_step(opt: Any, clip_norm: Callable[[], float]) -> StepResult:
    """The step's tail shared by the FSDP2 engines: when `opt.clip` is set, `clip_norm()` clips and returns
    the global norm, and a non-finite one skips the step (gradients dropped, weights untouched); then
    `opt.inner` steps and the gradients are freed."""
    norm = None
    if opt.clip is not None:
        norm = clip_norm()
        if not math.isfinite(norm):
            opt.zero_grad()
            return StepResult(stepped=False, grad_norm=norm)
    opt.inner.step()
    opt.zero_grad()
    return StepResult(stepped=True, grad_norm=norm)


class FSDP2Optimizer:
    """See the module docstring. `reshard`: FSDP2's reshard_after_forward (True: zero3, False: zero2)."""

    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.0,
                 precision: str = "32-true", clip: float | None = None, offload: str | None = None, *,
                 reshard: bool = True, group=None, blocks: nn.ModuleList | None = None, tp: int = 1,
                 **optimizer_kwargs: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        if clip is not None and not clip > 0:
            raise ConfigError(f"clip={clip} must be a positive gradient-norm limit (or None for no clipping)")
        self.mode = precision_mode(precision)
        self.precision, self.clip = self.mode.name, clip
        device = next(model.parameters()).device
        policies = _policies(self.precision, offload, device)
        if self.precision == "bf16-true":
            model.to(torch.bfloat16)
        group = self.group = group or dist.group.WORLD
        mesh = self._mesh(model, group, device, tp)
        sharded = [fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policies)
                   for block in (blocks if blocks is not None else find_blocks(model))]
        sharded.append(fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **policies))
        for module in sharded:  # memfit's strategies sum gradients over the ranks (FSDP2 averages by default)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM on every backend (gloo has no PREMUL_SUM)
        self.model = self.tracked_module = model
        self.device_type = device.type
        self.inner = make_torch_optimizer(optimizer, model.parameters(), lr=lr, weight_decay=weight_decay,
                                          **optimizer_kwargs)

    def _mesh(self, model: nn.Module, group, device: torch.device, tp: int):
        """The mesh FSDP2 shards over: the group's ranks, or with tp > 1 the "dp" dimension of a
        ("dp", "tp") mesh whose "tp" dimension the model's tensor plan is put on first."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        self.tp, self.dp, self.dp_rank, self.tp_summed, self.tp_group = tp, dist.get_world_size(group), 0, [], None
        if tp == 1:
            return DeviceMesh.from_group(group, device.type)
        from memfit.distributed.hf_tensor import heads_of, hf_tp_plan, shard_hf
        from memfit.distributed.tensor_parallel import check_tensor

        if getattr(model, "config", None) is None or group is not dist.group.WORLD:
            raise ConfigError("FSDP2 x tensor parallel (tp > 1) shards a Hugging Face causal LM by its tensor plan "
                              "over the whole world; give such a model and no group=")
        hf_tp_plan(model)  # a family without a plan is refused before any mesh exists
        check_tensor(*heads_of(model.config), self.dp, tp)
        self.dp //= tp
        self.mesh = init_device_mesh(device.type, (self.dp, tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank, self.tp_group = self.mesh.get_local_rank("dp"), self.mesh["tp"].get_group()
        self.tp_summed = shard_hf(model, self.mesh["tp"])  # names: fully_shard replaces the parameters
        return self.mesh["dp"]

    def data_rows(self, batch: int) -> slice:
        """This replica's rows of a global batch (the tp ranks of a replica take the same ones)."""
        from memfit.distributed.tensor_parallel import replica_rows

        return replica_rows(batch, self.dp, self.dp_rank)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # FSDP2 casts the gathered weights itself (MixedPrecisionPolicy)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Earlier micro-batches keep their gradients unreduced (FSDP2's set_requires_gradient_sync)."""
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        loss.backward()

    def step(self) -> StepResult:
        sum_over_tp(self.model, self.tp_summed, self.tp_group)
        return clip_then_step(self, lambda: (
            float(nn.utils.clip_grad_norm_(self.model.parameters(), self.clip).full_tensor())
            if self.tp == 1 else clip_across_meshes(self.model.parameters(), self.clip)))

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t.to_local() if hasattr(t, "to_local") else t
                for s in self.inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def state_dict(self) -> dict:
        """What checkpoint.pt records; the state itself is in the save_sharded folder."""
        return {"precision": self.precision, "engine": "fsdp2"}

    def save_sharded(self, folder) -> None:
        """Every rank writes its shards of the weights and optimizer state (torch.distributed.checkpoint)."""
        from memfit.distributed.fsdp2_checkpoint import save_fsdp2

        save_fsdp2(self.model, self.inner, folder, self.group)

    def load_sharded(self, folder) -> None:
        """Read a save_sharded folder written on any number of ranks."""
        from memfit.distributed.fsdp2_checkpoint import load_fsdp2

        load_fsdp2(self.model, self.inner, folder, self.group)

    def full_model_state(self) -> dict:
        """The whole model's weights on rank 0 (empty on the others)."""
        from memfit.distributed.fsdp2_checkpoint import full_state

        return full_state(self.model)

    def close(self) -> None:
        pass

    def __enter__(self) -> "FSDP2Optimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
