"""The run folder, checked before the first step: a folder that cannot be written fails now, with
one line, not at the first save after the work is done. A run folder belongs to one run: a run
holds its lock (memfit.train.runlock), and a fresh run refuses a folder that holds another run's
checkpoint unless told to --resume it or to start over with --overwrite."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from memfit.core.errors import ConfigError
from memfit.train import state as state_mod
from memfit.train.runlock import RunLock, held_by_parent

OVERWRITTEN = (state_mod.CHECKPOINT, state_mod.PREVIOUS, "metrics.json", "plot.png")
"""A run's files that --overwrite removes (with its sharded-*, compression-* and reshard-* folders)."""
_FOLDERS = ("sharded-", "compression-", "reshard-")


def new_run_dir() -> Path:
    """runs/<timestamp> under the working folder, with -N appended if that exists already."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / stamp
    i = 1
    while path.exists():
        path, i = Path("runs") / f"{stamp}-{i}", i + 1
    return path


def check_out(out: str | None) -> None:
    """Refuse an --out that names an existing file (before anything is built)."""
    if out is not None and os.path.lexists(out) and not Path(out).is_dir():
        raise ConfigError(f"--out {out!r} is an existing file, not a folder; pass a new or existing folder")


def check_fresh(out: str | None, overwrite: bool) -> None:
    """A fresh run (no --resume) refuses a folder that holds a checkpoint, unless `overwrite`."""
    if out is None or overwrite:
        return
    held = [name for name in (state_mod.CHECKPOINT, state_mod.PREVIOUS) if (Path(out) / name).is_file()]
    if held:
        raise ConfigError(f"run folder {out!r} already holds a run's {held[0]}; continue it with memfit train "
                          f"--resume {out}, or start over there with --overwrite (its checkpoints are removed)")


def check_resume_into(out: str | None, source: str | None) -> None:
    """A resume with --out elsewhere refuses a folder that holds another run's checkpoint."""
    if out is None or source is None or os.path.realpath(Path(source).parent) == os.path.realpath(out):
        return
    held = [name for name in (state_mod.CHECKPOINT, state_mod.PREVIOUS) if (Path(out) / name).is_file()]
    if held:
        raise ConfigError(f"--out {out!r} already holds another run's {held[0]}; resume into a folder without "
                          f"one, or leave out --out to continue in {str(Path(source).parent)!r}")


def _remove_previous_run(path: Path, log: Callable[[str], None]) -> None:
    """--overwrite: the earlier run's checkpoints, metrics and sharded folders go before this one starts."""
    gone = [p for p in path.iterdir() if p.name in OVERWRITTEN or p.name.startswith(_FOLDERS)]
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    if any(p.name == state_mod.CHECKPOINT for p in gone):
        log(f"memfit train: --overwrite: removed the earlier run's checkpoints and metrics from {path}")


def prepare_run_dir(out: str | None, log: Callable[[str], None], hold: Callable | None = None, *,
                    fresh: bool = False, overwrite: bool = False) -> Path:
    """Create the run folder (`out`, or runs/<timestamp>), prove it writable, and remove the temp
    files a killed run left in it. Raises ConfigError naming the folder and what would work.

    `hold(lock)` (an ExitStack's enter_context) takes the folder's run lock for the caller's run;
    None: the caller's launcher or rank 0 holds it. Under the lock a `fresh` run checks the folder
    holds no checkpoint (or, with `overwrite`, removes the earlier run's files)."""
    check_out(out)
    path = Path(out) if out else new_run_dir()
    hint = "pass --out with a folder you can write" if out is None else "pass a writable --out"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run folder {str(path)!r} ({exc.strerror or exc}); {hint}") from None
    try:
        with tempfile.TemporaryFile(dir=path, prefix=".memfit-probe-") as f:
            f.write(b"\0")
            f.flush()
    except OSError as exc:
        raise ConfigError(f"run folder {str(path)!r} is not writable ({exc.strerror or exc}); {hint}") from None
    if hold is not None and not held_by_parent(path):
        hold(RunLock(path))
    if hold is not None and fresh:
        check_fresh(str(path), overwrite)
        if overwrite:
            _remove_previous_run(path, log)
    removed = state_mod.remove_stale_temps(path)
    if removed:
        log(f"memfit train: removed {len(removed)} temporary file(s) that a killed run left in {path}")
    return path
