"""Ctrl-C and SIGTERM to the `--nproc` launcher reach every rank once; the launcher waits for them.

torch-elastic's own handlers turn a signal into an exception in the launcher: a traceback, exit 1,
and a 30-second timer that SIGKILLs ranks still saving. Instead the launcher keeps SIGINT and
SIGTERM for itself (LaunchConfig.signals_to_handle leaves them out) and forwards each one to the
ranks, which stop after their step, save and return 130 / 143 (memfit.train.signals); the launcher
then returns the ranks' code like any other end. A second signal is forwarded too: the ranks abort
without saving. Each rank starts a session of its own when it starts (`detach`), as torchrun's
ranks do: a Ctrl-C typed in the terminal reaches the ranks once, through the launcher, not twice;
and where the kernel schedules by session (autogroup), each rank gets its own share of a busy
machine, as under torchrun, instead of all ranks sharing the launcher's (2-3x slower steps when
measured on a loaded machine).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from typing import Iterator

FORWARDED = (signal.SIGINT, signal.SIGTERM)
ELASTIC_SIGNALS = "SIGHUP,SIGQUIT"
"""What torch-elastic may still handle itself (its default also names SIGTERM and SIGINT)."""


def _ranks() -> list[int]:
    """The launcher's live children: the ranks torch-elastic started with multiprocessing."""
    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]


class Forwarder:
    """Within the block, SIGINT/SIGTERM to this process are sent on to the ranks; `received`
    holds the first one (None: no signal)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        ranks = _ranks()
        if not ranks:  # no rank started yet (or all gone): nothing would save, stop the launch itself
            from memfit.train.signals import Interrupted

            raise Interrupted(signum)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def __enter__(self) -> "Forwarder":
        if threading.current_thread() is threading.main_thread():
            for signum in FORWARDED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def detach() -> None:
    """In a rank: a session of its own (torchrun's start_new_session; Ctrl-C comes through the
    launcher only), and SIGTERM from Linux when the launcher dies, so a rank never trains on with
    nobody waiting for it."""
    with contextlib.suppress(OSError):
        os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def forwarding() -> Iterator[Forwarder]:
    with Forwarder() as f:
        yield f
