"""The device of each rank when a machine has fewer GPUs than processes (simulated on the CPU).

torchrun users expect one GPU per process. No --device: the ranks train on the CPU (gloo) and rank 0
says so in one line. --device cuda: exit 2 with one line naming both counts, before any process
starts. Enough GPUs, or --device cpu / cuda:N: the device as given."""
from __future__ import annotations

import pytest
import torch

from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.train.distributed import rank_device

TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=32"


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_more_processes_than_gpus(one_gpu, monkeypatch):
    device, note = rank_device(None, 2)
    assert device == "cpu" and "2 processes" in note and "1 GPU" in note and "--device cpu" in note
    with pytest.raises(ConfigError, match="2 processes need 2 GPUs and this machine has 1"):
        rank_device("cuda", 2)
    assert rank_device("cpu", 2) == ("cpu", None)
    assert rank_device("cuda:0", 2) == ("cuda:0", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's count of processes on this machine
    assert rank_device(None)[0] == "cpu"


def test_enough_gpus_or_one_process_keep_the_device(one_gpu, monkeypatch):
    assert rank_device(None, 1) == (None, None)
    assert rank_device("cuda", 1) == ("cuda", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(None, 2) == (None, None) and rank_device("cuda", 2) == ("cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device(None, 4) == (None, None)


def test_cli_refuses_cuda_before_launching(one_gpu, capsys, tmp_path):
    rc = main(["train", "--model", TINY, "--seq", "32", "--steps", "2", "--strategy", "zero2", "--nproc", "2",
               "--device", "cuda", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "this machine has 1" in err and "--device cpu" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def _rank_on_one_gpu_machine(rank, world, out):
    from memfit.train import loop

    torch.cuda.is_available = lambda: True  # this spawned rank's view: CUDA with one GPU
    torch.cuda.device_count = lambda: 1
    # A CUDA build of torch (2.14.1 from PyPI) asks the accelerator for its current stream in every
    # optimizer step, which initialises CUDA: with no driver behind the fake view that raises. This
    # rank trains on the CPU, so the accelerator it would ask about is none.
    if hasattr(torch, "accelerator"):
        torch.accelerator.current_accelerator = lambda check_available=False: None
    said: list[str] = []
    cfg = loop.TrainConfig(model=TINY, seq=32, batch=2, steps=1, warmup=1, eval_batches=1, strategy="ddp", out=out,
                           track=False)
    result = loop.train(cfg, progress=False, log=said.append)
    return result.metrics["run"]["device"], result.metrics["config"]["device"], said


@pytest.mark.multiproc
def test_launched_ranks_fall_back_to_the_cpu_with_one_note(tmp_path):
    from memfit.distributed.spawn import run_world

    ranks = run_world(_rank_on_one_gpu_machine, 2, args=(str(tmp_path / "run"),), timeout_s=200)
    assert [r[:2] for r in ranks] == [("cpu", "cpu")] * 2
    notes = [[line for line in r[2] if "GPU" in line] for r in ranks]
    assert len(notes[0]) == 1 and "training on cpu" in notes[0][0] and notes[1] == []


def test_a_rank_without_a_gpu_gets_one_line_not_a_cuda_error(one_gpu, monkeypatch):
    import torch.distributed as dist

    from memfit.distributed import env

    if dist.is_initialized():
        pytest.skip("a process group is already open in this process")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device reached"))
    with pytest.raises(ConfigError, match="local rank 1 has no GPU: this machine has 1"):
        env.init("cuda")
