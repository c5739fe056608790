"""What every part of bench/precision_offload.py shares: the shapes (tiny ones under --quick), the
thread count, the data and one memfit step."""
from __future__ import annotations

import os

import torch

BUDGET = 32 * 2**20
FIT_SHAPE = dict(hidden=128, heads=2, vocab=256, seq=256)
FIT_BATCH = 4
CMP_SHAPE = dict(layers=4, hidden=256, heads=4, vocab=256, seq=128)
CMP_BATCH = 4
REPEATS = 7
CMP_REPEATS = 15  # the side-by-side steps are short: more rounds for a steadier median
if os.environ.get("MEMFIT_BENCH_QUICK"):  # --quick: tiny shapes and the fewest rounds, to check the script
    BUDGET, FIT_SHAPE, FIT_BATCH = 4 * 2**20, dict(hidden=32, heads=2, vocab=256, seq=32), 2
    CMP_SHAPE, CMP_BATCH, REPEATS, CMP_REPEATS = dict(layers=2, hidden=32, heads=2, vocab=256, seq=32), 2, 5, 5


THREADS = 1
"""Intra-op threads for every contender. On a small shared machine, OpenMP threads that lose their
core to another process stall at barriers (a 2-thread step measured 60x slower than usual here);
one thread each keeps the side-by-side comparison steady. DeepSpeed's CPU Adam gets the same
OMP_NUM_THREADS."""



def batch(n: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def memfit_step(model, opt, x, y) -> None:
    with opt.autocast():
        _, loss, n = model(x, y)
    opt.backward(loss / n, final=True)  # one micro-batch: offloaded updates may overlap backward
    opt.step()
