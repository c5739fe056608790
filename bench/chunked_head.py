"""The chunked LM head: the step's peak with the head in k chunks, and what it costs in time.

    python bench/chunked_head.py            # GPT-2 small at batch 1 x seq 1024 (traced), timings
    python bench/chunked_head.py --quick    # a small head-bound GPT only

Peaks: the steady-state peak of a training step (fp32, AdamW) traced under FakeTensorMode, which
equals the tracker on a real step (tests/test_plan_chunked_head.py); the small model is also
measured on a real step. Time: the head and loss alone (forward + backward of the hidden states
and the head weight), plain against chunked, interleaved in shuffled order (bench/common.py).
Writes bench/results/chunked_head.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import interleaved, save  # noqa: E402

from memfit.apply.chunked_head import chunked_cross_entropy, reference_cross_entropy  # noqa: E402
from memfit.apply.head_swap import chunk_head  # noqa: E402
from memfit.measure.trace import measure_step, trace_step  # noqa: E402
from memfit.models.spec import parse_model  # noqa: E402

CHUNKS = (None, 2, 4, 8, 16)


def peaks(name: str, batch: int, seq: int, real: bool) -> dict:
    spec = parse_model(name)
    out = {}
    for c in CHUNKS:
        build = lambda c=c: chunk_head(spec.build(seq=seq), c)  # noqa: E731
        t = trace_step(build, batch=batch, seq=seq)
        row = {"traced_peak": t.peak, "breakdown": t.breakdown()}
        if real:
            row["measured_peak"] = measure_step(build, batch=batch, seq=seq, allocator=False).peak
        out[str(c or "plain")] = row
    return {"model": name, "batch": batch, "seq": seq, "precision": "32-true", "optimizer": "adamw", "peaks": out}


def head_times(n: int, h: int, v: int, rounds: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.02).requires_grad_()
    y = torch.randint(0, v, (n,))

    def run(chunks):
        def go():
            loss = reference_cross_entropy(x, w, y) if chunks is None else chunked_cross_entropy(x, w, y, chunks=chunks)
            torch.autograd.grad(loss, [x, w])
        return go

    res = interleaved({"plain": run(None), "4 chunks": run(4), "16 chunks": run(16)}, rounds=rounds)
    return {"tokens": n, "hidden": h, "vocab": v, **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    small = "gpt:layers=2,hidden=64,heads=4,vocab=8192,seq=256"
    payload = {"small": peaks(small, 1, 256, real=True)}
    if not args.quick:
        payload["gpt2"] = peaks("gpt2", 1, 1024, real=False)
    payload["head_time"] = head_times(512, 256, 16384, rounds=5)
    path = save("chunked_head", payload)
    for key in ("small", "gpt2"):
        if key in payload:
            p = payload[key]["peaks"]
            print(key, {k: round(r["traced_peak"] / 2**20, 2) for k, r in p.items()}, "MiB")
    print({k: round(s["median"], 3) for k, s in payload["head_time"]["wall"].items()}, "s;", path)


if __name__ == "__main__":
    main()
