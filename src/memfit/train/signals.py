"""Ctrl-C and SIGTERM end a run after the current step, saved; a second signal aborts at once.

Batch schedulers and preemptible machines send SIGTERM some seconds before they kill, so it is
handled exactly like Ctrl-C. Stopping between steps keeps the checkpoint consistent: a signal
inside the optimizer step would leave some parameters updated and others not.

A process started to train (a rank of `memfit train --nproc`) calls `hold()` first thing: from then
on a signal is never fatal. One that comes before the loop's handler is installed (while torch and
the model are set up) is kept and stops the loop before its first step; one that comes after the
loop (while the run folder is finished) is kept and changes nothing.
"""
from __future__ import annotations

import signal
import threading
from typing import Callable

STOPPED = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
"""Why a run stopped, by the signal that stopped it (TrainResult.stopped)."""
EXIT_CODES = {"interrupted": 128 + signal.SIGINT, "terminated": 128 + signal.SIGTERM}
"""The shell's exit codes for a process ended by SIGINT (130) and SIGTERM (143)."""


_held: list[int] = []
"""Signals that came while no StopSignals was installed, after `hold()` (oldest first)."""


def _keep(signum: int, frame: object) -> None:
    _held.append(signum)


def hold() -> None:
    """From now on SIGINT/SIGTERM to this process are kept for the training loop, never fatal."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOPPED:
            signal.signal(signum, _keep)


class Interrupted(KeyboardInterrupt):
    """A second signal: the run aborts without saving. `signum` says which signal it was."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """Within the block, SIGINT and SIGTERM set `stopped` ("interrupted" / "terminated") instead of
    killing; the loop checks it between steps. Off the main thread (where Python delivers no
    signals) it does nothing."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.stopped: str | None = None
        self.previous: dict[int, object] = {}
        self._unsaid: str | None = None  # the handler's line when it could not be written then

    def _handle(self, signum: int, frame: object) -> None:
        if self.stopped is not None:
            raise Interrupted(signum)
        self.stopped = STOPPED[signal.Signals(signum)]
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        self._unsaid = (f"\nmemfit train: {name}: stopping after this step and saving (a second signal aborts "
                        "without saving)")
        self._say()

    def _say(self) -> None:
        try:  # the handler runs wherever the main thread was, possibly inside a write to stderr
            if self._unsaid is not None:
                self.log(self._unsaid)
                self._unsaid = None
        except RuntimeError:  # "reentrant call" (inside a print): said by check() between steps
            pass
        except (OSError, ValueError):  # a closed or full pipe: stop all the same, unsaid
            self._unsaid = None

    def check(self) -> str | None:
        """Between steps: why to stop ("interrupted" / "terminated"; None: go on), after writing the
        handler's line if the signal came while the main thread was writing."""
        self._say()
        return self.stopped

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPED:
                self.previous[signum] = signal.signal(signum, self._handle)
            while _held:  # a signal kept by hold() before the loop began
                self._handle(_held.pop(0), None)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self.previous.clear()
