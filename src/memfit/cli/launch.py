"""`memfit train --nproc N`: start N local processes through torchrun's API (elastic launch).

Each process runs the same `memfit train` command line (without --nproc) with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), rendezvous on 127.0.0.1 at a free port. Rank 0
speaks; another rank's output is shown only when it ended differently from rank 0. The exit code
is the worst rank's. As under torchrun, each rank runs one thread unless OMP_NUM_THREADS is set;
torch-elastic's log folder and temporary files go into a folder removed at the end (launch_env.py),
and a killed rank's disk offload folder is removed then too; Ctrl-C and
SIGTERM are forwarded to the ranks, which stop after their step and save, and a rank that dies takes the
others with it within seconds (launch_signals.py).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import uuid
from typing import Any

from memfit.core.errors import MemfitError


def to_argv(command: str, given: dict[str, Any], drop: tuple[str, ...] = ("nproc",)) -> list[str]:
    """The command line that parses back to `given` (options the user gave; argparse SUPPRESS)."""
    argv = [command]
    for key, value in given.items():
        if key.startswith("_") or key in drop or key == "command":
            continue
        flag = "--" + key.replace("_", "-")
        if key == "track":
            if value is False:
                argv.append("--no-track")
        elif isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(0 if key == "clip" and value is None else value)]
    return argv


def _worker(argv: list[str]) -> tuple[int, str]:
    from memfit.distributed.lifeline import bind_to_launcher

    bind_to_launcher()  # first of all: this rank dies with the launcher, even one killed with SIGKILL
    from memfit.train.signals import hold

    hold()  # from here on SIGINT/SIGTERM are kept for the training loop, never fatal
    from memfit.cli import main
    from memfit.cli.launch_signals import detach, mark_ready

    detach()
    mark_ready()
    if os.environ.get("RANK", "0") == "0":
        return main(argv), ""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except BaseException:
        sys.stderr.write(err.getvalue())  # an unexpected failure: show what this rank said
        raise
    return code, err.getvalue()


def launch(nproc: int, argv: list[str], max_restarts: int = 0, out: str | None = None,
           spill_dir: str | None = None) -> int:
    """Run `memfit <argv>` on `nproc` ranks; a rank that dies restarts them all up to `max_restarts`
    times (each attempt resumes from the run folder `out`, memfit.train.elastic). `spill_dir`: the
    ranks' disk offload folder (None: the temp folder), where a rank that was killed left its spill
    folder: removed once the launch ends."""
    from memfit.cli.launch_env import rank_environment
    from memfit.cli.launch_signals import Reaper, forwarding
    from memfit.core.spill import remove_stale_spill_folders

    from memfit.distributed.lifeline import launcher_environment

    try:
        with rank_environment() as folder, forwarding(os.path.join(folder, "ready")) as signals, \
                Reaper(signals) as reaper, launcher_environment():
            results = _elastic(nproc, argv, max_restarts, out, reaper.died, folder)
    finally:  # after the block: the ranks are gone (and the temp folder is the ranks' own again)
        remove_stale_spill_folders(spill_dir)
    if signals.received is not None and not results:
        return 128 + signals.received
    codes = {r: res[0] for r, res in results.items()}
    for r in sorted(results):
        if r != 0 and codes[r] != codes.get(0):
            sys.stderr.write(f"[rank {r}] {results[r][1]}")
    return max(codes.values())


def _elastic(nproc: int, argv: list[str], max_restarts: int, out: str | None, died: list[int],
             scratch: str) -> dict[int, Any]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from memfit.cli.launch_signals import ELASTIC_SIGNALS
    from memfit.distributed.env import free_port

    port = free_port()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"memfit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=max_restarts,
        monitor_interval=0.2, start_method="spawn", signals_to_handle=ELASTIC_SIGNALS,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(scratch, "elastic")),  # removed with `scratch`
    )
    try:
        with _quiet_elastic():
            return elastic_launch(config, _worker)(argv)
    except ChildFailedError as exc:
        raise MemfitError(_failed(exc, max_restarts, out, died)) from None


@contextlib.contextmanager
def _quiet_elastic():
    """torch-elastic logs a failed rank as a traceback of its own monitoring code and warns for each
    process it closes; the launcher says what happened in one line (`_failed`) instead."""
    import logging

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _failed(exc, max_restarts: int, out: str | None, died: list[int] = ()) -> str:
    """One line for a rank that died (killed, crashed) with no restart left: the first to die, as the
    launcher saw them end (`died`, pids), else torch-elastic's first (its timestamps tie for ranks that
    left no error file). A rank that raised names its error; its traceback (torch-elastic's error file,
    in the launch's temporary folder) is kept as rank<N>-error.txt in the run folder."""
    import signal

    by_pid = {f.pid: (r, f) for r, f in exc.failures.items()}
    rank, failure = next((by_pid[p] for p in died if p in by_pid), None) or exc.get_first_failure()
    code = failure.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    raised = (failure.error_file_data or {}).get("message") or {}
    if code > 0 and isinstance(raised, dict) and raised.get("message"):
        how += f" ({raised['message'].strip().splitlines()[-1][:200]}"
        stack = (raised.get("extraInfo") or {}).get("py_callstack")
        if out and stack and os.path.isdir(out):
            path = os.path.join(out, f"rank{rank}-error.txt")
            with contextlib.suppress(OSError), open(path, "w") as f:
                f.write(stack)
                how += f"; traceback in {path}"
        how += ")"
    tries = f"after {max_restarts} restart(s)" if max_restarts else "and --max-restarts is 0"
    tail = f"; continue from the last checkpoint with memfit train --resume {out}" if out else ""
    return f"rank {rank} {how} {tries}{tail}"
