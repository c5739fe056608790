"""What checksums cost a checkpoint save and load (docs/reliability.md, "Checksums").

    .venv/bin/python bench/checkpoint_checksums.py

A checkpoint-shaped dict of 300 MiB (25 fp32 weights of 1024 x 1024 and Adam's two moments for
each) saved and loaded through memfit.train.state, side by side:

    save plain      save_checkpoint without checksums (torch.save to a temp file, fsync, rename)
    save sealed     with checksums: crc32 of every tensor, digests of the rest, then the written
                    file read back (memory-mapped) and checked before the rename
    load plain      torch.load(weights_only=True) of the sealed file (what loading cost before)
    load checked    load_checkpoint of the sealed file: the load and every checksum checked

Timing: bench/common.py's interleaved rounds (shuffled order, median and spread, CPU seconds and
wall). The file lives in the system temp folder, so reads come through the page cache.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from memfit.train import state  # noqa: E402


def checkpoint(n: int = 25, side: int = 1024) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"step": 1, "model": {f"w{i}": torch.randn(side, side, generator=g) for i in range(n)},
            "optimizer": {"state": {i: {"exp_avg": torch.randn(side, side, generator=g),
                                        "exp_avg_sq": torch.rand(side, side, generator=g)} for i in range(n)}}}


def render_machine(result: dict) -> str:
    m = result.get("machine", {})
    return (f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}; run "
            f"{result.get('date', '?')}. {common.run_line(result)}")


def render(result: dict) -> str:
    """The docs/BENCHMARKS.md section (bench/render.py)."""
    t = result["timing"]
    rows = "\n".join(f"| {name} | {common.fmt_spread(t['cpu'][name])} | {common.fmt_spread(t['wall'][name])} |"
                      for name in ("save plain", "save sealed", "load plain", "load checked"))
    ratio = lambda a, b: t["cpu"][a]["median"] / t["cpu"][b]["median"]  # noqa: E731
    return (f"## Checkpoint checksums\n\n`.venv/bin/python bench/checkpoint_checksums.py`; "
            f"{render_machine(result)}\n\n"
            f"A {result['mib']:.0f} MiB checkpoint saved and loaded through memfit.train.state, with and without "
            "checksums (docs/reliability.md, \"Checksums\"). A sealed save adds the crc32 of every tensor and the "
            "read-back of the written file; a checked load adds the crc32 of every tensor.\n\n"
            "| contender | CPU seconds | wall seconds |\n|---|---:|---:|\n" + rows +
            f"\n\nCPU medians: sealed save {ratio('save sealed', 'save plain'):.2f}x the plain save, checked load "
            f"{ratio('load checked', 'load plain'):.2f}x the plain load. {common.load_line(t)}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=common.MIN_ROUNDS)
    args = ap.parse_args()
    ckpt = checkpoint()
    mib = sum(t.numel() * t.element_size() for d in (ckpt["model"], *ckpt["optimizer"]["state"].values())
              for t in d.values()) / 2**20
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        state.save_checkpoint(folder / "sealed.pt", ckpt, sealed=True)  # what the loads read
        contenders = {
            "save plain": lambda: state.save_checkpoint(folder / "plain.pt", ckpt),
            "save sealed": lambda: state.save_checkpoint(folder / "sealed2.pt", ckpt, sealed=True),
            "load plain": lambda: torch.load(folder / "sealed.pt", weights_only=True),
            "load checked": lambda: state.load_checkpoint(folder / "sealed.pt"),
        }
        timing = common.interleaved(contenders, rounds=args.rounds)
    cpu = timing["cpu"]
    for name in contenders:
        print(f"{name:13s} {common.fmt_spread(cpu[name])} CPU, {common.fmt_spread(timing['wall'][name])} wall "
              f"for {mib:.0f} MiB")
    print(f"sealed save / plain save (CPU medians): {cpu['save sealed']['median'] / cpu['save plain']['median']:.2f}")
    print(f"checked load / plain load (CPU medians): {cpu['load checked']['median'] / cpu['load plain']['median']:.2f}")
    print(common.load_line(timing))
    common.save("checkpoint_checksums", {"mib": round(mib, 1), "timing": timing})


if __name__ == "__main__":
    main()
