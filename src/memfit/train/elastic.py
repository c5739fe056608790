"""Elastic restarts: a rank killed mid-run, torchrun restarts every rank, the job goes on from its
last checkpoint.

torchrun (or `memfit train --nproc N --max-restarts K`, which launches through torchrun's API)
starts all ranks again with TORCHELASTIC_RESTART_COUNT > 0 and the same command line. A restarted
`memfit train` then resumes from the run folder's checkpoint.pt (ZeRO: the sharded-<step> folder
it names), so the job ends where an uninterrupted one would. The run folder must be the same on
every attempt: `--nproc` fixes it before launching; under torchrun with restarts give `--out`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from memfit.core.errors import ConfigError
from memfit.train import state as state_mod


def restart_count() -> int:
    """How many times torchrun has restarted this job's ranks (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def resumed_options(given: dict[str, Any]) -> dict[str, Any]:
    """The options of this attempt: on a restart with a checkpoint in the run folder, `given` plus
    resume=<the run folder>; otherwise `given` (a run killed before its first save starts over,
    which is the uninterrupted run too)."""
    if "nproc" in given:  # the launcher itself, not a rank
        return given
    folder = given.get("out") or given.get("resume")
    if max_restarts() > 0 and folder is None:
        raise ConfigError("torchrun --max-restarts needs --out: a restarted rank resumes from the run folder's "
                          "checkpoint, so every attempt must name the same folder")
    if restart_count() == 0 or folder is None:
        return given
    path = Path(folder)
    path = path.parent if path.is_file() else path
    if not (path / state_mod.CHECKPOINT).exists():
        return given
    # --overwrite cleared the folder for the first attempt; a restart continues what that attempt saved.
    return {**{k: v for k, v in given.items() if k != "overwrite"}, "resume": str(path)}
