"""`pipeline`: memfit's GPT (or a Hugging Face causal LM: memfit.distributed.hf_stages) cut into one
stage per rank, run by torch.distributed.pipelining.

    opt = distribute(gpt, "pipeline", "adamw", lr=3e-4, microbatches=4, schedule="1f1b", clip=1.0)
    loss, tokens, result = opt.accumulate_step([(x, y), ...])   # every rank passes the whole batch

Every rank draws the same global batch; the schedule (ScheduleGPipe or Schedule1F1B, from torch)
splits it into `microbatches` pieces, runs forward and backward through the stages and computes
the loss on the last one. The loss function returns each micro-batch's *summed* cross-entropy over
the global token count and `scale_grads=False`, so the gradients are those of one process on the
whole batch. Accumulation calls the schedule once per accumulated batch; the gradients add up.

What must see every stage: clipping (the squared norms of the stages are summed in one all-reduce
of scalars) and, with tied embeddings, the shared matrix's gradient (summed between the first and
the last stage). Activations and their gradients cross stages by P2P sends, counted per rank in
TRAFFIC["p2p_send"] where the stage builds them.

With `dp=R` the world holds R replicas of the pipeline on a 2-D mesh (rank = replica x stages +
stage): each replica reads its rows of the global batch (`data_rows`) and the stages' gradients are
summed over the replicas at the step. The step itself (fp16 loss scaling with one overflow check
for all ranks, clipping, optimizer offload) is memfit.distributed.mp_optimizer's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from memfit.core.compat import initialize_pipeline_stage
from memfit.core.errors import ConfigError
from memfit.distributed import comm
from memfit.distributed.mp_optimizer import ModelParallelOptimizer
from memfit.distributed.stages import cut_to_stage, mark_tied, stage_blocks, stage_sizes, tied_weight

SCHEDULES = ("gpipe", "1f1b")


def check_pipeline(layers: int, stages: int, global_batch: int, microbatches: int, schedule: str) -> None:
    """Everything a pipeline run needs that no process group is needed to check (fail fast, every rank)."""
    stage_sizes(layers, stages)
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; accepted: {', '.join(SCHEDULES)}")
    if microbatches < 1 or global_batch % microbatches:
        raise ConfigError(f"a global batch of {global_batch} sequences does not split into {microbatches} "
                          f"micro-batches; use --microbatches dividing {global_batch} (or change --batch)")
    if schedule == "1f1b" and microbatches < stages:
        raise ConfigError(f"1F1B needs at least as many micro-batches as stages ({stages}), got {microbatches}; "
                          f"use --microbatches {stages} or more, or --schedule gpipe")


def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    class CountingStage(PipelineStage):
        """torch's PipelineStage; the P2P sends it builds are counted in TRAFFIC."""

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            return _counted(super().get_fwd_send_ops(fwd_chunk_id))

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            return _counted(super().get_bwd_send_ops(bwd_chunk_id))

    return CountingStage


def _counted(ops: list) -> list:
    for op in ops:
        comm.TRAFFIC.add("p2p_send", op.tensor.numel() * op.tensor.element_size())
    return ops


def _blocks_of(model: nn.Module) -> tuple[bool, nn.ModuleList]:
    """(whether it is a Hugging Face model, its repeated blocks)."""
    from memfit.models.gpt import GPT

    if isinstance(model, GPT):
        return False, model.blocks
    if getattr(model, "config", None) is None or not hasattr(model, "base_model"):
        raise ConfigError(f"--strategy pipeline cuts memfit's GPT or a Hugging Face causal LM at its layers; got "
                          f"{type(model).__name__}. Use a gpt spec, a known name or a config.json, or a "
                          "data-parallel strategy")
    from memfit.distributed.hf_stages import check_hf_pipeline

    check_hf_pipeline(model.config)
    return True, model.base_model.layers


def cut_stage(model: nn.Module, rank: int, stages: int, hf: bool) -> nn.Module:
    """This rank's stage of memfit's GPT or of a Hugging Face causal LM (the model keeps only its parts)."""
    if hf:
        from memfit.distributed.hf_stages import cut_hf_to_stage

        return cut_hf_to_stage(model, rank, stages)
    mark_tied(model)
    return cut_to_stage(model, rank, stages)


_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")


@contextlib.contextmanager
def _no_global_module_hooks():
    """nn.Module's global hooks set aside (torch.nn.modules.module reads them at each call)."""
    import torch.nn.modules.module as m

    saved = {name: getattr(m, name) for name in _GLOBAL_HOOKS if hasattr(m, name)}
    for name, hooks in saved.items():
        setattr(m, name, type(hooks)())
    try:
        yield
    finally:
        for name, hooks in saved.items():
            setattr(m, name, hooks)


class PipelineOptimizer(ModelParallelOptimizer):
    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.0,
                 precision: str = "32-true", clip: float | None = None, offload: str | None = None,
                 spill_dir: str | None = None, *, microbatches: int | None = None, schedule: str = "1f1b",
                 dp: int = 1, group=None, loss_scale: Any = None, **kw: Any) -> None:
        """dp: data-parallel replicas of the pipeline (world = dp x stages; rank = replica x stages + stage)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        from memfit.apply.checkpoint import applied, checkpoint as apply_checkpoint, remove

        if group is not None:
            raise ConfigError("--strategy pipeline runs on the whole world (group=None); use dp= for replicas")
        self._mesh(dp, next(model.parameters()).device)
        self.microbatches, self.schedule_name = microbatches or self.stages, schedule
        self.hf, layers = _blocks_of(model)
        check_pipeline(len(layers), self.stages, self.microbatches, self.microbatches, schedule)
        policy = applied(model, layers)
        actions = policy.actions if policy is not None else None
        remove(model, layers)  # a policy's segments must not cross a stage boundary: re-applied to the stage below
        self.stage_module = cut_stage(model, self.rank, self.stages, self.hf)
        own = list(stage_blocks(len(layers), self.stages, self.rank))
        if actions is not None:
            apply_checkpoint(self.stage_module, [actions[i] for i in own], blocks=self.stage_module.blocks,
                             spill_dir=spill_dir)
        self.model, self.tracked_module = model, self.stage_module
        self._make_inner(self.stage_module, list(model.named_parameters()), optimizer, lr, weight_decay, precision,
                         clip, offload, spill_dir, loss_scale, kw)
        self.tied = self.stage_module.tied_weight() if self.hf else tied_weight(self.stage_module)
        self.tied_names = self.tied is not None  # the last stage's head.weight is the first's tok.weight
        self.tied_group = None
        if self.tied is not None or self.stages > 2:  # new_group is collective: every rank joins the call
            for d in range(self.dp):  # each replica's first and last stage
                g = (self.pp_group if self.stages == 2 and self.dp == 1 else
                     dist.new_group([d * self.stages, (d + 1) * self.stages - 1]))
                self.tied_group = g if d == self.dp_rank else self.tied_group
        device = next(self.stage_module.parameters()).device
        self.stage = _stage_class()(self.stage_module, self.rank, self.stages, device, group=self.pp_group)
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(self.stage, self.microbatches, loss_fn=self._loss, scale_grads=False)
        self._total = 1.0

    def _mesh(self, dp: int, device: torch.device) -> None:
        """This rank's stage, its replica and the groups: the world (the step's scalars), the
        pipeline's (P2P between stages) and, with dp > 1, the stage's replicas (gradients)."""
        world = dist.get_world_size()
        if dp < 1 or world % dp:
            raise ConfigError(f"{dp} pipeline replicas do not divide the world of {world} processes; "
                              f"use a dp dividing {world} (stages = world / dp)")
        self.group, self.dp, self.stages = None, dp, world // dp
        self.pp_group, self.dp_group, self.dp_rank = None, None, 0
        self.rank = dist.get_rank()
        if dp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (dp, self.stages), mesh_dim_names=("dp", "pp"))
            self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
            self.rank, self.dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")

    def data_rows(self, batch: int) -> slice:
        """This replica's rows of a global batch (every stage of a replica takes the same)."""
        if batch % self.dp:
            raise ConfigError(f"a global batch of {batch} sequences does not split over {self.dp} pipeline "
                              f"replicas; use a batch divisible by {self.dp}")
        per = batch // self.dp
        return slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scaled(self._loss_sum(logits, target) / self._total)

    def _targets(self, y: torch.Tensor) -> float:
        """Target tokens: memfit's GPT skips -1; a Hugging Face model shifts by one and skips -100."""
        return float((y[:, 1:] != -100).sum()) if self.shifted else float((y != -1).sum())

    # ------------------------------------------------------------------ the step
    def run_batch(self, x: torch.Tensor, y: torch.Tensor, total: float) -> float:
        """Forward and backward of one (accumulated) batch through the pipeline; the last stage
        returns its summed loss (over `total`, times `total`), the others 0."""
        if x.shape[0] % self.microbatches:
            raise ConfigError(f"a batch of {x.shape[0]} sequences does not split into {self.microbatches} "
                              "micro-batches")
        self._total = total
        losses: list[torch.Tensor] = []
        args = (x,) if self.rank == 0 else ()
        target = y if self.rank == self.stages - 1 else None
        with self.inner.autocast():
            if not self.schedule._stage_backward_initialized:
                self._initialize(x, target)
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return float(sum(float(t.detach()) for t in losses)) * total / scale

    def _initialize(self, x: torch.Tensor, target: torch.Tensor | None) -> None:
        """torch infers the stages' shapes on the first step with one forward and an autograd.grad;
        module hooks a memory tracker set (multi-grad hooks, which autograd.grad refuses) must not
        see it. A resumed run's first step is the tracked one, so this runs without global hooks."""
        rows = x.shape[0] // self.microbatches
        args = (x[:rows],) if self.rank == 0 else ()
        init = self.schedule._initialize_stage
        with _no_global_module_hooks():
            initialize_pipeline_stage(init, args, None if target is None else target[:rows])

    def accumulate_step(self, micro: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_sum: Any = None):
        """The train loop's step: (global mean loss, global tokens, StepResult). Every rank holds the
        whole global batch, so the token count needs no communication."""
        micro = list(micro)
        total = sum(self._targets(y) for _, y in micro)
        total = max(comm.control_sum([total], group=self.dp_group)[0] if self.dp > 1 else total, 1.0)
        running = sum(self.run_batch(x, y, total) for x, y in micro)
        result = self.step()
        return comm.control_sum([running], group=self.group)[0] / total, int(total), result

    def _reduce_grads(self) -> None:
        if self.tied is not None and self.tied.grad is not None:
            comm.all_reduce(self.tied.grad, group=self.tied_group)
        if self.dp > 1:
            for p in self.params:
                if p.grad is not None:
                    comm.all_reduce(p.grad, group=self.dp_group)

    def _norm_weights(self) -> list[float]:
        # The tied matrix's gradient is on two stages after the sum; count it once (on the first).
        # With dp replicas the (equal, reduced) gradients are on every replica: 1/dp each.
        return [0.0 if (p is self.tied and self.rank != 0) else 1.0 / self.dp for p in self.params]

    def checkpoint_parts(self, i: int, t: torch.Tensor) -> dict[str, torch.Tensor]:
        from memfit.distributed.fused import fused_sizes

        sizes = fused_sizes(self.model, self.names[i])
        return {"": t} if sizes is None else {f".part{k}": part for k, part in enumerate(t.split(sizes))}

    # ------------------------------------------------------------------ evaluation and state
    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | None = None) -> float:
        """Mean loss per token over fixed batches: a plain forward passed stage to stage (no schedule,
        so any batch size works); every rank returns the same figure."""
        was = self.stage_module.training
        self.stage_module.eval()
        total = count = 0.0
        try:
            dev = next(self.stage_module.parameters()).device
            for x, y in batches:
                x, y = x.to(dev), y.to(dev)
                h = x if self.rank == 0 else self._recv_like(x)
                with self.inner.autocast():
                    out = self.stage_module(h)
                if self.rank < self.stages - 1:
                    out = out.to(self.mode.param_dtype)  # what the schedule sends: the stages agree on it
                    comm.TRAFFIC.add("p2p_send", out.numel() * out.element_size())
                    dist.send(out.contiguous(), self._peer(self.rank + 1))
                else:
                    total += float(self._loss_sum(out, y))
                count += self._targets(y)
        finally:
            self.stage_module.train(was)
        return comm.control_sum([total], group=self.pp_group)[0] / max(count, 1.0)

    def _peer(self, stage: int) -> int:
        """The global rank of this replica's `stage`."""
        return self.dp_rank * self.stages + stage

    def _loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shifted:
            from memfit.distributed.hf_stages import hf_shifted

            return F.cross_entropy(*hf_shifted(logits, y), ignore_index=-100, reduction="sum")
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1, reduction="sum")

    def _recv_like(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.config.hidden_size if self.hf else self.model.cfg.hidden
        buf = torch.empty(x.shape[0], x.shape[1], hidden, dtype=self.mode.param_dtype, device=x.device)
        dist.recv(buf, self._peer(self.rank - 1))
        return buf

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole GPT's state dict on every rank: the union of the stages' (original names)."""
        mine = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        everyone: list[Any] = [None] * self.stages
        dist.all_gather_object(everyone, mine, group=self.pp_group)
        return {k: v for part in everyone for k, v in part.items()}

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        raise ConfigError("--strategy pipeline runs forward and backward together in its schedule: "
                          "call accumulate_step / run_batch instead of model(x) + backward")

    def close(self) -> None:
        from memfit.apply.checkpoint import remove

        remove(self.stage_module, self.stage_module.blocks)
        self.inner.close()
