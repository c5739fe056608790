"""A Hugging Face model's multi-process `memfit train` runs against one process on the same global batch:
the reference check the model-parallel and 3-D tests share (tests/test_hf_train_model_parallel.py,
tests/test_mesh3d_train.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from hf_family_configs import write_config
from memfit.cli import main

FAST = ["--seq", "32", "--eval-batches", "2", "--quiet", "--warmup", "1", "--steps", "3", "--device", "cpu"]
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def _ranks_run(config: str, out: Path, nproc: int, layout: list[str]) -> dict:
    """metrics.json of an `nproc`-rank run with --batch 2 per process."""
    proc = subprocess.run([sys.executable, "-m", "memfit", "train", "--model", config, *FAST, "--batch", "2",
                           "--nproc", str(nproc), *layout, "--out", str(out)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def _estimate(config: str, nproc: int, layout: list[str], capsys) -> dict[int, int]:
    """`memfit estimate` of the run's layout: rank -> total bytes."""
    capsys.readouterr()
    assert main(["estimate", config, "--batch", "2", "--seq", "32", "--world", str(nproc), *layout, "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    return {r: row["total"] for row in ranks for r in row["rank_ids"]}


def runs_against_one_process(tmp_path: Path, capsys, family: str, nproc: int,
                             layouts: dict[str, list[str]]) -> Iterator[tuple[str, list[dict], dict[int, int]]]:
    """For each layout (name -> its train/estimate flags): `nproc` ranks at --batch 2 each follow one
    process's losses on the whole global batch, every rank holds fewer parameter bytes than the one
    process; yields (name, the step breakdown's ranks, `memfit estimate`'s rank -> total bytes)."""
    config = write_config(tmp_path, family)
    assert main(["train", "--model", config, *FAST, "--batch", str(2 * nproc), "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    for name, layout in layouts.items():
        m = _ranks_run(config, tmp_path / name, nproc, layout)
        # fp32 reassociation only (TP partial sums, the stages' micro-batches summed in another order, dp
        # reduce-scatter sums), as for memfit's GPT (tests/test_distributed_model_parallel_train.py):
        # observed <= 1e-7 relative over 3 steps
        assert m["steps"]["loss"] == pytest.approx(one["steps"]["loss"], rel=1e-5), name
        ranks = m["memory"]["step_breakdown"]["ranks"]
        assert [r["rank"] for r in ranks] == list(range(nproc))
        for r in ranks:
            assert r["breakdown"]["params"] < one["memory"]["step_breakdown"]["breakdown"]["params"]
        yield name, ranks, _estimate(config, nproc, layout, capsys)
