"""Run a function on N local processes joined in a gloo group on 127.0.0.1 (tests, benchmarks).

    results = run_world(fn, 2, args=(...,), timeout_s=120)   # fn(rank, world, *args) -> picklable

Never hangs: the group's collectives time out after `timeout_s`, and processes still running at
the deadline are killed. A rank's exception comes back as RuntimeError with its traceback.

Where the platform has it (Linux), the ranks are forked from a forkserver that imported torch and
memfit once: a spawned rank imports them afresh, seconds of CPU that were most of a small
multi-process test on a 2-core machine. Each rank still gets the caller's current environment and
working directory, as a spawned one would.
"""
from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from memfit.core.scratch import owned_folder
from memfit.distributed import env


# imported once by the forkserver: torch (and torch._dynamo, which torch.optim imports on first use)
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "memfit.distributed.env", "memfit.apply.optimizer"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call); later calls change nothing
    return ctx


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str, timeout_s: float, threads: int,
           environ: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's when it started
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    try:
        env.init("cpu", timeout_s=timeout_s)
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        try:
            env.shutdown()
        except Exception:
            pass
    torch.save(result, Path(out) / f"{rank}.pt")


def run_world(fn: Callable, world: int, args: tuple = (), timeout_s: float = 120.0, threads: int = 1) -> list[Any]:
    """fn(rank, world, *args) on `world` spawned processes; their return values in rank order."""
    with owned_folder("memfit-world-") as out:  # one a killed caller left: removed by the next call
        port = env.free_port()
        ctx = _context()
        environ = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out, timeout_s, threads, environ),
                             daemon=True)
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s + 30
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:  # also on Ctrl-C or an error while waiting: no rank outlives the call
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results, errors = [], []
        for r in range(world):
            f = Path(out) / f"{r}.pt"
            if not f.exists():
                errors.append(f"rank {r}: " + ("still running at the deadline" if r in hung else
                                               f"exited with code {procs[r].exitcode} and no result"))
                continue
            status, value = torch.load(f, weights_only=False)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
