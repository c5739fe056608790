"""The run folder, checked before the first step: a folder that cannot be written fails now, with
one line, not at the first save after the work is done."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from memfit.core.errors import ConfigError
from memfit.train import state as state_mod


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


def prepare_run_dir(out: str | None, log: Callable[[str], None]) -> Path:
    """Create the run folder (`out`, or runs/<timestamp>), prove it writable, and remove the temp
    files a killed run left in it. Raises ConfigError naming the folder and what would work."""
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
    removed = state_mod.remove_stale_temps(path)
    if removed:
        log(f"memfit train: removed {len(removed)} temporary file(s) that a killed run left in {path}")
    return path
