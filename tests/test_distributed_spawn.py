"""memfit.distributed.spawn.run_world: ranks forked from a preloaded forkserver behave as spawned ones."""
from __future__ import annotations

import os

import pytest

from memfit.distributed import spawn
from memfit.distributed.spawn import run_world


def _where(rank: int, world: int, name: str) -> tuple:
    import torch.distributed as dist

    return rank, world, dist.get_world_size(), os.environ.get(name), os.getcwd()


def _fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one says no")


@pytest.mark.multiproc
def test_each_rank_sees_the_callers_environment_and_folder_as_they_are_now(tmp_path, monkeypatch):
    """The forkserver starts with the first call; a variable set or a folder entered after it must
    still reach the ranks (a spawned rank copies the caller's state at each call)."""
    run_world(_where, 2, ("MEMFIT_SPAWN_PROBE",))  # the server exists from here on
    monkeypatch.setenv("MEMFIT_SPAWN_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    got = run_world(_where, 2, ("MEMFIT_SPAWN_PROBE",))
    assert got == [(r, 2, 2, "set after the server started", str(tmp_path)) for r in range(2)]
    monkeypatch.delenv("MEMFIT_SPAWN_PROBE")
    assert [g[3] for g in run_world(_where, 2, ("MEMFIT_SPAWN_PROBE",))] == [None, None]


@pytest.mark.multiproc
def test_a_rank_that_raises_comes_back_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1:(.|\n)*ValueError: rank one says no"):
        run_world(_fails, 2, timeout_s=30)


def test_the_forkserver_preloads_torch_and_is_used_where_the_platform_has_it():
    import multiprocessing

    ctx = spawn._context()
    has = "forkserver" in multiprocessing.get_all_start_methods()
    assert ctx.get_start_method() == ("forkserver" if has else "spawn")
    assert "torch" in spawn.PRELOAD
