"""A rank never outlives the process that launched it.

A launcher killed with SIGKILL runs no cleanup: its ranks stay, each waiting in a collective for
a peer that died (seen: 17 minutes in gloo waits, SIGTERM kept by the training loop's handler and
never acted on, the launcher's stdout and stderr held open). So each rank binds its life to its
launcher's, as early as it can:

- Linux's parent-death signal (prctl PR_SET_PDEATHSIG): the kernel sends SIGKILL when the parent
  exits. SIGKILL, not SIGTERM: a rank blocked in C++ (a collective) never runs a Python handler,
  and a kill of the launcher is a kill of the job; its checkpoint.pt is whole (atomic writes) and a
  sharded folder it tore is removed on resume (memfit.train.distributed.remove_torn).
- The race: a launcher that died before the signal was set leaves no signal to send. The launcher
  puts its pid in the environment (LAUNCHER_ENV); a rank whose parent is already another process
  exits at once. Under torchrun (no such variable) the parent at start is torchrun's agent.
- A watchdog thread that polls the parent's pid, for systems without prctl (and should the
  signal not come: it is tied to the thread that started the rank, not to the process).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "MEMFIT_LAUNCHER_PID"
"""The pid of the `--nproc` launcher, set in its ranks' environment."""
POLL_S = 0.5
"""How often the watchdog looks at the parent's pid: a rank outlives its launcher by at most this
(plus the time to be scheduled) where the parent-death signal is not available."""

_bound: int | None = None  # the parent pid this process is bound to


def _set_parent_death_signal(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when its parent exits; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die(parent: int) -> None:
    with contextlib.suppress(OSError):  # stderr may be the dead launcher's pipe
        os.write(2, f"memfit: pid {os.getpid()}: its launcher (pid {parent}) is gone; exiting\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            _die(parent)


def bind_to_launcher() -> int | None:
    """Tie this process's life to its launcher's (see the module's docstring); returns the pid it is
    bound to, or None when not started by a launcher (no LAUNCHER_ENV, not under torchrun).
    Idempotent: the second call in a process does nothing."""
    global _bound
    if _bound is not None:
        return _bound
    expected = os.environ.get(LAUNCHER_ENV)
    if expected is None and not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    _set_parent_death_signal(signal.SIGKILL)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()
    if os.getppid() != parent or parent == 1:  # it died before the signal was set: nobody would send it
        _die(parent)
    _bound = parent
    os.environ.pop(LAUNCHER_ENV, None)  # not for this rank's own children
    threading.Thread(target=_watch, args=(parent,), name="memfit-lifeline", daemon=True).start()
    return parent


@contextlib.contextmanager
def launcher_environment():
    """In the launcher, around starting its ranks: they find its pid in LAUNCHER_ENV."""
    before = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = before
