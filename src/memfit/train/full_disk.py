"""A spill folder that fills up during a run (optimizer state or activations on disk): the run
saves what it can and stops with one line saying what to do, exit 2, never a traceback.

What can be saved: a step that failed before the optimizer changed anything leaves the weights
and the optimizer state as the previous step left them. The data sampler and torch's RNG are put
back to where they were before the step (`Before`), and that state is saved as the checkpoint of
the previous step: the resumed run is the uninterrupted run. A step that failed after some of its
updates (a chunk of disk-offloaded state updated during backward) is torn: nothing is saved and
the last checkpoint stays the good state. Several processes: the failing rank stops (its peers
with it), and the last checkpoint is the good state.
"""
from __future__ import annotations

import contextlib
import errno
import shutil
from dataclasses import dataclass
from typing import Any

from memfit.core.errors import MemfitError
from memfit.core.spill import spill_root
from memfit.core.units import format_bytes

FULL = (errno.ENOSPC, errno.EDQUOT)


class SpillFull(MemfitError):
    """The spill folder filled up during a step; the message is the whole story."""


def is_full(exc: BaseException) -> bool:
    """A full disk or quota, as an OSError or as the activation spill's SpillError."""
    from memfit.apply.disk_spill import SpillError

    if isinstance(exc, OSError):
        return exc.errno in FULL
    return isinstance(exc, SpillError) and " is full" in str(exc)


def _streamed(opt: Any) -> Any:
    """The optimizer's disk/CPU offload engine (memfit.apply.optim_offload), or None."""
    return getattr(opt, "streamed", None)


def _updates(opt: Any) -> int:
    s = _streamed(opt)
    return s.chunk_updates if s is not None else 0


@dataclass
class Before:
    """What a step changes besides the weights, taken before it: put back if it fails."""

    sampler: dict
    rng: dict
    updates: int

    @classmethod
    def take(cls, run: Any) -> "Before":
        from memfit.train import state as state_mod

        return cls(run.sampler.state_dict(), state_mod.rng_state(), _updates(run.opt))


def _settle(opt: Any) -> None:
    """Wait for the offload's writes and updates still queued (each may fail the same way)."""
    s = _streamed(opt)
    intake = getattr(s, "intake", None)
    for _ in range(3):
        try:
            if intake is not None:
                intake.drain()
            return
        except OSError:
            continue


def untouched(run: Any, before: Before) -> bool:
    """Whether the failed step left the weights and optimizer state as the previous step did."""
    _settle(run.opt)
    return _updates(run.opt) == before.updates


def put_back(run: Any, before: Before) -> None:
    """The sampler, RNG and gradients as they were before the failed step."""
    from memfit.train import state as state_mod

    s = _streamed(run.opt)
    with contextlib.suppress(OSError):
        if s is not None:
            s.discard_grads()
        else:
            run.opt.zero_grad(set_to_none=True)
    run.sampler.load_state_dict(before.sampler)
    state_mod.set_rng_state(before.rng)


def message(exc: BaseException, spill_dir: str | None, step: int, kept: str, run_dir: Any) -> str:
    root = spill_root(spill_dir)
    try:
        free = format_bytes(shutil.disk_usage(root).free) + " free"
    except OSError:
        free = "free space unknown"
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "full"
    return (f"spill folder {str(root)!r} filled up during step {step + 1} ({why}, {free}): stopped; {kept}; free "
            f"space there or choose another folder, then continue with memfit train --resume {run_dir} "
            "[--spill-dir OTHER_FOLDER]")
