"""`tensor`: Megatron-style tensor parallelism of memfit's GPT (or of a Hugging Face causal LM by its own
tensor plan: memfit.distributed.hf_tensor) with DTensor, and DP x TP on a 2-D mesh.

    opt = distribute(gpt, "tensor", "adamw", lr=3e-4, tp=2)      # world = dp x tp; dp = world / tp
    loss, tokens, result = opt.accumulate_step([(x, y), ...])    # this data-parallel replica's rows

In every block the attention's fused qkv projection and the MLP's up-projection are split by
output columns (ColwiseParallel: each TP rank owns whole heads and a slice of the FFN), the two
output projections by input rows (RowwiseParallel: partial sums all-reduced in forward). The
embeddings, norms and head stay replicated: their gradients are equal on the TP ranks because
the block inputs' gradients are all-reduced (ColwiseParallel's backward). torch does the
sharding (torch.distributed.tensor.parallel.parallelize_module on the "tp" mesh dimension); memfit
only reorders the fused matrices so that each rank's contiguous slice holds its own heads
(q_r, k_r, v_r) and, for SwiGLU, its own (gate_r, up_r).

Across the "dp" dimension the replicas take contiguous rows of the global batch; each gradient
(a TP shard or a replicated tensor) is sum-all-reduced over the dp group at the step. Clipping
uses the global norm (shard norms summed over TP, replicated ones counted once). The step (fp16
loss scaling with one overflow check for all ranks, optimizer offload of each rank's shards,
checkpoints) is memfit.distributed.mp_optimizer's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from memfit.apply.precision import cast_model, precision_mode
from memfit.core.errors import ConfigError
from memfit.distributed import comm
from memfit.distributed.fused import fused_groups
from memfit.distributed.mp_optimizer import ModelParallelOptimizer, local


def check_tensor(heads: int, kv_heads: int, world: int, tp: int) -> None:
    """The checks a tensor-parallel run needs no process group for (fail fast, every rank)."""
    if tp < 1 or world % tp:
        raise ConfigError(f"a TP degree of {tp} does not divide the world of {world} processes; "
                          f"use --tp dividing {world} (dp = world / tp)")
    if heads % tp or kv_heads % tp:
        raise ConfigError(f"a TP degree of {tp} does not divide the model's {heads} attention heads "
                          f"({kv_heads} key/value heads); use --tp dividing both, or another --nproc")


def interleave(t: torch.Tensor, sizes: list[int], tp: int) -> torch.Tensor:
    """Rows [A; B; C] -> [A_0; B_0; C_0; A_1; ...]: chunk r of the result is rank r's part of each."""
    parts = [p.chunk(tp) for p in t.split(sizes)]
    return torch.cat([torch.cat([p[r] for p in parts]) for r in range(tp)])


def deinterleave(t: torch.Tensor, sizes: list[int], tp: int) -> torch.Tensor:
    per_rank = [s // tp for s in sizes]
    chunks = [c.split(per_rank) for c in t.chunk(tp)]
    return torch.cat([torch.cat([chunks[r][i] for r in range(tp)]) for i in range(len(sizes))])


def shard_gpt(gpt: nn.Module, tp_mesh) -> None:
    """Put every block's attention and MLP on the TP mesh dimension (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in gpt.blocks:
        with torch.no_grad():
            for name, sizes in fused_groups(block).items():
                lin = block.get_submodule(name)
                lin.weight.copy_(interleave(lin.weight, sizes, tp))
                if lin.bias is not None:
                    lin.bias.copy_(interleave(lin.bias, sizes, tp))
        block._memfit_fused = fused_groups(block)  # full-size groups, for the full state dict
        block.attn.heads //= tp
        block.attn.kv_heads //= tp
        parallelize_module(block, tp_mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})


def _is_shard(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(t, DTensor) and any(isinstance(pl, Shard) for pl in t.placements)


class TensorParallelOptimizer(ModelParallelOptimizer):
    def __init__(self, model: nn.Module, optimizer: str = "adamw", lr: float = 3e-4, weight_decay: float = 0.0,
                 precision: str = "32-true", clip: float | None = None, offload: str | None = None,
                 spill_dir: str | None = None, *, tp: int | None = None, group=None, loss_scale: Any = None,
                 **kw: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from memfit.models.gpt import GPT

        self.hf = not isinstance(model, GPT)
        if self.hf and getattr(model, "config", None) is None:
            raise ConfigError(f"--strategy tensor shards memfit's GPT or a Hugging Face causal LM by its tensor "
                              f"plan; got {type(model).__name__}. Use a gpt spec, a known name or a config.json")
        world = dist.get_world_size(group)
        self.tp = tp or world
        if self.hf:
            from memfit.distributed.hf_tensor import heads_of, hf_tp_plan

            hf_tp_plan(model)  # refuses a family without a plan before any mesh exists
            check_tensor(*heads_of(model.config), world, self.tp)
        else:
            check_tensor(model.cfg.heads, model.cfg.kv_heads, world, self.tp)
        self.dp, self.group = world // self.tp, group
        device = next(model.parameters()).device
        self.mesh = init_device_mesh(device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        self.tp_group, self.dp_group = self.mesh["tp"].get_group(), self.mesh["dp"].get_group()
        self.dp_rank = self.mesh.get_local_rank("dp")
        cast_model(model, precision_mode(precision))  # before sharding: DTensors are made from the cast weights
        self.tp_summed: set[str] = set()
        if self.hf:
            from memfit.distributed.hf_tensor import shard_hf

            self.tp_summed = set(shard_hf(model, self.mesh["tp"]))
        else:
            shard_gpt(model, self.mesh["tp"])
        self._make_inner(model, list(model.named_parameters()), optimizer, lr, weight_decay, precision, clip,
                         offload, spill_dir, loss_scale, kw)
        self.model, self.tracked_module = model, model

    # ------------------------------------------------------------------ the step
    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Counts the bytes of DTensor's collectives in the forward and backward run inside it."""
        from memfit.distributed.dtensor_traffic import CountCollectives

        return CountCollectives(self.tp)

    def data_rows(self, batch: int) -> slice:
        """This replica's rows of a global batch (all TP ranks of a replica take the same)."""
        return replica_rows(batch, self.dp, self.dp_rank)

    def _dp_sum(self, values: list[float]) -> list[float]:
        return comm.control_sum(values, group=self.dp_group) if self.dp > 1 else values

    def accumulate_step(self, micro: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_sum: Any = None):
        """The train loop's step over this replica's rows: (global mean loss, global tokens, StepResult)."""
        micro = list(micro)
        total = max(self._dp_sum([float(sum(self._targets(y) for _, y in micro))])[0], 1.0)
        running = 0.0
        for i, (x, y) in enumerate(micro):
            with self.micro_batch(i == len(micro) - 1), self.autocast():
                loss = self._loss_sum(x, y)
                self.backward(loss / total, final=i == len(micro) - 1)
            running += float(loss.detach())
        result = self.step()
        return self._dp_sum([running])[0] / total, int(total), result

    def _targets(self, y: torch.Tensor) -> int:
        """Target tokens of a micro-batch: memfit's GPT skips -1; a Hugging Face model shifts the labels
        by one inside (the first token of each row is no target) and skips -100."""
        return int((y[:, 1:] != -100).sum()) if self.shifted else int((y != -1).sum())

    def _loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shifted:  # the model's mean over its targets, back to their sum
            return self.model(input_ids=x, labels=y).loss * self._targets(y)
        if self.hf:  # aligned targets (memfit.train.step.loss_sum's arithmetic)
            logits = self.model(input_ids=x).logits
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=-1,
                                   reduction="sum")
        return self.model(x, y)[1]

    def _reduce_grads(self) -> None:
        if self.tp > 1:  # replicated weights that see only this rank's heads (Qwen3's q/k norms)
            for name, p in zip(self.names, self.params):
                if name in self.tp_summed and p.grad is not None:
                    comm.all_reduce(local(p.grad), group=self.tp_group)
        if self.dp > 1:
            for p in self.params:
                if p.grad is not None:
                    comm.all_reduce(local(p.grad), group=self.dp_group)

    def _norm_weights(self) -> list[float]:
        # Summed over the world: a shard counts once per dp replica (equal after the dp sum), a
        # replicated tensor (plain, or a DTensor placed Replicate, such as a row-parallel bias) once
        # per rank. Powers of two divide exactly, so the usual degrees add no rounding.
        return [1.0 / self.dp if _is_shard(p) else 1.0 / (self.dp * self.tp) for p in self.params]

    def checkpoint_parts(self, i: int, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """A shard as a DTensor placed like its parameter; a fused matrix's shard as one DTensor per
        part (rank r holds chunk r of q, of k and of v), so any TP degree reads them back."""
        from torch.distributed.tensor import DTensor, Shard

        from memfit.distributed.fused import fused_sizes

        p = self.params[i]
        if not _is_shard(p):
            return {"": t}
        sizes = fused_sizes(self.model, self.names[i])
        if sizes is None:
            return {"": DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())}
        out = {}
        for k, (part, full) in enumerate(zip(t.split([s // self.tp for s in sizes]), sizes)):
            shape = torch.Size([full, *p.shape[1:]])
            out[f".part{k}"] = DTensor.from_local(part, p.device_mesh, [Shard(0)], run_check=False, shape=shape,
                                                  stride=torch.empty(shape, device="meta").stride())
        return out

    # ------------------------------------------------------------------ state
    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The plain GPT's state dict (full tensors, fused matrices in their original row order); a
        collective: every rank calls it."""
        return {name: self._full(name, t) for name, t in self.model.state_dict().items()}

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        t = t.full_tensor() if isinstance(t, DTensor) else t
        if name.startswith("blocks."):
            i, _, leaf = name[len("blocks."):].partition(".")
            fused = getattr(self.model.blocks[int(i)], "_memfit_fused", {})
            owner = leaf.rsplit(".", 1)[0]
            if owner in fused:
                t = deinterleave(t, fused[owner], self.tp)
        return t.detach().cpu().clone()


def replica_rows(batch: int, dp: int, dp_rank: int) -> slice:
    """Data-parallel place `dp_rank`'s rows of a global batch of `batch` sequences over `dp` replicas
    (every tensor-parallel rank of a replica takes the same ones)."""
    if batch % dp:
        raise ConfigError(f"a global batch of {batch} sequences does not split over {dp} data-parallel "
                          f"replicas; use a batch divisible by {dp}")
    per = batch // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)
