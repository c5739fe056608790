"""Resuming a run in another layout: zero1/2/3 (either engine) <-> ddp/ps <-> one process <-> pipeline/tensor.

Within a family the layout's own loader reshards (ZeRO onto any world size; pipeline and tensor
onto any stages x TP degree x replicas; one process, ddp and ps share checkpoint.pt's format).
Across families the checkpoint is read whole (memfit.train.portable) and put into the new layout:
one process, ddp and ps load it directly (each rank holds the whole state anyway); for zero and
mp, rank 0 writes it once in the target's layout (reshard-<step>/ in the run folder, removed
after) and every rank reads its own slices from there; onto FSDP2 every rank reads it whole and
torch's set_state_dict keeps its shards.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

from memfit.core.errors import ConfigError, CorruptCheckpointError
from memfit.train import distributed as dist_train
from memfit.train.portable import kind, kind_of, plain_model, read_portable
from memfit.train.portable_load import load_into_pt, write_folder

RESHARD = "reshard"


def source_folder(checkpoint: dict, run_dir: Path) -> Path | None:
    return dist_train.checkpoint_folder(run_dir, checkpoint)


def restorer(opt: Any, model: nn.Module, checkpoint: dict, run_dir: Path, ctx: Any) -> Callable[[], None] | None:
    """What loads the model and optimizer state for memfit.train.resume.restore: None for one process
    resuming a one-process, ddp or ps checkpoint (restore's own loads, each with its own message)."""
    if ctx is None and kind_of(checkpoint["config"]) == "pt":
        return None
    return lambda: restore_states(opt, model, checkpoint, run_dir, ctx)


def restore_states(opt: Any, model: nn.Module, checkpoint: dict, run_dir: Path, ctx: Any) -> None:
    """Load the model and optimizer state of `checkpoint` (written by any layout) into this run's."""
    source = kind_of(checkpoint["config"])
    target = kind(ctx.strategy, ctx.engine) if ctx is not None else "pt"
    if source == target:
        if ctx is not None:
            dist_train.restore(opt, model, checkpoint, run_dir)
        else:
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        return
    if target == "fsdp2":  # every rank reads the whole state and keeps its shards (torch's set_state_dict)
        from memfit.distributed.fsdp2_checkpoint import load_full

        p = read_portable(checkpoint, source_folder(checkpoint, run_dir))
        load_full(opt.model, opt.inner, p.model, p.optim, p.step)
        return
    if target == "pt":
        load_into_pt(read_portable(checkpoint, source_folder(checkpoint, run_dir)), model,
                     getattr(opt, "inner", opt) if ctx is not None else opt)
        return
    import torch.distributed as dist

    folder = run_dir / f"{RESHARD}-{checkpoint['step']}"
    failed = [None]
    if ctx.main:
        try:
            shutil.rmtree(folder, ignore_errors=True)  # a conversion a kill cut short
            write_folder(read_portable(checkpoint, source_folder(checkpoint, run_dir)),
                         plain_model(checkpoint["config"]), target, folder)
        except CorruptCheckpointError as exc:  # its own line, on every rank
            failed = [("corrupt", str(exc))]
        except Exception as exc:  # every rank raises it, none waits for a folder that will not come
            failed = [("other", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(failed, src=0)
    if failed[0] is not None:
        what, said = failed[0]
        if what == "corrupt":
            raise CorruptCheckpointError(said)
        raise ConfigError(f"cannot resume this checkpoint in another layout ({said})".splitlines()[0])
    try:
        if target == "zero":
            from memfit.distributed.checkpoint import load_sharded

            load_sharded(opt, folder)
        else:
            opt.load_sharded(folder)
    finally:
        dist.barrier()
        if ctx.main:
            shutil.rmtree(folder, ignore_errors=True)
