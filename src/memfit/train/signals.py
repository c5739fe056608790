"""Ctrl-C and SIGTERM end a run after the current step, saved; a second signal aborts at once.

Batch schedulers and preemptible machines send SIGTERM some seconds before they kill, so it is
handled exactly like Ctrl-C. Stopping between steps keeps the checkpoint consistent: a signal
inside the optimizer step would leave some parameters updated and others not.
"""
from __future__ import annotations

import signal
import threading
from typing import Callable

STOPPED = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
"""Why a run stopped, by the signal that stopped it (TrainResult.stopped)."""
EXIT_CODES = {"interrupted": 128 + signal.SIGINT, "terminated": 128 + signal.SIGTERM}
"""The shell's exit codes for a process ended by SIGINT (130) and SIGTERM (143)."""


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

    def _handle(self, signum: int, frame: object) -> None:
        if self.stopped is not None:
            raise Interrupted(signum)
        self.stopped = STOPPED[signal.Signals(signum)]
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        self.log(f"\nmemfit train: {name}: stopping after this step and saving (a second signal aborts without saving)")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPED:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self.previous.clear()
