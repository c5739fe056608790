"""Precision and optimizer offload: how large a model trains under a fixed device budget, every
precision mode with and without optimizer offload, what CPU and disk offload cost per step (and the
disk throughput they reach), and memfit against torch.amp and DeepSpeed ZeRO-Offload on CPU.

    .venv/bin/python bench/precision_offload.py

1. Largest model under a device budget. A GPT family (hidden 128, 2 heads, byte vocabulary, 4 x
   256 tokens per step) grown in layers; device bytes are the peak of memfit's tracker over two
   real training steps. Plain fp32 AdamW against memfit bf16-master + CPU optimizer offload + full
   activation checkpointing. The per-layer cost is fitted from 1 and 2 layers, then the largest
   fitting depth is confirmed by measuring it and the next depth (which must not fit). The chosen
   depths are run again in a fresh process each for the physical figure, the growth of peak RSS.
2. Every precision mode (32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, bf16-master,
   16-master) with the optimizer in memory, offloaded to CPU and to disk: tracker device and host
   peaks and peak RSS growth (a fresh process per contender), and the step time side by side.
3. Offload overhead. A 4-layer, hidden-256 GPT (3.3M parameters, 4 x 128 tokens), AdamW without
   clipping; in-memory, CPU and disk offload with the default 16 MiB chunks (one chunk here: it is
   updated after backward), with 4 MiB chunks updated during backward, and with the gradient files
   kept between steps (see OFFLOADS), in 32-true and bf16-master. Disk throughput = spill bytes /
   seconds inside read and write calls, against a plain sequential write + read of the same number
   of bytes in the same folder, right after each step (both through the page cache).
4. Side by side (torchrun, world size 1, gloo, DS_ACCELERATOR=cpu): memfit bf16-master + CPU
   offload, memfit bf16-mixed, torch.amp bf16 autocast + AdamW (no GradScaler: bf16 has fp32's
   exponent range, so a careful user does not scale), torch.amp fp16 autocast + GradScaler + AdamW,
   and DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU (bf16, DeepSpeedCPUAdam), all with
   clipping at 1.0, same model and data. Peak memory per contender from a fresh process each: the
   growth of peak RSS over the process's size before the model is built, and memfit's tracker peak
   of device-resident bytes (offloaded copies excluded via mark_host).
Timing everywhere: bench/common.py's interleaved rounds (shuffled order, median and spread, load).
Contenders that are not installed are skipped with a note. Every contender runs with one intra-op
thread (see THREADS).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import PeakRSS, fmt_bytes, interleaved, run_fresh, save  # noqa: E402
from precision_offload_compare import compare  # noqa: E402
from precision_offload_setup import (BUDGET, CMP_BATCH, CMP_REPEATS, CMP_SHAPE, FIT_BATCH, FIT_SHAPE,  # noqa: E402
                                     REPEATS, THREADS, batch, memfit_step)

from memfit.apply.checkpoint import checkpoint  # noqa: E402
from memfit.apply.host_io import read_at as _read_at, write_at as _write_at  # noqa: E402
from memfit.apply.optimizer import TrainingOptimizer  # noqa: E402
from memfit.core.tracker import track  # noqa: E402
from memfit.models.gpt import GPT, GPTConfig  # noqa: E402

NAME = "precision_offload"
COMMAND = ".venv/bin/python bench/precision_offload.py"


# ---------------------------------------------------------------- 1. largest model under a budget
def fit_model(kind: str, layers: int):
    """(model, step, optimizer) of one configuration of the budget table."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, **FIT_SHAPE))
    x, y = batch(FIT_BATCH, FIT_SHAPE["seq"])
    if kind == "fp32-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            _, loss, n = model(x, y)
            (loss / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, step, opt
    checkpoint(model, "full")
    opt = TrainingOptimizer(model, "adamw", lr=1e-3, precision="bf16-master", offload="cpu")
    return model, lambda: memfit_step(model, opt, x, y), opt


def fit_probe(kind: str, layers: int) -> dict:
    t0 = time.perf_counter()
    model, step, opt = fit_model(kind, layers)
    with track(model, opt) as t:
        for _ in range(2):
            step()
    out = {"layers": layers, "params": model.num_params(), "peak": t.peak_bytes, "host_peak": t.host_peak_bytes,
           "breakdown": t.breakdown, "seconds": time.perf_counter() - t0}
    if isinstance(opt, TrainingOptimizer):
        opt.close()
    print(f"  {kind:>22} {layers:>3} layers {out['params'] / 1e6:6.2f}M params: peak {fmt_bytes(out['peak'])}"
          f" ({out['seconds']:.1f}s)", flush=True)
    return out


def worker_fit_rss(kind: str, layers: int) -> dict:
    """Fresh process: growth of peak RSS over building the model and two steps (after a 1-layer
    warm-up run that pays the libraries' one-time set-up)."""
    _, warm, wopt = fit_model(kind, 1)
    warm()
    if isinstance(wopt, TrainingOptimizer):
        wopt.close()
    del warm, wopt
    with PeakRSS() as r:
        _, step, opt = fit_model(kind, layers)
        for _ in range(2):
            step()
    return {"rss_growth": r.growth}


def largest_under_budget(kind: str) -> dict:
    probes = {n: fit_probe(kind, n) for n in (1, 2)}
    per_layer = probes[2]["peak"] - probes[1]["peak"]
    guess = max(1, int((BUDGET - probes[1]["peak"]) // per_layer) + 1)
    probe = lambda n: probes.setdefault(n, fit_probe(kind, n)) if n not in probes else probes[n]  # noqa: E731
    layers = guess
    while layers > 1 and probe(layers)["peak"] > BUDGET:
        layers -= 1
    while probe(layers + 1)["peak"] <= BUDGET:
        layers += 1
    best, nxt = probes[layers], probes[layers + 1]
    physical = run_fresh(Path(__file__), ["--worker", "fit", "--contender", kind, "--layers", str(layers)])
    print(f"  {kind}: {layers} layers, peak RSS growth {fmt_bytes(physical.get('rss_growth', 0))}", flush=True)
    return {"kind": kind, "layers": layers, "params": best["params"], "peak": best["peak"],
            "host_peak": best["host_peak"], "breakdown": best["breakdown"], "rss_growth": physical.get("rss_growth"),
            "next": {"layers": layers + 1, "params": nxt["params"], "peak": nxt["peak"]}}


# ---------------------------------------------------------------- 2. every precision mode
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16-master", "16-master"]
MODE_OFFLOADS = [None, "cpu", "disk"]


def mode_optimizer(model, precision: str, offload: str | None, spill: str | None) -> TrainingOptimizer:
    return TrainingOptimizer(model, "adamw", lr=1e-3, precision=precision, offload=offload,
                             spill_dir=spill if offload == "disk" else None)


def worker_mode(precision: str, offload: str | None) -> dict:
    """Fresh process: tracker peaks over one steady-state step and the growth of peak RSS over
    building the model and three steps (after a 1-layer warm-up run of the same mode)."""
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    spill = tempfile.mkdtemp(prefix="memfit-bench-")
    warm = GPT(GPTConfig(**{**CMP_SHAPE, "layers": 1}))
    wopt = mode_optimizer(warm, precision, offload, spill)
    memfit_step(warm, wopt, x, y)
    wopt.close()
    del warm, wopt
    with PeakRSS() as r:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CMP_SHAPE))
        opt = mode_optimizer(model, precision, offload, spill)
        memfit_step(model, opt, x, y)  # creates the optimizer state
        with track(model, opt) as t:
            for _ in range(2):
                memfit_step(model, opt, x, y)
    with torch.no_grad():
        _, loss, n = model(x, y)
    opt.close()
    shutil.rmtree(spill, ignore_errors=True)
    return {"tracker_peak": t.peak_bytes, "tracker_host_peak": t.host_peak_bytes, "rss_growth": r.growth,
            "loss_after_3_steps": (loss / n).item()}


def precision_modes() -> dict:
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    spill = tempfile.mkdtemp(prefix="memfit-bench-")
    runs, rows = {}, []
    for precision in PRECISIONS:
        for offload in MODE_OFFLOADS:
            label = f"{precision} / {offload or 'in memory'}"
            mem = run_fresh(Path(__file__), ["--worker", "mode", "--contender", precision, "--offload", str(offload)])
            print(f"  {label:<24} {mem}", flush=True)
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CMP_SHAPE))
            runs[label] = (model, mode_optimizer(model, precision, offload, spill))
            rows.append({"precision": precision, "offload": offload, "label": label, **mem})
    try:
        timing = interleaved({k: (lambda m=m, o=o: memfit_step(m, o, x, y)) for k, (m, o) in runs.items()},
                             rounds=REPEATS)
    finally:
        for _, o in runs.values():
            o.close()
        shutil.rmtree(spill, ignore_errors=True)
    return {"model": CMP_SHAPE, "batch": CMP_BATCH, "params": GPT(GPTConfig(**CMP_SHAPE)).num_params(),
            "rows": rows, "timing": timing}


# ---------------------------------------------------------------- 3. offload overhead and disk throughput
def raw_disk(path: str, nbytes: int) -> tuple[int, float]:
    """Sequential overwrite then read of nbytes of an existing file in 16 MiB calls (the size of a
    spill chunk): (bytes moved, seconds). The file is created untimed on first use, as the spill
    files are created before the steps that rewrite them."""
    block = torch.empty(16 << 20, dtype=torch.uint8).random_(0, 255)

    def sweep(fd: int, op) -> None:
        off = 0
        while off < nbytes:
            n = min(len(block), nbytes - off)
            op(fd, block[:n], off)
            off += n

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < nbytes:
            sweep(fd, _write_at)
        t0 = time.perf_counter()
        sweep(fd, _write_at)
        sweep(fd, _read_at)
        return 2 * nbytes, time.perf_counter() - t0
    finally:
        os.close(fd)


# (label, offload target, chunk bytes): default 16 MiB chunks (one chunk here: it is complete only
# when backward ends, so the spill I/O runs alone and its throughput is the I/O path's), and 4 MiB
# chunks, the later ones updated on the worker thread while backward goes on.
# The last row keeps the gradient files between steps instead of deleting them after each one.
OFFLOADS = [("none", None, None, False), ("cpu", "cpu", None, False), ("disk", "disk", None, False),
            ("cpu, 4 MiB chunks during backward", "cpu", 4 << 20, False),
            ("disk, 4 MiB chunks during backward", "disk", 4 << 20, False),
            ("disk, gradient files kept", "disk", None, True)]


def overhead() -> dict:
    x, y = batch(CMP_BATCH, CMP_SHAPE["seq"])
    spill_root = tempfile.mkdtemp(prefix="memfit-bench-")
    runs = {}
    for precision in ("32-true", "bf16-master"):
        for label, offload, chunk, keep in OFFLOADS:
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CMP_SHAPE))
            opt = TrainingOptimizer(model, "adamw", lr=1e-3, precision=precision, offload=offload,
                                    spill_dir=spill_root if offload == "disk" else None, chunk_bytes=chunk,
                                    keep_grad_files=keep)
            memfit_step(model, opt, x, y)  # warm-up; creates the optimizer state
            runs[(precision, label)] = {"model": model, "opt": opt, "times": [], "io": []}
    before: dict[tuple, tuple] = {}

    def io_before(key) -> None:
        io = runs[key]["opt"].io_stats
        if io:
            before[key] = (io.bytes_read + io.bytes_written, io.read_s + io.write_s)

    def io_after(key) -> None:
        io, r = runs[key]["opt"].io_stats, runs[key]
        if io and key in before:
            moved = io.bytes_read + io.bytes_written - before[key][0]
            # raw right after, so each spill figure is paired with a raw one taken under the same load
            raw_moved, raw_s = raw_disk(os.path.join(spill_root, "raw.bin"), moved // 2)
            r["io"].append((moved, io.read_s + io.write_s - before[key][1], raw_moved / raw_s))

    try:
        timing = interleaved({k: (lambda r=r: memfit_step(r["model"], r["opt"], x, y)) for k, r in runs.items()},
                             rounds=REPEATS, warmup=0, setup=io_before, after=io_after)
        for k, r in runs.items():
            r["io"] = r["io"][-REPEATS:]
    finally:
        for r in runs.values():
            r["opt"].close()
        if os.path.exists(os.path.join(spill_root, "raw.bin")):
            os.unlink(os.path.join(spill_root, "raw.bin"))
        os.rmdir(spill_root)
    rows = []
    for (precision, label), r in runs.items():
        sec = timing["wall"][(precision, label)]["median"]
        base = timing["wall"][(precision, "none")]["median"]
        streamed = r["opt"].streamed
        row = {"precision": precision, "offload": label, "step": timing["wall"][(precision, label)],
               "step_seconds": sec, "overhead_pct": 100 * (sec / base - 1),
               "chunks": len(streamed.chunks) if streamed else 0,
               "chunk_updates_during_backward": streamed.early_updates if streamed else 0}
        if r["io"]:
            row["spill_bytes_per_step"] = int(statistics.median(m for m, _, _ in r["io"]))
            row["spill_throughput"] = statistics.median(m / s for m, s, _ in r["io"])
            row["raw_throughput"] = statistics.median(raw_tp for _, _, raw_tp in r["io"])
            row["throughput_pct_of_raw"] = statistics.median(100 * m / s / raw_tp for m, s, raw_tp in r["io"])
        rows.append(row)
        print(f"  {precision:>11} offload={label:<36} {sec * 1e3:7.1f} ms  ({row['overhead_pct']:+.0f}%)", flush=True)
    timing = {k: v for k, v in timing.items() if k not in ("wall", "cpu")}  # per row above; keys are tuples
    timing["orders"] = [[" / ".join(k) for k in order] for order in timing["orders"]]
    return {"model": CMP_SHAPE, "batch": CMP_BATCH, "params": GPT(GPTConfig(**CMP_SHAPE)).num_params(), "rows": rows,
            "timing": timing}


# ---------------------------------------------------------------- main and render
def main() -> None:
    torch.set_num_threads(THREADS)
    print("1. largest model under the budget", flush=True)
    fit = [largest_under_budget(k) for k in ("fp32-adamw", "memfit bf16-master+offload+ckpt")]
    print("2. every precision mode", flush=True)
    modes = precision_modes()
    print("3. offload overhead", flush=True)
    over = overhead()
    print("4. memfit vs torch.amp vs DeepSpeed", flush=True)
    cmp_ = compare()
    quick = bool(os.environ.get("MEMFIT_BENCH_QUICK"))
    payload = {"command": COMMAND + (" --quick" if quick else ""), "quick": quick, "budget": BUDGET, "fit_shape": FIT_SHAPE, "fit_batch": FIT_BATCH, "fit": fit,
               "ratio": fit[1]["params"] / fit[0]["params"], "modes": modes, "overhead": over, "compare": cmp_,
               "threads": torch.get_num_threads(), "repeats": REPEATS, "compare_repeats": CMP_REPEATS}
    path = save(NAME, payload)
    print(render(json.loads(path.read_text())))
    print(f"wrote {path.relative_to(ROOT)}")


def render(r: dict) -> str:
    from precision_offload_render import render as _render

    return _render(r)


if __name__ == "__main__":
    if "--quick" in sys.argv[1:] and not os.environ.get("MEMFIT_BENCH_QUICK"):  # the constants are read at import
        os.environ["MEMFIT_BENCH_QUICK"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny shapes (checks the script, numbers meaningless)")
    ap.add_argument("--worker", choices=["fit", "mode"])
    ap.add_argument("--contender")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--offload")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        torch.set_num_threads(THREADS)
        if a.worker == "fit":
            res = worker_fit_rss(a.contender, a.layers)
        else:
            res = worker_mode(a.contender, None if a.offload == "None" else a.offload)
        Path(a.out).write_text(json.dumps(res))
    else:
        main()
