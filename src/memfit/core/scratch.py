"""Temporary folders owned by one process, that a kill -9 cannot leave behind for long.

`owned_folder(prefix)`: a private (0700) folder named <prefix><pid>-<random> in the system temp
folder, holding a lock file (`.lock`, flock-ed while the owner lives), removed with everything in it
when the block ends however it ends (a return, an exception, a signal turned into one). A process
killed with SIGKILL runs no cleanup: the next owned folder made with the same prefix under the same
root removes the folders whose owner is gone (`remove_stale`), as memfit.core.spill does for spill
folders (which use `remove_stale` too).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from memfit.core.owner import hold_lock, owner_gone, release_lock

LOCK_NAME = ".lock"
_LIVE: set[str] = set()
"""This process's open owned folders: never stale, also while being created (before their lock)."""


def owner_of(name: str, prefix: str) -> int | None:
    """The process id in a folder's name <prefix><pid>-..., None if the name carries none."""
    m = re.match(re.escape(prefix) + r"(\d+)-", name)
    return int(m.group(1)) if m else None


def remove_stale(root: str | os.PathLike, prefix: str, live: set[str] = _LIVE) -> list[Path]:
    """Remove the folders <prefix><pid>-... under `root` whose owner process is gone; return them.

    Stale: its lock can be taken (the kernel dropped the dead owner's lock) or, without a lock file,
    the process id in its name is dead. Folders of live processes (and this process's, `live`), other
    users' folders, links and anything named otherwise are left alone."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        pid = owner_of(entry.name, prefix)
        if pid is None or os.path.realpath(entry.path) in live:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                continue
        except (OSError, AttributeError):
            continue
        gone, fd = owner_gone(pid, os.path.join(entry.path, LOCK_NAME), st.st_mtime)
        try:
            if gone:
                shutil.rmtree(entry.path, ignore_errors=True)
                if not os.path.exists(entry.path):
                    removed.append(Path(entry.path))
        finally:
            release_lock(fd)
    return removed


@contextlib.contextmanager
def owned_folder(prefix: str, root: str | os.PathLike | None = None) -> Iterator[str]:
    """A folder of this process's for the block (see the module's docstring); stale ones removed first."""
    root = str(root) if root is not None else tempfile.gettempdir()
    remove_stale(root, prefix)
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
    real = os.path.realpath(folder)
    _LIVE.add(real)
    fd = None
    try:
        fd = hold_lock(os.path.join(folder, LOCK_NAME))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        release_lock(fd)  # after removal: a cleaner that takes the lock finds nothing left to remove
        _LIVE.discard(real)
