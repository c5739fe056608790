"""`memfit train --strategy S`: the training loop's hook-up to memfit.distributed.

One process per rank (torchrun, or `--nproc N` which launches through torchrun's API). Every rank
builds the same model from the same seed, draws the same global batch of N x batch sequences and
keeps its own contiguous rows, so N ranks with --batch B see exactly the sequences of one process
with --batch N*B. Rank 0 writes the run folder; metrics.json carries every rank's tracked memory
breakdown and the bytes each rank sent in the tracked step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError
from memfit.models.gpt import GPT
from memfit.distributed.comm import TRAFFIC
from memfit.train.data import WindowSampler
from memfit.train.rank_device import rank_device, resolve_engine  # noqa: F401 (memfit.train.distributed API)


@dataclasses.dataclass
class DistContext:
    strategy: str
    rank: int
    world: int
    engine: str = "memfit"
    """Who carries out zero2/zero3 (memfit.distributed.strategy.ENGINES; never "auto": resolve_engine)."""

    @property
    def main(self) -> bool:
        return self.rank == 0


def precheck(cfg: Any, resuming: bool = False, world: int | None = None) -> None:
    """The checks a --strategy run needs no process group for: made before anything starts (and
    again on every rank), so an impossible config fails at once with one message, never a hang."""
    from memfit.distributed.strategy import check_strategy

    strategy = check_strategy(cfg.strategy)
    world = world or int(os.environ.get("WORLD_SIZE", 0)) or None
    if getattr(cfg, "dp", 1) != 1 and strategy != "pipeline":
        raise ConfigError(f"--dp sets the replicas of --strategy pipeline; with --strategy {strategy} leave it out "
                          "(tensor: --tp sets dp = nproc / tp)")
    if strategy in ("pipeline", "tensor"):
        from memfit.train.model_parallel import precheck_model_parallel

        precheck_model_parallel(cfg, world, resuming)
    if strategy in ("ddp", "ps") and cfg.offload_optimizer != "none":
        raise ConfigError(f"--offload-optimizer with --strategy {strategy} is not supported: the offload takes "
                          "gradients before they are reduced; use --strategy zero1, zero2 or zero3")
    rank_device(cfg.device, world)  # --device cuda with fewer GPUs than processes: refused before any start
    from memfit.train.checkpoint_kind import check_checkpointable

    check_checkpointable(strategy, cfg.optimizer)  # a run whose saves would fail: refused before it trains


def setup(cfg: Any, device: torch.device, resuming: bool = False) -> DistContext | None:
    """Join the process group for `cfg.strategy` (None: a single-process run)."""
    from memfit.distributed import env

    line = resolve_engine(cfg, device)  # (under --nproc the launcher resolved it and said so)
    if cfg.strategy in (None, "none"):
        if env.launched() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError("started with several processes but no --strategy; pass --strategy ddp, ps, zero1, "
                              "zero2 or zero3")
        return None
    precheck(cfg, resuming)
    if not env.launched():
        raise ConfigError(f"--strategy {cfg.strategy} needs several processes: add --nproc N, or start with "
                          "torchrun --nproc-per-node N -m memfit train ...")
    if line and os.environ.get("RANK", "0") == "0":
        print(f"memfit train: {line}", file=sys.stderr, flush=True)
    rank, world = env.init(env.local_device(device))
    if cfg.out is None:  # one run folder for all ranks (each would stamp its own time)
        import torch.distributed as dist

        from memfit.train.rundir import new_run_dir

        box = [str(new_run_dir()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        cfg.out = box[0]
    return DistContext(cfg.strategy, rank, world, cfg.engine)


STOP_REASONS = ("interrupted", "terminated", "steps", "stop_at", "time_limit")
"""Why a run of several processes stops, the first that any rank has winning."""


def agree_stop(reason: str | None) -> str | None:
    """One stop decision for all ranks before each step: a signal that reached one rank, or one rank's clock
    passing the time limit, stops them all at the same step (never a rank left waiting in a collective)."""
    import torch.distributed as dist

    from memfit.distributed.comm import control_sum

    flags = control_sum([float(reason == r) for r in STOP_REASONS], op=dist.ReduceOp.MAX)
    return next((r for r, f in zip(STOP_REASONS, flags) if f), None)


def agree_flag(flag: bool) -> bool:
    """True on every rank when it is True on any (one small all-reduce)."""
    import torch.distributed as dist

    from memfit.distributed.comm import control_sum

    return bool(control_sum([float(flag)], op=dist.ReduceOp.MAX)[0])


def agree_horizon(horizon: int | None) -> int | None:
    """A time-limited run's schedule length, the same on every rank (each rank times its own steps,
    and the learning rate follows the length): the shortest any rank fitted."""
    import math

    import torch.distributed as dist

    from memfit.distributed.comm import control_sum

    low = control_sum([math.inf if horizon is None else float(horizon)], op=dist.ReduceOp.MIN)[0]
    return None if math.isinf(low) else int(low)


def make_optimizer(ctx: DistContext, model: nn.Module, cfg: Any, precision: str):
    from memfit.distributed.strategy import distribute
    from memfit.train.config import optimizer_extra

    from memfit.train import compression

    offload = None if cfg.offload_optimizer == "none" else cfg.offload_optimizer
    if ctx.engine == "fsdp2":  # torch's FSDP2: fully_shard per block (memfit.distributed.fsdp2)
        layout = ({"pp": cfg.pp, "tp": cfg.tp or 1, "microbatches": cfg.microbatches, "schedule": cfg.schedule}
                  if ctx.strategy == "pipeline" else {})  # the 3-D layout (memfit.distributed.mesh3d)
        opt = distribute(model, ctx.strategy, cfg.optimizer, lr=cfg.lr, engine="fsdp2", weight_decay=cfg.weight_decay,
                         precision=precision, clip=cfg.clip, offload=offload, **layout, **optimizer_extra(cfg))
        if ctx.strategy == "pipeline":  # memfit's data: a Hugging Face model's targets aligned with its inputs
            opt.aligned_targets = True
        return opt
    opt = distribute(model, ctx.strategy, cfg.optimizer, lr=cfg.lr, engine="memfit", weight_decay=cfg.weight_decay,
                     precision=precision, clip=cfg.clip, offload=offload,
                     spill_dir=cfg.spill_dir, **optimizer_extra(cfg), **strategy_options(cfg))
    opt.compression = compression.attach(opt, getattr(cfg, "compress", "none"), cfg)  # --compress
    if ctx.strategy in ("pipeline", "tensor"):  # a Hugging Face model takes memfit's aligned targets here
        opt.aligned_targets = True
    return opt


def strategy_options(cfg: Any) -> dict:
    if cfg.strategy == "pipeline":
        return {"microbatches": cfg.microbatches, "schedule": cfg.schedule, "dp": cfg.dp,
                "virtual_stages": getattr(cfg, "virtual_stages", None)}
    return {"tp": cfg.tp} if cfg.strategy == "tensor" else {}


def rank_sampler(ctx: DistContext, data: torch.Tensor, cfg: Any) -> "RankSampler":
    """This rank's sampler: its rows for the data-parallel strategies; the whole global batch on
    every pipeline stage; its replica's rows for tensor (all TP ranks of a replica read the same)."""
    batch, rank, world = cfg.batch, ctx.rank, ctx.world
    if ctx.strategy == "pipeline" and ctx.engine == "fsdp2":  # 3-D: the whole global batch (data_rows picks)
        batch, rank, world = cfg.batch * ctx.world, 0, 1
    elif ctx.strategy == "pipeline":  # the replica's rows on each of its stages
        stages = ctx.world // cfg.dp
        batch, rank, world = cfg.batch * stages, ctx.rank // stages, cfg.dp
    elif ctx.strategy == "tensor":
        tp = cfg.tp or ctx.world
        batch, rank, world = cfg.batch * tp, ctx.rank // tp, ctx.world // tp
    return RankSampler(data, batch, cfg.seq, cfg.seed, rank, world)


class RankSampler:
    """This rank's rows of the global batch a WindowSampler of world x batch draws."""

    def __init__(self, data: torch.Tensor, batch: int, seq: int, seed: int, rank: int, world: int) -> None:
        self.inner = WindowSampler(data, batch * world, seq, seed)
        self.rows = slice(rank * batch, (rank + 1) * batch)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inner.next()
        return x[self.rows].contiguous(), y[self.rows].contiguous()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def accumulate_step(opt, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_sum):
    """The distributed accumulate_step: each rank's summed loss over the *global* token count,
    DDP's no_sync on all but the last micro-batch; returns (global mean loss, global tokens, result)."""
    from memfit.distributed.comm import control_sum

    if hasattr(opt, "accumulate_step"):  # pipeline, tensor: their own data layout (memfit.distributed)
        return opt.accumulate_step(micro_batches, loss_sum)
    micro = list(micro_batches)
    local = float(sum((y != -1).sum() for _, y in micro))
    total = max(control_sum([local])[0], 1.0)
    running = torch.zeros((), dtype=torch.float64)
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        with opt.micro_batch(last), opt.autocast():
            if isinstance(getattr(opt.model, "module", opt.model), GPT):  # DDP wraps the model
                _, loss, _ = opt.model(x, y)
            else:
                loss, _ = loss_sum(opt.model, x, y)
        opt.backward(loss / total, final=last)
        running += loss.detach().double().cpu()
    result = opt.step()
    return control_sum([float(running)])[0] / total, int(total), result


def gather_breakdown(ctx: DistContext, breakdown: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's breakdown with every rank's under "ranks" (and the bytes each sent that step)."""
    import torch.distributed as dist

    mine = {"rank": ctx.rank, "peak_bytes": breakdown["peak_bytes"], "breakdown": breakdown["breakdown"],
            "bytes_sent": TRAFFIC.as_dict()}
    everyone: list[Any] = [None] * ctx.world
    dist.all_gather_object(everyone, mine)
    return {**breakdown, "strategy": ctx.strategy, "world": ctx.world, "ranks": everyone}


SHARDED = "sharded"
"""Folders sharded-<step> in the run folder hold ZeRO's optimizer state (torch.distributed.checkpoint)."""


def save_states(opt, model: nn.Module, run_dir: Path, step: int) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Every rank: ZeRO writes its slices under run_dir/sharded-<step> (checkpoint.pt, written after
    it, names the folder, so a crash between the two leaves the previous pair intact); returns the
    full model state dict and the folder's checksums (memfit.distributed.shard_sums; None: no
    folder). checkpoint.pt holds both with rank 0's optimizer state: all of it for ddp and ps,
    whose rank 0 has the whole state."""
    from memfit.distributed import shard_sums
    from memfit.train import compression

    compression.save_state(opt, run_dir, step)  # --compress: each rank's residuals and momenta
    folder = None
    if hasattr(opt, "save_sharded"):  # pipeline, tensor: memfit.distributed.parallel_checkpoint
        opt.save_sharded(folder := _fresh_folder(run_dir, step))
    elif getattr(opt, "engine", None) is not None:
        from memfit.distributed.checkpoint import save_sharded

        save_sharded(opt, folder := _fresh_folder(run_dir, step))
    return model_state(opt, model), (shard_sums.gather(folder) if folder is not None else None)


def _fresh_folder(run_dir: Path, step: int) -> Path:
    """sharded-<step>, or sharded-<step>.<n> when that exists (a second save at the same step, such
    as the final one after a periodic one): a save never overwrites a folder checkpoint.pt may name,
    so a save that dies half-way tears only its own folder. Rank 0 picks; every rank uses its pick."""
    import torch.distributed as dist

    folder, n = run_dir / f"{SHARDED}-{step}", 0
    while folder.exists():
        n += 1
        folder = run_dir / f"{SHARDED}-{step}.{n}"
    box = [str(folder)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def checkpoint_folder(run_dir: Path, checkpoint: dict) -> Path | None:
    """The sharded folder `checkpoint` names (its checksums record it), else complete_folder's pick."""
    named = (checkpoint.get("shards") or {}).get("folder")
    if isinstance(named, str) and (run_dir / named / ".metadata").exists():
        return run_dir / named
    return complete_folder(run_dir, checkpoint["step"])


def complete_folder(run_dir: Path, step: int) -> Path | None:
    """The newest complete folder saved at `step` (DCP renames its .metadata into place last)."""
    done = [f for f in run_dir.glob(f"{SHARDED}-{step}*")
            if f.name.split(".")[0] == f"{SHARDED}-{step}" and (f / ".metadata").exists()]
    return max(done, key=lambda f: (f / ".metadata").stat().st_mtime_ns) if done else None


def prune_sharded(run_dir: Path, step: int, previous: tuple[int, str | None] | None = None) -> None:
    """Rank 0, after checkpoint.pt names sharded-<step>: remove the older folders, except the one of
    checkpoint.prev.pt (`previous`: its step and folder name), kept so a resume from it finds its shards."""
    import shutil

    from memfit.train import compression

    steps = [step] + ([previous[0]] if previous is not None else [])
    compression.prune(run_dir, steps)
    keep = {complete_folder(run_dir, step)}
    if previous is not None:
        keep.add(run_dir / previous[1] if previous[1] else complete_folder(run_dir, previous[0]))
    for old in run_dir.glob(f"{SHARDED}-*"):
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def remove_torn(run_dir: Path, checkpoint: dict, ctx: DistContext | None) -> list[str]:
    """Resume: the sharded folders a kill left, removed by rank 0 once every rank has read its slices:
    a save a kill tore (no .metadata), or one at or after the resumed step that checkpoint.pt does not
    name (killed before checkpoint.pt was replaced). The folder the checkpoint names and complete older
    ones (checkpoint.prev.pt's, kept for a resume from it) stay. Returns the names removed."""
    if ctx is not None:
        import torch.distributed as dist

        dist.barrier()  # no rank is still choosing among the folders
        if not ctx.main:
            return []
    import shutil

    keep, step = checkpoint_folder(run_dir, checkpoint), checkpoint["step"]
    gone = []
    for f in run_dir.glob(f"{SHARDED}-*"):
        head = f.name.split(".")[0][len(SHARDED) + 1:]
        older = head.isdigit() and int(head) < step and (f / ".metadata").exists()
        if f != keep and not older:
            gone.append(f.name)
    gone += [f.name for f in run_dir.glob(f".{SHARDED}-*.partial")]  # --engine fsdp2: a save cut before its rename
    for name in sorted(gone):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return sorted(gone)


def restore(opt, model: nn.Module, checkpoint: dict, run_dir: Path) -> None:
    """Resume: ZeRO reads weights and optimizer slices from the checkpoint's sharded-<step> folder
    (any world size); ddp and ps load checkpoint.pt's model and optimizer state on every rank."""
    from memfit.train import compression

    compression.load_state(opt, run_dir, checkpoint["step"])  # --compress: this rank's residuals
    sharded = hasattr(opt, "load_sharded")  # pipeline, tensor
    if sharded or getattr(opt, "engine", None) is not None:
        from memfit.distributed.checkpoint import load_sharded

        folder = checkpoint_folder(run_dir, checkpoint)
        if folder is None:
            raise ConfigError(f"{run_dir} has no {SHARDED}-{checkpoint['step']}/: it was not written by a zero1-3, "
                              "pipeline or tensor run; resume it with the strategy it was written with")
        from memfit.train.state import check_shards

        check_shards(folder, checkpoint)  # every rank, before any of them loads
        opt.load_sharded(folder) if sharded else load_sharded(opt, folder)
        return
    model.load_state_dict(checkpoint["model"])
    if checkpoint["optimizer"].get("stage") is not None:
        raise ConfigError("this checkpoint's optimizer state is a ZeRO shard; resume with --strategy zero1-3")
    opt.load_state_dict(checkpoint["optimizer"])


def model_state(opt, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state dict on every rank (ZeRO-3 gathers its released weights for it)."""
    if hasattr(opt, "full_model_state"):  # pipeline: the stages' union; tensor: full tensors
        return opt.full_model_state()
    engine = getattr(opt, "engine", None)
    if engine is None or engine.stage < 3:
        return model.state_dict()
    with gathered(engine):
        return {k: v.clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def gathered(engine):
    for b in engine.layout.buckets:
        engine.gather(b.index)
    try:
        yield
    finally:
        for b in engine.layout.buckets:
            engine._release(b.index)

