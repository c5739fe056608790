"""Telling whether the process that left a file behind is still alive.

Two signals, used together: the writer's process id (in the file's name) and, where the writer
holds one, an advisory lock (`fcntl.flock`) on a lock file. The kernel releases a flock when its
holder dies, also on kill -9, so a lock that can be taken means its owner is gone; the process id
covers the moment between creating a file and locking it, and files that carry no lock.
"""
from __future__ import annotations

import os
import time

try:
    import fcntl
except ImportError:  # Windows: no flock; owners are then told apart by process id alone
    fcntl = None  # type: ignore[assignment]

YOUNG_S = 60.0
"""A lock-free file younger than this may belong to a writer that has not locked it yet."""


def pid_alive(pid: int) -> bool:
    """True if a process with this id exists (possibly another user's)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def hold_lock(path: str) -> int | None:
    """Create `path` and hold an exclusive flock on it until the returned descriptor is closed.
    None where flock is unavailable. Blocks while another process's cleanup briefly holds the lock
    to look at it (that cleanup leaves a live owner's file alone)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if fcntl is None:
        os.close(fd)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        raise
    return fd


def release_lock(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def try_take_lock(path: str) -> int | None:
    """The descriptor of `path` with its flock taken (its owner is gone), or None if a live
    process holds it, the file is missing, or flock is unavailable."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def owner_gone(pid: int | None, lock_path: str | None, mtime: float,
               young_s: float = YOUNG_S) -> tuple[bool, int | None]:
    """(whether the owner of a file is gone, a lock descriptor to close after removing it).

    With a lock file: gone when its lock can be taken and the writer's pid is dead, is this very
    process (whose own live locks cannot be taken), or the file is older than young_s (the pid was
    reused). Without one: gone when the pid is dead, or unknown and the file is older than young_s."""
    young = time.time() - mtime < young_s
    if lock_path is not None and os.path.exists(lock_path):
        fd = try_take_lock(lock_path)
        if fd is None:
            return (fcntl is None and pid is not None and not pid_alive(pid)), None
        if pid is None or not pid_alive(pid) or pid == os.getpid() or not young:
            return True, fd
        release_lock(fd)
        return False, None
    if pid is None:
        return not young, None
    return not pid_alive(pid), None
