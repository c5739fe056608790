"""The GPU benches' pure parts: the ladder search finds the largest rung that fits with few trials,
and the MFU FLOP count of a known model."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("start", [0, 3, 9])
@pytest.mark.parametrize("limit", [-1, 0, 4, 11, 19])
def test_double_then_bisect_finds_the_largest_fitting_rung(limit, start):
    g = _load("gpu_larger_model")
    n, trials = 20, {}

    def fits(i):
        trials[i] = i <= limit
        return trials[i]

    lo, hi = g._double_then_bisect(fits, start, n, max_trials=12, trials=trials)
    assert lo == limit
    assert hi == (limit + 1 if limit + 1 < n else n)
    assert len(trials) <= 9  # doubling then bisection, not a scan of all 20 rungs


def test_flops_per_token_of_gpt2_small():
    t = _load("gpu_train")
    f = t.flops_per_token("gpt2", 1024)
    h, layers, vocab = 768, 12, 50257
    per_block = h * 3 * h + h * h + h * 4 * h + 4 * h * h  # qkv, attention out, MLP up and down
    assert f["n_matmul"] == layers * per_block + vocab * h  # the tied head counted once
    assert f["flops_per_token"] == 6 * f["n_matmul"] + 12 * layers * h * 1024
