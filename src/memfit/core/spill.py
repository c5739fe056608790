"""Spill folders: the private folders that activation offload and optimizer offload write to.

One set of rules for both users:

- `validate_spill_dir(root)`: the spill root is created if missing; a file, an uncreatable or
  unwritable folder, or too little free space is a ConfigError with one message shape.
- `SpillFolder(root, kind)`: a private (0700) folder named memfit-spill-<pid>-<kind>-<random>,
  holding a lock file (`.lock`, flock-ed while the owner lives). It is removed on close(), on
  garbage collection and at interpreter exit; after kill -9 the next SpillFolder made under the
  same root removes it (`remove_stale_spill_folders`).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

from memfit.core.errors import ConfigError
from memfit.core.owner import hold_lock, release_lock
from memfit.core.scratch import remove_stale
from memfit.core.units import format_bytes

PREFIX = "memfit-spill-"
LOCK_NAME = ".lock"
MIN_FREE_BYTES = 256 * 2**20
"""A spill folder with less free space than this is refused up front."""
_OWNER = re.compile(re.escape(PREFIX) + r"(\d+)-")
_LIVE: set[str] = set()
"""This process's open spill folders: never stale, also while being created (before their lock)."""


def _refuse(root: Path, problem: str) -> ConfigError:
    return ConfigError(f"spill folder {str(root)!r} {problem}; pass spill_dir (--spill-dir) a writable "
                       "folder with enough free space")


def spill_root(path: str | os.PathLike | None) -> Path:
    """The folder spill folders are made in: `path`, or the system temp folder."""
    return Path(path if path is not None else tempfile.gettempdir()).expanduser()


def validate_spill_dir(path: str | os.PathLike | None, need_bytes: int = 0, purpose: str = "offload") -> Path:
    """Check (and create if missing) a spill root before training; return it.

    Refused with a ConfigError: a file, a folder that cannot be created or written, and less free
    space than max(need_bytes, MIN_FREE_BYTES)."""
    root = spill_root(path)
    if root.exists() and not root.is_dir():
        raise _refuse(root, "is a file, not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _refuse(root, f"cannot be created ({exc.strerror or exc})") from None
    try:
        probe = tempfile.mkdtemp(prefix=".memfit-probe-", dir=root)
        try:
            with open(os.path.join(probe, "w"), "wb") as f:
                f.write(b"\0" * 4096)
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as exc:
        raise _refuse(root, f"is not writable ({exc.strerror or exc})") from None
    free = shutil.disk_usage(root).free
    need = max(MIN_FREE_BYTES, need_bytes)
    if free < need:
        raise _refuse(root, f"has only {format_bytes(free)} free; {purpose} needs at least {format_bytes(need)}")
    return root


def owner_pid(name: str) -> int | None:
    """The process id in a spill folder's name, None if the name carries none."""
    m = _OWNER.match(name)
    return int(m.group(1)) if m else None


def remove_stale_spill_folders(root: str | os.PathLike | None) -> list[Path]:
    """Remove the spill folders under `root` whose owner process is gone; return what was removed.

    A folder is stale when its lock can be taken (its owner died: the kernel dropped the lock) or,
    for folders without a lock file, when the process id in its name is dead. Folders of live
    processes, other users' folders and anything not named memfit-spill-<pid>-... are left alone."""
    return remove_stale(spill_root(root), PREFIX, _LIVE)


def _close(path: str, fd: int | None) -> None:
    shutil.rmtree(path, ignore_errors=True)
    release_lock(fd)  # after removal: a cleaner that takes the lock finds nothing left to remove
    _LIVE.discard(os.path.realpath(path))


class SpillFolder:
    """A private folder for one user's spill files, owned (locked) by this process."""

    def __init__(self, root: str | os.PathLike | None, kind: str, need_bytes: int = 0,
                 purpose: str = "offload") -> None:
        root = validate_spill_dir(root, need_bytes, purpose)
        remove_stale_spill_folders(root)
        path = None
        try:
            path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{kind}-", dir=str(root))  # mode 0700
            _LIVE.add(os.path.realpath(path))
            fd = hold_lock(os.path.join(path, LOCK_NAME))
        except OSError as exc:
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
                _LIVE.discard(os.path.realpath(path))
            raise _refuse(root, f"is not writable ({exc.strerror or exc})") from None
        self.path = Path(path)
        self._finalizer = weakref.finalize(self, _close, path, fd)

    def file(self, name: str) -> str:
        return str(self.path / name)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the folder and everything in it. Safe to call twice."""
        self._finalizer()
