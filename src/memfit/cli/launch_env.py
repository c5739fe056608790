"""What the `--nproc` launcher sets up around its ranks, as torchrun does, and takes down after.

- Threads: torchrun sets OMP_NUM_THREADS=1 for every rank when the user did not set it (N ranks
  each running one thread per core oversubscribe the machine N times: 15-40x slower steps).
- One process (`compiler_cache`): only the compiler cache folder, as below.
- Scratch: torch-elastic's per-launch log tree (torchelastic_*), torch.multiprocessing's error
  files (pytorch-errorfile-*.pickle, left behind by a killed rank) and the compiler cache folder
  that importing torch._dynamo creates (torchinductor_<user>) all go into one temporary folder,
  removed when the launch ends, however it ends (a run, a refusal, a killed rank, a signal).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

THREADS_PER_RANK = "1"
"""torchrun's OMP_NUM_THREADS for each rank when more than one runs on a machine."""
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


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
    within the block (unless the user chose a cache folder); removed with everything in it after."""
    folder = tempfile.mkdtemp(prefix=prefix)
    before = tempfile.tempdir
    tempfile.tempdir = folder  # this process's mkstemp/mkdtemp (torch-elastic's logs and error files)
    try:
        with _environ(**{CACHE_ENV: os.path.join(folder, "inductor")}):
            yield folder
    finally:
        tempfile.tempdir = before
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def compiler_cache() -> Iterator[None]:
    """One process's run: the folder importing torch._dynamo creates (torchinductor_<user>) goes
    into a temporary folder removed after, unless the user chose one (TORCHINDUCTOR_CACHE_DIR)."""
    if CACHE_ENV in os.environ:
        yield
        return
    folder = tempfile.mkdtemp(prefix="memfit-cache-")
    try:
        with _environ(**{CACHE_ENV: os.path.join(folder, "inductor")}):
            yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def rank_environment() -> Iterator[str]:
    """The launcher's block: one thread per rank unless OMP_NUM_THREADS is set, and a scratch folder."""
    with _environ(OMP_NUM_THREADS=THREADS_PER_RANK), scratch("memfit-launch-") as folder:
        yield folder
