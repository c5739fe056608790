"""Ctrl-C and SIGTERM end a run after the current step, saved; a second signal skips what is left
that does not keep work (the final evaluation and the plot), never the save.

Batch schedulers and preemptible machines send SIGTERM some seconds before they kill, so it is
handled exactly like Ctrl-C. Stopping between steps keeps the checkpoint consistent: a signal
inside the optimizer step would leave some parameters updated and others not.

The handlers only count signals. Python runs a handler wherever the main thread is, possibly in a
callback that torch's C++ is running (a torch.save writing the checkpoint, an autograd hook): an
exception raised there reaches C++ code that cannot pass it on, and the process aborts (SIGABRT;
seen as "terminate called after throwing an instance of 'pybind11::error_already_set'"), and a
print there may write to a stream that is closing. So the loop reads the counts between steps and
says what it does; nothing is written or raised from a handler.

A process started to train (a rank of `memfit train --nproc`, and `memfit train` itself before its
loop) calls `hold()`: from then on a signal is never fatal. One that comes before the loop's
handler is installed (while torch and the model are set up) is kept and stops the loop before its
first step; one that comes after the loop (while the run folder is finished) is kept and changes
nothing.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

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


@contextlib.contextmanager
def holding(restore: bool = True) -> Iterator[None]:
    """`hold()` within the block; after it the previous handlers again (restore=False: kept until
    the process ends, as ignored signals, for a process that only trains: one while it exits changes nothing)."""
    before = {s: signal.getsignal(s) for s in STOPPED}
    hold()
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for s, h in before.items():
                # restore=False: ignored from here to the exit. Not the counting handler: Python puts
                # SIG_DFL back under every Python-level handler as the interpreter finalizes, so a
                # signal in the process's last milliseconds would kill it (-15) after its line
                signal.signal(s, (h if h is not None else signal.SIG_DFL) if restore else signal.SIG_IGN)
            _held.clear()


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises Interrupted as Ctrl-C raises KeyboardInterrupt, where it would
    otherwise kill the process at once (its default action): the blocks being left clean up (the
    temporary folders of a run that is still preparing, before `holding` keeps signals for its loop)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield  # a handler is in place already (a rank's `hold()`, the caller's own): left as it is
        return

    def _raise(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is _raise:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Interrupted(KeyboardInterrupt):
    """A signal that stops what has nothing to save (the launcher before its ranks start).
    `signum` says which signal it was."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"


class StopSignals:
    """Within the block, SIGINT and SIGTERM set `stopped` ("interrupted" / "terminated") instead of
    killing; the loop checks it between steps, and `hurry` (a second signal: save and leave, no
    final evaluation, no plot). Off the main thread (where Python delivers no signals) it does
    nothing."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.stopped: str | None = None
        self.signals: list[int] = []  # every stop signal received, oldest first (the handler appends only)
        self.previous: dict[int, object] = {}
        self._said = 0  # how many of `signals` the loop has reported

    def _handle(self, signum: int, frame: object) -> None:
        self.signals.append(signum)  # nothing else here: see the module's docstring

    @property
    def hurry(self) -> bool:
        """A second signal came: save and leave without the final evaluation and the plot."""
        return len(self.signals) > 1

    def check(self) -> str | None:
        """Between steps: why to stop ("interrupted" / "terminated"; None: go on), after saying
        what each signal since the last check does."""
        signals = list(self.signals)
        if signals and self.stopped is None:
            self.stopped = STOPPED[signal.Signals(signals[0])]
        for i in range(self._said, len(signals)):
            name = _name(signals[i])
            self._write(f"\nmemfit train: {name}: stopping after this step and saving (a second signal skips the "
                        "final evaluation and the plot, not the save)" if i == 0 else
                        f"memfit train: second {name}: saving now, without the final evaluation and the plot")
        self._said = len(signals)
        return self.stopped

    def _write(self, line: str) -> None:
        try:
            self.log(line)
        except (OSError, ValueError):  # stderr closed or a full pipe (the terminal went away): stop all the same
            pass

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPED:
                self.previous[signum] = signal.signal(signum, self._handle)
            while _held:  # a signal kept by hold() before the loop began
                self.signals.append(_held.pop(0))
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self.previous.clear()
