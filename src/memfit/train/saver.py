"""Saving a run: checkpoint.pt and metrics.json, and what happens when the disk refuses.

A failed save (a full disk, a folder gone read-only) never costs the run: the previous checkpoint
is intact (atomic writes), training goes on with one warning and the next save tries again. If
that one fails too, the run stops with one line naming the folder, its free space and the last
step saved (SaveError: exit code 2).

Each checkpoint.pt is written with checksums and read back before it replaces the old one; the
old one then becomes checkpoint.prev.pt, but only if it is known good (this run wrote it, or
resumed from it), so a corrupt checkpoint.pt never displaces the good one a run resumed from.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from memfit.core.errors import MemfitError
from memfit.core.units import format_bytes
from memfit.train import report, state as state_mod


class SaveError(MemfitError):
    """Saving failed twice in a row (or at the end of the run): the run stopped."""


def _free(folder: Path) -> str:
    try:
        return format_bytes(shutil.disk_usage(folder).free) + " free"
    except OSError:
        return "free space unknown"


class Saver:
    def __init__(self, run_dir: Path, log: Callable[[str], None], saved_step: int | None = None) -> None:
        self.run_dir, self.log = run_dir, log
        self.saved_step = saved_step
        """The step of the newest checkpoint on disk (None: none yet)."""
        self.failing = False
        self.trusted = False
        """Whether checkpoint.pt is known good (this run wrote it or resumed from it, every check passed):
        only then may it become checkpoint.prev.pt."""
        self.folder: str | None = None
        """The sharded folder checkpoint.pt names, when this run wrote it (several processes)."""
        self.previous: tuple[int, str | None] | None = None
        """checkpoint.prev.pt's step and sharded folder, once this run has kept one (the folder is kept too)."""

    def resumed(self, checkpoint: dict[str, Any]) -> None:
        """The run continues `checkpoint` (loaded by resume_config, which records its file as "_source",
        and checked): the file it came from is known good and keeps its sharded folder."""
        self.saved_step = checkpoint["step"]
        source = checkpoint.get("_source")
        folder = (checkpoint.get("shards") or {}).get("folder")
        if source is None:
            return
        if os.path.realpath(source) == os.path.realpath(self.run_dir / state_mod.CHECKPOINT):
            self.trusted, self.folder = True, folder
        elif os.path.realpath(source) == os.path.realpath(self.run_dir / state_mod.PREVIOUS):
            self.previous = (checkpoint["step"], folder)

    def _keep_previous(self, tmp) -> None:
        """Before the new checkpoint.pt replaces the old: the old one, if good, becomes checkpoint.prev.pt."""
        current = self.run_dir / state_mod.CHECKPOINT
        if not current.is_file():
            return
        if not self.trusted:  # e.g. a resume from checkpoint.prev.pt because checkpoint.pt is corrupt
            self.log(f"memfit train: replacing {current}, which this run did not resume from; "
                     f"{state_mod.PREVIOUS} stays as it is")
            return
        state_mod.keep_previous(current, self.run_dir / state_mod.PREVIOUS)
        self.previous = (self.saved_step, self.folder) if self.saved_step is not None else None

    def save(self, step: int, checkpoint: dict[str, Any], metrics: dict[str, Any], *, last: bool) -> bool:
        """Write both files; True if they were written. A second failure in a row, or a failure
        of the `last` save (no later save to retry), raises SaveError."""
        try:
            state_mod.save_checkpoint(self.run_dir / state_mod.CHECKPOINT, checkpoint, sealed=True,
                                      before_replace=self._keep_previous)
            self.saved_step, self.trusted = step, True
            self.folder = (checkpoint.get("shards") or {}).get("folder")
            state_mod.save_json(self.run_dir / report.METRICS, metrics)
        except OSError as exc:
            reason = f"{exc.strerror or exc}, {_free(self.run_dir)}"
            if self.failing or last:
                raise SaveError(self._stop_message(step, reason)) from None
            self.failing = True
            self.log(f"memfit train: cannot save step {step} in {self.run_dir} ({reason}); training on, "
                     "retrying at the next save")
            return False
        if self.failing:
            self.log(f"memfit train: saved step {step} in {self.run_dir} (the earlier save had failed)")
        self.failing = False
        return True

    def _stop_message(self, step: int, reason: str) -> str:
        if self.saved_step is None:
            kept = "no checkpoint was saved; free space and run again"
        else:
            kept = (f"the last checkpoint saved is step {self.saved_step}; free space and continue with "
                    f"memfit train --resume {self.run_dir}")
        return f"cannot save step {step} in {self.run_dir} ({reason}): stopped; {kept}"
