"""FSDP2 x tensor parallel x pipeline on one ("pp", "dp", "tp") DeviceMesh (torchtitan's 3-D layout),
for a Hugging Face causal LM (memfit's GPT: FSDP2 x pipeline, tp=1).

    opt = distribute(hf_model, "zero3", engine="fsdp2", tp=2, pp=2, microbatches=4, schedule="1f1b")
    loss, tokens, result = opt.accumulate_step([(x, x)])   # every rank passes the whole global batch

World = pp x dp x tp, rank = (stage x dp + replica) x tp + tp place (tp the innermost dimension, as
torchtitan orders it). Each rank builds its stage (memfit.distributed.hf_stages: decoder layers cut at
layer boundaries, the embeddings on the first stage, the norm and the head on the last), puts the
model's own tensor plan on "tp" (memfit.distributed.hf_tensor; tp=1 skips it), then `fully_shard`s
each of its decoder layers and the stage over "dp" (dp=1 is allowed: one shard). torch's pipelining
schedule (GPipe or 1F1B) runs the micro-batches over "pp"; the stage it drives is the FSDP module, so
torch's stage keeps gradients unsynchronised and weights gathered between micro-batches and
reduce-scatters once after the last backward (PipelineStage.perform_reduce_grad).

reshard_after_forward is False, as torchtitan sets it under pipelining: a stage's layers are gathered
at their first forward and stay whole (with their unsharded gradients) to the end of the schedule, so
a rank's peak holds its stage's whole weights and gradients beside its shards and optimizer state
(memfit.measure.mesh3d_estimate counts it so).

The loss of a micro-batch is its summed cross-entropy over the global batch's token count, gradients
are summed (not averaged) over "dp", so they are one process's on the whole batch. What must see more
than one mesh dimension is done at the step: the plan's replicated_with_grad_allreduce weights summed
over "tp", tied embeddings summed between the first and the last stage of each (dp, tp) place, and
the clipping norm summed over the whole world (each element counted once).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from memfit.apply.optimizer import StepResult
from memfit.apply.precision import precision_mode
from memfit.apply.torch_optim import make_torch_optimizer
from memfit.core.errors import ConfigError
from memfit.distributed import comm


def check_mesh3d(world: int, pp: int, tp: int) -> int:
    """dp = world / (pp x tp), or one line saying what divides."""
    if pp < 1 or tp < 1 or world % (pp * tp):
        raise ConfigError(f"pp {pp} x tp {tp} does not divide the world of {world} processes; give --pp and "
                          f"--tp whose product divides {world} (dp = world / (pp x tp))")
    return world // (pp * tp)


def clip_3d(params: list[nn.Parameter], limit: float, holders: int, skip: Any = None) -> float:
    """Clip gradients spread over a 3-D mesh: each rank's squared local shards weighted by the share of its
    stage's `holders` (dp x tp) ranks holding each element (its sharded dimensions' sizes / holders), `skip`
    (a tied matrix counted on the other stage) left out, summed over the world. Returns the norm."""
    grads = [p.grad for p in params if p.grad is not None and p is not skip]
    device = next((p.device for p in params), torch.device("cpu"))  # a stage without gradients joins too
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        sharded = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_shard()) \
            if hasattr(g, "placements") else 1
        total += local.detach().double().square().sum() * (sharded / holders)
    dist.all_reduce(total)
    norm = float(total.sqrt())
    if math.isfinite(norm):
        coef = min(1.0, limit / (norm + 1e-6))
        for p in params:
            if p.grad is not None:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)
    return norm


class Mesh3DOptimizer:
    """See the module docstring. The interface is PipelineOptimizer's: data_rows, accumulate_step, step.
    `pp`: pipeline stages (default world / tp), `tp`: the tensor plan's degree; dp = world / (pp x tp)."""

    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.0,
                 precision: str = "32-true", clip: float | None = None, offload: str | None = None, *,
                 pp: int | None = None, tp: int = 1, microbatches: int | None = None, schedule: str = "1f1b",
                 group=None, **optimizer_kwargs: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        from memfit.distributed.fsdp2 import _policies
        from memfit.distributed.pipeline import _blocks_of, check_pipeline
        from memfit.distributed.stages import tied_weight

        if group is not None:
            raise ConfigError("the 3-D layout (pp, dp, tp) runs on the whole world; leave out group=")
        if clip is not None and not clip > 0:
            raise ConfigError(f"clip={clip} must be a positive gradient-norm limit (or None for no clipping)")
        hf, layers = _blocks_of(model)
        if not hf and tp > 1:
            raise ConfigError("tp > 1 shards a Hugging Face causal LM by its tensor plan; memfit's GPT runs FSDP2 x "
                              "pipeline here (tp=1), or --strategy tensor on memfit's engine")
        self.mode = precision_mode(precision)
        self.precision, self.clip, self.hf = self.mode.name, clip, hf
        pp = pp or max(dist.get_world_size() // tp, 1)  # the world in stages (no dp) unless given
        self.microbatches, self.schedule_name = microbatches or pp, schedule
        device = next(model.parameters()).device
        policies = _policies(self.precision, offload, device)
        self.dp = check_mesh3d(dist.get_world_size(), pp, tp)
        self.pp, self.tp = pp, tp
        check_pipeline(len(layers), pp, self.microbatches, self.microbatches, schedule)
        if tp > 1:
            from memfit.distributed.hf_tensor import heads_of, hf_tp_plan
            from memfit.distributed.tensor_parallel import check_tensor

            hf_tp_plan(model)
            check_tensor(*heads_of(model.config), tp, tp)
        if self.precision == "bf16-true":
            model.to(torch.bfloat16)
        self._groups(device)
        self.stage_module = self._cut(model, layers, hf)
        self.tp_summed: list[str] = []
        if tp > 1:
            from memfit.distributed.hf_tensor import shard_hf

            self.tp_summed = shard_hf(model, self.mesh["tp"])
        dp_mesh = self.mesh["dp"]
        sharded = [fully_shard(b, mesh=dp_mesh, reshard_after_forward=False, **policies)
                   for b in self.stage_module.blocks]
        sharded.append(fully_shard(self.stage_module, mesh=dp_mesh, reshard_after_forward=False, **policies))
        for m in sharded:  # summed over dp, as memfit's strategies sum (FSDP2 averages by default)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        self.model, self.tracked_module = model, self.stage_module
        self.tied = self.stage_module.tied_weight() if hf else tied_weight(self.stage_module)
        self.params = list(self.stage_module.parameters())
        self.inner = make_torch_optimizer(optimizer, self.params, lr=lr, weight_decay=weight_decay,
                                          **optimizer_kwargs)
        self.fsdp_modules = sharded
        self._schedule(device)
        self._total = 1.0

    def _cut(self, model: nn.Module, layers: nn.ModuleList, hf: bool) -> nn.Module:
        """This rank's stage; a memfit checkpoint policy on the whole model is taken off and put back on the
        stage's own layers (its segments must not cross a stage boundary), as memfit's pipeline does."""
        from memfit.apply.checkpoint import applied, checkpoint as apply_checkpoint, remove
        from memfit.distributed.pipeline import cut_stage
        from memfit.distributed.stages import stage_blocks

        policy = applied(model, layers)
        remove(model, layers)
        stage = cut_stage(model, self.rank, self.pp, hf)
        if policy is not None:
            own = stage_blocks(len(layers), self.pp, self.rank)
            apply_checkpoint(stage, [policy.actions[i] for i in own], blocks=stage.blocks)
        return stage

    def _groups(self, device: torch.device) -> None:
        """The ("pp", "dp", "tp") mesh, this rank's place on it and the groups the step needs."""
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device.type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.rank, self.stages = self.mesh.get_local_rank("pp"), self.pp
        self.dp_rank, self.tp_rank = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("tp")
        self.pp_group, self.dp_group = self.mesh["pp"].get_group(), self.mesh["dp"].get_group()
        self.tp_group = self.mesh["tp"].get_group() if self.tp > 1 else None
        self.tied_group = None
        ranks = self.mesh.mesh  # (pp, dp, tp) -> global rank
        if self.pp > 1:  # new_group is collective: every rank joins every (dp, tp) place's call
            for d in range(self.dp):
                for t in range(self.tp):
                    g = dist.new_group([int(ranks[0, d, t]), int(ranks[-1, d, t])])
                    if (d, t) == (self.dp_rank, self.tp_rank):
                        self.tied_group = g

    def _schedule(self, device: torch.device) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        from memfit.distributed.pipeline import _stage_class

        self.stage = _stage_class()(self.stage_module, self.rank, self.pp, device, group=self.pp_group)
        kind = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        self.schedule = kind(self.stage, self.microbatches, loss_fn=self._loss, scale_grads=False)

    # ------------------------------------------------------------------ data and loss
    def data_rows(self, batch: int) -> slice:
        """This replica's rows of a global batch (every stage and tp rank of a replica takes the same)."""
        from memfit.distributed.tensor_parallel import replica_rows

        return replica_rows(batch, self.dp, self.dp_rank)

    aligned_targets = False
    """A Hugging Face model's targets: False, its labels (shifted by one inside the loss, -100 skipped);
    True, memfit's data (`memfit train`: aligned with the inputs, -1 skipped), as memfit's GPT takes them
    (memfit.distributed.mp_optimizer.ModelParallelOptimizer.aligned_targets)."""

    @property
    def shifted(self) -> bool:
        return self.hf and not self.aligned_targets

    def _loss_sum(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from memfit.distributed.hf_stages import hf_shifted

        out, tgt = hf_shifted(logits, target) if self.shifted else (logits.reshape(-1, logits.size(-1)),
                                                                     target.reshape(-1))
        return F.cross_entropy(out.float(), tgt, ignore_index=-100 if self.shifted else -1, reduction="sum")

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed cross-entropy over the global batch's target tokens."""
        return self._loss_sum(logits, target) / self._total

    def _targets(self, y: torch.Tensor) -> float:
        return float((y[:, 1:] != -100).sum()) if self.shifted else float((y != -1).sum())

    def run_batch(self, x: torch.Tensor, y: torch.Tensor, total: float) -> float:
        """Forward and backward of this replica's rows `x` (targets `y`) through the pipeline; the last stage
        returns the summed loss of its rows (the others 0)."""
        from memfit.core.compat import initialize_pipeline_stage
        from memfit.distributed.pipeline import _no_global_module_hooks

        if x.shape[0] % self.microbatches:
            raise ConfigError(f"a replica's batch of {x.shape[0]} sequences does not split into "
                              f"{self.microbatches} micro-batches; use --microbatches dividing it")
        self._total = total
        losses: list[torch.Tensor] = []
        first, last = self.rank == 0, self.rank == self.pp - 1
        target = y if last else None
        if not self.schedule._stage_backward_initialized:
            rows = x.shape[0] // self.microbatches
            with _no_global_module_hooks():  # a tracker's hooks must not see torch's shape inference
                initialize_pipeline_stage(self.schedule._initialize_stage, (x[:rows],) if first else (),
                                          None if target is None else target[:rows])
        self.schedule.step(*((x,) if first else ()), target=target, losses=losses, return_outputs=False)
        return float(sum(float(t.detach()) for t in losses)) * total

    def accumulate_step(self, micro: Iterable[tuple[torch.Tensor, Any]], loss_sum: Any = None):
        """(global mean loss, global target tokens, StepResult) for the global batches `micro`, (inputs,
        targets) pairs (every rank passes the whole batch; a Hugging Face model's targets are its labels:
        the inputs, shifted as it shifts them)."""
        micro = list(micro)
        total = max(sum(self._targets(y) for _, y in micro), 1.0)
        rows = [self.data_rows(x.shape[0]) for x, _ in micro]
        running = sum(self.run_batch(x[r], y[r], total) for (x, y), r in zip(micro, rows))
        result = self.step()
        own = running if self.tp_rank == 0 else 0.0  # one tp rank of each replica's last stage speaks
        return comm.control_sum([own])[0] / total, int(total), result

    # ------------------------------------------------------------------ the step
    def step(self) -> StepResult:
        from memfit.distributed.fsdp2 import clip_then_step, sum_over_tp

        sum_over_tp(self.model, self.tp_summed, self.tp_group)
        if self.tied is not None and self.tied.grad is not None:  # the same (dp, tp) shard on both ends
            g = self.tied.grad
            dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.tied_group)
        skip = self.tied if self.rank != 0 else None
        return clip_then_step(self, lambda: clip_3d(self.params, self.clip, self.dp * self.tp, skip))

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss per token over fixed batches, every rank the same figure: a plain forward passed
        stage to stage within each (dp, tp) place (every replica computes it: FSDP gathers over "dp");
        the gathered weights are resharded after, as the step leaves them."""
        was = self.stage_module.training
        self.stage_module.eval()
        total = count = 0.0
        peers = self.mesh.mesh[:, self.dp_rank, self.tp_rank].tolist()
        try:
            dev = next(self.stage_module.parameters()).device
            with torch.no_grad():
                for x, y in batches:
                    x, y = x.to(dev), y.to(dev)
                    h = x if self.rank == 0 else self._recv_hidden(x, peers[self.rank - 1], dev)
                    out = self.stage_module(h)
                    if self.rank < self.pp - 1:
                        dist.send(out.to(self._hidden_dtype()).contiguous(), peers[self.rank + 1])
                    else:
                        total += float(self._loss_sum(out, y))
                    count += self._targets(y)
        finally:
            self.stage_module.train(was)
            for m in self.fsdp_modules:
                m.reshard()
        return comm.control_sum([total], group=self.pp_group)[0] / max(count, 1.0)

    def _hidden_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "32-true" else torch.bfloat16

    def _recv_hidden(self, x: torch.Tensor, src: int, device: torch.device) -> torch.Tensor:
        hidden = self.model.config.hidden_size if self.hf else self.model.cfg.hidden
        buf = torch.empty(x.shape[0], x.shape[1], hidden, dtype=self._hidden_dtype(), device=device)
        dist.recv(buf, src)
        return buf

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What checkpoint.pt records; the state itself is in the save_sharded folder."""
        return {"precision": self.precision, "engine": "fsdp2", "mesh3d": [self.pp, self.dp, self.tp]}

    def save_sharded(self, folder) -> None:
        """Every rank writes its shards of its stage (torch.distributed.checkpoint, atomic rename): the
        keys are the whole model's names, so the stages' keys do not meet (the optimizer's param_groups
        flattened per parameter name, memfit.distributed.fsdp2_checkpoint._options)."""
        from memfit.distributed.fsdp2_checkpoint import save_fsdp2

        save_fsdp2(self.model, self.inner, folder, flat=True)  # the stages' param_groups differ

    def load_sharded(self, folder) -> None:
        from memfit.distributed.fsdp2_checkpoint import load_fsdp2

        load_fsdp2(self.model, self.inner, folder, flat=True)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank: each stage's full tensors, joined over "pp"."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        mine = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        mine = {k: v.detach().cpu() for k, v in mine.items()}
        everyone: list[Any] = [None] * self.pp
        dist.all_gather_object(everyone, mine, group=self.pp_group)
        return {k: v for part in everyone for k, v in part.items()}

    def state_tensors(self) -> list[torch.Tensor]:
        return [t.to_local() if hasattr(t, "to_local") else t
                for s in self.inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def backward(self, loss: torch.Tensor, *, final: bool = False) -> None:
        raise ConfigError("the 3-D layout runs forward and backward together in its pipeline schedule: call "
                          "accumulate_step instead of model(x) + backward")

    def close(self) -> None:
        from memfit.apply.checkpoint import remove

        remove(self.stage_module, self.stage_module.blocks)

    def __enter__(self) -> "Mesh3DOptimizer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
