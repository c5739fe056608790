"""Temp files that a checkpoint write leaves behind when its process is killed mid-save.

A checkpoint is written to a temp file beside it and renamed over the old one (atomic). The temp
file is named `.<name>.<pid>.<random>.tmp` (see `temp_prefix`), so a later run can tell a dead
writer's leftovers from a live writer's file and remove them (`remove_stale_checkpoint_temps`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from memfit.core.owner import owner_gone

LEGACY_AGE_S = 3600.0
"""Temp files named without a pid (older memfit) are removed once older than this."""


def temp_prefix(path: str | os.PathLike) -> str:
    """The prefix for `tempfile.mkstemp(prefix=..., suffix=".tmp", dir=path.parent)` when writing `path`."""
    return f".{Path(path).name}.{os.getpid()}."


def _writer_pid(name: str, target: str) -> tuple[bool, int | None]:
    """(whether `name` is a temp file of `target`, the writer's pid if the name carries one)."""
    head = f".{target}."
    if not (name.startswith(head) and name.endswith(".tmp")):
        return False, None
    m = re.match(r"(\d+)\.", name[len(head):])
    return True, int(m.group(1)) if m else None


def remove_stale_checkpoint_temps(run_dir: str | os.PathLike, target: str = "checkpoint.pt") -> list[Path]:
    """Remove `.<target>.*.tmp` files in `run_dir` whose writer process is gone; return them.

    A temp file with this process's own pid is stale too: call this before saving, not during a
    save. Temp files without a pid in their name are removed once older than LEGACY_AGE_S."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return removed
    for entry in entries:
        ours, pid = _writer_pid(entry.name, target)
        if not ours:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        gone = pid == os.getpid() or owner_gone(pid, None, mtime, young_s=LEGACY_AGE_S)[0]
        if gone:
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
    return removed
