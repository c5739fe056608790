"""Ctrl-C and SIGTERM to the `--nproc` launcher reach every rank once; the launcher waits for them.

torch-elastic's own handlers turn a signal into an exception in the launcher: a traceback, exit 1,
and a 30-second timer that SIGKILLs ranks still saving. Instead the launcher keeps SIGINT and
SIGTERM for itself (LaunchConfig.signals_to_handle leaves them out) and forwards each one to the
ranks, which stop after their step, save and return 130 / 143 (memfit.train.signals); the launcher
then returns the ranks' code like any other end. A second signal is forwarded too: the ranks
skip their final evaluation and plot, and still save. A rank that is still starting (importing
torch: seconds) has no handler yet, and a signal would kill it (or raise KeyboardInterrupt in an
import): each rank leaves a file named for its
pid in the launcher's ready folder (READY_ENV) once its handlers are in place (memfit.train.signals.
hold), and a signal is sent to a rank only then; one owed to a rank still starting is sent when it
is ready. Each rank starts a session of its own when it starts (`detach`), as torchrun's
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
import time
from typing import Iterator

FORWARDED = (signal.SIGINT, signal.SIGTERM)
READY_ENV = "MEMFIT_LAUNCH_READY"
"""The folder where each rank leaves a file named for its pid once its signal handlers are in place."""
ELASTIC_SIGNALS = "SIGHUP,SIGQUIT"
"""What torch-elastic may still handle itself (its default also names SIGTERM and SIGINT)."""
REAP_GRACE_S = 3.0
"""How long the ranks that outlive a crashed rank get to end by themselves before the launcher kills them."""
REAP_ENV = "MEMFIT_REAP_GRACE_S"
"""Overrides REAP_GRACE_S (seconds; "inf": leave them to torch-elastic's 30 s, as bench/rank_death.py compares)."""


def _ranks() -> list[int]:
    """The launcher's live children: the ranks torch-elastic started with multiprocessing."""
    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]


class Forwarder:
    """Within the block, SIGINT/SIGTERM to this process are sent on to the ranks; `received`
    holds the first one (None: no signal). `folder`: where ranks say they are ready (None: all are)."""

    def __init__(self, folder: str | None = None) -> None:
        self.received: int | None = None
        self.folder = folder
        self._previous: dict[int, object] = {}
        self._owed: dict[int, list[int]] = {}  # rank pid -> signals to send once it is ready
        self._lock = threading.RLock()  # the handler (main thread, possibly nested) and the sender thread
        self._done = threading.Event()
        self._sender: threading.Thread | None = None

    def ready(self, pid: int) -> bool:
        return self.folder is None or os.path.exists(os.path.join(self.folder, str(pid)))

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        ranks = _ranks()
        if not ranks:  # no rank started yet (or all gone): nothing would save, stop the launch itself
            from memfit.train.signals import Interrupted

            raise Interrupted(signum)
        with self._lock:
            for pid in ranks:
                self._owed.setdefault(pid, []).append(signum)
        self._send()
        if self._owed and self._sender is None:
            self._sender = threading.Thread(target=self._send_when_ready, name="memfit-signals", daemon=True)
            self._sender.start()

    def _send(self) -> None:
        """Send what is owed to each rank that is ready; forget ranks that are gone."""
        with self._lock:
            for pid in list(self._owed):
                try:
                    if self.ready(pid):
                        for signum in self._owed.pop(pid):
                            os.kill(pid, signum)
                    else:
                        os.kill(pid, 0)
                except ProcessLookupError:
                    self._owed.pop(pid, None)

    def _send_when_ready(self) -> None:
        while not self._done.wait(0.05):
            self._send()

    def __enter__(self) -> "Forwarder":
        if self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)
            self._env = os.environ.get(READY_ENV)
            os.environ[READY_ENV] = self.folder  # the ranks inherit it
        if threading.current_thread() is threading.main_thread():
            for signum in FORWARDED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self._done.set()
        if self._sender is not None:
            self._sender.join(1.0)
        if self.folder is not None:
            if self._env is None:
                os.environ.pop(READY_ENV, None)
            else:
                os.environ[READY_ENV] = self._env


def mark_ready() -> None:
    """In a rank, once its signal handlers are in place: the launcher may now send it signals."""
    folder = os.environ.get(READY_ENV)
    if folder:
        with contextlib.suppress(OSError):
            open(os.path.join(folder, str(os.getpid())), "w").close()


def detach() -> None:
    """In a rank: a session of its own (torchrun's start_new_session; Ctrl-C comes through the
    launcher only). Dying with the launcher is memfit.distributed.lifeline's."""
    with contextlib.suppress(OSError):
        os.setsid()


@contextlib.contextmanager
def forwarding(folder: str | None = None) -> Iterator[Forwarder]:
    with Forwarder(folder) as f:
        yield f


class Reaper:
    """A rank that died (kill -9, the OOM killer, a segfault, an uncaught exception) takes the ranks it
    leaves with it, REAP_GRACE_S later.

    Why: torch-elastic stops the other ranks with SIGTERM and SIGKILLs them only after
    torch.multiprocessing's fixed 30 s grace, which the launch API does not expose. A rank blocked in a
    collective or a save with a dead peer runs no Python handler, so it waited out all 30 s. Killing it is
    safe: every checkpoint is written aside and renamed into place (memfit.train.saver,
    memfit.distributed.fsdp2_checkpoint), so a torn save is never read and the restart resumes from the
    last whole one. Not after a forwarded Ctrl-C/SIGTERM: then the ranks are saving on purpose (they end
    with exit code 0 and their own code in the result), and no rank is killed."""

    def __init__(self, signals: Forwarder, grace: float | None = None, poll: float = 0.1) -> None:
        if grace is None:
            grace = float(os.environ.get(REAP_ENV) or REAP_GRACE_S)
        self.signals, self.grace, self.poll = signals, grace, poll
        self.killed: list[int] = []
        self.died: list[int] = []
        """The pids of ranks that ended with a non-zero code, first first (memfit.cli.launch._failed names it)."""
        self._seen: dict[int, multiprocessing.process.BaseProcess] = {}
        self._doomed: list[tuple[float, multiprocessing.process.BaseProcess]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memfit-reaper", daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(self.poll):
            # active_children() forgets a child once it has ended: the references kept here still hold
            # its exit code (torch-elastic's monitor polls the same Process objects).
            for p in multiprocessing.active_children():
                self._seen.setdefault(p.pid, p)
            ended = [p for p in self._seen.values() if p.exitcode is not None]
            # Seen ending in one poll: a rank that aborted (a collective's error on losing its peer) is
            # the consequence, not the cause, so it goes after the others.
            for p in sorted(ended, key=lambda p: p.exitcode == -signal.SIGABRT):
                del self._seen[p.pid]
                if p.exitcode != 0:
                    self.died.append(p.pid)
                    if self.signals.received is None:
                        at = time.monotonic() + self.grace
                        self._doomed += [(at, q) for q in self._seen.values() if q.exitcode is None]
            self._reap()

    def _reap(self) -> None:
        now, left = time.monotonic(), []
        for at, p in self._doomed:
            if p.exitcode is not None or self.signals.received is not None:
                continue
            if at > now:
                left.append((at, p))
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
                self.killed.append(p.pid)
        self._doomed = left

    def __enter__(self) -> "Reaper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(1.0)
