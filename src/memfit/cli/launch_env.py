"""What the `--nproc` launcher sets up around its ranks, as torchrun does, and takes down after.

- Threads: torchrun sets OMP_NUM_THREADS=1 for every rank when the user did not set it (N ranks
  each running one thread per core oversubscribe the machine N times: 15-40x slower steps).
- One process (`compiler_cache`): only the compiler cache folder, as below.
- Scratch: torch-elastic's per-launch log tree (torchelastic_*), torch.multiprocessing's error
  files (pytorch-errorfile-*.pickle, left behind by a killed rank) and the compiler cache folder
  that importing torch._dynamo creates (torchinductor_<user>) all go into one temporary folder,
  removed when the launch ends, however it ends (a run, a refusal, a killed rank, a signal);
  one left by a kill -9 of the launcher is removed by the next launch (memfit.core.scratch).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

from memfit.core.scratch import owned_folder

THREADS_PER_RANK = "1"
"""torchrun's OMP_NUM_THREADS for each rank when more than one runs on a machine."""
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHE_PREFIX = "memfit-inductor-"
"""One process's compiler cache folder: memfit-inductor-<pid>-<random> in the temp folder."""
LAUNCH_PREFIX = "memfit-launch-"
"""The launcher's scratch folder: memfit-launch-<pid>-<random> in the temp folder."""


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set the variables the user left unset for the block (children inherit them); restore after."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def scratch(prefix: str = "memfit-") -> Iterator[str]:
    """A temporary folder that this process's temporary files and torch's compiler cache use
    within the block (unless the user chose a cache folder); removed with everything in it after.
    Named for this process and locked while it lives (memfit.core.scratch): one that a kill -9 of
    its launcher left is removed by the next launch."""
    with owned_folder(prefix) as folder:
        before = tempfile.tempdir
        tempfile.tempdir = folder  # this process's mkstemp/mkdtemp (torch-elastic's error files)
        try:
            with _environ(**{CACHE_ENV: os.path.join(folder, "inductor")}):
                yield folder
        finally:
            tempfile.tempdir = before


@contextlib.contextmanager
def compiler_cache() -> Iterator[None]:
    """One process's run: the folder importing torch._dynamo creates (torchinductor_<user>) goes
    into a temporary folder removed after, unless the user chose one (TORCHINDUCTOR_CACHE_DIR)."""
    if CACHE_ENV in os.environ:
        yield
        return
    with owned_folder(CACHE_PREFIX) as folder, _environ(**{CACHE_ENV: os.path.join(folder, "inductor")}):
        yield


@contextlib.contextmanager
def rank_environment() -> Iterator[str]:
    """The launcher's block: one thread per rank unless OMP_NUM_THREADS is set, and a scratch folder."""
    with _environ(OMP_NUM_THREADS=THREADS_PER_RANK), scratch(LAUNCH_PREFIX) as folder:
        yield folder
