"""One run per run folder: a lock held while a run uses the folder.

The lock is `fcntl.flock` on `.memfit-run.lock` in the folder. The operating system drops it when
the process ends, however it ends (kill -9 included), so a killed run never leaves a stale lock.
The file records the holder's pid, host and start time for the refusal message of a second run.

Several processes: the launcher of `memfit train --nproc N` holds the lock and tells its ranks so
(HELD_ENV names the folder); under a bare torchrun rank 0 holds it. Ranks never lock each other out.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from memfit.core.errors import ConfigError

LOCK = ".memfit-run.lock"
HELD_ENV = "MEMFIT_RUN_LOCK_HELD"
"""Set by a process that holds a folder's lock for its children (the --nproc launcher): the folder."""

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not locked there
    fcntl = None  # type: ignore[assignment]


def _same(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def held_by_parent(folder: str | os.PathLike) -> bool:
    """Whether a launcher above this process holds `folder`'s lock for it."""
    held = os.environ.get(HELD_ENV)
    return bool(held) and _same(held, folder)


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {int(info['pid'])} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "details not yet written"


class RunLock:
    """Hold `folder`'s run lock: `with RunLock(folder):` (ConfigError if another run holds it)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if fcntl is None:
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:  # e.g. another user's lock file
                raise ConfigError(f"cannot open the run lock {str(self.path)!r} ({exc.strerror or exc}); "
                                  "pass another --out") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(
                    f"run folder {str(self.folder)!r} is in use by another memfit train run ({_holder(self.path)}); "
                    "wait for it to end, or pass another --out") from None
            except OSError:  # a file system without locks (some network mounts): run unlocked
                os.close(fd)
                return
            # The holder before us may have removed the file after we opened it: lock the file that is there.
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())

    def release(self) -> None:
        """Remove the lock file while still holding it (a waiting run then locks a fresh file), then unlock."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
