"""Continuing a run from its checkpoint: which options may change, and a checkpoint checked before
it is trusted (an edited or foreign file gives one line saying what is wrong with it)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

import torch

from memfit.core.errors import ConfigError, CorruptCheckpointError
from memfit.train import state as state_mod
from memfit.train.config import RESUMABLE, TrainConfig, flag

# What memfit train writes into a checkpoint: key -> the type its value must have.
_LAYOUT: dict[str, Any] = {
    "step": int, "horizon": (int, type(None)), "config": dict, "model": dict, "optimizer": dict,
    "sampler": dict, "rng": dict, "history": dict, "corpus": dict,
}


def check_checkpoint(ckpt: Any, where: str) -> None:
    """Raise ConfigError unless `ckpt` has the layout memfit train writes."""
    if not isinstance(ckpt, dict):
        raise ConfigError(f"checkpoint {where} holds a {type(ckpt).__name__}, not a memfit train checkpoint")
    missing = [k for k in _LAYOUT if k not in ckpt]
    if missing:
        raise ConfigError(f"checkpoint {where} lacks {', '.join(missing)}: it was not written by memfit train "
                          "(or was edited); resume from a run folder memfit train wrote")
    for key, kind in _LAYOUT.items():
        if not isinstance(ckpt[key], kind) or (kind is int and isinstance(ckpt[key], bool)):
            raise ConfigError(f"checkpoint {where}: {key!r} is a {type(ckpt[key]).__name__}, which memfit train "
                              "never writes there (the file was edited or is not from memfit train)")
    history = ckpt["history"]
    if not all(isinstance(history.get(k), dict) for k in ("steps", "val")) or not isinstance(ckpt["rng"].get("cpu"),
                                                                                           torch.Tensor):
        raise ConfigError(f"checkpoint {where}: its history or RNG state is damaged; resume from an unedited run folder")
    if not isinstance(ckpt["corpus"].get("digest"), str) or ckpt["step"] < 0:
        raise ConfigError(f"checkpoint {where}: its data record or step is damaged; resume from an unedited run folder")


LAYOUT = ("strategy", "tp", "dp", "pp", "microbatches", "schedule", "virtual_stages", "engine")
"""Options that say how the processes share the work, not what is computed: a resume may change
them (memfit.train.reshard loads any layout's checkpoint into any other)."""


def resume_config(run_dir: str | Path, overrides: dict[str, Any],
                  world: int | None = None) -> tuple[TrainConfig, dict[str, Any]]:
    """The saved config of `run_dir` (or of its checkpoint.pt) with `overrides`, and the loaded checkpoint.

    Only RESUMABLE and LAYOUT options may differ from the saved ones; repeating a saved value is fine.
    `world`: the processes of the resumed run (None: WORLD_SIZE, else 1); see keep_global_batch.
    """
    path = Path(run_dir)
    folder = path.parent if path.is_file() else path  # RUN/checkpoint.pt names the same run as RUN
    ckpt = state_mod.load_checkpoint(path)
    check_checkpoint(ckpt, repr(str(path)))
    # Which file: a run resumed from checkpoint.pt keeps it as checkpoint.prev.pt at its first save
    # (memfit.train.saver); one resumed from checkpoint.prev.pt replaces checkpoint.pt and keeps the former.
    ckpt["_source"] = str(path / state_mod.CHECKPOINT if path.is_dir() else path)
    saved = dict(ckpt["config"])
    bad = sorted(k for k, v in overrides.items() if k not in RESUMABLE + LAYOUT and saved.get(k) != v)
    if bad:
        raise ConfigError(f"cannot change {', '.join(map(flag, bad))} when resuming (the run would not continue "
                          f"the same trajectory); allowed with --resume: {', '.join(map(flag, RESUMABLE))}")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        cfg = TrainConfig(**{k: v for k, v in saved.items() if k in known})
    except TypeError as exc:
        raise ConfigError(f"checkpoint {str(path)!r} has a damaged config ({exc})") from None
    # The run continues where it is now (the folder may have moved since it was saved) unless --out says otherwise.
    if overrides.get("strategy", cfg.strategy) != cfg.strategy:  # the old layout's options do not carry over
        defaults = TrainConfig()
        cfg = dataclasses.replace(cfg, **{k: getattr(defaults, k) for k in LAYOUT})
    cfg = dataclasses.replace(cfg, **{"out": str(folder), **overrides})
    keep_global_batch(cfg, ckpt, world)
    from memfit.train.model_parallel import check_3d_resume

    check_3d_resume(cfg, ckpt, world or int(os.environ.get("WORLD_SIZE", 0) or 0) or 1)
    check_steps(cfg, ckpt)
    return cfg, ckpt


def keep_global_batch(cfg: TrainConfig, ckpt: dict[str, Any], world: int | None) -> None:
    """--batch is per process: a resume on another number of processes keeps the global batch (the
    run's trajectory) by changing it, or says which process counts can."""
    import os

    world = world or int(os.environ.get("WORLD_SIZE", 0) or 0) or 1
    saved = ckpt.get("world")
    if not isinstance(saved, int) or saved == world:
        return
    total = cfg.batch * saved
    if total % world:
        counts = ", ".join(str(n) for n in range(1, total + 1) if total % n == 0 and n <= 64)
        raise ConfigError(f"this run's global batch is {total} sequences ({saved} processes x --batch {cfg.batch}); "
                          f"{world} processes cannot share it evenly: resume with a process count dividing it "
                          f"({counts})")
    cfg.batch = total // world


def check_steps(cfg: TrainConfig, ckpt: dict[str, Any]) -> None:
    """A resumed run cannot be shortened below the steps it has done."""
    if cfg.steps is not None and cfg.steps < ckpt["step"]:
        raise ConfigError(f"the run in {cfg.out!r} is already at step {ckpt['step']}, past --steps {cfg.steps}; "
                          f"give --steps above {ckpt['step']} to continue it")


def restore(ckpt: dict[str, Any], where: str, model: torch.nn.Module, opt: Any, sampler: Any,
            load_states: Callable[[], None] | None = None) -> None:
    """Load the model, optimizer, sampler and RNG state; a part that does not fit is one ConfigError.
    `load_states` replaces the model and optimizer loads (several processes: ZeRO's sharded files)."""
    states: list[tuple[str, Callable[[], Any]]] = [
        ("model weights", lambda: model.load_state_dict(ckpt["model"])),
        ("optimizer state", lambda: opt.load_state_dict(ckpt["optimizer"])),
    ] if load_states is None else [("model and optimizer state", load_states)]
    parts = states + [
        ("data sampler state", lambda: sampler.load_state_dict(ckpt["sampler"])),
        ("RNG state", lambda: state_mod.set_rng_state(ckpt["rng"])),
    ]
    for what, load in parts:
        try:
            load()
        except CorruptCheckpointError:  # a shard whose checksum fails: its own line names it
            raise
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
            said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
            said = said if len(said) <= 200 else said[:197] + "..."
            raise ConfigError(f"the {what} in checkpoint {where} do not fit this run ({said}); "
                              "the file was edited or comes from another model") from None
